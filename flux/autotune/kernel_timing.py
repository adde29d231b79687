"""One fused kernel alone on one GPU: inputs, launches with every flag set, correctness, timing.

Shared by the kernel tuner (flux/autotune/kernels.py) and bench/bench_fused_gemm.py.
Problems are the kernel's own (m, n, k): ag runs all gathered rows against its N columns of
the weight; rs runs one rank's block of rows and adds the peer's partial (``src``).

Timings, each the median over rounds (all calls interleaved round by round, each round starting
one variant further, so that a drift of clocks or temperature spreads over all of them; where a
call runs 0.5 ms or more, each variant first runs untimed for WARM_MS, so that its samples run
at the clock its own power draw sets, not the one the variant before it left):
  loop   ``calls`` launches back to back between two CUDA events, ms per call;
  graph  that loop captured in a CUDA graph and replayed, ms per call;
  spin   one launch queued behind a GPU spin of SPIN_CYCLES (kernel time from a cool start,
         host cost hidden): a diagnostic, never a headline.
Where one input set fits in L2 the launches rotate among several sets (and outputs), so
that a loop does not time L2-resident operands.
"""
import math
import statistics
from typing import Callable, Dict, List, Sequence

import torch

from flux.autotune.tuner import capture  # the loop as a CUDA graph, or None

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
L2_BYTES = 60 << 20  # H100/H200 L2 is 50/60 MB: rotate sets while one set is below this
SPIN_CYCLES = 1_000_000
LEAD_CYCLES = 100_000  # time_calls(lead=True): ~50 us at 2 GHz, more than one call's enqueue
WARM_MS = 60.0  # warm_calls: GPU time per variant and round before its samples
# plan_sampling: a call of LONG_CALL_MS or more is sampled in loops of about LONG_SAMPLE_MS. Each loop
# sample pays a start cost that grows with the call (21 us a sample at 0.2-0.5 ms a call, 450 us at
# 5-20 ms; most likely the clock after the synchronisation before the sample, docs/performance.md §9):
# with 2-4 calls a sample torch.mm's loop time read 1.00-1.15x its graph time from 0.5 ms a call
# (median 1.07), with samples of 20 ms 0.99-1.02x (median 1.006).
LONG_CALL_MS = 0.5
LONG_SAMPLE_MS = 20.0
TIMEOUT_MS = 10000
RS_SEGMENTS = 8  # segments of the peer's partial, as the fused RS strategy signals them
MAX_REF_ROWS = 2048
MAX_AG_WORLD = 64


