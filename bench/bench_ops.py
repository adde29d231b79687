"""Benchmark of flux.ag_gemm and flux.gemm_rs against cuBLAS, NCCL and PyTorch async-TP.

Run (one process per GPU)::

    torchrun --nproc_per_node=2 bench/bench_ops.py                      # public suite, both ops
    torchrun --nproc_per_node=2 bench/bench_ops.py --quick              # 2 shapes per op, few rounds
    torchrun --nproc_per_node=2 bench/bench_ops.py --op gemm_rs --shapes 8192x14336x8192,512x14336x8192
    torchrun --nproc_per_node=2 bench/bench_ops.py --strategies sequential --out /tmp/r.json

Shapes (GUIDE.md §3). A shape is ``M x K x N``, M the gathered (full) number of rows.
The listed shape IS the GEMM that each rank runs at world size W = 2, so that the
``gemm`` column is comparable with the reference cuBLAS figures of GUIDE.md §3
(8192x8192x14336: 2*M*K*N / 2.467 ms = 780 TFLOP/s on one H200):

    ag_gemm  (column-parallel, sequence-parallel input)
        input   A_shard [M/W, K]     this rank's rows
        weight  W       [N, K]       weight_layout "nk" (nn.Linear); N is this rank's N
        out             [M, N]       = all_gather(A_shard, dim 0) @ W^T
    gemm_rs  (row-parallel output)
        input   A       [M, K]       K is this rank's K
        weight  W       [N, K]       weight_layout "nk"
        out             [M/W, N]     = reduce_scatter(A @ W^T, dim 0)

With ``--scale-with-world`` (the default) N (ag_gemm) or K (gemm_rs) is multiplied by
2/W and rounded to a multiple of 128, so that the total problem (summed over the ranks)
stays that of the listed shape at W = 2; at W = 2 nothing changes. The effective local
shapes are written into the JSON. ``--no-scale-with-world`` runs the listed shape on
every rank whatever W is. M must be divisible by W.

Methods, all measured side by side in one process, on the same tensors:

    gemm      cuBLAS alone (F.linear), the GEMM each rank runs in the unfused sequence:
              ag_gemm: gathered [M, K] @ W[N, K]^T;  gemm_rs: [M, K] @ W[N, K]^T.  = t_gemm
    comm      the NCCL collective alone: ag_gemm: all_gather_into_tensor of [M/W, K];
              gemm_rs: reduce_scatter_tensor of [M, N] (sum).                        = t_comm
    seq       NCCL then cuBLAS (ag_gemm: all_gather_into_tensor, then F.linear) or
              cuBLAS then NCCL (gemm_rs: F.linear, then reduce_scatter_tensor).      = t_seq
              Its output is the reference for every correctness check.
    async_tp  PyTorch async-TP (torch.distributed._symmetric_memory):
              torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [W.t()], 0, group_name)
                  (return_A left at its default True: the multimem path, which needs
                  NVLink multicast, is only taken with return_A=False)
              torch.ops.symm_mem.fused_matmul_reduce_scatter(A, W.t(), "sum", 0, group_name)
              If it cannot run, the JSON records "unavailable: <reason>".
    flux:<s>  every flux strategy s in flux.ops.<op>.available_strategies(device) (or those named
              by --strategies, with parameters, e.g. 'fused(config=1)'), called
              through flux.ops.<op>.run_strategy(s, ...) (argument check on the first,
              correctness call only; check=False while timing).
    flux:auto the public op (flux.ag_gemm / flux.gemm_rs): the autotuner's choice plus
              the dispatch; in the JSON only.

Protocol (GUIDE.md §3):
  * random data (torch.randn; A ~ N(0, 1), W ~ N(0, 1/K)), never zeros; a different seed
    per rank for A;
  * correctness before timing: each non-baseline method's output is compared with the
    ``seq`` output, relative error ||out - ref|| / ||ref|| (fp32 norms, maximum over the
    ranks) < tol (bf16 2e-2, fp16 1e-2, fp32 1e-4; --tol overrides). A method above tol
    is reported "incorrect" and not timed; an exception is reported "error: ...";
  * timing: --warmup calls, then --iters rounds. Each round: torch.cuda.synchronize();
    a GPU spin of --queue-ahead-us (default 1000 us, torch.cuda._sleep) during which
    the host enqueues what follows; an all_reduce of a 1-element tensor (the current
    stream waits for it, so the GPUs of all ranks start the round together, not only
    their hosts); CUDA event; one call; CUDA event; synchronize. A method's time is the
    median over its rounds, then the maximum of that median over the ranks (all_reduce
    MAX). The spin keeps the host's launch cost out of the GPU time, as in a model where
    the host runs ahead or a CUDA graph replays the op; without it (--queue-ahead-us 0)
    the rank whose host arrives last pays its Python/launch overhead inside the timed
    region and small shapes measure host time. The host time of a call (wall clock in
    the call, median, max over ranks) is recorded as host_ms; host_bound marks a method
    whose host time exceeds the head start, so its t_ms includes host time (table: '*').
    Methods run one after the other (not interleaved per round), so slow drift of clocks
    or temperature shows as a few percent of noise on large shapes: raise --iters;
  * overlap efficiency E = (t_seq - t_op) / (t_seq - t_gemm) (None when t_seq <= t_gemm)
    and speedup t_seq / t_op, for every non-baseline method.
  * Known limitation: rounds are back to back on the same tensors, so shapes whose
    operands fit in the 60 MB L2 of an H200 partly run from L2. --flush-l2 writes a 256 MB
    buffer before every round (outside the timed region) to rule that out.

Environment hygiene: NVLink multicast (NVLS) is never used: this script forces
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before
torch.distributed is imported.

Output: rank 0 writes JSON to --out (default bench/results/bench_ops-<host>-<time>.json):
metadata (versions, GPU, world size, command line, date), then per op and shape every
time in ms, E, speedup and relative error per method; and prints a compact table per op
last. Exit status 0 even if some method is unavailable or incorrect (see the JSON).
"""
import os

