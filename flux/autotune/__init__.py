"""Strategy choice for the overlapped ops.

``choose(problem)`` is called once per op call and returns a Candidate (a strategy and its
parameters), in this order of precedence:

1. a strategy forced for the process (``force(op, label)``, or the environment variable
   ``FLUX_STRATEGY_<OP>``, e.g. ``FLUX_STRATEGY_GEMM_RS=decomposed(chunks=2)``);
2. a tuned choice from the cache of this topology (flux/autotune/cache.py: the user's file,
   then the shipped defaults), for the problem's M bucket, N, K, dtype and layout;
3. the analytic default (``default_candidate``).

A call never tunes unless asked: with FLUX_AUTOTUNE=1 an op call whose problem has no cache
entry tunes it on the spot (collectively, with the call's own tensors) and records it;
``torchrun ... -m flux.autotune`` tunes a list of shapes ahead of time.

The choice depends only on what every rank of the group shares (the problem, the topology,
the cache files and process-wide settings, which must be alike on all ranks). The ops put
the choice into the argument signature that the ranks compare before any data moves, so
ranks that would choose differently (different cache files, say) get the same error
instead of a hang.

Modules: topology (the cache key), space (candidates and pruning), cache (the JSON files),
tuner (collective timing), __main__ (the CLI).
"""
import logging
import os
import zlib
from typing import Callable, Dict, Optional, Sequence

import torch

from flux import envs
from flux.strategies import warn_once
from flux.autotune.cache import GENERATION as cache_generation
from flux.autotune.cache import TuneCache, problem_key
from flux.autotune.space import Candidate, Problem, candidates, m_bucket, why_invalid
from flux.autotune.topology import Topology, detect

log = logging.getLogger("flux")

OPS = ("ag_gemm", "gemm_rs")
_forced: Dict[str, Optional[str]] = {}
# choose() is on every call's path: its answers are remembered per problem, device, forced
# label and generations; a generation moves whenever something they depend on changes
# (force, reset; any cache entry: flux.autotune.cache.GENERATION).
_choices: Dict[tuple, "Candidate"] = {}
_generation = [0]


