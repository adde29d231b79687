"""A Megatron-core GPT TransformerLayer built from flux's spec against one built from
megatron-core's local spec, on GPUs, run by tests/test_megatron.py::test_gpu_megatron_layer
through

    torchrun --nproc_per_node=2 tests/gpu_megatron_worker.py

with NCCL, one process per GPU, tensor-parallel size = the world size, sequence parallelism on.
Each rank prints one line per case, ``FLUXMEGATRON {"case", "rank", "status": ok|fail, "error",
"value"}``, and writes the same JSON line to $FLUX_GPU_RESULTS_DIR/megatron.<rank> when that
is set (and the list of cases it runs to cases.json there).

Four layers per case, of one set of weights (drawn in fp32, rounded to the case's dtype, copied
by state_dict):

  stock   megatron's local spec (get_gpt_layer_local_spec: megatron's Column/RowParallelLinear,
          unfused DotProductAttention, no Transformer Engine or apex) in the case's dtype; its
          norms are flux's SequenceParallelTorchNorm, since megatron's WrappedTorchNorm (the local
          spec's norm without apex) refuses sequence parallelism
  flux    flux.integrations.megatron.get_gpt_layer_flux_spec() in the case's dtype
  fused   the same with config.gradient_accumulation_fusion: every linear weight's gradient
          goes to an fp32 ``main_grad`` (megatron's DDP attributes set as DDP sets them)
  exact   the stock layer in float64, the reference

The output, the input's gradient and every parameter's gradient (``main_grad`` for the fused
layer's linear weights) of flux and fused must be within twice the stock layer's relative error
against exact plus a floor (tests/_ref.py: error <= 2 * baseline + eps). Flux's layers must
have run flux's ops (4 ag_gemm and 4 gemm_rs calls per forward and backward of a layer) and
logged no fallback.

``compare_layers`` runs on the CPU too (gloo, float32), where tests/test_megatron.py calls it
with megatron's CUDA allocations pointed at the CPU.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1), forced
here before torch or NCCL start.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import collections  # noqa: E402
import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _ref  # noqa: E402

CASE_TIMEOUT_S = 240


def setup_megatron(world: int, cuda: bool = False) -> None:
    """megatron-core's parallel state with tensor-parallel size ``world`` (idempotent); ``cuda``:
    also seed megatron's model-parallel CUDA RNG, which its GPU layers draw their weights from."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        if cuda:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(1234)  # megatron's GPU initialisation draws from it


def layer_config(world: int, dtype: torch.dtype, device: torch.device, *, hidden: int, heads: int, ffn: int,
                 accumulate: bool = False):
    """A one-layer GPT TransformerConfig: tensor-parallel size ``world``, sequence parallel,
    biases on, no dropout, unfused bias/activation/softmax, parameters in ``dtype`` (created
    on the CPU when ``device`` is the CPU)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
        tensor_model_parallel_size=world, sequence_parallel=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=device.type == "cpu", perform_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=accumulate, transformer_impl="local")


def stock_spec():
    """megatron-core's local GPT layer spec with its torch norms swapped for flux's
    SequenceParallelTorchNorm (WrappedTorchNorm refuses sequence parallelism; apex's norm,
    when installed, is kept)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    import flux.integrations.megatron as fm

    return fm._swap_classes(get_gpt_layer_local_spec(), {WrappedTorchNorm: fm.SequenceParallelTorchNorm})


def build_layer(spec, config, device: torch.device, dtype: torch.dtype):
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(spec, config=config, layer_number=1)
    # torch's norms are made in the default dtype on the CPU (megatron's Float16Module and
    # .cuda() move them in training); .to keeps the parameters' megatron attributes.
    return layer.to(device=device, dtype=dtype)