# Before torch.distributed is imported: never use NVLink multicast (NVLS). Forced, not
# defaulted, on purpose: on shared hosts a program using it can take the GPUs down.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

sys.path.insert(0, REPO)  # run from a checkout without installing
from flux.autotune.space import PUBLIC_SUITE as SUITE, Candidate, per_rank_shape  # noqa: E402
QUICK = {
    "ag_gemm": ["4096x8192x14336", "512x8192x14336"],
    "gemm_rs": ["4096x14336x8192", "512x14336x8192"],
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_TOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark flux.ag_gemm / flux.gemm_rs against cuBLAS, NCCL and PyTorch async-TP "
                    "(run with torchrun --nproc_per_node=N; the protocol is in the module docstring).")
    p.add_argument("--op", choices=["ag_gemm", "gemm_rs", "all"], default="all", help="default: all")
    p.add_argument("--shapes", default="suite",
                   help="'suite' (the public suite of GUIDE.md §3) or a comma-separated list MxKxN,... "
                        "(M gathered; used for every op selected); default: suite")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="default: bf16")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per method and shape (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed rounds per method and shape (default 20)")
    p.add_argument("--out", default=None,
                   help="JSON file written by rank 0 (default bench/results/bench_ops-<host>-<time>.json)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated flux strategies to run, each a name or a candidate label with "
                        "parameters, e.g. 'decomposed,decomposed(wait_barrier=1)' (default: all of "
                        "available_strategies)")
    p.add_argument("--ablation", action="store_true",
                   help="also time the stages of the decomposed strategies alone: 'split' (the W row-block "
                        "GEMMs, no communication) and, for gemm_rs, 'reduce' (the final reduction pass)")
    p.add_argument("--scale-with-world", action=argparse.BooleanOptionalAction, default=True,
                   help="multiply N (ag_gemm) or K (gemm_rs) by 2/W, rounded to a multiple of 128, so the "
                        "total problem is the listed one at W=2 (default: on)")
    p.add_argument("--skip-async-tp", action="store_true", help="do not run PyTorch async-TP")
    p.add_argument("--flush-l2", action="store_true",
                   help="write a 256 MB buffer before every timed round (outside the timed region)")
    p.add_argument("--queue-ahead-us", type=float, default=1000.0,
                   help="GPU spin (torch.cuda._sleep) at the start of each round, before the rendezvous, "
                        "during which the host enqueues the call, so that its launch cost is not timed; "
                        "0 times each call from an empty queue, host overhead included (default 1000)")
    p.add_argument("--tol", type=float, default=None, help="relative-error tolerance (default: bf16 2e-2, fp16 1e-2, fp32 1e-4)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 shapes per op (unless --shapes is given), warmup 2, iters 5")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.iters = min(args.warmup, 2), min(args.iters, 5)
    if args.warmup < 0 or args.iters < 1 or args.queue_ahead_us < 0:
        p.error("--warmup must be >= 0, --iters >= 1 and --queue-ahead-us >= 0")
    if args.tol is None:
        args.tol = DEFAULT_TOL[args.dtype]
    ops = ["ag_gemm", "gemm_rs"] if args.op == "all" else [args.op]
    args.ops = ops
    args.shape_lists = {}
    for op in ops:
        if args.shapes == "suite":
            names = (QUICK if args.quick else SUITE)[op]
        else:
            names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        shapes = []
        for s in names:
            try:
                m, k, n = (int(v) for v in s.lower().split("x"))
            except ValueError:
                p.error(f"bad shape {s!r}: expected MxKxN, e.g. 8192x8192x14336")
            if min(m, k, n) <= 0:
                p.error(f"bad shape {s!r}: every dimension must be positive")
            shapes.append((m, k, n))
        args.shape_lists[op] = shapes
    args.strategy_filter = split_labels(args.strategies) if args.strategies else None
    return args


# ----------------------------------------------------------------------------- helpers


def split_labels(text: str):
    """'a,b(x=1,y=2),c' -> ['a', 'b(x=1,y=2)', 'c'] (commas inside parentheses kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [s for s in out if s]


def _short(e: BaseException, limit: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= limit else msg[:limit] + "..."


def _eff(t_seq, t_gemm, t_op):
    """(E, speedup) of a method that took t_op ms."""
    if t_op is None or t_seq is None:
        return None, None
    e = (t_seq - t_op) / (t_seq - t_gemm) if (t_gemm is not None and t_seq - t_gemm > 0) else None
    return e, (t_seq / t_op if t_op > 0 else None)


class Bench:
    """The distributed state and the measuring primitives."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args = torch, dist, args
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if "RANK" not in os.environ:  # plain `python bench_ops.py`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29512")
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        dist.init_process_group("nccl", device_id=self.device, timeout=datetime.timedelta(minutes=10))
        self.group = dist.group.WORLD
        self.group_name = self.group.group_name
        self.dtype = getattr(torch, DTYPES[args.dtype])
        self.token = torch.zeros(1, device=self.device)
        self.flush = (torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=self.device)
                      if args.flush_l2 else None)
        # GPU spin before each timed call; cycles at the H200's 1.98 GHz boost clock (a
        # lower clock only lengthens the head start, which is harmless).
        self.spin_cycles = int(args.queue_ahead_us * 1980)

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    # Reductions over the ranks, all on the NCCL group (every rank calls them alike).
    def max_all(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def gather_all(self, x: float):
        t = self.torch.tensor([x], dtype=self.torch.float64, device=self.device)
        out = self.torch.empty(self.world, dtype=self.torch.float64, device=self.device)
        self.dist.all_gather_into_tensor(out, t, group=self.group)
        return [float(v) for v in out.tolist()]

    def sync(self):
        self.torch.cuda.synchronize()
        self.dist.barrier(group=self.group, device_ids=[self.local_rank])
        self.torch.cuda.synchronize()

    def rel_err(self, out, ref) -> float:
        """||out - ref|| / ||ref|| in fp32, maximum over the ranks (NaN -> inf)."""
        torch = self.torch
        if tuple(out.shape) != tuple(ref.shape):
            err = math.inf
        else:
            o, r = out.float(), ref.float()
            den = torch.linalg.vector_norm(r).item()
            num = torch.linalg.vector_norm(o - r).item()
            del o, r
            err = num / den if den > 0 else num
            if not math.isfinite(err):
                err = math.inf
        return self.max_all(err)

    def time(self, fn):
        """Median over --iters rounds of one call, maximum over the ranks (ms), and the
        host time of the call (median of the wall-clock time spent in ``fn()``)."""
        torch, dist = self.torch, self.dist
        for _ in range(self.args.warmup):
            fn()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times, host = [], []
        for _ in range(self.args.iters):
            if self.flush is not None:
                self.flush.fill_(1)
            torch.cuda.synchronize()
            if self.spin_cycles:
                # Head start: while the GPU spins, the host enqueues the rendezvous and the
                # call, so the call's launch cost stays out of its GPU time (--queue-ahead-us).
                # The spin comes before the rendezvous: it counts cycles, and the two GPUs'
                # clocks can differ, so it would skew the ranks if it came after.
                torch.cuda._sleep(self.spin_cycles)
            # Rendezvous on the GPU: a synchronous NCCL op makes the current stream wait
            # for it, so the rounds of all ranks start on the GPUs together (a host barrier
            # alone would leave the GPUs skewed by the hosts' launch times).
            dist.all_reduce(self.token, group=self.group)
            start.record()
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            host.append((h1 - h0) * 1e3)
        med = statistics.median(times)
        per_rank = self.gather_all(med)
        host_ms = self.max_all(statistics.median(host))
        return {"t_ms": max(per_rank), "t_ms_per_rank": per_rank, "host_ms": host_ms,
                # the host took longer than the GPU head start: its launch cost is in t_ms
                "host_bound": bool(self.spin_cycles and host_ms * 1e3 > self.args.queue_ahead_us),
                "rank0_rounds_min_ms": min(times) if self.rank == 0 else None,
                "rank0_rounds_max_ms": max(times) if self.rank == 0 else None}

    def agree_failed(self, failed: bool) -> bool:
        """True on every rank if any rank failed."""
        return self.max_all(1.0 if failed else 0.0) > 0


# ----------------------------------------------------------------------------- one shape


def _method(bench, name, make_fn, ref, results):
    """Correctness check, then timing, of one non-baseline method; fills results[name].

    make_fn() -> (call, unavailable_reason): ``call()`` returns the op's output tensor.
    """
    torch = bench.torch
    entry = {"status": None}
    results[name] = entry
    call, why = None, None
    try:
        call, why = make_fn()
    except Exception as e:  # noqa: BLE001  (recorded, never fatal)
        why = _short(e)
    # Every rank must take the same path from here on.
    if bench.agree_failed(call is None):
        entry["status"] = f"unavailable: {why or 'unavailable on another rank'}"
        return entry
    out, failure = None, None
    try:
        bench.sync()
        out = call()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        failure = _short(e)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    if bench.agree_failed(failure is not None):
        entry["status"] = f"error: {failure or 'failed on another rank'}"
        return entry
    err = bench.rel_err(out, ref)
    del out
    entry["rel_err"] = err if math.isfinite(err) else None
    if not (err < bench.args.tol):
        entry["status"] = "incorrect"
        return entry
    failure = None
    timing = None
    try:
        bench.sync()
        timing = bench.time(lambda: call())
    except Exception as e:  # noqa: BLE001
        failure = _short(e)
    if bench.agree_failed(failure is not None):
        entry["status"] = f"error while timing: {failure or 'failed on another rank'}"
        return entry
    entry.update(timing)
    entry["status"] = "ok"
    return entry


def _async_tp_available(bench):
    """Import PyTorch's symmetric memory and enable it for the group; None or a reason."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as e:  # noqa: BLE001
        return f"torch.distributed._symmetric_memory: {_short(e)}"
    ops = bench.torch.ops.symm_mem
    for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        if not hasattr(ops, op):
            return f"torch.ops.symm_mem.{op} does not exist in torch {bench.torch.__version__}"
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed up to torch 2.8 or so; deprecated no-op-ish later
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(bench.group_name)
        except Exception as e:  # noqa: BLE001
            return f"enable_symm_mem_for_group: {_short(e)}"
    return None


def run_shape(bench, op, shape, strategies):
    torch, dist, F = bench.torch, bench.dist, bench.torch.nn.functional
    import flux

    args, W, dev, dt = bench.args, bench.world, bench.device, bench.dtype
    m, k, n = shape
    rec = {"shape": f"{m}x{k}x{n}", "M": m, "K": k, "N": n}
    if m % W != 0:
        rec["status"] = f"skipped: M={m} is not divisible by the world size {W}"
        return rec
    n_loc, k_loc = per_rank_shape(op, m, k, n, W, args.scale_with_world)
    rec["local"] = {"N": n_loc, "K": k_loc}
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + bench.rank)
    wgen = torch.Generator(device=dev)
    wgen.manual_seed(2000 + bench.rank)
    weight = torch.randn((n_loc, k_loc), device=dev, dtype=dt, generator=wgen) * (1.0 / math.sqrt(k_loc))
    w_kn = weight.t()  # [K, N] view for the symm_mem ops (cuBLAS reads it transposed, no copy)
    mod = importlib.import_module(f"flux.ops.{op}")  # flux.ops.ag_gemm is also a function name
    flop = 2.0 * m * k_loc * n_loc
    if op == "ag_gemm":
        a_shard = torch.randn((m // W, k_loc), device=dev, dtype=dt, generator=gen)
        a_full = torch.randn((m, k_loc), device=dev, dtype=dt, generator=gen)  # for t_gemm only
        gathered = torch.empty((m, k_loc), device=dev, dtype=dt)
        rec["local"].update(A_shard=[m // W, k_loc], weight=[n_loc, k_loc], out=[m, n_loc])

        def gemm():
            return F.linear(a_full, weight)

        def comm():
            dist.all_gather_into_tensor(gathered, a_shard, group=bench.group)
            return gathered

        def seq():
            dist.all_gather_into_tensor(gathered, a_shard, group=bench.group)
            return F.linear(gathered, weight)

        def make_async_tp():
            why = _async_tp_available(bench)
            if why:
                return None, why
            f = torch.ops.symm_mem.fused_all_gather_matmul
            return (lambda: f(a_shard, [w_kn], 0, bench.group_name)[1][0]), None

        def make_flux(s):
            c = Candidate.parse(s)
            mod.run_strategy(c.strategy, a_shard, weight, group=bench.group, weight_layout="nk", check=True,
                             **c.kwargs)
            return (lambda: mod.run_strategy(c.strategy, a_shard, weight, group=bench.group, weight_layout="nk",
                                             check=False, **c.kwargs)), None

        def make_auto():
            return (lambda: flux.ag_gemm(a_shard, weight, group=bench.group)), None
        auto_input = a_shard
        comm_bytes = m * k_loc * a_shard.element_size()
    else:
        a = torch.randn((m, k_loc), device=dev, dtype=dt, generator=gen)
        partial = torch.empty((m, n_loc), device=dev, dtype=dt)
        partial.copy_(torch.randn((m, n_loc), device=dev, dtype=dt, generator=gen))
        rs_out = torch.empty((m // W, n_loc), device=dev, dtype=dt)
        rec["local"].update(A=[m, k_loc], weight=[n_loc, k_loc], out=[m // W, n_loc])

        def gemm():
            return F.linear(a, weight)

        def comm():
            dist.reduce_scatter_tensor(rs_out, partial, group=bench.group)
            return rs_out

        def seq():
            out = torch.empty((m // W, n_loc), device=dev, dtype=dt)
            dist.reduce_scatter_tensor(out, F.linear(a, weight), group=bench.group)
            return out

        def make_async_tp():
            why = _async_tp_available(bench)
            if why:
                return None, why
            f = torch.ops.symm_mem.fused_matmul_reduce_scatter
            return (lambda: f(a, w_kn, "sum", 0, bench.group_name)), None

        def make_flux(s):
            c = Candidate.parse(s)
            mod.run_strategy(c.strategy, a, weight, group=bench.group, weight_layout="nk", check=True, **c.kwargs)
            return (lambda: mod.run_strategy(c.strategy, a, weight, group=bench.group, weight_layout="nk",
                                             check=False, **c.kwargs)), None

        def make_auto():
            return (lambda: flux.gemm_rs(a, weight, group=bench.group)), None
        auto_input = a
        comm_bytes = m * n_loc * a.element_size()

    # Baselines: the reference output first (also a check that NCCL and cuBLAS run).
    bench.sync()
    ref = seq().clone()
    torch.cuda.synchronize()
    ref_ok = bool(torch.isfinite(ref.float()).all().item())
    if bench.agree_failed(not ref_ok):
        rec["status"] = "error: the sequential reference is not finite"
        return rec
    base = {}
    for name, fn in (("gemm", gemm), ("comm", comm), ("seq", seq)):
        bench.sync()
        base[name] = bench.time(fn)
    t_gemm, t_comm, t_seq = base["gemm"]["t_ms"], base["comm"]["t_ms"], base["seq"]["t_ms"]
    rec.update(t_gemm_ms=t_gemm, t_comm_ms=t_comm, t_seq_ms=t_seq,
               gemm_tflops=flop / t_gemm / 1e9 if t_gemm > 0 else None,
               comm_algbw_GBps=comm_bytes / t_comm / 1e6 if t_comm > 0 else None,
               baselines=base)

    if args.ablation:
        rec["ablation"] = ablation(bench, op, m, k_loc, n_loc, weight)

    methods = {}
    if args.skip_async_tp:
        methods["async_tp"] = {"status": "unavailable: --skip-async-tp"}
    else:
        _method(bench, "async_tp", make_async_tp, ref, methods)
        bench.sync()
    for s in strategies:
        def mk(s=s):
            name = Candidate.parse(s).strategy
            if name not in mod.available_strategies(dev):
                return None, f"not in flux.ops.{op}.available_strategies({dev})"
            return make_flux(s)
        _method(bench, f"flux:{s}", mk, ref, methods)
        bench.sync()
    _method(bench, "flux:auto", make_auto, ref, methods)
    if methods["flux:auto"].get("status") == "ok":  # what the automatic choice ran
        from flux import autotune
        from flux.ops._common import problem_of

        methods["flux:auto"]["choice"] = autotune.choose(
            problem_of(op, auto_input, weight, "nk", None, W, m), dev).label
    for entry in methods.values():
        if entry.get("status") == "ok":
            entry["E"], entry["speedup"] = _eff(t_seq, t_gemm, entry["t_ms"])
    rec["methods"] = methods
    flux_ok = {nm: e for nm, e in methods.items()
               if nm.startswith("flux:") and nm != "flux:auto" and e.get("status") == "ok"}
    if flux_ok:
        nm, e = min(flux_ok.items(), key=lambda kv: kv[1]["t_ms"])
        rec["best_flux"] = {"strategy": nm[len("flux:"):], "t_ms": e["t_ms"], "E": e["E"],
                            "speedup": e["speedup"]}
    else:
        rec["best_flux"] = None
    rec["status"] = "ok"
    return rec


def ablation(bench, op, m, k, n, weight):
    """The decomposed strategies' stages alone, on this rank's shapes (no communication):
    'split' = the W row-block GEMMs of m/W rows each, as the strategies issue them (cuBLAS
    through flux.ops._common.gemm_into); ag_gemm at W = 2 also 'first<c>' = a GEMM of c rows,
    then one of the other m - c (other splits of the same rows: the first GEMM can only hold
    local rows, c < m/W); gemm_rs also 'reduce' = flux::reduce_chunks_ over
    [W, m/W, n] into [m/W, n]. Subtracted from a strategy's time they leave what the
    communication, the signals and the launches add."""
    torch, W, dev, dt = bench.torch, bench.world, bench.device, bench.dtype
    from flux.ops._common import gemm_into

    rows = m // W
    gen = torch.Generator(device=dev)
    gen.manual_seed(3000 + bench.rank)
    a = torch.randn((m, k), device=dev, dtype=dt, generator=gen)
    out = torch.empty((m, n), device=dev, dtype=dt)

    def split():
        for p in range(W):
            gemm_into(out[p * rows:(p + 1) * rows], a[p * rows:(p + 1) * rows], weight, None, "nk")
        return out

    res = {}
    bench.sync()
    res["split"] = bench.time(split)
    if op == "ag_gemm" and W == 2:
        for c in sorted({rows - 128, rows - 256, rows - 512, rows - 1024, rows // 2}):
            if 0 < c < rows:
                def first(c=c):
                    gemm_into(out[:c], a[:c], weight, None, "nk")
                    gemm_into(out[c:], a[c:], weight, None, "nk")
                    return out

                bench.sync()
                res[f"first{c}"] = bench.time(first)
    if op == "gemm_rs" and hasattr(torch.ops.flux, "reduce_chunks_"):
        red = torch.empty((rows, n), device=dev, dtype=dt)
        parts = out.view(W, rows, n)

        def reduce():
            torch.ops.flux.reduce_chunks_(red, parts, None)
            return red

        bench.sync()
        res["reduce"] = bench.time(reduce)
    res.update(_fused_ablation(bench, op, m, k, n, weight, a, out))
    return res


def _fused_ablation(bench, op, m, k, n, weight, a, out):
    """The fused strategies' compute alone, every flag already set (no communication, no
    barrier): AG 'fused_kernel' = the fused kernel over all m rows, 'fused_copy_kernel' = the
    own rows' copy into place, then the kernel (what the strategy runs on its stream);
    RS (world size 2) 'fused_kernel' = the own-block kernel with the peer's partial (random)
    folded in, 'fused_compute' = the peer rows' cuBLAS GEMM, then that kernel."""
    torch, W, dev, dt = bench.torch, bench.world, bench.device, bench.dtype
    from flux.ops._common import _fused_kernels_built, gemm_into

    if dt != torch.bfloat16 or not _fused_kernels_built() or torch.cuda.get_device_capability(dev) != (9, 0):
        return {}
    rows = m // W
    res = {}
    if op == "ag_gemm":
        from flux.ops.ag_gemm import _fused_swizzle

        flags = torch.ones(W, dtype=torch.int32, device=dev)
        full = torch.empty_like(a)
        full.copy_(a)
        swz = _fused_swizzle(m, n)

        def kernel():
            torch.ops.flux.ag_gemm_fused_(out, full, weight, None, flags, bench.rank, W, rows, 10000, 0, 1, swz, 0)
            return out

        def copy_kernel():
            full[bench.rank * rows:(bench.rank + 1) * rows].copy_(a[:rows])
            return kernel()

        bench.sync()
        res["fused_kernel"] = bench.time(kernel)
        bench.sync()
        res["fused_copy_kernel"] = bench.time(copy_kernel)
    elif W == 2:
        segments = 8
        flags = torch.ones(segments, dtype=torch.int32, device=dev)
        src = torch.randn((rows, n), device=dev, dtype=dt)
        res_out = torch.empty((rows, n), device=dev, dtype=dt)
        staging = torch.empty((rows, n), device=dev, dtype=dt)
        swz = 8 if rows >= 16 * 128 else 1
        own = a[:rows]

        def kernel():
            torch.ops.flux.gemm_rs_fused_(res_out, own, weight, None, src, flags, -(-rows // segments), 0, 1, 10000,
                                          0, 1, swz, 0)
            return res_out

        def compute():
            gemm_into(staging, a[rows:], weight, None, "nk")
            return kernel()

        bench.sync()
        res["fused_kernel"] = bench.time(kernel)
        bench.sync()
        res["fused_compute"] = bench.time(compute)
    return res


# ----------------------------------------------------------------------------- output


def metadata(bench, argv):
    torch = bench.torch
    import flux
    from flux.runtime import extension_error

    def _try(f):
        try:
            return f()
        except Exception as e:  # noqa: BLE001
            return f"unknown ({_short(e, 100)})"

    props = torch.cuda.get_device_properties(bench.device)
    nccl = _try(lambda: ".".join(str(v) for v in torch.cuda.nccl.version())
                if isinstance(torch.cuda.nccl.version(), tuple) else str(torch.cuda.nccl.version()))
    def _git(*cmd):
        r = subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None

    commit = _try(lambda: _git("rev-parse", "--verify", "-q", "HEAD"))
    dirty = _try(lambda: None if commit is None else bool(_git("status", "--porcelain", "--untracked-files=no")))
    return {
        "command": f"torchrun --nproc_per_node={bench.world} " + shlex.join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "world_size": bench.world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "gpu": props.name,
        "gpu_count_visible": torch.cuda.device_count(),
        "gpu_sm_count": props.multi_processor_count,
        "python": sys.version.split()[0],
        "flux": flux.__version__,
        "flux_file": flux.__file__,
        "flux_cuda_kernels_available": flux.cuda_kernels_available(),
        "flux_extension_error": extension_error(),
        "git_commit": commit,
        "git_dirty": dirty,
        "env": {v: os.environ.get(v) for v in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES",
                                                "FLUX_STRATEGY_AG_GEMM", "FLUX_STRATEGY_GEMM_RS", "FLUX_CACHE_DIR",
                                                "FLUX_AUTOTUNE")},
        "protocol": {"dtype": bench.args.dtype, "warmup": bench.args.warmup, "iters": bench.args.iters,
                     "tol": bench.args.tol, "scale_with_world": bench.args.scale_with_world,
                     "flush_l2": bench.args.flush_l2, "quick": bench.args.quick,
                     "queue_ahead_us": bench.args.queue_ahead_us,
                     "time": "median over rounds of CUDA-event time of one call, max over ranks",
                     "E": "(t_seq - t_op) / (t_seq - t_gemm)", "speedup": "t_seq / t_op"},
    }


