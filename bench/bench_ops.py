"""Benchmark of flux.ag_gemm and flux.gemm_rs against cuBLAS, NCCL and PyTorch async-TP.

Run (one process per GPU)::

    torchrun --nproc_per_node=2 bench/bench_ops.py                      # public suite, both ops
    torchrun --nproc_per_node=2 bench/bench_ops.py --quick              # 2 shapes per op, few rounds
    torchrun --nproc_per_node=2 bench/bench_ops.py --op gemm_rs --shapes 8192x14336x8192,512x14336x8192
    torchrun --nproc_per_node=2 bench/bench_ops.py --strategies all --out /tmp/r.json
    torchrun --nproc_per_node=2 bench/bench_ops.py --matrix             # argument matrix only (below)
    torchrun --nproc_per_node=2 bench/bench_ops.py --matrix --shapes suite   # the suite, then the matrix

Shapes (the public suite: flux.autotune.space.PUBLIC_SUITE). A shape is ``M x K x N``, M the gathered (full) number of rows.
The listed shape IS the GEMM that each rank runs at world size W = 2, so that the
``gemm`` column is comparable with cuBLAS alone on one GPU
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
              Its output is the reference for every correctness check. Its host time is
              the budget of every flux strategy's (an NCCL collective plus torch.mm).
    async_tp  PyTorch async-TP (torch.distributed._symmetric_memory):
              torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [W.t()], 0, group_name)
                  (return_A left at its default True: the multimem path, which needs
                  NVLink multicast, is only taken with return_A=False)
              torch.ops.symm_mem.fused_matmul_reduce_scatter(A, W.t(), "sum", 0, group_name)
              If it cannot run, the JSON records "unavailable: <reason>".
    flux:<s>  the flux strategy s (a name, or a candidate label with parameters, e.g.
              'fused(config=3,swizzle=8)'), made once with
              flux.ops.<op>.prepare_strategy(s, ..., check=True) (the arguments checked
              across the ranks, a C++ plan made), then called as that plan's zero-argument
              callable. Default methods: one per strategy, with its default parameters:
              ag_gemm 'sequential,decomposed,oneshot,fused', gemm_rs
              'sequential,oneshot,decomposed,fused'. --strategies names others;
              --strategies all runs every candidate of the autotuner's search space valid for
              the shape (flux.autotune.space.candidates). A strategy missing from
              flux.ops.<op>.available_strategies(device) is recorded "unavailable".
    flux:auto the public op (flux.ag_gemm / flux.gemm_rs): the autotuner's choice plus the
              dispatch. Its first call (the correctness check) checks, chooses and plans;
              later calls run the plan from C++. Its choice is recorded.

Protocol:
  * random data (torch.randn; A ~ N(0, 1), W ~ N(0, 1/K)), never zeros; a different seed
    per rank for A;
  * correctness before timing: each non-baseline method's output is compared with the
    ``seq`` output, relative error ||out - ref|| / ||ref|| (fp32 norms, maximum over the
    ranks) < tol (bf16 2e-2, fp16 1e-2, fp32 1e-4; --tol overrides). A method above tol
    is reported "incorrect" and not timed; an exception is reported "error: ...";
  * timing: --warmup eager calls, then each method (baselines included) is timed in the
    four ways users run the ops, plus a diagnostic, one mode after the other. A figure is
    a median on each rank, then the maximum of that median over the ranks (all_reduce MAX):

      loop    back-to-back eager calls, as a model run eagerly. Per round: synchronize, host
              barrier, then a rendezvous on the GPU (an all_reduce of one element: the current
              stream waits for it, so the GPUs of all ranks start the round together, not only
              their hosts); CUDA event; --loop-calls calls back to back; CUDA event;
              synchronize. Time per call = the round's time / --loop-calls; loop_ms = median
              over --iters rounds. A call whose host time exceeds its GPU time shows it here.
      graph   the same --loop-calls calls captured once in a CUDA graph (after the warm-up,
              3 more calls on a side stream, then torch.cuda.graph on that stream),
              replayed once per round after the same rendezvous, CUDA events around the
              replay: graph_ms = median over --iters rounds of replay time / --loop-calls. No
              host cost at all: a call's GPU time in a graphed model. When capture or replay
              fails on any rank, or the last call's output after the replays is off the
              reference by tol or more, graph_ms is None and graph_status "unavailable:
              <reason>" (otherwise "ok"); the other modes still count.
      single  one call on an idle GPU, the latency a lone layer sees. Per round: synchronize,
              host barrier, synchronize (no GPU op after the barrier); CUDA event; one call;
              CUDA event; synchronize. The events are enqueued around the call, so its host
              enqueue time is in single_ms on purpose (and so is the ranks' skew on leaving
              the barrier). Median over --iters rounds.
      host    CPU time to enqueue one call while the GPU is kept busy (the host running ahead,
              as in a model whose GPU is the bottleneck): --host-calls calls in batches of
              20; before each batch a GPU spin (torch.cuda._sleep) of 2 ms + 0.5 ms per call,
              which outlasts the batch's enqueue, so no call finds an idle GPU; each call
              timed on the host (time.perf_counter); synchronize after the batch. host_us =
              median µs per call over the --host-calls calls. The budget: every flux
              strategy's host_us <= seq's (NCCL collective + torch.mm); the host table puts
              them side by side.
      spin    diagnostic only, never the headline (the protocol of earlier runs, kept to
              compare with them; --no-spin skips it). Per round: synchronize; a GPU spin of
              --queue-ahead-us during which the host enqueues what follows; the GPU
              rendezvous; CUDA event; one call; CUDA event; synchronize. spin_ms = median
              over --iters rounds. The spin keeps the host's launch cost out unless the host
              takes longer than --queue-ahead-us to enqueue the rendezvous and the call.

    --flush-l2 writes a 256 MB buffer before every round of loop, graph, single and spin
    (outside the timed region; in loop and graph only the round's first call finds a cold
    L2). Methods run one after the other (not interleaved per round), so slow drift of clocks
    or temperature shows as a few percent of noise on large shapes: raise --iters;
  * for every non-baseline method and each mode m of loop, graph, single, spin: overlap
    efficiency E_m = (t_seq_m - t_op_m) / (t_seq_m - t_gemm_m) (None when t_seq_m <=
    t_gemm_m) and speedup_m = t_seq_m / t_op_m, with the baselines timed in the same mode;
  * run time: per method and shape about 930 calls (1 check, 5 warm-up, 200 loop, 3 graph
    warm-up, 200 replayed, 10 single, 10 spin, 500 host) and 25 host-batch spins of 12 ms.
    On 2xH200 in bf16 one seq call of each of the 13 suite shapes adds up to ~13 ms, and the
    9 default methods of a shape (3 baselines, async-TP, 4 strategies, auto) cost about 8 seq
    calls: ~95 s of calls, ~35 s of spins, ~40 s of start-up, planning and graph capture, so
    about 3 minutes for the public suite at 2 ranks (estimated, not measured; --strategies
    all runs 14 to 17 strategies per shape: about 2.5 times that; --quick: under a minute);
  * Known limitation: rounds are back to back on the same tensors, so shapes whose
    operands fit in the 60 MB L2 of an H200 partly run from L2 (--flush-l2 rules that out
    for the first call of a round).

Matrix (--matrix): is the automatic choice at least as fast as NCCL then cuBLAS for every
documented argument, not only the suite's (bf16, "nk", no bias, 2-D, out_dtype None)? The
public op (flux.ag_gemm / flux.gemm_rs, as flux:auto) against a baseline doing the same,
at one shape per op: --matrix-shape, MxKxN as the suite's shapes (N or K scaled with the
world size as above), one for both ops or "AGSHAPE,RSSHAPE"; default 4096x8192x8192 for
both. --matrix alone runs only the matrix (the suite runs too when --shapes is given, e.g.
--shapes suite, and then first); --dtype does not apply to it. Cells, 32 per op, every
combination of:

    dtype          bf16, fp16 (input and weight)
    weight_layout  "nk" (weight [N, K]), "kn" (weight [K, N], contiguous): the same matrix
    bias           no, yes ([N], in the output dtype, as flux requires: fp32 with out_dtype fp32)
    input_dim      2: [rows, K];  3: [rows/2, 2, K] (Megatron's [s, b, h]; dim 0 is gathered or
                   scattered, so M must be divisible by 2W)
    out_dtype      None (the input dtype), torch.float32

  * baseline ("NCCL then cuBLAS doing the same"), on the input viewed as [rows, K]:
      ag_gemm  all_gather_into_tensor into a [M, K] buffer, then torch.mm(gathered, w_kn)
               (w_kn: "nk" weight.t(), the view F.linear multiplies by; "kn" the weight
               itself), then bias added in place; viewed as the op's output shape
      gemm_rs  torch.mm(input, w_kn), then reduce_scatter_tensor in the output dtype, then
               bias added in place to this rank's rows (once, after the sum); viewed likewise
    with out_dtype float32 the GEMM is torch.mm(a, w_kn, out_dtype=torch.float32) (tensor
    cores, fp32 output, as flux); where that raises on some rank (probed once per dtype at
    the start) every rank multiplies fp32 copies instead, torch.mm(a.float(), w_kn.float()),
    and the cell records "baseline upcast: ..." in baseline_gemm;
  * per cell: the baseline's output, then the op's first call (which checks, chooses and
    plans), compared with it: relative error as in the suite, tol by the input dtype (bf16
    2e-2, fp16 1e-2; --tol overrides both). Above tol the cell is "incorrect" and nothing is
    timed; an exception is "error: ..." (every rank takes the same path). The op's choice is
    recorded (flux.autotune.choose of the call's problem, out_dtype included). Then the
    baseline and the op are timed in loop and graph mode only (as above; the graph's output
    checked against the baseline's), and ratio_m = flux_m / baseline_m; a ratio over
    1.02 in either mode (flux more than 2% slower) marks the cell '!';
  * run time: per cell about 820 calls (per side: 1 check, 5 warm-up, 200 loop, 3 graph
    warm-up, 200 replayed). At the default shape on 2xH200 a call is about 1 ms (each rank's
    0.55 TFLOP GEMM takes ~0.7 ms, plus the collective; fp32 outputs move twice the bytes), so
    ~0.8 s of calls per cell, plus ~0.5 s of rendezvous, graph capture and the first call's
    planning: ~85 s for the 64 cells, about 2 minutes with start-up (estimated, not measured;
    every further ms per call adds ~50 s; --quick: under a minute).

Environment hygiene: NVLink multicast (NVLS) is never used: this script forces
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before
torch.distributed is imported.

Output: rank 0 writes JSON to --out (default bench/results/bench_ops-<host>-<time>.json):
{"metadata": versions, GPU, world size, command line, date, the protocol's parameters;
"results": {op: {"available_strategies": [...], "shapes": [one record per shape] (empty
with --matrix and no --shapes), "matrix": (with --matrix) {...}}}}. A shape's record:

    shape, M, K, N, local           the listed shape; this rank's N, K and tensor shapes
    t_gemm_ms, t_comm_ms, t_seq_ms  the baselines' loop_ms (back-to-back calls)
    gemm_tflops, comm_algbw_GBps    from t_gemm_ms and t_comm_ms
    baselines                       {"gemm" | "comm" | "seq": timing}
    methods                         {"async_tp" | "flux:<s>" | "flux:auto": timing, plus
                                    "status" ("ok", "incorrect", "unavailable: ...",
                                    "error: ..."), "rel_err", "E" and "speedup" (each
                                    {"loop", "graph", "single", "spin": value or None});
                                    flux:auto also "choice", the candidate it runs}
    best_flux                       the fastest flux:<s> (auto excluded) by graph_ms, by
                                    loop_ms when one of them has no graph time:
                                    {"strategy", "mode", "t_ms", "E", "speedup"}, or None
    status                          "ok", or why the shape did not run

where a timing is {"loop_ms", "graph_ms", "single_ms", "spin_ms" (ms per call; None where
not measured), "host_us" (µs per call), "graph_status", "per_rank" (each rank's median of
each of these), "rank0_min_max_ms" ({mode: [min, max] over rank 0's rounds})}. Printed
last, per op: a compact table (t_gemm; seq, async-TP and flux:auto in graph, loop and
single ms and host µs; E and speedup of flux:auto in graph mode and its speedup over
async-TP) and a host table (host µs per call of seq next to every method's).

results[op]["matrix"] is {"shape", "M", "K", "N", "local": {"N", "K"}, "cells": [one record
per cell]}; a cell's record:

    dtype, weight_layout, bias,     its labels ("bf16", "nk", false, 2, null, ...)
    input_dim, out_dtype
    local                           this rank's input, weight and output shapes
    baseline_gemm                   "torch.mm", "torch.mm(out_dtype=torch.float32)" or
                                    "baseline upcast: ..."
    status                          "ok", "incorrect", "error: ...", "error while timing:
                                    ...", or "skipped: ..." (M not divisible)
    rel_err, choice                 the op's first output against the baseline's; the
                                    candidate the automatic choice runs
    baseline, flux                  timing (loop_ms and graph_ms measured; the other modes
                                    None, graph_status "not measured" where not graphed)
    ratio                           {"loop", "graph": flux / baseline or None}
    slower                          a ratio > 1.02 (marked '!')

Printed after the suite's tables, per op: the matrix table, one row per cell (the five
labels; baseline and flux loop and graph ms; the ratios; '!'; the choice). Exit status 0
even if some method is unavailable or incorrect (see the JSON).
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
# One method per strategy, with its default parameters (--strategies all: every candidate).
DEFAULT_STRATEGIES = {
    "ag_gemm": "sequential,decomposed,oneshot,fused",
    "gemm_rs": "sequential,oneshot,decomposed,fused",
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_TOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}
MODES = ("loop", "graph", "single", "spin")  # the modes timed in ms (host is in µs)
# torch.cuda._sleep counts cycles: at the H200's 1.98 GHz boost clock (a lower clock only
# lengthens a spin, which is harmless).
CYCLES_PER_US = 1980
# Host mode: calls per batch, and the GPU spin before each batch. The spin must outlast the
# batch's enqueue so that no call finds the GPU idle: 2 ms, plus 0.5 ms per call (10x and
# more what a call's enqueue takes).
HOST_BATCH = 20
HOST_SPIN_US = 2000.0
HOST_SPIN_PER_CALL_US = 500.0
# Calls on the capture stream before capturing, as PyTorch recommends: lazy per-stream state
# (a cuBLAS workspace, say) is made there, not inside the capture.
GRAPH_WARMUP = 3
# --matrix: one shape per op (M x K x N as the suite's), the dtypes of its cells, the modes
# timed (host, single and spin left out to keep the 64 cells short), and the ratio
# flux / baseline above which a cell is marked '!' (more than 2% slower in some mode).
MATRIX_SHAPE = "4096x8192x8192"
MATRIX_DTYPES = ("bf16", "fp16")
MATRIX_MODES = ("loop", "graph")
MATRIX_SLOWER = 1.02


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark flux.ag_gemm / flux.gemm_rs against cuBLAS, NCCL and PyTorch async-TP "
                    "(run with torchrun --nproc_per_node=N; the protocol is in the module docstring).")
    p.add_argument("--op", choices=["ag_gemm", "gemm_rs", "all"], default="all", help="default: all")
    p.add_argument("--shapes", default=None,
                   help="'suite' (the public suite, flux.autotune.space.PUBLIC_SUITE) or a comma-separated list MxKxN,... "
                        "(M gathered; used for every op selected); default: suite, or none with --matrix")
    p.add_argument("--matrix", action="store_true",
                   help="measure the public ops against NCCL then cuBLAS doing the same on the matrix of "
                        "documented arguments (dtype bf16/fp16 x weight_layout x bias x 2-D/3-D input x out_dtype "
                        "None/float32), loop and graph mode, at --matrix-shape; the shape suite then runs only "
                        "if --shapes is given (e.g. --shapes suite)")
    p.add_argument("--matrix-shape", default=MATRIX_SHAPE,
                   help=f"--matrix: MxKxN for both ops, or AGSHAPE,RSSHAPE (default {MATRIX_SHAPE}; N (ag_gemm) "
                        "or K (gemm_rs) scaled with the world size as the suite's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="the suite's dtype (the matrix runs both bf16 and fp16); default: bf16")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per method and shape (default 5)")
    p.add_argument("--iters", type=int, default=10,
                   help="timed rounds per method and shape in each of the loop, graph, single and spin "
                        "modes (default 10)")
    p.add_argument("--loop-calls", type=int, default=20,
                   help="calls per round in loop mode, and captured in the graph (default 20)")
    p.add_argument("--host-calls", type=int, default=500,
                   help=f"calls timed on the host in host mode, in batches of {HOST_BATCH} (default 500)")
    p.add_argument("--out", default=None,
                   help="JSON file written by rank 0 (default bench/results/bench_ops-<host>-<time>.json)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated flux strategies to run, each a name or a candidate label with "
                        "parameters, e.g. 'decomposed,fused(config=3,swizzle=8)'; 'all': every candidate "
                        "of the autotuner's search space valid for the shape (default: ag_gemm "
                        f"'{DEFAULT_STRATEGIES['ag_gemm']}', gemm_rs '{DEFAULT_STRATEGIES['gemm_rs']}')")
    p.add_argument("--scale-with-world", action=argparse.BooleanOptionalAction, default=True,
                   help="multiply N (ag_gemm) or K (gemm_rs) by 2/W, rounded to a multiple of 128, so the "
                        "total problem is the listed one at W=2 (default: on)")
    p.add_argument("--skip-async-tp", action="store_true", help="do not run PyTorch async-TP")
    p.add_argument("--flush-l2", action="store_true",
                   help="write a 256 MB buffer before every timed round (outside the timed region)")
    p.add_argument("--no-spin", dest="spin", action="store_false",
                   help="skip the spin diagnostic (a GPU spin of --queue-ahead-us before each call)")
    p.add_argument("--queue-ahead-us", type=float, default=1000.0,
                   help="spin diagnostic: GPU spin (torch.cuda._sleep) at the start of each round, before "
                        "the rendezvous, during which the host enqueues the call (default 1000)")
    p.add_argument("--tol", type=float, default=None,
                   help="relative-error tolerance, of the suite and of every matrix cell (default by the input "
                        "dtype: bf16 2e-2, fp16 1e-2, fp32 1e-4)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 shapes per op (unless --shapes is given), warmup 2, iters 5, "
                        "loop-calls 10, host-calls 100")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.iters = min(args.warmup, 2), min(args.iters, 5)
        args.loop_calls, args.host_calls = min(args.loop_calls, 10), min(args.host_calls, 100)
    if args.warmup < 0 or min(args.iters, args.loop_calls, args.host_calls) < 1 or args.queue_ahead_us < 0:
        p.error("--warmup must be >= 0, --iters, --loop-calls and --host-calls >= 1 and --queue-ahead-us >= 0")
    # The matrix's cells are of both dtypes: each its own default, unless --tol is given.
    args.matrix_tol = {d: DEFAULT_TOL[d] if args.tol is None else args.tol for d in MATRIX_DTYPES}
    if args.tol is None:
        args.tol = DEFAULT_TOL[args.dtype]
    ops = ["ag_gemm", "gemm_rs"] if args.op == "all" else [args.op]
    args.ops = ops

    def shape_of(s):
        try:
            m, k, n = (int(v) for v in s.strip().lower().split("x"))
        except ValueError:
            p.error(f"bad shape {s!r}: expected MxKxN, e.g. 8192x8192x14336")
        if min(m, k, n) <= 0:
            p.error(f"bad shape {s!r}: every dimension must be positive")
        return m, k, n

    # --matrix alone measures the matrix only: the suite takes minutes and answers another question.
    args.run_suite = args.shapes is not None or not args.matrix
    args.shape_lists = {}
    for op in ops:
        if not args.run_suite:
            names = []
        elif args.shapes in (None, "suite"):
            names = (QUICK if args.quick else SUITE)[op]
        else:
            names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        args.shape_lists[op] = [shape_of(s) for s in names]
    mshapes = [shape_of(s) for s in args.matrix_shape.split(",")]
    if len(mshapes) not in (1, 2):
        p.error(f"bad --matrix-shape {args.matrix_shape!r}: expected MxKxN or AGSHAPE,RSSHAPE")
    args.matrix_shapes = {"ag_gemm": mshapes[0], "gemm_rs": mshapes[-1]}
    # op -> strategy labels; None: every candidate valid for the shape (made per shape)
    if args.strategies is None:
        args.strategy_lists = {op: split_labels(DEFAULT_STRATEGIES[op]) for op in ops}
    elif args.strategies.strip() == "all":
        args.strategy_lists = {op: None for op in ops}
    else:
        args.strategy_lists = {op: split_labels(args.strategies) for op in ops}
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
    """(E, speedup) of a method that took t_op ms, the baselines t_seq and t_gemm in the same mode."""
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
        self.spin_cycles = int(args.queue_ahead_us * CYCLES_PER_US)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

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
        """Host rendezvous with idle GPUs: synchronize, barrier, synchronize."""
        self.torch.cuda.synchronize()
        self.dist.barrier(group=self.group, device_ids=[self.local_rank])
        self.torch.cuda.synchronize()

    def gpu_rendezvous(self):
        """sync(), then a synchronous NCCL op that the current stream waits for, so that what
        follows starts on the GPUs of all ranks together (a host barrier alone would leave the
        GPUs skewed by the hosts' launch times)."""
        self.sync()
        self.dist.all_reduce(self.token, group=self.group)

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

    def agree_failed(self, failed: bool) -> bool:
        """True on every rank if any rank failed."""
        return self.max_all(1.0 if failed else 0.0) > 0

    # ------------------------------------------------------------------------- timing

    def time(self, fn, ref=None, modes=MODES + ("host",), tol=None):
        """The timings of one method (module docstring, Protocol) in ``modes`` (spin only with
        --spin): loop_ms, graph_ms, single_ms, spin_ms (ms per call, max over the ranks of the
        median over the rounds; None where not measured), host_us (None where not measured),
        graph_status, the per-rank medians and rank 0's range of rounds. ``ref``: the
        expected output, which the graph's last call must match within ``tol`` (default
        --tol) after the replays (None: not checked)."""
        torch, args = self.torch, self.args
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        calls = args.loop_calls

        def loop():
            for _ in range(calls):
                fn()

        rounds = {mode: None for mode in MODES}
        if "loop" in modes:
            rounds["loop"] = self._rounds(self.gpu_rendezvous, loop, calls)
        if "single" in modes:
            rounds["single"] = self._rounds(self.sync, fn)
        if "spin" in modes and args.spin:
            rounds["spin"] = self._rounds(self._spin_start, fn)
        # Graph after the modes of few rounds: torch.cuda.graph empties the allocator's cache,
        # so the next eager call allocates its output with cudaMalloc, an outlier that the
        # median over --host-calls calls ignores and the median of a few rounds might not.
        graph_status = "not measured"
        if "graph" in modes:
            rounds["graph"], graph_status = self._graph_rounds(fn, ref, args.tol if tol is None else tol)
        res, per_rank, spread = {}, {}, {}
        for mode in MODES:
            times = rounds[mode]
            res[f"{mode}_ms"] = None
            if times is not None:
                res[f"{mode}_ms"], per_rank[f"{mode}_ms"] = self._median_max(times)
                if self.rank == 0:
                    spread[mode] = [min(times), max(times)]
        res["host_us"] = None
        if "host" in modes:
            res["host_us"], per_rank["host_us"] = self._median_max(self._host_times(fn))
        res.update(graph_status=graph_status, per_rank=per_rank, rank0_min_max_ms=spread)
        return res

    def _median_max(self, samples):
        """(maximum over the ranks, per-rank list) of each rank's median of ``samples``."""
        per_rank = self.gather_all(statistics.median(samples))
        return max(per_rank), per_rank

    def _rounds(self, start_round, body, calls=1):
        """This rank's time per call (ms) in each of --iters rounds: ``start_round()``, CUDA
        event, ``body()`` (``calls`` calls), CUDA event, synchronize."""
        times = []
        for _ in range(self.args.iters):
            if self.flush is not None:
                self.flush.fill_(1)
            start_round()
            self.start.record()
            body()
            self.end.record()
            self.end.synchronize()
            times.append(self.start.elapsed_time(self.end) / calls)
        return times

    def _spin_start(self):
        """The spin diagnostic's round start: while the GPU spins, the host enqueues the
        rendezvous and the call, so the call's launch cost stays out of its GPU time. The
        spin comes before the rendezvous: it counts cycles, and the two GPUs' clocks can
        differ, so it would skew the ranks if it came after."""
        self.torch.cuda.synchronize()
        if self.spin_cycles:
            self.torch.cuda._sleep(self.spin_cycles)
        self.dist.all_reduce(self.token, group=self.group)

    def _host_times(self, fn):
        """This rank's host time (µs) of each of --host-calls calls, enqueued in batches
        behind a GPU spin that outlasts the batch's enqueue."""
        torch = self.torch
        times, left = [], self.args.host_calls
        torch.cuda.synchronize()
        while left:
            n = min(HOST_BATCH, left)
            torch.cuda._sleep(int((HOST_SPIN_US + HOST_SPIN_PER_CALL_US * n) * CYCLES_PER_US))
            for _ in range(n):
                h0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - h0) * 1e6)
            torch.cuda.synchronize()
            left -= n
        return times

    def _graph_rounds(self, fn, ref, tol):
        """(this rank's graph-mode times or None, graph_status): --loop-calls calls captured
        once, replayed once per round after the GPU rendezvous; the last call's output must
        then be within relative error ``tol`` of ``ref`` (None: not checked). Every rank takes
        the same path: a capture that fails on one rank is abandoned on all of them (the
        peers' replays would wait for its collectives and signals)."""
        torch, calls = self.torch, self.args.loop_calls
        graph, side, prev = torch.cuda.CUDAGraph(), torch.cuda.Stream(), torch.cuda.current_stream()
        out, failure = None, None
        try:
            side.wait_stream(prev)
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP):
                    fn()
            prev.wait_stream(side)
            # thread_local: the default, global mode would also fail the capture on an unsafe
            # CUDA call from another thread (NCCL's watchdog queries events), which says
            # nothing about the op.
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                for _ in range(calls):
                    out = fn()
        except Exception as e:  # noqa: BLE001  (recorded, never fatal)
            failure = f"capture: {_short(e, 200)}"
            self._leave_capture(graph, side, prev)
        if self.agree_failed(failure is not None):
            return None, f"unavailable: {failure or 'capture failed on another rank'}"
        times = None
        try:
            times = self._rounds(self.gpu_rendezvous, graph.replay, calls)
        except Exception as e:  # noqa: BLE001
            failure = f"replay: {_short(e, 200)}"
            torch.cuda.synchronize()
        if self.agree_failed(failure is not None):
            return None, f"unavailable: {failure or 'replay failed on another rank'}"
        if ref is not None:
            # Replays run the captured kernels on the captured addresses and arguments: a
            # call that depends on per-call host state computes wrong results, silently.
            err = self.rel_err(out, ref)
            if not err < tol:
                return None, f"unavailable: the output after the replays is off the reference (rel err {err:.2g})"
        return times, "ok"

    def _leave_capture(self, graph, stream, prev):
        """Clean up after a failed capture: torch.cuda.graph's exit skips restoring the current
        stream when capture_end raises, and ``stream`` must not stay in capture mode (every
        later synchronize would fail)."""
        torch = self.torch
        torch.cuda.set_stream(prev)
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # an invalidated capture ends all the same (cudaStreamEndCapture)
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- one shape