def randomize(layer, hidden: int, ffn: int, seed: int) -> None:
    """Every parameter drawn from one seeded generator, in name order, alike on every rank
    (the replicated ones, norms and row biases, must agree; megatron zeroes biases and sets
    norms to 1, which would leave their gradients' paths untested): linear weights N(0, 1/fan_in),
    biases N(0, 0.1^2), norm weights 1 + N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            v = torch.randn(tuple(p.shape), generator=gen)
            if "layernorm" in name and name.endswith("weight"):
                v = 1 + 0.1 * v
            elif name.endswith("bias"):
                v = 0.1 * v
            else:
                v = v / (ffn if "linear_fc2" in name else hidden) ** 0.5
            p.copy_(v)


def _linear_weights(layer):
    return [(n, p) for n, p in layer.named_parameters() if ".linear_" in n and n.endswith("weight")]


@contextlib.contextmanager
def counting_flux_calls():
    """Counts the flux op calls made by flux.integrations.megatron's layers, and collects the
    fallback warnings they log."""
    import flux.integrations.megatron as fm

    calls = collections.Counter()
    fallbacks = []

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    class Catch(logging.Handler):
        def emit(self, record):
            if "megatron's own forward" in record.getMessage():
                fallbacks.append(record.getMessage())

    handler = Catch()
    log = logging.getLogger("flux")
    log.addHandler(handler)
    fm._logged.clear()  # a reason logged earlier in this process is logged again
    try:
        with mock.patch.object(fm, "ag_gemm", counted("ag_gemm", fm.ag_gemm)), \
                mock.patch.object(fm, "gemm_rs", counted("gemm_rs", fm.gemm_rs)):
            yield calls, fallbacks
    finally:
        log.removeHandler(handler)


def run_layer(layer, x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, main_grads: bool = False):
    """One forward and backward of ``layer`` on this rank's rows ``x`` [s/W, b, h] with output
    gradient ``g``. Returns (output, d x, {parameter name: gradient}); with ``main_grads`` the
    linear weights get fp32 ``main_grad`` buffers and DDP's ``grad_added_to_main_grad``
    attribute first, and their entries are those buffers."""
    fused = set()  # ids: `in` on tensors would compare values
    if main_grads:
        for _, p in _linear_weights(layer):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.grad_added_to_main_grad = False
            fused.add(id(p))
    xi = x.detach().clone().requires_grad_()
    out, _ = layer(xi, attention_mask=mask)
    out.backward(g)
    grads = {}
    for name, p in layer.named_parameters():
        if id(p) in fused:
            assert p.grad_added_to_main_grad, f"{name}: grad_added_to_main_grad was not set"
            assert p.grad is not None and p.grad.shape == p.shape, f"{name}: no placeholder gradient"
            grads[name] = p.main_grad
        else:
            assert p.grad is not None, f"{name}: no gradient"
            grads[name] = p.grad
    return out.detach(), xi.grad, grads


def compare_layers(rank: int, world: int, device: torch.device, dtype: torch.dtype, *, seq: int, batch: int,
                   hidden: int, heads: int, ffn: int, seed: int = 1234) -> dict:
    """Build the four layers (module docstring), run them on the same rows and compare; raise
    AssertionError naming every quantity out of tolerance. Returns, per quantity, the flux and
    fused layers' relative errors, the stock layer's (baseline) and the largest absolute
    difference between flux and stock, plus the flux call counts."""
    import flux.integrations.megatron as fm

    setup_megatron(world)
    stock = build_layer(stock_spec(), layer_config(world, dtype, device, hidden=hidden, heads=heads, ffn=ffn),
                        device, dtype)
    randomize(stock, hidden, ffn, seed)
    state = stock.state_dict()
    flux_layer = build_layer(fm.get_gpt_layer_flux_spec(),
                             layer_config(world, dtype, device, hidden=hidden, heads=heads, ffn=ffn), device, dtype)
    fused_layer = build_layer(fm.get_gpt_layer_flux_spec(),
                              layer_config(world, dtype, device, hidden=hidden, heads=heads, ffn=ffn, accumulate=True),
                              device, dtype)
    exact = build_layer(stock_spec(), layer_config(world, torch.float64, device, hidden=hidden, heads=heads, ffn=ffn),
                        device, torch.float64)
    for layer in (flux_layer, fused_layer, exact):
        layer.load_state_dict(state)
    kinds = {type(m).__name__ for m in flux_layer.modules()}
    assert {"FluxColumnParallelLinear", "FluxRowParallelLinear"} <= kinds, f"flux spec built {sorted(kinds)}"
    assert not {"ColumnParallelLinear", "RowParallelLinear"} & kinds, f"flux spec built {sorted(kinds)}"

    rows = seq // world
    x = _ref.rand((seq, batch, hidden), torch.float32, seed + 1)[rank * rows:(rank + 1) * rows].to(dtype)
    g = _ref.rand((seq, batch, hidden), torch.float32, seed + 2)[rank * rows:(rank + 1) * rows].to(dtype)
    x, g = x.to(device), g.to(device)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]

    ref = run_layer(exact, x.double(), g.double(), mask)
    base = run_layer(stock, x, g, mask)
    with counting_flux_calls() as (calls, fallbacks):
        got = run_layer(flux_layer, x, g, mask)
        flux_calls = dict(calls)
        got_fused = run_layer(fused_layer, x, g, mask, main_grads=True)
        fused_calls = {k: v - flux_calls.get(k, 0) for k, v in calls.items()}
    problems = []
    if fallbacks:
        problems.append(f"flux layers fell back: {fallbacks}")
    for what, c in (("flux", flux_calls), ("fused", fused_calls)):
        if c != {"ag_gemm": 4, "gemm_rs": 4}:
            problems.append(f"{what} layer made flux calls {c}, expected 4 ag_gemm and 4 gemm_rs")

    def items(res):
        out, dx, grads = res
        return [("output", out), ("input gradient", dx)] + [(f"d {n}", t) for n, t in sorted(grads.items())]

    report = {"flux calls": flux_calls}
    eps = _ref.EPS[dtype]
    for (what, r), (_, b), (_, f), (_, fu) in zip(items(ref), items(base), items(got), items(got_fused)):
        berr = _ref.rel_err(b, r)
        errs = {"flux": _ref.rel_err(f, r), "fused": _ref.rel_err(fu, r)}
        for name, err in errs.items():
            if not err <= 2 * berr + eps:
                problems.append(f"{name} {what}: relative error {err:.3g} > 2 * baseline {berr:.3g} + {eps:g}")
        report[what] = {"flux": errs["flux"], "fused": errs["fused"], "baseline": berr,
                        "max |flux - stock|": (f.double() - b.double()).abs().max().item()}
    assert not problems, "\n".join(problems)
    return report


# --------------------------------------------------------------------------------------
# GPU cases: (seq, batch, hidden, heads, ffn)

CASES = {
    "layer-bf16": dict(dtype=torch.bfloat16, seq=2048, batch=2, hidden=1024, heads=16, ffn=4096),
    # A sequence shard of odd length (501 rows per rank) and widths off the powers of two.
    "layer-bf16-odd": dict(dtype=torch.bfloat16, seq=1002, batch=1, hidden=1536, heads=12, ffn=4160),
    "layer-fp16": dict(dtype=torch.float16, seq=1024, batch=2, hidden=1024, heads=16, ffn=4096),
}


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    faulthandler.enable()
    setup_megatron(world, cuda=True)
    names = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] != "all" else list(CASES)
    out_dir = os.environ.get("FLUX_GPU_RESULTS_DIR")
    results = open(os.path.join(out_dir, f"megatron.{rank}"), "w") if out_dir else None
    if out_dir and rank == 0:  # what the test expects a result of from every rank
        with open(os.path.join(out_dir, "cases.json"), "w") as f:
            json.dump(names, f)
    for name in names:
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # a hung case ends the run, with stacks
        rec = {"case": name, "rank": rank, "status": "ok", "error": None, "value": None}
        try:
            kw = dict(CASES[name])
            rec["value"] = compare_layers(rank, world, dev, kw.pop("dtype"), **kw)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (reported to the test)
            rec.update(status="fail", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        faulthandler.cancel_dump_traceback_later()
        line = json.dumps(rec)
        print("FLUXMEGATRON " + line, flush=True)
        if results is not None:
            results.write(line + "\n")
            results.flush()
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
