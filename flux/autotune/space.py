"""The search space: which strategy, with which parameters, may run a given problem.

A Candidate is a strategy name plus keyword parameters for it (see the strategies in
flux/ops/ag_gemm.py and flux/ops/gemm_rs.py). ``candidates(problem)`` lists the valid
ones, pruned before any timing (device, dtype, layout, alignment, sizes).
"""
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch


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


@dataclasses.dataclass(frozen=True)
class Problem:
    """One op call's shape as the tuner sees it. m: all rows (the gathered M for AG)."""
    op: str
    m: int
    n: int
    k: int
    dtype: torch.dtype
    world: int
    weight_layout: str = "nk"
    out_dtype_differs: bool = False  # a wider output (fp32 from bf16/fp16 where overlapped)
    device_type: str = "cuda"
    sm90: bool = True          # the device runs the sm_90a kernels
    fused_built: bool = True   # flux._C holds them

    def __post_init__(self):
        if self.op not in ("ag_gemm", "gemm_rs"):
            raise ValueError(f"Problem: unknown op {self.op!r}")
        if min(self.m, self.n, self.k, self.world) < 1:
            raise ValueError(f"Problem: sizes must be positive: {self}")


TILE_M = 128  # rows of one tile of the decomposed sub-blocks' minimum
MAX_CHUNKS = 7  # = flux.runtime.symm.MAX_DATA_CHANNELS (this module stays free of CUDA imports)
# Rows of one tile and CTAs of one cluster along M of each fused kernel configuration
# (csrc/ag_gemm/ag_gemm_fused_cfg*.cu, csrc/gemm_rs/rs_fused_cfg*.cu). Along N, the kernels serve
# M tiles in bands of cluster_m * swizzle tiles.
FUSED_AG_TILE_M = {0: (128, 2), 1: (256, 2), 2: (128, 2), 3: (256, 1)}
FUSED_RS_TILE_M = {0: (128, 2), 1: (256, 2), 2: (256, 1)}
FUSED_TILE_M = {"ag_gemm": FUSED_AG_TILE_M, "gemm_rs": FUSED_RS_TILE_M}


_SPACES = {
    "ag_gemm": [Candidate("sequential"), Candidate("decomposed")] + [
        Candidate.of("decomposed", first8=f) for f in (4, 6, 7)] + [Candidate("oneshot")] + [
        Candidate.of("fused", config=c, swizzle=s) for c in sorted(FUSED_AG_TILE_M) for s in (1, 8)],
    "gemm_rs": [Candidate("sequential"), Candidate("oneshot"), Candidate.of("decomposed", chunks=1),
                Candidate.of("decomposed", chunks=2), Candidate.of("decomposed_p2p", chunks=1)] + [
        Candidate.of("fused", config=c, segments=s, swizzle=z) for c in sorted(FUSED_RS_TILE_M) for s in (8, 16)
        for z in (1, 8)],
}
# op -> strategy -> the parameter names it takes
_PARAMS = {op: {c.strategy: {k for x in space if x.strategy == c.strategy for k, _ in x.params} for c in space}
           for op, space in _SPACES.items()}


def strategy_params(op: str, strategy: str):
    """The parameter names that ``strategy`` of ``op`` takes (empty for an unknown strategy)."""
    return _PARAMS[op].get(strategy, set())


def _space(op: str) -> List[Candidate]:
    return _SPACES[op]


def why_invalid(c: Candidate, p: Problem) -> Optional[str]:
    """Why ``c`` cannot run ``p`` (None when it can)."""
    known = _PARAMS[p.op].get(c.strategy)
    if known is None:
        return f"{p.op} has no strategy {c.strategy!r}"
    if c.params and not {k for k, _ in c.params} <= known:
        return f"{c.strategy} takes parameters {sorted(known)}, not {sorted(c.kwargs)}"
    if c.strategy == "sequential":
        return None
    if p.device_type != "cuda":
        return "overlapped strategies need CUDA"
    if p.world == 1:
        return "nothing to overlap at world size 1"
    if p.out_dtype_differs and (p.dtype not in (torch.bfloat16, torch.float16) or c.strategy == "fused"):
        return "out_dtype differs: overlapped as fp32 from bf16/fp16, not by the fused kernels"
    if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {p.dtype}"
    rows = p.m // p.world
    if c.strategy == "fused":
        if not (p.sm90 and p.fused_built):
            return "the fused kernels need sm_90a and a flux._C built for it"
        if p.dtype != torch.bfloat16 or p.weight_layout != "nk":
            return "the fused kernel is bf16, weight_layout 'nk'"
        if p.k % 8 or p.n % 8:
            return "K and N must be multiples of 8"
        tile = FUSED_TILE_M[p.op].get(c.kwargs.get("config", 0))
        if tile is None:
            return f"no fused configuration {c.kwargs.get('config')}"
        tile_m, cluster_m = tile
        # The AG kernel runs all M rows; the RS kernel this rank's block of them.
        kernel_rows = p.m if p.op == "ag_gemm" else rows
        swizzle = c.kwargs.get("swizzle", 1)
        if swizzle > 1 and kernel_rows < cluster_m * swizzle * tile_m:
            return "bands of M tiles larger than the problem pad the grid"
        if p.op == "gemm_rs" and c.kwargs.get("segments", 8) < 1:
            return "segments must be positive"
    if "first8" in c.kwargs:
        if p.world != 2:
            return "first8 splits the rows of two ranks"
        if not 1 <= c.kwargs["first8"] <= 8:
            return "first8 must be 1..8"
        if rows < 1024:
            return "first8: under 1024 rows per rank the split only adds a launch"
    if not 1 <= c.kwargs.get("chunks", 1) <= MAX_CHUNKS:
        return f"chunks must be 1..{MAX_CHUNKS} (one signal channel each)"
    if c.kwargs.get("chunks", 1) > 1 and rows < c.kwargs["chunks"] * TILE_M:
        return "sub-blocks smaller than a tile"
    return None


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