def _first_call(bench, call):
    """One untimed call, every rank taking the same path: (its output, None), or (None, the
    failure seen on this or another rank)."""
    out, failure = None, None
    try:
        bench.sync()
        out = call()
        bench.torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (recorded, never fatal)
        failure = _short(e)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    if bench.agree_failed(failure is not None):
        return None, failure or "failed on another rank"
    return out, None


def _method(bench, name, make_fn, ref, results):
    """Correctness check, then timing, of one non-baseline method; fills results[name].

    make_fn() -> (call, unavailable_reason): ``call()`` returns the op's output tensor.
    """
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
    out, failure = _first_call(bench, call)
    if failure is not None:
        entry["status"] = f"error: {failure}"
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
        timing = bench.time(call, ref)
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
    """One shape of one op: the baselines, then every method. ``strategies``: flux strategy
    labels, or None for every candidate of the search space valid for the shape."""
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

        op_input, public = a_shard, flux.ag_gemm
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

        op_input, public = a, flux.gemm_rs
        comm_bytes = m * n_loc * a.element_size()

    def make_flux(label):
        c = Candidate.parse(label)
        if c.strategy not in mod.available_strategies(dev):
            return None, f"not in flux.ops.{op}.available_strategies({dev})"
        # Checked and planned once, here; each call then enqueues the plan from C++.
        call = mod.prepare_strategy(c.strategy, op_input, weight, group=bench.group, weight_layout="nk",
                                    check=True, **c.kwargs)
        if op == "ag_gemm":  # (out, gathered or None)
            return (lambda: call()[0]), None
        return call, None

    def make_auto():
        return (lambda: public(op_input, weight, group=bench.group)), None

    from flux.ops._common import problem_of

    problem = problem_of(op, op_input, weight, "nk", None, W, m)
    if strategies is None:
        from flux.autotune.space import candidates

        strategies = [c.label for c in candidates(problem)]

    # Baselines: the reference output first (also a check that NCCL and cuBLAS run).
    bench.sync()
    ref = seq().clone()
    torch.cuda.synchronize()
    ref_ok = bool(torch.isfinite(ref.float()).all().item())
    if bench.agree_failed(not ref_ok):
        rec["status"] = "error: the sequential reference is not finite"
        return rec
    base = {}
    for name, fn, expect in (("gemm", gemm, None), ("comm", comm, None), ("seq", seq, ref)):
        bench.sync()
        base[name] = bench.time(fn, expect)
    t_gemm, t_comm, t_seq = (base[b]["loop_ms"] for b in ("gemm", "comm", "seq"))
    rec.update(t_gemm_ms=t_gemm, t_comm_ms=t_comm, t_seq_ms=t_seq,
               gemm_tflops=flop / t_gemm / 1e9 if t_gemm > 0 else None,
               comm_algbw_GBps=comm_bytes / t_comm / 1e6 if t_comm > 0 else None,
               baselines=base)

    methods = {}
    if args.skip_async_tp:
        methods["async_tp"] = {"status": "unavailable: --skip-async-tp"}
    else:
        _method(bench, "async_tp", make_async_tp, ref, methods)
        bench.sync()
    for s in strategies:
        _method(bench, f"flux:{s}", lambda s=s: make_flux(s), ref, methods)
        bench.sync()
    _method(bench, "flux:auto", make_auto, ref, methods)
    if methods["flux:auto"].get("status") == "ok":  # what the automatic choice ran
        from flux import autotune

        methods["flux:auto"]["choice"] = autotune.choose(problem, dev).label
    for entry in methods.values():
        if entry.get("status") == "ok":
            eff = {md: _eff(base["seq"][f"{md}_ms"], base["gemm"][f"{md}_ms"], entry[f"{md}_ms"]) for md in MODES}
            entry["E"] = {md: e for md, (e, _) in eff.items()}
            entry["speedup"] = {md: sp for md, (_, sp) in eff.items()}
    rec["methods"] = methods
    flux_ok = {nm: e for nm, e in methods.items()
               if nm.startswith("flux:") and nm != "flux:auto" and e.get("status") == "ok"}
    rec["best_flux"] = None
    if flux_ok:
        # Graph mode is the GPU time alone; loop only when some strategy could not be graphed,
        # so that all are compared in one mode.
        mode = "graph" if all(e["graph_ms"] is not None for e in flux_ok.values()) else "loop"
        nm, e = min(flux_ok.items(), key=lambda kv: kv[1][f"{mode}_ms"])
        rec["best_flux"] = {"strategy": nm[len("flux:"):], "mode": mode, "t_ms": e[f"{mode}_ms"],
                            "E": e["E"][mode], "speedup": e["speedup"][mode]}
    rec["status"] = "ok"
    return rec


