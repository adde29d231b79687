"""The search space: which strategy, with which parameters, may run a given problem.

A Candidate is a strategy name plus keyword parameters for it (the strategy tables of
flux/strategies.py; their implementations are described in flux/ops/ag_gemm.py and
flux/ops/gemm_rs.py). ``candidates(problem)`` lists the table's points that are valid, pruned
before any timing (device, dtype, layout, alignment, sizes).
"""
import dataclasses
from typing import Dict, List, Optional, Tuple

# A tuned choice, of a strategy (tuner.py) or of a fused kernel's configuration (kernels.py), replaces the
# analytic default only if it is more than this much faster.
MARGIN = 0.01


@dataclasses.dataclass(frozen=True)
class Candidate:
    strategy: str
    params: Tuple[Tuple[str, int], ...] = ()

    @staticmethod
    def of(strategy: str, **params: int) -> "Candidate":
        return Candidate(strategy, tuple(sorted(params.items())))

    @property
    def kwargs(self) -> Dict[str, int]:
        return dict(self.params)

    @property
    def label(self) -> str:
        if not self.params:
            return self.strategy
        return f"{self.strategy}(" + ",".join(f"{k}={v}" for k, v in self.params) + ")"

    @staticmethod
    def parse(label: str) -> "Candidate":
        if "(" not in label:
            return Candidate(label)
        name, rest = label.split("(", 1)
        params = {}
        for item in rest.rstrip(")").split(","):
            if item:
                k, v = item.split("=")
                params[k] = int(v)
        return Candidate.of(name, **params)


# The strategies, their parameters and their rules live in the tables of flux/strategies.py.
from flux.strategies import (FUSED_AG_TILE_M, FUSED_RS_TILE_M, FUSED_TILE_M, MAX_CHUNKS, TILE_M,  # noqa: E402,F401
                             TABLES, Problem, param_error)
from flux.strategies import why_invalid as _why_invalid  # noqa: E402

_SPACES = {op: [Candidate.of(s.name, **kw) for s in table.values() for kw in s.space]
           for op, table in TABLES.items()}


def strategy_params(op: str, strategy: str):
    """The parameter names that ``strategy`` of ``op`` takes (empty for an unknown strategy)."""
    s = TABLES[op].get(strategy)
    return {q.name for q in s.params} if s is not None else set()


def _space(op: str) -> List[Candidate]:
    return _SPACES[op]


def why_invalid(c: Candidate, p: Problem) -> Optional[str]:
    """Why ``c`` cannot run ``p``, or is not worth timing for it (None when it can)."""
    return _why_invalid(p, c.strategy, c.kwargs)


def candidates(p: Problem) -> List[Candidate]:
    """The valid candidates for ``p``, 'sequential' first."""
    return [c for c in _space(p.op) if why_invalid(c, p) is None]


def m_bucket(m: int) -> int:
    """Rows are bucketed to the next power of two (N and K stay exact): a tuned choice serves
    every M in (bucket/2, bucket]."""
    return 1 << max(0, (m - 1).bit_length())


# The public shape suite (M x K x N at two ranks; M is the gathered M): what the benchmark
# measures and `python -m flux.autotune --suite` tunes.
PUBLIC_SUITE = {
    "ag_gemm": ["8192x8192x14336", "8192x8192x5120", "4096x8192x14336", "16384x8192x4096",
                "2048x8192x8192", "512x8192x14336", "128x8192x14336"],
    "gemm_rs": ["8192x14336x8192", "8192x4096x8192", "4096x14336x8192", "2048x8192x8192",
                "512x14336x8192", "128x14336x8192"],
}
SUITE_ROUND = 128  # scaled N / K are rounded to this (a GEMM tile multiple)


def per_rank_shape(op: str, m: int, k: int, n: int, world: int, scale: bool = True) -> Tuple[int, int]:
    """(N, K) of one rank's GEMM for a suite shape at ``world`` ranks. Suite shapes are each
    rank's GEMM at two ranks; with ``scale`` N (ag_gemm, column-parallel) or K (gemm_rs,
    row-parallel) is multiplied by 2/world and rounded to a multiple of 128, so that the
    whole problem stays that of the listed shape; at two ranks nothing changes."""
    def scaled(v):
        return v if not scale or world == 2 else max(SUITE_ROUND, round(v * 2 / world / SUITE_ROUND) * SUITE_ROUND)
    return (scaled(n), k) if op == "ag_gemm" else (n, scaled(k))
