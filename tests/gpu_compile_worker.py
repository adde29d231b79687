"""GPU check of flux.integrations.compile, run by
tests/test_compile.py::test_gpu_compiled_mlp_runs_flux_ops_and_replays_in_a_cuda_graph through

    torchrun --nproc_per_node=2 tests/gpu_compile_worker.py

with NCCL, one process per GPU. Each rank writes one line to $FLUX_GPU_RESULTS_DIR/results.<rank>
(and prints it): ``ok <JSON of what was measured>`` or ``fail <traceback>``.

A sequence-parallel MLP in bf16, [s, b, h] activations (functional collectives, F.linear, GELU):

    y = reduce_scatter(gelu(all_gather(x) @ W1^T + b1) @ W2^T) + b2

1. compiled (``fullgraph=True``) with the pass enabled: the forward and the backward graph each
   get one flux.ag_gemm and one flux.gemm_rs (``stats()``), the flux ops run (profiler), and
   the output and the gradients of x, W1, b1, W2, b2 are within bf16 tolerance of the float64
   result: relative norm error <= 2 * that of the unfused eager bf16 run + 5e-4;
2. its forward compiled for inference (no gradients), called eagerly twice (a flux problem's
   first call plans it and cannot be captured), captured in a CUDA graph
   (``torch.cuda.graph``), and replayed on three new inputs copied into the static input, each
   replay checked the same way.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1), forced here
before torch or NCCL start.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import faulthandler  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as fc  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BF16, F64 = torch.bfloat16, torch.float64
EPS_BF16 = 5e-4  # tests/_ref.py's floor for bf16
RUN_TIMEOUT_S = 480  # below the test's bound, so that a hang ends with stacks


def _all_gather(x, group):
    ag = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return ag(x, 0, group)


def _reduce_scatter(x, group):
    rs = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd
    return rs(x, "sum", 0, group)


def _rand(shape, seed, dev, scale=1.0):
    """bf16 values, the same on every rank for a seed (the float64 runs take them exactly)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float32) * scale).to(BF16).to(dev)


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def _check(what, out, ref, base):
    """``out`` (flux) and ``base`` (unfused, same precision) against the float64 ``ref``."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert not torch.isnan(out).any().item(), f"{what}: NaN"
    err, berr = _rel_err(out, ref), _rel_err(base, ref)
    assert err <= 2 * berr + EPS_BF16, f"{what}: relative error {err:.3g} > 2 * baseline {berr:.3g} + {EPS_BF16:g}"
    return round(err, 6), round(berr, 6)


def _flux_ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.name.startswith("flux::")})


def run(rank, world, dev):
    import torch._inductor.config as inductor_config

    import flux.integrations.compile as fcomp

    # Every graph goes through the pass (a graph from Inductor's cache would count nothing).
    inductor_config.fx_graph_cache = False
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = False
    except (ImportError, AttributeError):
        pass
    group = dist.group.WORLD
    s_local, b, h, f_local = 256, 2, 1024, 2048
    x = _rand((s_local, b, h), 10 + rank, dev)
    w1, b1 = _rand((f_local, h), 20 + rank, dev, h ** -0.5), _rand((f_local,), 30 + rank, dev, 0.1)
    w2, b2 = _rand((h, f_local), 40 + rank, dev, (f_local * world) ** -0.5), _rand((h,), 50, dev, 0.1)
    gy = _rand((s_local, b, h), 60 + rank, dev)
    inputs = [x, w1, b1, w2, b2]
    names = ["x", "w1", "b1", "w2", "b2"]

    def mlp(x, w1, b1, w2, b2):
        hid = F.gelu(F.linear(_all_gather(x, group), w1, b1))
        return _reduce_scatter(F.linear(hid, w2), group) + b2

    def fwd_bwd(fn, dtype):
        leaves = [t.to(dtype).detach().clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(gy.to(dtype))  # gy is bf16: the float64 run takes the same values
        torch.cuda.synchronize()
        return [y.detach()] + [t.grad for t in leaves]

    result = {}
    # 1. Forward and backward, compiled with flux ops.
    ref = fwd_bwd(mlp, F64)
    base = fwd_bwd(mlp, BF16)
    compiled = torch.compile(mlp, fullgraph=True)
    fcomp.reset_stats()
    with fcomp.enabled():
        got = fwd_bwd(compiled, BF16)
    counts = fcomp.stats()
    assert counts == {"ag_gemm": 2, "gemm_rs": 2, "skipped": 0}, f"rewrites {counts}"
    ran = _flux_ops_run(lambda: fwd_bwd(compiled, BF16))
    assert ran == ["flux::ag_gemm", "flux::gemm_rs"], f"flux ops run: {ran}"
    again = fwd_bwd(compiled, BF16)
    for what, a, r, bs, a2 in zip(["output"] + [f"gradient of {n}" for n in names], got, ref, base, again):
        result[what] = _check(what, a, r, bs)
        _check(what + " (second call)", a2, r, bs)
    result["rewrites"] = counts

    # 2. The inference forward, captured in a CUDA graph after eager warm-up calls.
    fcomp.reset_stats()
    params = inputs[1:]
    with torch.no_grad():
        infer = torch.compile(mlp, fullgraph=True)
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with fcomp.enabled(), torch.cuda.stream(side):
            for _ in range(2):  # compiles, then plans every flux problem (a first call cannot be captured)
                infer(static_x, *params)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        counts = fcomp.stats()
        assert counts == {"ag_gemm": 1, "gemm_rs": 1, "skipped": 0}, f"inference rewrites {counts}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = infer(static_x, *params)
        errs = []
        for i in range(3):
            xi = _rand((s_local, b, h), 70 + 10 * i + rank, dev)
            r = mlp(xi.double(), *[p.double() for p in inputs[1:]])
            bs = mlp(xi, *params)
            static_x.copy_(xi)
            graph.replay()
            torch.cuda.synchronize()
            errs.append(_check(f"CUDA graph replay {i}", static_y.clone(), r, bs))
        del graph, static_y
    result["graph_replays"] = errs
    result["inference_rewrites"] = counts
    return result


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    faulthandler.enable()
    faulthandler.dump_traceback_later(RUN_TIMEOUT_S, exit=True)
    try:
        line = "ok " + json.dumps(run(rank, world, dev))
    except Exception as e:  # noqa: BLE001  (reported to the test)
        line = f"fail {type(e).__name__}: {e}\n{traceback.format_exc()}"
    faulthandler.cancel_dump_traceback_later()
    print(f"FLUXCOMPILE rank {rank}: {line}", flush=True)
    out_dir = os.environ.get("FLUX_GPU_RESULTS_DIR")
    if out_dir:
        with open(os.path.join(out_dir, f"results.{rank}"), "w") as f:
            f.write(line + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