# ----------------------------------------------------------------------------- the matrix


def matrix_cells():
    """The 32 cells of one op (module docstring, Matrix): every combination of the documented
    arguments that change what a call runs."""
    return [{"dtype": dt, "weight_layout": wl, "bias": b, "input_dim": d, "out_dtype": od}
            for dt in MATRIX_DTYPES for wl in ("nk", "kn") for b in (False, True) for d in (2, 3)
            for od in (None, "float32")]


def mm_out_dtype_unavailable(bench, dtype_name):
    """Why torch.mm(a, b, out_dtype=torch.float32) cannot run for inputs of ``dtype_name``
    on some rank (None: it runs on every rank). Where it cannot, the matrix's baseline
    multiplies fp32 copies instead ("baseline upcast"); every rank runs the same baseline."""
    torch = bench.torch
    why = None
    try:
        a = torch.ones((16, 16), device=bench.device, dtype=getattr(torch, DTYPES[dtype_name]))
        torch.mm(a, a, out_dtype=torch.float32)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (recorded in the cells, never fatal)
        why = _short(e, 200)
    if bench.agree_failed(why is not None):
        return why or "failed on another rank"
    return None


def run_cell(bench, op, shape, cell, upcast):
    """One cell of the matrix: the public op and the baseline (NCCL then cuBLAS doing the
    same), the op's output checked against the baseline's, then both timed in loop and
    graph mode. ``upcast``: dtype name -> mm_out_dtype_unavailable's answer."""
    torch, dist = bench.torch, bench.dist
    import flux
    from flux import autotune
    from flux.ops._common import problem_of

    W, dev, group = bench.world, bench.device, bench.group
    m, k, n = shape
    rec = dict(cell)
    # A 3-D input is [rows/2, 2, K]: dim 0, the one gathered or scattered, must still split
    # evenly over the ranks.
    div = 2 * W if cell["input_dim"] == 3 else W
    if m % div:
        rec["status"] = f"skipped: M={m} is not divisible by {div}"
        return rec
    n_loc, k_loc = per_rank_shape(op, m, k, n, W, bench.args.scale_with_world)
    dt = getattr(torch, DTYPES[cell["dtype"]])
    out_dtype = getattr(torch, cell["out_dtype"]) if cell["out_dtype"] else None
    layout, tol = cell["weight_layout"], bench.args.matrix_tol[cell["dtype"]]
    rows_in, rows_out = (m // W, m) if op == "ag_gemm" else (m, m // W)

    def shaped(rows, cols):
        return (rows // 2, 2, cols) if cell["input_dim"] == 3 else (rows, cols)

    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + bench.rank)
    wgen = torch.Generator(device=dev)
    wgen.manual_seed(2000 + bench.rank)
    inp = torch.randn(shaped(rows_in, k_loc), device=dev, dtype=dt, generator=gen)
    w_nk = torch.randn((n_loc, k_loc), device=dev, dtype=dt, generator=wgen) * (1.0 / math.sqrt(k_loc))
    # The same matrix in either layout; "kn" stores it [K, N], contiguous as the op requires.
    weight = w_nk if layout == "nk" else w_nk.t().contiguous()
    w_kn = weight.t() if layout == "nk" else weight  # [K, N] for torch.mm ("nk": a view, as F.linear)
    # flux takes the bias in the output dtype (fp32 with out_dtype=torch.float32).
    bias = (torch.randn(n_loc, device=dev, dtype=out_dtype or dt, generator=wgen) if cell["bias"] else None)
    rec["local"] = {"input": list(inp.shape), "weight": list(weight.shape), "out": list(shaped(rows_out, n_loc))}
    why_upcast = upcast[cell["dtype"]] if out_dtype is not None else None
    if out_dtype is None:
        rec["baseline_gemm"] = "torch.mm"
    elif why_upcast is None:
        rec["baseline_gemm"] = "torch.mm(out_dtype=torch.float32)"
    else:
        rec["baseline_gemm"] = f"baseline upcast: torch.mm of fp32 copies (torch.mm(out_dtype=) failed: {why_upcast})"

    def gemm(a2d):
        if out_dtype is None:
            return torch.mm(a2d, w_kn)
        if why_upcast is None:  # tensor cores, fp32 output, as flux computes it
            return torch.mm(a2d, w_kn, out_dtype=out_dtype)
        return torch.mm(a2d.float(), w_kn.float())

    # The bias is added in place, after the collective for gemm_rs (once, to the summed rows).
    if op == "ag_gemm":
        gathered = torch.empty((m, k_loc), device=dev, dtype=dt)

        def baseline():
            dist.all_gather_into_tensor(gathered, inp.view(-1, k_loc), group=group)
            out = gemm(gathered)
            if bias is not None:
                out.add_(bias)
            return out.view(shaped(rows_out, n_loc))

        public = flux.ag_gemm
    else:
        def baseline():
            out = torch.empty((rows_out, n_loc), device=dev, dtype=out_dtype or dt)
            dist.reduce_scatter_tensor(out, gemm(inp.view(-1, k_loc)), group=group)
            if bias is not None:
                out.add_(bias)
            return out.view(shaped(rows_out, n_loc))

        public = flux.gemm_rs

    def call():
        return public(inp, weight, bias, group=group, weight_layout=layout, out_dtype=out_dtype)

    # Correctness first, every rank on the same path (agree_failed after each step).
    ref = out = failure = None
    try:
        bench.sync()
        ref = baseline()
        torch.cuda.synchronize()
        if not bool(torch.isfinite(ref).all().item()):
            failure = "the baseline's output is not finite"
    except Exception as e:  # noqa: BLE001  (recorded, never fatal)
        failure = f"baseline: {_short(e)}"
    if bench.agree_failed(failure is not None):
        rec["status"] = f"error: {failure or 'failed on another rank'}"
        return rec
    out, failure = _first_call(bench, call)
    if failure is not None:
        rec["status"] = f"error: {failure}"
        return rec
    # What the automatic choice ran (after the first call, which may have tuned the problem).
    rec["choice"] = autotune.choose(problem_of(op, inp, weight, layout, out_dtype, W, m), dev).label
    err = bench.rel_err(out, ref)
    del out
    rec["rel_err"] = err if math.isfinite(err) else None
    if not err < tol:
        rec["status"] = "incorrect"
        return rec
    timing = {}
    try:
        for name, fn in (("baseline", baseline), ("flux", call)):
            bench.sync()
            timing[name] = bench.time(fn, ref, modes=MATRIX_MODES, tol=tol)
    except Exception as e:  # noqa: BLE001
        failure = _short(e)
    if bench.agree_failed(failure is not None):
        rec["status"] = f"error while timing: {failure or 'failed on another rank'}"
        return rec
    rec.update(timing)
    rec["ratio"] = {}
    for md in MATRIX_MODES:
        t_base, t_flux = timing["baseline"][f"{md}_ms"], timing["flux"][f"{md}_ms"]
        rec["ratio"][md] = t_flux / t_base if t_base and t_flux is not None else None
    rec["slower"] = any(r is not None and r > MATRIX_SLOWER for r in rec["ratio"].values())
    rec["status"] = "ok"
    return rec


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

    # FLUX_COMMIT where the runner sets it (a copied tree may carry stale git metadata).
    commit = os.environ.get("FLUX_COMMIT") or _try(lambda: _git("rev-parse", "--verify", "-q", "HEAD"))
    dirty = (None if os.environ.get("FLUX_COMMIT") else
             _try(lambda: None if commit is None else bool(_git("status", "--porcelain", "--untracked-files=no"))))
    args = bench.args
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
        "protocol": {"dtype": args.dtype, "warmup": args.warmup, "iters": args.iters,
                     "loop_calls": args.loop_calls, "host_calls": args.host_calls, "host_batch": HOST_BATCH,
                     "host_spin_us": [HOST_SPIN_US, HOST_SPIN_PER_CALL_US], "graph_warmup": GRAPH_WARMUP,
                     "spin": args.spin, "queue_ahead_us": args.queue_ahead_us,
                     "tol": args.tol, "scale_with_world": args.scale_with_world,
                     "flush_l2": args.flush_l2, "quick": args.quick, "skip_async_tp": args.skip_async_tp,
                     "strategies": args.strategies or DEFAULT_STRATEGIES,
                     "modes": {
                         "loop": "CUDA events around loop_calls back-to-back calls after a GPU rendezvous; "
                                 "ms per call",
                         "graph": "CUDA events around one replay of a CUDA graph of loop_calls calls after a "
                                  "GPU rendezvous; ms per call",
                         "single": "CUDA events around one call on an idle GPU after a host barrier, host "
                                   "enqueue time included; ms",
                         "host": "host wall-clock time of one call, the GPU kept busy by a spin; us",
                         "spin": "diagnostic: CUDA events around one call enqueued behind a GPU spin of "
                                 "queue_ahead_us and a GPU rendezvous; ms"},
                     "time": "median over the rounds (host: over the calls) on each rank, max over the ranks",
                     "t_gemm_ms, t_comm_ms, t_seq_ms": "loop mode",
                     "E": "(t_seq_m - t_op_m) / (t_seq_m - t_gemm_m), the baselines in the same mode m",
                     "speedup": "t_seq_m / t_op_m",
                     "suite": args.run_suite,
                     "matrix": None if not args.matrix else {
                         "shapes": {op: "x".join(map(str, args.matrix_shapes[op])) for op in args.ops},
                         "cells": "dtype (bf16, fp16) x weight_layout (nk, kn) x bias (no, yes) x input_dim "
                                  "(2: [rows, K], 3: [rows/2, 2, K]) x out_dtype (None, float32)",
                         "modes": list(MATRIX_MODES), "tol": args.matrix_tol,
                         "baseline": "ag_gemm: all_gather_into_tensor, torch.mm, + bias; gemm_rs: torch.mm, "
                                     "reduce_scatter_tensor in the output dtype, + bias",
                         "ratio": "flux_m / baseline_m", "slower": f"ratio > {MATRIX_SLOWER} in some mode"}},
    }


