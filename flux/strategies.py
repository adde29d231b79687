"""The strategy tables of the GEMM op families: the one place that says which strategy exists,
its C++ code, its parameters, when it can run and what runs instead.

Each entry is read by the choice and the tuner's search space (flux/autotune/space.py), by the
plan (flux/ops/_plans.py) and, through the generated header csrc/runtime/strategies.h
(``python -m flux.strategies > csrc/runtime/strategies.h``; tests/test_strategies.py checks it
is current), by the C++ runtime, whose dispatch expands that header's FLUX_PLAN_STRATEGIES.

Rules come in three kinds, all pure functions of a Problem:
  Strategy.why_not(p)   the strategy cannot run p: the call runs ``fallback`` (logged once);
  Param.domain(v)       a value that no problem accepts: a caller's error (ValueError);
  Param.why_not(p, v)   the value cannot serve p: the strategy runs with the default (logged);
  Param.prune(p, v)     it could run but is not worth timing: the tuner skips it.

Adding a strategy: one entry here (its ``cxx`` names the Runtime member that runs its plan),
the regenerated header, and that member's implementation (see docs/strategies.md).

Strategy names are one vocabulary across every op family, the MoE ones included;
``canonical_strategy`` reads the names a family used before (``STRATEGY_ALIASES``) as current ones.
"""
import dataclasses
import logging
import sys
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from flux import fused_configs

OP_CODES = {"ag_gemm": 0, "gemm_rs": 1}  # OpKind in C++; the top bits of a plan's token
# The channels of a rank's signal pad (one word per peer each), as the C++ side numbers them
# (k<Name>Channel in the generated header): the entry barrier, the data signals of chunks
# 1..7, the fused kernels' flags, the barrier's "started" word, the fused RS segment flags.
SIGNAL_CHANNELS = {"barrier": 0, "data": 1, "flag": 8, "started": 9, "segment": 10}
MAX_CHUNKS = SIGNAL_CHANNELS["flag"] - SIGNAL_CHANNELS["data"]  # one data channel per chunk
TILE_M = 128  # rows of one tile: the decomposed sub-blocks' minimum
# (rows of one tile, CTAs of one cluster along M) of each fused kernel configuration, from the
# table flux/fused_configs.py. Along N, the kernels serve M tiles in bands of cluster_m * swizzle tiles.
FUSED_AG_TILE_M = {c.id: (c.tile_m, c.cluster_m) for c in fused_configs.CONFIGS["ag"]}
FUSED_RS_TILE_M = {c.id: (c.tile_m, c.cluster_m) for c in fused_configs.CONFIGS["rs"]}
FUSED_TILE_M = {"ag_gemm": FUSED_AG_TILE_M, "gemm_rs": FUSED_RS_TILE_M}
# Where the first8 split pays: under this many rows per rank it only adds a GEMM launch.
FIRST8_MIN_ROWS = 1024
# c10::ScalarType values: a call's key in C++ (Runtime::make_plan, Runtime::call) and the dtype
# fields of the cross-rank signature (flux/ops/_checks.py). -1: no dtype (no out_dtype given).
DTYPE_CODES = {None: -1, torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
               torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15}
DTYPE_CODES.update({getattr(torch, n): c for n, c in (("float8_e5m2", 23), ("float8_e4m3fn", 24))
                    if hasattr(torch, n)})


@dataclasses.dataclass(frozen=True)
class Problem:
    """One op call as the rules see it. m: all rows (the gathered M for AG). ``no_symm``: why
    the group has no symmetric workspace (None: it has one, or the question is the tuner's,
    which assumes one); it is not part of the choice."""
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
    out_dtype: Optional[torch.dtype] = None  # the output dtype where it differs (None: read as fp32)
    shared_gpu: bool = False  # ranks of the group share a GPU (FLUX_GLOO_CUDA, more ranks than GPUs; tests)
    no_symm: Optional[str] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.op not in OP_CODES:
            raise ValueError(f"Problem: unknown op {self.op!r}")
        if min(self.m, self.n, self.k, self.world) < 1:
            raise ValueError(f"Problem: sizes must be positive: {self}")

    @property
    def rows(self) -> int:
        """Rows of one rank's block (M / W)."""
        return self.m // self.world

    @property
    def out(self) -> torch.dtype:
        """The output dtype."""
        return (self.out_dtype or torch.float32) if self.out_dtype_differs else self.dtype

    @property
    def kernel_m(self) -> int:
        """Rows of the fused kernel: all gathered rows (ag_gemm), one rank's block (gemm_rs)."""
        return self.m if self.op == "ag_gemm" else self.rows


