"""Where the host time of one call goes: CUDA API calls and ATen ops per call, per method.

    torchrun --nproc_per_node=2 bench/profile_host.py --out host.json
    torchrun --nproc_per_node=2 bench/profile_host.py --shapes ag:4096x8192x14336,rs:4096x14336x8192
    torchrun --nproc_per_node=1 bench/profile_host.py --shapes moe:128x8x8x7168,moe:4096x64x8x7168

For each shape (M gathered, N (AG) or K (RS) scaled with the world size, as bench_ops.py) and
method, bf16, random inputs: 'seq' (NCCL all-gather then torch.mm, or torch.mm then NCCL
reduce-scatter: the host budget) and every flux strategy with default parameters through its
plan. Protocol, as bench_ops.py's host timing: batches of 20 calls enqueued behind a GPU spin
that outlasts them (the host runs ahead, no call waits for the GPU), --calls calls in all; the
host time of each call (time.perf_counter), median; then the same batches under torch.profiler
(CPU and CUDA activity: the CUDA runtime and driver calls CUPTI sees, and ATen ops, which the
profiler records from C++ too), summed per name and divided by the number of calls. The
profiler's own cost inflates what it records; the unprofiled median is the figure, the
breakdown says where it goes. Rank 0 prints per method: host µs, then the API calls and ATen
ops by total µs per call (count per call in brackets). JSON (--out): everything, per rank.

``moe:TxExKxH``: the MoE dispatch and combine (bounded and unbounded), their C++ entries and a gather (moe_methods).
With FLUX_GLOO_CUDA=1 the ranks may share one GPU (flux's test mode: gloo, no NCCL): 'seq' is
then left out, as gloo moves CUDA tensors through host copies, and 'mm' (torch.mm of the same
GEMM alone, the floor of every method's host cost) takes its place. The strategies' host time is
the CPU's enqueue cost, which does not depend on where the peer sits; what the GPUs then do is
not timed here.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flux.autotune.space import per_rank_shape  # noqa: E402
from flux.ops import ag_gemm as ag_mod, gemm_rs as rs_mod  # noqa: E402

BATCH = 20
SPIN_US = 2000 + 500 * BATCH
DEFAULT_SHAPES = "ag:4096x8192x14336,ag:16384x8192x4096,ag:128x8192x14336,rs:4096x14336x8192,rs:8192x14336x8192,rs:128x14336x8192"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="comma-separated op:MxKxN (op: ag or rs; M gathered) or moe:TxExKxH")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _cycles_per_us():
    # torch.cuda._sleep spins a number of GPU clock cycles; the SM clock of this GPU.
    return torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate / 1e3


def host_batches(fn, calls, times=None):
    """Enqueue ``calls`` calls of ``fn`` in batches behind a GPU spin; host µs of each call."""
    times = [] if times is None else times
    left = calls
    torch.cuda.synchronize()
    while left:
        n = min(BATCH, left)
        torch.cuda._sleep(int(SPIN_US * _cycles_per_us()))
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        left -= n
    return times


def breakdown(fn, calls):
    """{name: [µs per call, count per call]} of the CUDA API calls and ATen ops of ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        host_batches(fn, calls)
    acc = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        name = e.name
        if name.startswith("cudaDeviceSynchronize") or name == "cudaStreamSynchronize":
            continue
        if e.device_type == torch.autograd.DeviceType.CPU and (name.startswith("cu") or name.startswith("aten::")
                                                                 or name.startswith("c10d::")
                                                                 or name.startswith("nccl:")):
            if "_sleep" in name:
                continue
            acc[name][0] += e.self_cpu_time_total if name.startswith(("aten::", "c10d::", "nccl:")) else e.cpu_time_total
            acc[name][1] += 1
    return {k: [v[0] / calls, v[1] / calls] for k, v in sorted(acc.items(), key=lambda kv: -kv[1][0])}