def _num(v, fmt, width, suffix=""):
    """``v`` in format ``fmt`` (then ``suffix``), or '-' where it was not measured,
    right-aligned in ``width``."""
    return f"{format(v, fmt) + suffix if isinstance(v, (int, float)) else '-':>{width}}"


# The compact table's method groups: the four figures of seq, async-TP and flux:auto.
TABLE_GROUPS = (("seq", "seq (NCCL + cuBLAS)"), ("async_tp", "async-TP"), ("flux:auto", "flux (auto)"))
_GROUP_W = 33  # "   graph    loop  single  host µs "


def _group_cells(e):
    if not e or e.get("status", "ok") != "ok":
        e = {}
    return (f" {_num(e.get('graph_ms'), '.3f', 7)} {_num(e.get('loop_ms'), '.3f', 7)}"
            f" {_num(e.get('single_ms'), '.3f', 7)} {_num(e.get('host_us'), '.1f', 8)} ")


def table(op, recs, world, dtype):
    lines = [f"{op}  (W={world}, {dtype})  ms per call: graph = CUDA-graph replay, loop = back-to-back eager calls, "
             "single = one call on an idle GPU (host time included);",
             "    host = CPU µs per call, the GPU busy; E = (seq - t) / (seq - gemm) and the speedups (x seq, "
             "x async-TP) in graph mode; -: unavailable"]
    hdr1 = f"{'':<16} {'':>7} "
    hdr2 = f"{'shape':<16} {'gemm':>7} "
    for _, title in TABLE_GROUPS:
        hdr1 += f"|{title:^{_GROUP_W}}"
        hdr2 += f"| {'graph':>7} {'loop':>7} {'single':>7} {'host µs':>8} "
    hdr1 += "| flux (auto), graph"
    hdr2 += f"| {'E':>6} {'x seq':>7} {'x aTP':>7}  choice"
    lines += [hdr1, hdr2, "-" * len(hdr2)]
    for r in recs:
        row = f"{r['shape']:<16}"
        if r.get("status") != "ok":
            lines.append(f"{row} {r.get('status')}")
            continue
        entries = {"seq": r["baselines"]["seq"], **r["methods"]}
        row += f" {_num(r['baselines']['gemm']['graph_ms'], '.3f', 7)} "
        for name, _ in TABLE_GROUPS:
            row += "|" + _group_cells(entries.get(name))
        auto, atp = entries.get("flux:auto") or {}, entries.get("async_tp") or {}
        E = sp = vs = None
        if auto.get("status") == "ok":
            E, sp = auto["E"]["graph"], auto["speedup"]["graph"]
            if atp.get("status") == "ok" and atp["graph_ms"] is not None and auto["graph_ms"]:
                vs = atp["graph_ms"] / auto["graph_ms"]
        row += f"| {_num(E, '+.2f', 6)} {_num(sp, '.2f', 7, 'x')} {_num(vs, '.2f', 7, 'x')}  {auto.get('choice', '-')}"
        lines.append(row)
    return "\n".join(lines)


