"""Collective timing: every rank of the group times the same candidates together, the way
the choice will be served (back-to-back calls in a loop, and that loop as a CUDA graph); a
candidate's time is its maximum over ranks; rank 0 picks the fastest and broadcasts its
index, so every rank adopts the same choice even if their clocks disagree.
"""
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from flux.autotune.space import MARGIN, Candidate

ROUNDS = 3  # interleaved timing rounds over all candidates


def _sync(group: dist.ProcessGroup, device: torch.device) -> None:
    """Start every rank's timing together: a one-element all-reduce, then the device idle."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LOOP_CALLS = 10  # back-to-back calls per timed loop (and per captured graph)


def time_on_rank(fn: Callable[[], object], device: torch.device, iters: int,
                 align: Optional[Callable[[], None]] = None, graph=None) -> float:
    """Median milliseconds per call of ``fn`` on this rank, timed as calls are served: each sample
    is a loop of LOOP_CALLS back-to-back calls between two CUDA events (the host enqueues while
    the GPU runs, so a call's host cost shows where it exceeds its GPU time, as in an eager
    training step), or the replay of ``graph`` (that loop captured in a CUDA graph: no host cost,
    as in vLLM's decode or a graphed step). ``align`` (after a synchronize, before the start event)
    lines the ranks' devices up. On the CPU: wall-clock time of one call."""
    samples = []
    for _ in range(iters):
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        if align is not None:
            align()
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(LOOP_CALLS):
                fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / LOOP_CALLS)
    return statistics.median(samples)


def capture(fn: Callable[[], object], calls: int = LOOP_CALLS):
    """``calls`` back-to-back calls of ``fn`` captured in a CUDA graph (warmed up on a side
    stream first, as PyTorch asks), or None where ``fn`` cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return graph
    except Exception:  # noqa: BLE001  (timed in loop mode only; the caller records it)
        torch.cuda.synchronize()
        return None


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
                    timer: Optional[Callable[[Candidate, Callable[[], object]], float]] = None,
                    prepare: Optional[Callable[[Candidate], Callable[[], object]]] = None,
                    detail: Optional[Dict[str, Dict[str, float]]] = None) -> Dict[str, float]:
    """{candidate label: max over ranks of its time (ms per call)}: on CUDA the mean of its loop
    and graph timings (time_on_rank), the two ways the choice will be used (loop alone where any
    rank cannot capture it). The candidates are timed in ``rounds`` interleaved rounds (a, b, c,
    a, b, c, ...), ``iters`` samples each in all, so that a slow drift of the machine (clocks,
    temperature, another candidate's after-effects) spreads over all of them instead of
    favouring whichever ran first. ``prepare(c)``: a callable running ``c`` on fixed tensors
    (its plan made once), else ``run(c)`` per call; ``timer(c, fn)`` replaces this rank's
    measurement of one round (tests); ``detail`` receives {"loop": {...}, "graph": {...}}."""
    fns = [prepare(c) if prepare else (lambda c=c: run(c)) for c in cands]
    for fn in fns:
        for _ in range(warmup):
            fn()
    cuda = device.type == "cuda" and timer is None
    graphs = [capture(fn) if cuda else None for fn in fns]
    # Every rank must time the same way: graph timing only where every rank could capture.
    ok = torch.tensor([0.0 if g is None else 1.0 for g in graphs] or [0.0], dtype=torch.float64,
                      device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    graphs = [g if cuda and f == 1.0 else None for g, f in zip(graphs, ok.tolist())]
    per_round = max(1, -(-iters // rounds))
    one = torch.zeros(1, device=device)
    align = (lambda: dist.all_reduce(one, group=group)) if device.type == "cuda" else None
    loop: List[List[float]] = [[] for _ in cands]
    graph: List[List[float]] = [[] for _ in cands]
    for _ in range(rounds):
        for i, (c, fn) in enumerate(zip(cands, fns)):
            fn()  # one untimed call: this candidate's buffers and caches, after the previous one's
            _sync(group, device)
            loop[i].append(timer(c, fn) if timer else time_on_rank(fn, device, per_round, align))
            if graphs[i] is not None:
                _sync(group, device)
                graph[i].append(time_on_rank(fn, device, per_round, align, graph=graphs[i]))
    mine = [statistics.median(s) for s in loop] + [statistics.median(s) if s else -1.0 for s in graph]
    times = torch.tensor(mine, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    t = times.tolist()
    n = len(cands)
    loop_ms = {c.label: t[i] for i, c in enumerate(cands)}
    graph_ms = {c.label: t[n + i] for i, c in enumerate(cands) if t[n + i] >= 0}
    if detail is not None:
        detail["loop"], detail["graph"] = loop_ms, graph_ms
    del graphs
    return {c.label: (loop_ms[c.label] + graph_ms[c.label]) / 2 if c.label in graph_ms else loop_ms[c.label]
            for c in cands}


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