_listeners = []  # called whenever earlier choices may no longer hold (flux/ops/_gemm_op.py drops its plans)


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever a choice made earlier may change: force, reset, a new cache entry."""
    _listeners.append(fn)


def _bump() -> None:
    _generation[0] += 1
    _choices.clear()
    for fn in _listeners:
        fn()


def force(op: str, name: Optional[str]) -> None:
    """Force strategy ``name`` (a Candidate label, e.g. "decomposed(chunks=2)") for every later
    call of ``op`` in this process (None: undo). Set it alike on every rank of a group."""
    if op not in OPS:
        raise ValueError(f"flux.autotune.force: unknown op {op!r}; known: {OPS}")
    _forced[op] = name
    _bump()


# Rows per rank block (M / W) from which splitting the GEMM into W row blocks pays. Each
# block's GEMM reads the whole weight again, so for few rows, where the GEMM is bound by
# reading the weight (bf16 on H200: below ~200 FLOP/B, i.e. a few hundred rows), splitting
# costs more than the communication it hides. Thresholds measured on 2xH200
# (docs/design.md): AG decomposed wins from M/W = 256 (M = 512: 1.15x), loses at 64;
# RS decomposed wins from M/W = 1024 (1.17x) and ties at 256, where one-shot is as good.
AG_DECOMPOSED_MIN_ROWS = 256
RS_DECOMPOSED_MIN_ROWS = 512
RS_ONESHOT_MIN_ROWS = 128


def default_strategy(op: str, available: Sequence[str], *, m: int, n: int, k: int, dtype: torch.dtype,
                     world: int) -> str:
    """The analytic default for ``op`` on an M x K x N problem (M: all rows, gathered for AG)."""
    rows = m // max(world, 1)
    if op == "ag_gemm":
        want = "decomposed" if rows >= AG_DECOMPOSED_MIN_ROWS else "sequential"
    elif rows >= RS_DECOMPOSED_MIN_ROWS:
        want = "decomposed"
    else:
        want = "oneshot" if rows >= RS_ONESHOT_MIN_ROWS else "sequential"
    return want if want in available else "sequential"


def default_candidate(p: Problem) -> Candidate:
    """``default_strategy`` for a Problem, as a Candidate valid for it."""
    names = [c.strategy for c in candidates(p)]
    name = default_strategy(p.op, names, m=p.m, n=p.n, k=p.k, dtype=p.dtype, world=p.world)
    for c in candidates(p):
        if c.strategy == name:
            return c
    return Candidate("sequential")


_topologies: Dict[tuple, Topology] = {}
_caches: Dict[str, TuneCache] = {}


def topology(world: int, device: torch.device) -> Topology:
    key = (world, device.type, device.index)
    if key not in _topologies:
        _topologies[key] = detect(world, device)
    return _topologies[key]


def cache_for(world: int, device: torch.device) -> TuneCache:
    """The cache of tuned choices of this topology (``topology(world, device)``), loaded once."""
    topo = topology(world, device)
    if topo.key not in _caches:
        _caches[topo.key] = TuneCache(topo.key)
    return _caches[topo.key]


def reset() -> None:
    """Forget detected topologies and loaded caches (tests; after changing FLUX_CACHE_DIR)."""
    _topologies.clear()
    _caches.clear()
    _bump()


def key_of(p: Problem) -> str:
    return problem_key(p.op, m_bucket(p.m), p.n, p.k, str(p.dtype).replace("torch.", ""), p.world, p.weight_layout)


def _warn_once(op: str, what: str, why: str) -> None:
    warn_once(f"flux.{op}: {what} cannot run here ({why}); using the default")


def choose(p: Problem, device: Optional[torch.device] = None) -> Candidate:
    """The candidate for one call (see the module docstring)."""
    label = _forced.get(p.op) or envs.forced_strategy(p.op)
    key = (p, None if device is None else (device.type, device.index), label, _generation[0],
           cache_generation[0])
    c = _choices.get(key)
    if c is None:
        c = _choose(p, device, label)
        if len(_choices) > 4096:
            _choices.clear()
        _choices[key] = c
    return c


def _choose(p: Problem, device: Optional[torch.device], label: Optional[str]) -> Candidate:
    if label:
        c = Candidate.parse(label)
        why = why_invalid(c, p)
        if why is None:
            return c
        _warn_once(p.op, f"forced strategy {label!r}", why)
        return default_candidate(p)
    if device is not None:
        entry = cache_for(p.world, device).get(key_of(p))
        if entry is not None:
            c = Candidate.parse(entry["choice"])
            if why_invalid(c, p) is None:
                return c
    return default_candidate(p)


def candidate_code(c: Candidate) -> int:
    """A stable small integer for a candidate (it goes into the cross-rank signature)."""
    return zlib.crc32(c.label.encode()) & 0x7FFFFFFF


def tuning_requested(p: Problem, device: torch.device) -> bool:
    """FLUX_AUTOTUNE=1 and no cache entry (nor a forced strategy) for this problem."""
    if not envs.AUTOTUNE.get() or device.type != "cuda":
        return False
    if _forced.get(p.op) or envs.forced_strategy(p.op):
        return False
    return cache_for(p.world, device).get(key_of(p)) is None


def tune(p: Problem, run: Callable[[Candidate], object], group, device: torch.device, *, save: bool = True,
         warmup: int = 3, iters: int = 10, timer=None, prepare=None) -> dict:
    """Check every candidate of ``p`` against 'sequential' (any rank's failure drops it), time the
    rest on all ranks of ``group`` together (loop and graph: flux.autotune.tuner), record the
    choice in the cache of this topology (written by the group's first rank of each node when
    ``save``) and return the entry {"choice", "default", "times_ms", "loop_ms", "graph_ms"}.
    ``prepare(c)``: a callable running candidate ``c`` on fixed tensors (plan made once). Collective."""
    from flux.autotune import tuner

    cache = cache_for(p.world, device)
    cands = tuner.correct_candidates(run, candidates(p), group, device, p.dtype)
    detail: Dict[str, Dict[str, float]] = {}
    times = tuner.time_candidates(run, cands, group, device, warmup=warmup, iters=iters, timer=timer,
                                  prepare=prepare, detail=detail)
    default = default_candidate(p)
    if default.label not in times:  # the default failed its correctness check: never pick it
        default = Candidate("sequential")
    best = tuner.pick(times, cands, group, device, default=default)
    entry = {"choice": best.label, "default": default.label, "times_ms": times, "loop_ms": detail.get("loop", {}),
             "graph_ms": detail.get("graph", {})}
    cache.put(key_of(p), entry)
    for fn in _listeners:  # plans made from the former choice
        fn()
    if save and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        cache.save()
    return entry