def host_table(op, recs):
    """Host µs per call of seq (the budget: an NCCL collective + torch.mm) next to every method's."""
    names = ["seq"]
    for r in recs:
        names += [nm for nm in r.get("methods", {}) if nm not in names]
    widths = [max(len(nm), 8) for nm in names]
    lines = [f"{op}  host µs per call (CPU time to enqueue, the GPU busy; !: a flux method over seq's, "
             "the budget; -: unavailable)"]
    hdr = f"{'shape':<16}" + "".join(f" {nm:>{w}} " for nm, w in zip(names, widths))
    lines += [hdr, "-" * len(hdr)]
    for r in recs:
        row = f"{r['shape']:<16}"
        if r.get("status") != "ok":
            lines.append(f"{row} {r.get('status')}")
            continue
        budget = r["baselines"]["seq"]["host_us"]
        for nm, w in zip(names, widths):
            e = r["baselines"]["seq"] if nm == "seq" else r["methods"].get(nm) or {}
            v = e.get("host_us") if e.get("status", "ok") == "ok" else None
            over = nm.startswith("flux:") and v is not None and v > budget
            row += f" {_num(v, '.1f', w)}{'!' if over else ' '}"
        lines.append(row)
    return "\n".join(lines)


def _cell_labels(c):
    """A matrix cell's five labels, in the matrix table's columns."""
    return (f"{c['dtype']:<5} {c['weight_layout']:<6} {'yes' if c['bias'] else 'no':<4} "
            f"{c['input_dim']}-D{'':<3} {c['out_dtype'] or 'None':<9}")