def methods(op, m, k, n, world, group, shared=False):
    """[(name, zero-argument callable)] for one shape; ``shared``: 'mm' instead of 'seq'."""
    g = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
    if op == "ag":
        a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
        gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)

        def seq():
            dist.all_gather_into_tensor(gathered, a, group=group)
            return torch.mm(gathered, w.t())
        out = [("mm", lambda: torch.mm(gathered, w.t())) if shared else ("seq", seq)]
        for s in ag_mod.available_strategies(a.device):
            if not (shared and s == "sequential"):  # on gloo it runs in Python: not the C++ path
                out.append((s, ag_mod.prepare_strategy(s, a, w, group=group)))
        return out
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
    res = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)

    def seq():
        dist.reduce_scatter_tensor(res, torch.mm(a, w.t()), group=group)
        return res
    out = [("mm", lambda: torch.mm(a, w.t())) if shared else ("seq", seq)]
    for s in rs_mod.available_strategies(a.device):
        if not (shared and s == "sequential"):  # on gloo it runs in Python: not the C++ path
            out.append((s, rs_mod.prepare_strategy(s, a, w, group=group)))
    return out


def moe_methods(t, e, k, h, group):
    """[(name, zero-argument callable)] of ``moe:TxExKxH`` (T tokens per rank, E experts, top-K,
    hidden H, uniform routing): flux.moe_dispatch and flux.moe_combine of the bounded variant (C = T)
    and of the unbounded one, repeat calls (their plan made); at world size 1 (the ``local`` strategy) their C++ entries alone
    with the same arguments ('dispatch entry', 'combine entry'); and 'gather' (``x[rows]`` of the
    T * K rows: one ATen op with the dispatch's output size, the floor of its host cost)."""
    import flux

    g = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
    w = torch.rand(t, k, device="cuda", generator=g).softmax(-1)
    recv, _, handle = flux.moe_dispatch(x, idx, w, e, group=group, max_tokens_per_rank=t)
    rows = torch.div(idx.reshape(-1).sort(stable=True).indices, k, rounding_mode="floor")
    recv_u, _, handle_u = flux.moe_dispatch(x, idx, w, e, group=group)
    out = [("gather", lambda: x[rows]),
           ("dispatch", lambda: flux.moe_dispatch(x, idx, w, e, group=group, max_tokens_per_rank=t)),
           ("combine", lambda: flux.moe_combine(recv, handle)),
           ("dispatch unbounded", lambda: flux.moe_dispatch(x, idx, w, e, group=group)),
           ("combine unbounded", lambda: flux.moe_combine(recv_u, handle_u))]
    if handle.strategy == "local":
        out += [("dispatch entry", lambda: torch.ops.flux.moe_local_dispatch(x, idx, e, t, 0, True)),
                ("combine entry", lambda: torch.ops.flux.moe_local_combine(recv, w, handle.recv_dest, k))]
    return out


def main():
    args = parse_args()
    shared = os.environ.get("FLUX_GLOO_CUDA") == "1"  # ranks sharing GPUs: gloo (see the docstring)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    if shared:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    dist.init_process_group("gloo" if shared else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    results = []
    for spec in args.shapes.split(","):
        op, shape = spec.split(":")
        if op == "moe":
            cases = moe_methods(*(int(x) for x in shape.split("x")), group)
        else:
            m, k, n = (int(x) for x in shape.split("x"))
            n, k = per_rank_shape("ag_gemm" if op == "ag" else "gemm_rs", m, k, n, world)
            cases = methods(op, m, k, n, world, group, shared)
        for name, fn in cases:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            times = host_batches(fn, args.calls)
            dist.barrier()
            parts = breakdown(fn, min(args.calls, 60))
            dist.barrier()
            rec = {"op": op, "shape": shape, "method": name, "rank": rank, "host_us": statistics.median(times),
                   "parts": parts}
            recs = [None] * world
            dist.all_gather_object(recs, rec)
            results.append(recs)
            if rank == 0:
                print(f"\n{op} {shape} {name}: host µs per call " +
                      " / ".join(f"{r['host_us']:.1f}" for r in recs) + " (per rank)")
                for nm, (us, cnt) in list(parts.items())[:14]:
                    print(f"    {us:8.2f} µs  [{cnt:4.1f}]  {nm[:90]}")
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "%storchrun --nproc_per_node=%d bench/profile_host.py %s" % (
                "FLUX_GLOO_CUDA=1 " if shared else "", world, " ".join(shlex.quote(a) for a in sys.argv[1:])),
                "world": world, "gpus": torch.cuda.device_count(), "shared": shared,
                "torch": torch.__version__, "results": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