def _fmt_t(t):
    return f"{t:7.3f}" if isinstance(t, (int, float)) else f"{'-':>7}"


def _cell(e):
    """'t E x' of a method entry, or its status in short."""
    if not e:
        return "-"
    if e.get("status") != "ok":
        st = e.get("status") or "?"
        return "incorrect" if st == "incorrect" else st.split(":")[0]
    E = e.get("E")
    sp = e.get("speedup")
    star = "*" if e.get("host_bound") else ""
    return f"{e['t_ms']:.3f}{star} {('%+.2f' % E) if E is not None else '  n/a'} {('%.2fx' % sp) if sp else '-'}"


def table(op, recs, strategies, world, dtype):
    cols = ["async_tp"] + [f"flux:{s}" for s in strategies]
    heads = ["async-TP"] + list(strategies)
    lines = [f"{op}  (W={world}, {dtype}; ms; cells: time E speedup-vs-seq; "
             "E=(seq-t)/(seq-gemm); *: host-bound, launch time included)"]
    width = 18
    hdr = f"{'shape':<16} {'gemm':>7}  {'comm':>7}  {'seq':>7} "
    for h in heads:
        hdr += f" | {h[:width]:<{width}}"
    hdr += f" | {'best flux':<{width + 12}} | auto (its choice; vs best)"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for r in recs:
        row = f"{r['shape']:<16}"
        if r.get("status") != "ok":
            lines.append(f"{row} {r.get('status')}")
            continue
        for b in ("gemm", "comm", "seq"):
            e = r.get("baselines", {}).get(b, {})
            row += f" {_fmt_t(r[f't_{b}_ms'])}{'*' if e.get('host_bound') else ' '}"
        for c in cols:
            row += f" | {_cell(r['methods'].get(c)):<{width}}"
        b = r.get("best_flux")
        if b:
            E = b["E"]
            best = f"{b['strategy']} {b['t_ms']:.3f} {('%+.2f' % E) if E is not None else 'n/a'} {b['speedup']:.2f}x"
            row += f" | {best:<{width + 12}}"
        else:
            row += f" | {'-':<{width + 12}}"
        a = r["methods"].get("flux:auto") or {}
        if a.get("status") == "ok":
            vs = f"; {100 * (a['t_ms'] / b['t_ms'] - 1):+.1f}%" if b else ""
            row += f" | {a['t_ms']:.3f} ({a.get('choice', '?')}{vs})"
        else:
            row += " | -"
        lines.append(row)
    return "\n".join(lines)