def matrix_table(op, mrec, world):
    """One row per cell: baseline and flux (auto) in loop and graph ms, their ratios."""
    lines = [f"{op} matrix  {mrec['shape']} (W={world}; local {mrec['local']})  ms per call: loop = back-to-back "
             "eager calls, graph = CUDA-graph replay;",
             "    baseline = NCCL then cuBLAS doing the same; flux = the public op; ratio = flux / baseline; "
             f"!: flux over {MATRIX_SLOWER:.2f}x the baseline in some mode; -: unavailable"]
    labels = f"{'dtype':<5} {'layout':<6} {'bias':<4} {'input':<6} {'out_dtype':<9}"
    hdr1 = f"{'':<{len(labels)}} |{'baseline':^17}|{'flux (auto)':^17}|{'ratio':^17}|"
    hdr2 = labels + " |" + f" {'loop':>7} {'graph':>7} |" * 3 + "   choice"
    lines += [hdr1, hdr2, "-" * len(hdr2)]
    for c in mrec["cells"]:
        row = _cell_labels(c)
        if c.get("status") != "ok":
            err = f" (rel err {c['rel_err']:.2g})" if c.get("rel_err") is not None else ""
            lines.append(f"{row} | {c.get('status')}{err}")
            continue
        b, f, r = c["baseline"], c["flux"], c["ratio"]
        row += f" | {_num(b['loop_ms'], '.3f', 7)} {_num(b['graph_ms'], '.3f', 7)}"
        row += f" | {_num(f['loop_ms'], '.3f', 7)} {_num(f['graph_ms'], '.3f', 7)}"
        row += f" | {_num(r['loop'], '.3f', 7)} {_num(r['graph'], '.3f', 7)} |"
        row += f" {'!' if c['slower'] else ' '} {c.get('choice', '-')}"
        if c["baseline_gemm"].startswith("baseline upcast"):
            row += "  (baseline upcast)"
        lines.append(row)
    return "\n".join(lines)