def fused_built_for(op: str, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether a fused kernel of ``op`` is built for dtype -> out_dtype (the table filtered by
    what flux._C reports built: flux/autotune/kernel_configs.py)."""
    from flux.autotune.kernel_configs import kernel_configs

    try:
        return bool(kernel_configs(op, dtype, out_dtype))
    except ValueError:  # a dtype no fused kernel names
        return False


def wide_out_ok(dtype: torch.dtype, out_dtype: Optional[torch.dtype]) -> bool:
    """Whether the overlapped strategies serve this out_dtype: the input's own, or fp32 from
    bf16/fp16 (tensor-core GEMMs with an fp32 output; gemm_rs sums in fp32)."""
    return out_dtype is None or out_dtype == dtype or (
        out_dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16))


def _overlap_why_not(p: Problem) -> Optional[str]:
    """Why no overlapped strategy can run ``p`` (None when they can)."""
    if p.device_type != "cuda":
        return "input is not on a CUDA device"
    if p.world == 1:
        return "world size 1"
    if p.no_symm is not None:
        return p.no_symm
    wide_ok = p.out_dtype in (None, torch.float32) and p.dtype in (torch.bfloat16, torch.float16)
    if p.out_dtype_differs and not wide_ok:
        return f"out_dtype {p.out_dtype} from {p.dtype} (the overlapped strategies write the input dtype or fp32)"
    if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {p.dtype} is not supported by this strategy"
    return None


def _fused_why_not(p: Problem) -> Optional[str]:
    """Why the fused CUTLASS kernels (csrc/ag_gemm/, csrc/gemm_rs/) cannot run ``p``."""
    why = _overlap_why_not(p)
    if why is not None:
        return why
    if not p.fused_built:
        return "flux._C was built without the sm_90a kernels"
    if not p.sm90:
        return "the fused kernels are built for sm_90a (Hopper)"
    if not fused_built_for(p.op, p.dtype, p.out):
        return f"no fused {p.op} kernel is built for {p.dtype} -> {p.out} (flux/fused_configs.py, FLUX_KERNELS)"
    if p.shared_gpu and p.world > 2:
        # Each rank's persistent kernel holds every SM it gets while it waits for its peers'
        # pushes; with more than two ranks on one GPU those pushes (same-GPU copies, which need
        # SMs) and the peers' kernels cannot all be resident, and the waits never end.
        return "ranks share a GPU at world size > 2: the persistent fused kernels cannot all progress"
    if p.weight_layout != "nk":
        return "the fused kernels take weight_layout 'nk' only"
    if p.k % 8 or p.n % 8:
        return f"K={p.k} and N={p.n} must be multiples of 8 (16-byte rows for TMA)"
    return None


def _never(*_) -> Optional[str]:
    return None


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    default: int
    domain: Callable[[str, int], Optional[str]] = _never  # (op, value): no problem accepts it
    # (p, params) -> reason; both see the candidate's whole parameter dict.
    why_not: Callable[[Problem, Mapping[str, int]], Optional[str]] = _never  # cannot serve p: run the default
    prune: Callable[[Problem, Mapping[str, int]], Optional[str]] = _never  # the tuner's heuristic only


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    code: int  # StrategyKind in C++
    cxx: str  # the Runtime member that runs its plan (csrc/ag_gemm/ag_gemm_plan.cpp, csrc/gemm_rs/...)
    why_not: Callable[[Problem], Optional[str]] = _never
    fallback: Optional[str] = None  # what runs when why_not answers (its parameters at their defaults)
    params: Tuple[Param, ...] = ()
    space: Tuple[Mapping[str, int], ...] = ({},)  # the parameter points the tuner tries, in order

    def param(self, name: str) -> Param:
        return next(q for q in self.params if q.name == name)


def _first8_why_not(p: Problem, kw: Mapping[str, int]) -> Optional[str]:
    f = kw["first8"]
    # The C++ plan (csrc/ag_gemm/ag_gemm_plan.cpp) splits only at two ranks, f < 8; the split
    # must leave rows on both sides.
    if f == 8 or (p.world == 2 and 0 < p.rows * f // 8 < p.rows):
        return None
    return f"needs world size 2 and 0 < {f}/8 of {p.rows} rows < {p.rows}"


def band_rows(op: str, config: int, swizzle: int) -> int:
    """Rows of one band of the fused kernel's tile order: cluster_m * swizzle M tiles."""
    tile_m, cluster_m = FUSED_TILE_M[op][config]
    return cluster_m * swizzle * tile_m


def _swizzle_prune(p: Problem, kw: Mapping[str, int]) -> Optional[str]:
    swizzle = kw["swizzle"]
    if swizzle > 1 and p.kernel_m < band_rows(p.op, kw.get("config", 0), swizzle):
        return "bands of M tiles larger than the problem pad the grid"
    return None


def fused_ag_swizzle(p: Problem, config: int, swizzle: int) -> int:
    """The kernel tuner's AG swizzle (timed on one GPU, every flag set) as the fused strategy
    launches it for ``p``: halved until a band of cluster_m * swizzle M tiles holds no more rows
    than one rank's block. The kernel starts on this rank's band, so its first waves then read
    only local rows while the peers' shards arrive (a cluster taller than the block still spans
    ranks). A swizzle given as a strategy argument is launched as given."""
    while swizzle > 1 and band_rows("ag_gemm", config, swizzle) > p.rows:
        swizzle //= 2
    return swizzle


_CHUNKS = Param("chunks", 1, domain=lambda op, v: None if 1 <= v <= MAX_CHUNKS else
                f"chunks must be 1..{MAX_CHUNKS} (one signal channel each)",
                prune=lambda p, kw: "sub-blocks smaller than a tile"
                if kw["chunks"] > 1 and p.rows < kw["chunks"] * TILE_M else None)
_FIRST8 = Param("first8", 8, domain=lambda op, v: None if 1 <= v <= 8 else "first8 must be 1..8",
                why_not=_first8_why_not,
                prune=lambda p, kw: f"first8: under {FIRST8_MIN_ROWS} rows per rank the split only adds a launch"
                if kw["first8"] != 8 and p.rows < FIRST8_MIN_ROWS else None)
def _config_why_not(p: Problem, kw: Mapping[str, int]) -> Optional[str]:
    from flux.autotune.kernel_configs import kernel_configs

    if any(c.id == kw["config"] for c in kernel_configs(p.op, p.dtype, p.out)):
        return None
    return f"configuration {kw['config']} is not built for {p.dtype} -> {p.out}"


# Without config (a plan made from the tuner's 'fused' or a forced label), the plan's config,
# raster and swizzle are the kernel tuner's choice (flux.autotune.kernels.choose_config).
_CONFIG = Param("config", 0, domain=lambda op, v: None if v in FUSED_TILE_M[op] else f"no fused configuration {v}",
                why_not=_config_why_not)
_RASTER = Param("raster", 1, domain=lambda op, v: None if 0 <= v <= 2 else "raster must be 0..2")
_SWIZZLE = Param("swizzle", 0, domain=lambda op, v: None if v >= 0 else "swizzle must be 0 (analytic) or positive",
                 prune=_swizzle_prune)
_SEGMENTS = Param("segments", 8, domain=lambda op, v: None if v >= 1 else "segments must be positive")

AG_GEMM: Dict[str, Strategy] = {s.name: s for s in (
    Strategy("sequential", 0, "ag_sequential"),
    Strategy("decomposed", 1, "ag_decomposed", _overlap_why_not, "sequential", (_FIRST8,),
             ({}, {"first8": 4}, {"first8": 6}, {"first8": 7})),
    Strategy("oneshot", 2, "ag_oneshot", _overlap_why_not, "sequential"),
    Strategy("fused", 3, "ag_fused", _fused_why_not, "decomposed", (_CONFIG, _SWIZZLE, _RASTER)),
)}
GEMM_RS: Dict[str, Strategy] = {s.name: s for s in (
    Strategy("sequential", 0, "rs_sequential"),
    Strategy("oneshot", 2, "rs_oneshot", _overlap_why_not, "sequential"),
    Strategy("decomposed", 1, "rs_decomposed", _overlap_why_not, "sequential", (_CHUNKS,),
             ({"chunks": 1}, {"chunks": 2})),
    Strategy("decomposed_p2p", 4, "rs_decomposed_p2p", _overlap_why_not, "sequential", (_CHUNKS,),
             ({"chunks": 1},)),
    Strategy("fused", 3, "rs_fused", _fused_why_not, "decomposed", (_CONFIG, _SEGMENTS, _SWIZZLE, _RASTER)),
)}
TABLES: Dict[str, Dict[str, Strategy]] = {"ag_gemm": AG_GEMM, "gemm_rs": GEMM_RS}

# The plan's parameter vector (Runtime::make_plan): every parameter of every table, in this order.
PARAM_ORDER = ("first8", "chunks", "segments", "config", "swizzle", "raster")
PARAM_DEFAULTS = {q.name: q.default for t in TABLES.values() for s in t.values() for q in s.params}
# One code per strategy name across the op families (one C++ enum).
STRATEGY_CODES = {s.name: s.code for t in TABLES.values() for s in t.values()}


def _check_tables() -> None:
    for t in TABLES.values():
        for s in t.values():
            assert STRATEGY_CODES[s.name] == s.code, f"strategy {s.name}: one code across op families"
            assert s.fallback is None or s.fallback in t, f"{s.name} falls back to an unknown strategy"
            for q in s.params:
                assert PARAM_DEFAULTS[q.name] == q.default, f"parameter {q.name}: one default across strategies"
    assert set(PARAM_DEFAULTS) == set(PARAM_ORDER), "every parameter has its place in the plan's vector"
    assert len(set(STRATEGY_CODES.values())) == len(STRATEGY_CODES), "strategy codes are distinct"


_check_tables()

# One vocabulary across the op families (docs/strategies.md): ``sequential`` is always the process
# group's collectives then the compute, ``decomposed`` always the symmetric workspace filled by the
# copy engine beside the GEMMs. The MoE families' former names for those stay accepted wherever a
# user gives a name (``strategy=`` arguments, FLUX_STRATEGY_<OP>) and are read through this table.
STRATEGY_ALIASES: Dict[str, Dict[str, str]] = {
    "moe": {"all_to_all": "sequential"},
    "moe_tp": {"symm": "decomposed"},
}


def canonical_strategy(family: str, name: Optional[str]) -> str:
    """``name`` as op family ``family`` calls it now: surrounding blanks dropped, a former name
    replaced by its current one, anything else returned as given for the caller to check
    (None: "")."""
    name = (name or "").strip()
    return STRATEGY_ALIASES.get(family, {}).get(name, name)


def param_error(op: str, name: str, kw: Mapping[str, int]) -> Optional[str]:
    """Why strategy ``name`` of ``op`` cannot take these parameters at all (None when it can)."""
    s = TABLES[op].get(name)
    if s is None:
        return f"{op} has no strategy {name!r}"
    known = {q.name for q in s.params}
    if not set(kw) <= known:
        return f"{name} takes parameters {sorted(known)}, not {sorted(kw)}"
    for q in s.params:
        why = q.domain(op, kw[q.name]) if q.name in kw else None
        if why:
            return why
    return None


def resolve(p: Problem, name: str, kw: Mapping[str, int], on_fallback: Callable[[str, str, str], None]):
    """(name, params) that will actually run ``p``: a strategy that cannot run falls back along
    its chain (fused -> decomposed -> sequential), parameters that cannot serve ``p`` go back to
    their defaults; ``on_fallback(from_label, reason, to_label)`` is told of each step."""
    kw = dict(kw)
    while True:
        s = TABLES[p.op][name]
        why = s.why_not(p)
        if why is None:
            break
        on_fallback(name, why, s.fallback)
        name, kw = s.fallback, {}
    for q in s.params:
        why = q.why_not(p, kw) if q.name in kw else None
        if why:
            on_fallback(f"{name}({q.name}={kw[q.name]})", why, name)
            del kw[q.name]
    return name, kw


def why_invalid(p: Problem, name: str, kw: Mapping[str, int]) -> Optional[str]:
    """Why the tuner, a forced label or a cached choice may not use ``name(**kw)`` for ``p``."""
    why = param_error(p.op, name, kw)
    if why is not None:
        return why
    s = TABLES[p.op][name]
    why = s.why_not(p)
    if why is not None:
        return why
    for q in s.params:
        if q.name in kw:
            why = q.why_not(p, kw) or q.prune(p, kw)
            if why:
                return why
    return None


_log = logging.getLogger("flux")
_warned = set()


def warn_once(message: str) -> None:
    """Log a fallback's reason once per process (the choice's and the plan's alike)."""
    if message not in _warned:
        _warned.add(message)
        _log.warning(message)


def _camel(name: str) -> str:
    return "".join(w.upper() if any(c.isdigit() for c in w) else w.capitalize() for w in name.split("_"))


def cxx_header() -> str:
    """csrc/runtime/strategies.h, generated from the tables."""
    names = sorted(STRATEGY_CODES, key=STRATEGY_CODES.get)
    assert [STRATEGY_CODES[n] for n in names] == list(range(len(names))), "strategy codes are 0..n-1"
    ops = sorted(OP_CODES, key=OP_CODES.get)
    lines = [
        "// Generated from flux/strategies.py by `python -m flux.strategies > csrc/runtime/strategies.h`:",
        "// do not edit (tests/test_strategies.py checks that it is current).",
        "#pragma once",
        "#include <cstdint>",
        "",
        "namespace flux {",
        "",
        "enum class OpKind : int64_t { " + ", ".join(f"{_camel(o)} = {OP_CODES[o]}" for o in ops) + " };",
        "enum class StrategyKind : int64_t { " + ", ".join(f"{_camel(n)} = {STRATEGY_CODES[n]}" for n in names)
        + " };",
        f"constexpr int64_t kNumOps = {len(ops)};",
        f"constexpr int64_t kNumStrategies = {len(names)};",
        "constexpr const char* kOpNames[] = {" + ", ".join(f'"{o}"' for o in ops) + "};",
        "constexpr const char* kStrategyNames[] = {" + ", ".join(f'"{n}"' for n in names) + "};",
        "// The parameter vector of Runtime::make_plan, in this order, with these defaults.",
        f"constexpr int64_t kNumPlanParams = {len(PARAM_ORDER)};",
        "constexpr const char* kPlanParamNames[] = {" + ", ".join(f'"{q}"' for q in PARAM_ORDER) + "};",
        "constexpr int64_t kPlanParamDefaults[] = {" + ", ".join(str(PARAM_DEFAULTS[q]) for q in PARAM_ORDER)
        + "};",
        "// Signal pad channels (flux/runtime/symm.py sizes the pads from the last one).",
    ] + [f"constexpr int k{_camel(c)}Channel = {v};" for c, v in SIGNAL_CHANNELS.items()] + [
        "constexpr int kMaxDataChannels = kFlagChannel - kDataChannel;",
        "",
        "}  // namespace flux",
        "",
        "// X(op, strategy, member): Runtime::member runs the plans of that op and strategy.",
        "#define FLUX_PLAN_STRATEGIES(X) \\",
    ]
    rows = [f"  X({_camel(op)}, {_camel(s.name)}, {s.cxx})" for op in ops for s in TABLES[op].values()]
    lines += [r + " \\" for r in rows[:-1]] + [rows[-1], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(cxx_header())