def default_out():
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(HERE, "results", f"bench_ops-{socket.gethostname()}-{stamp}.json")


# ----------------------------------------------------------------------------- main


def main(argv=None):
    argv = sys.argv if argv is None else argv
    args = parse_args(argv[1:])

    import torch

    if not torch.cuda.is_available():
        print("bench_ops.py: no CUDA device; this benchmark needs GPUs (run it with torchrun on a GPU host)",
              file=sys.stderr)
        return 2
    try:
        import flux  # noqa: F401
    except ImportError:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, REPO)
        import flux  # noqa: F401

    bench = Bench(args)
    torch, dist = bench.torch, bench.dist
    out_path = args.out or default_out()
    try:
        meta = metadata(bench, argv)
        bench.log(f"bench_ops: W={bench.world} {meta['gpu']} torch {meta['torch']} NCCL {meta['nccl']} "
                  f"flux {meta['flux']} (CUDA kernels: {meta['flux_cuda_kernels_available']})")
        results = {}
        strategy_lists = {}
        for op in args.ops:
            mod = importlib.import_module(f"flux.ops.{op}")
            avail = list(mod.available_strategies(bench.device))
            strategies = avail if args.strategy_filter is None else list(args.strategy_filter)
            strategy_lists[op] = strategies
            recs = []
            for shape in args.shape_lists[op]:
                bench.log(f"[{op}] {shape[0]}x{shape[1]}x{shape[2]} ...")
                try:
                    rec = run_shape(bench, op, shape, strategies)
                except torch.cuda.OutOfMemoryError as e:
                    rec = {"shape": "x".join(map(str, shape)), "status": f"error: {_short(e, 200)}"}
                recs.append(rec)
                if rec.get("status") == "ok":
                    abl = "".join(f"{k} {v['t_ms']:.3f}  " for k, v in rec.get("ablation", {}).items())
                    bench.log(f"    gemm {rec['t_gemm_ms']:.3f}  comm {rec['t_comm_ms']:.3f}  "
                              f"seq {rec['t_seq_ms']:.3f}  {abl}" +
                              "  ".join(f"{k} [{_cell(v)}]" for k, v in rec["methods"].items()))
                else:
                    bench.log(f"    {rec.get('status')}")
                gc.collect()
                torch.cuda.empty_cache()
                bench.sync()
            results[op] = {"available_strategies": avail, "shapes": recs}
        if bench.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "w") as f:
                json.dump({"metadata": meta, "results": results}, f, indent=1)
            print(f"\nwrote {out_path}\n")
            for op in args.ops:
                print(table(op, results[op]["shapes"], strategy_lists[op], bench.world, args.dtype))
                print()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