class KernelProblem:
    """Input sets and a sampled fp32 reference of one (op, m, n, k, dtype, out_dtype)."""

    def __init__(self, op: str, m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype,
                 device: torch.device, max_sets: int = 4, seed: int = 0):
        self.op, self.m, self.n, self.k, self.dtype, self.out_dtype = op, m, n, k, dtype, out_dtype
        el, oel = torch.empty(0, dtype=dtype).element_size(), torch.empty(0, dtype=out_dtype).element_size()
        in_bytes = (m * k + n * k) * el + (m * n * oel if op == "rs" else 0)
        self.n_sets = 1 if in_bytes > L2_BYTES else max(2, min(max_sets, math.ceil(2 * L2_BYTES / in_bytes)))
        g = torch.Generator(device=device).manual_seed(seed)
        self.sets = []
        for _ in range(self.n_sets):
            # Unit-variance outputs: a ~ N(0, 1), w ~ N(0, 1/k).
            s = {"a": torch.randn(m, k, device=device, dtype=dtype, generator=g),
                 "w": (torch.randn(n, k, device=device, dtype=torch.float32, generator=g) / math.sqrt(k)).to(dtype),
                 "out": torch.empty(m, n, device=device, dtype=out_dtype)}
            if op == "rs":
                s["src"] = torch.randn(m, n, device=device, dtype=out_dtype, generator=g)
            self.sets.append(s)
        step = max(1, m // MAX_REF_ROWS)
        self.rows = torch.arange(0, m, step, device=device)[:MAX_REF_ROWS]
        s0 = self.sets[0]
        self.ref_mm = s0["a"][self.rows].float() @ s0["w"].float().t()
        self.ref = self.ref_mm + s0["src"][self.rows].float() if op == "rs" else self.ref_mm
        self.ag_flags = torch.ones(MAX_AG_WORLD, dtype=torch.int32, device=device)
        self.rs_flags = torch.ones(RS_SEGMENTS, dtype=torch.int32, device=device)

    @property
    def flop(self) -> int:
        return 2 * self.m * self.n * self.k

    def fused(self, config: int, raster: int, swizzle: int, ag_world: int = 2) -> List[Callable[[], None]]:
        """One launcher per input set of the fused kernel (every flag set: nothing waits). ag: the
        rows as the shards of ``ag_world`` ranks (where they divide), this one rank 0, so that the
        kernel reads each peer's flag once per CTA; 1: no peer, no flag read."""
        fns = []
        world = ag_world if 1 <= ag_world <= MAX_AG_WORLD and self.m % ag_world == 0 else 1
        for s in self.sets:
            if self.op == "ag":
                fns.append(lambda s=s, w=world: torch.ops.flux.ag_gemm_fused_(
                    s["out"], s["a"], s["w"], None, self.ag_flags, 0, w, self.m // w, TIMEOUT_MS, 0,
                    raster, swizzle, config))
            else:
                seg_rows = -(-self.m // RS_SEGMENTS)
                fns.append(lambda s=s, r=seg_rows: torch.ops.flux.gemm_rs_fused_(
                    s["out"], s["a"], s["w"], None, s["src"], self.rs_flags, r, 0, 1, TIMEOUT_MS, 0,
                    raster, swizzle, config))
        return fns

    def cublas(self, add: bool = False) -> List[Callable[[], None]]:
        """torch.mm into the output (in the output dtype), then (``add``) the peer's partial added."""
        fns = []
        for s in self.sets:
            if self.out_dtype == self.dtype:
                def mm(s=s):
                    torch.mm(s["a"], s["w"].t(), out=s["out"])
            elif self._mm_out_dtype():
                def mm(s=s):
                    torch.mm(s["a"], s["w"].t(), out_dtype=self.out_dtype, out=s["out"])
            else:  # a torch without mm(out_dtype=): the product rounded to the input dtype, widened
                def mm(s=s):
                    s["out"].copy_(torch.mm(s["a"], s["w"].t()))
            if add:
                fns.append(lambda s=s, mm=mm: (mm(), s["out"].add_(s["src"])))
            else:
                fns.append(mm)
        return fns

    def cublas_beta1(self, check: bool = False) -> List[Callable[[], None]]:
        """rs, output in the input dtype: cuBLAS's GEMM adding into its output (``out.addmm_``, beta =
        1), which reads and writes the output as the fused epilogue reads the partial and writes the
        sum, with no separate pass: a diagnostic of what the source costs cuBLAS. The output
        accumulates call after call; ``check``: the output first set to the peer's partial (for the
        error check, untimed)."""
        fns = []
        for s in self.sets:
            if check:
                fns.append(lambda s=s: s["out"].copy_(s["src"]).addmm_(s["a"], s["w"].t()))
            else:
                fns.append(lambda s=s: s["out"].addmm_(s["a"], s["w"].t()))
        return fns

    def _mm_out_dtype(self) -> bool:
        s = self.sets[0]
        try:
            tiny = torch.empty(8, 8, device=s["a"].device, dtype=self.out_dtype)
            torch.mm(s["a"][:8], s["w"][:8].t(), out_dtype=self.out_dtype, out=tiny)
            return True
        except (RuntimeError, TypeError):
            return False

    def rel_err(self, fns: Sequence[Callable[[], None]], with_partial: bool = True) -> float:
        """Run set 0's launcher on a NaN-poisoned output; relative error of the sampled rows
        against the fp32 reference (rs: with the peer's partial added unless not ``with_partial``);
        inf where any output element stayed NaN."""
        out = self.sets[0]["out"]
        out.fill_(float("nan"))
        fns[0]()
        torch.cuda.synchronize()
        if torch.isnan(out).any().item():
            return math.inf
        got = out[self.rows].float()
        ref = self.ref if with_partial else self.ref_mm
        return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tolerance(problem: KernelProblem) -> float:
    """The error a fused launch may have: twice cuBLAS's on the same problem in the same
    precision (rs: torch.mm then the addition of the partial), at least 1e-3."""
    err = problem.rel_err(problem.cublas(add=problem.op == "rs"))
    return max(2 * err, 1e-3)


def loop_of(fns: Sequence[Callable[[], None]], calls: int) -> Callable[[], None]:
    def loop():
        for i in range(calls):
            fns[i % len(fns)]()
    return loop


def _events_ms(run: Callable[[], None], spin: bool = False, cycles: int = SPIN_CYCLES) -> float:
    """GPU ms between events around ``run``; ``spin``: behind a GPU spin of ``cycles`` enqueued
    before the start event, which then fires once the spin ends and the host has enqueued the
    first call (no start gap while the host launches it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if spin:
        torch.cuda._sleep(cycles)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def estimate_ms(fns: Sequence[Callable[[], None]]) -> float:
    """A first reading of one call (after a warm-up call), to size the loops."""
    fns[0]()
    return _events_ms(loop_of(fns, 3)) / 3


def plan_sampling(t_ms: float, quick: bool = False, min_rounds: int = 0, sample_ms: float = 0.0):
    """(calls per sample, rounds): samples of ~2 ms (1 ms quick; LONG_SAMPLE_MS where a call takes
    LONG_CALL_MS or more, unless quick; ``sample_ms`` where given), at least 2 calls, at most 64
    unless ``sample_ms`` asks for more; fewer rounds where a sample is long, so that the largest
    problems stay within the time budget; at least ``min_rounds`` rounds (the callers' --rounds)."""
    target = sample_ms if sample_ms > 0 else (1.0 if quick else LONG_SAMPLE_MS if t_ms >= LONG_CALL_MS else 2.0)
    calls = max(2, round(target / max(t_ms, 1e-4)))
    if sample_ms <= 0:
        calls = min(64, calls)
    rounds = 3 if quick or calls * t_ms > 5.0 else 5
    return calls, max(rounds, min_rounds)


def warm_calls(t_ms: float) -> int:
    """Untimed calls of a variant before its samples in each round, where one call runs 0.5 ms or
    more: WARM_MS of GPU time. The card's clock follows the power that the running kernel draws with
    a lag of tens of milliseconds, so without them a variant's first samples run at the clock that
    the variant before it left (on an H200 at 16384 rows, up to 14% either way)."""
    return 0 if t_ms < 0.5 else math.ceil(WARM_MS / t_ms)


def time_calls(variants: Dict[str, Sequence[Callable[[], None]]], calls: int, rounds: int,
               timings: Sequence[str] = ("loop", "graph", "spin"), settle: bool = True,
               warm: int = 0, lead: bool = False) -> Dict[str, Dict]:
    """{label: {timing: median ms per call or None}} for every variant, rounds interleaved, each
    round starting one variant further (no variant always follows the same one).
    ``settle``: one untimed call of a variant before its samples of each round (its operands
    after the previous variant's); ``warm``: that many more (``warm_calls``: the clock);
    ``lead``: loop and graph samples start behind a GPU spin of LEAD_CYCLES (``_events_ms``), so
    that the host's launch of the first call is not in the sample (later calls' host cost is)."""
    loops = {lab: loop_of(fns, calls) for lab, fns in variants.items()}
    for lab, fns in variants.items():
        fns[0]()
    graphs = {lab: capture(loops[lab], calls=1) if "graph" in timings else None for lab in variants}
    samples = {lab: {t: [] for t in timings} for lab in variants}
    lead_kw = {"spin": True, "cycles": LEAD_CYCLES} if lead else {}
    order = list(variants)
    for r in range(rounds):
        for lab in order[r % len(order):] + order[:r % len(order)]:
            fns = variants[lab]
            if warm:
                loop_of(fns, warm)()
            if settle:
                fns[-1]()
            if "loop" in timings:
                samples[lab]["loop"].append(_events_ms(loops[lab], **lead_kw) / calls)
            if "graph" in timings and graphs[lab] is not None:
                samples[lab]["graph"].append(_events_ms(graphs[lab].replay, **lead_kw) / calls)
            if "spin" in timings:
                samples[lab]["spin"].append(_events_ms(fns[0], spin=True))
    del graphs
    return {lab: {t: (statistics.median(v) if v else None) for t, v in d.items()} for lab, d in samples.items()}