def _cell_summary(c):
    """One progress line's worth of a matrix cell."""
    if c.get("status") != "ok":
        return c.get("status") or "?"
    return (" ".join(f"{md} {_num(c['baseline'][f'{md}_ms'], '.3f', 0)}/{_num(c['flux'][f'{md}_ms'], '.3f', 0)}"
                     f" ({_num(c['ratio'][md], '.3f', 0)})" for md in MATRIX_MODES)
            + f"  {c['choice']}{'  !' if c['slower'] else ''}")


def _summary(e, seq_host=None):
    """One progress line's worth of a method entry or a baseline timing."""
    if e.get("status", "ok") != "ok":
        return e.get("status") or "?"
    s = " ".join(f"{md} {_num(e[f'{md}_ms'], '.3f', 0)}" for md in MODES) + f" host {e['host_us']:.1f}us"
    if seq_host is not None:
        s += f" (seq {seq_host:.1f}us)"
    if "E" in e:
        s += "  E/speedup " + " ".join(f"{md} {_num(e['E'][md], '+.2f', 0)}/{_num(e['speedup'][md], '.2f', 0, 'x')}"
                                       for md in ("graph", "loop"))
    if e["graph_status"] != "ok":
        s += f"  [graph {e['graph_status']}]"
    return s


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

        def dump(complete):  # after every shape, so that a run cut short keeps what it measured
            if bench.rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
                with open(out_path, "w") as f:
                    json.dump({"metadata": dict(meta, complete=complete), "results": results}, f, indent=1)

        # The matrix's baseline GEMM for out_dtype=torch.float32, decided once per dtype.
        upcast = {d: mm_out_dtype_unavailable(bench, d) for d in MATRIX_DTYPES} if args.matrix else None
        for op in args.ops:
            mod = importlib.import_module(f"flux.ops.{op}")
            avail = list(mod.available_strategies(bench.device))
            recs = []  # left empty by --matrix without --shapes (report.py reads the key)
            results[op] = {"available_strategies": avail, "shapes": recs}
            for shape in args.shape_lists[op]:
                bench.log(f"[{op}] {shape[0]}x{shape[1]}x{shape[2]} ...")
                try:
                    rec = run_shape(bench, op, shape, args.strategy_lists[op])
                except torch.cuda.OutOfMemoryError as e:
                    rec = {"shape": "x".join(map(str, shape)), "status": f"error: {_short(e, 200)}"}
                recs.append(rec)
                if rec.get("status") == "ok":
                    for name, e in rec["baselines"].items():
                        bench.log(f"    {name:<12} {_summary(e)}")
                    seq_host = rec["baselines"]["seq"]["host_us"]
                    for name, e in rec["methods"].items():
                        bench.log(f"    {name:<12} {_summary(e, seq_host)}")
                else:
                    bench.log(f"    {rec.get('status')}")
                dump(False)
                gc.collect()
                torch.cuda.empty_cache()
                bench.sync()
            if not args.matrix:
                continue
            m, k, n = args.matrix_shapes[op]
            n_loc, k_loc = per_rank_shape(op, m, k, n, bench.world, args.scale_with_world)
            cells = []
            results[op]["matrix"] = {"shape": f"{m}x{k}x{n}", "M": m, "K": k, "N": n,
                                     "local": {"N": n_loc, "K": k_loc}, "cells": cells}
            bench.log(f"[{op}] matrix at {m}x{k}x{n}: baseline/flux ms per call (flux / baseline)")
            for cell in matrix_cells():
                try:
                    c = run_cell(bench, op, (m, k, n), cell, upcast)
                except torch.cuda.OutOfMemoryError as e:
                    c = dict(cell, status=f"error: {_short(e, 200)}")
                cells.append(c)
                bench.log(f"    {_cell_labels(c)} {_cell_summary(c)}")
                dump(False)
                gc.collect()
                torch.cuda.empty_cache()
                bench.sync()
        dump(True)
        if bench.rank == 0:
            print(f"\nwrote {out_path}\n")
            if args.run_suite:
                for op in args.ops:
                    print(table(op, results[op]["shapes"], bench.world, args.dtype))
                    print()
                    print(host_table(op, results[op]["shapes"]))
                    print()
            if args.matrix:
                for op in args.ops:
                    print(matrix_table(op, results[op]["matrix"], bench.world))
                    print()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
