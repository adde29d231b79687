"""Collective timing: every rank of the group times the same candidates together; a
candidate's time is its maximum over ranks; rank 0 picks the fastest and broadcasts its
index, so every rank adopts the same choice even if their clocks disagree.
"""
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from flux.autotune.space import Candidate

ROUNDS = 3  # interleaved timing rounds over all candidates
MARGIN = 0.01  # a candidate must beat the analytic default by more than 1% to replace it


def _sync(group: dist.ProcessGroup, device: torch.device) -> None:
    """Start every rank's timing together: a one-element all-reduce, then the device idle."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_on_rank(fn: Callable[[], object], device: torch.device, iters: int,
                 align: Optional[Callable[[], None]] = None) -> float:
    """Median milliseconds of one call of ``fn`` on this rank; ``align`` (enqueued after the
    spin, before the start event) lines the ranks' devices up, as bench/bench_ops.py does."""
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # The protocol of bench/bench_ops.py: queue the call behind a ~1 ms spin so that the
            # host's launch time stays out of the device time (else small shapes measure Python).
            torch.cuda._sleep(2_000_000)
            if align is not None:
                align()
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-10}


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def correct_candidates(run: Callable[[Candidate], object], cands: Sequence[Candidate], group: dist.ProcessGroup,
                       device: torch.device, dtype: torch.dtype) -> List[Candidate]:
    """The candidates whose output matches 'sequential' (cands[0]) on every rank: a kernel
    that computes the wrong thing is never timed, let alone chosen."""
    ref = _first(run(cands[0])).double()
    bad = []
    for c in cands[1:]:
        out = _first(run(c)).double()
        err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        bad.append(1.0 if not err <= TOLERANCE.get(dtype, 2e-2) else 0.0)  # NaN fails too
    flags = torch.tensor([0.0] + bad, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [c for c, f in zip(cands, flags.tolist()) if f == 0.0]


def time_candidates(run: Callable[[Candidate], object], cands: Sequence[Candidate], group: dist.ProcessGroup,
                    device: torch.device, warmup: int = 3, iters: int = 10, rounds: int = ROUNDS,
                    timer: Optional[Callable[[Candidate, Callable[[], object]], float]] = None) -> Dict[str, float]:
    """{candidate label: max over ranks of its median time (ms)}. The candidates are timed in
    ``rounds`` interleaved rounds (a, b, c, a, b, c, ...), ``iters`` calls each in all, so
    that a slow drift of the machine (clocks, temperature, another candidate's after-effects)
    spreads over all of them instead of favouring whichever ran first. ``timer(c, fn)``
    replaces this rank's measurement of one round (tests)."""
    fns = [lambda c=c: run(c) for c in cands]
    for fn in fns:
        for _ in range(warmup):
            fn()
    per_round = max(1, -(-iters // rounds))
    one = torch.zeros(1, device=device)
    align = (lambda: dist.all_reduce(one, group=group)) if device.type == "cuda" else None
    samples: List[List[float]] = [[] for _ in cands]
    for _ in range(rounds):
        for i, (c, fn) in enumerate(zip(cands, fns)):
            fn()  # one untimed call: this candidate's buffers and caches, after the previous one's
            _sync(group, device)
            samples[i].append(timer(c, fn) if timer else time_on_rank(fn, device, per_round, align))
    mine = [statistics.median(s) for s in samples]
    times = torch.tensor(mine, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {c.label: float(t) for c, t in zip(cands, times.tolist())}


def pick(times: Dict[str, float], cands: List[Candidate], group: dist.ProcessGroup,
         device: torch.device, default: Optional[Candidate] = None, margin: float = MARGIN) -> Candidate:
    """The fastest candidate by rank 0's reading of ``times``, the same on every rank. With
    ``default``, another candidate is chosen only if it beats the default by more than
    ``margin`` (a fraction): a choice within the timing noise is not worth leaving the
    analytic default for."""
    best = min(range(len(cands)), key=lambda i: times[cands[i].label])
    if default is not None and default.label in times:
        d = [c.label for c in cands].index(default.label)
        if times[cands[best].label] >= times[default.label] * (1 - margin):
            best = d
    idx = torch.tensor([best], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    dist.broadcast(idx, src=dist.get_global_rank(group, 0), group=group)
    return cands[int(idx.item())]