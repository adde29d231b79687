"""The fused kernels' compiled configurations, read through one adapter.

``kernel_configs(op, dtype, out_dtype)`` lists the KernelConfig (id, tile, cluster, schedule,
(input, output) dtypes) of op 'ag' (csrc/ag_gemm/) or 'rs' (csrc/gemm_rs/) built for those
dtypes. Source: the table flux/ops/fused_configs.py where it exists (read through whichever of
its plausible shapes it has), else the built-in list of what csrc/ compiles today (AG 0..3,
RS 0..2, bf16 only); then, where flux._C answers ``torch.ops.flux.fused_kernels_built()``, only
what it reports built. ``config_source(op)`` says which source was used.
"""
import dataclasses
import importlib
import re
from typing import Dict, List, Optional, Tuple

import torch

OPS = ("ag", "rs")
_OP_ALIASES = {"ag": "ag", "ag_gemm": "ag", "rs": "rs", "gemm_rs": "rs"}
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
       "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
       "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def _op(op: str) -> str:
    if op not in _OP_ALIASES:
        raise ValueError(f"fused kernel configs: unknown op {op!r} (ag, rs)")
    return _OP_ALIASES[op]


def _dt(d) -> str:
    name = _DT.get(d) if not isinstance(d, str) else _DT.get(d.lower())
    if name is None:
        raise ValueError(f"fused kernel configs: unsupported dtype {d!r}")
    return name


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compiled configuration: a tile_m x tile_n x tile_k tile, a cluster_m x cluster_n
    cluster, a schedule ('cooperative' or 'pingpong') and the (input, output) dtypes built."""
    op: str
    id: int
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int
    cluster_n: int
    schedule: str
    dtypes: Tuple[Tuple[str, str], ...] = (("bf16", "bf16"),)

    def __post_init__(self):
        if self.op not in OPS or self.id < 0 or self.schedule not in ("cooperative", "pingpong"):
            raise ValueError(f"KernelConfig: bad op, id or schedule: {self}")
        if min(self.tile_m, self.tile_n, self.tile_k) < 16 or self.cluster_m * self.cluster_n not in (1, 2, 4):
            raise ValueError(f"KernelConfig: bad tile or cluster: {self}")

    @property
    def desc(self) -> str:
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k}/{self.cluster_m}x{self.cluster_n}/"
                f"{'pp' if self.schedule == 'pingpong' else 'coop'}")


# The configurations compiled today (csrc/ag_gemm/ag_gemm_fused_cfg*.cu, csrc/gemm_rs/rs_fused_cfg*.cu).
_BUILTIN = {
    "ag": [KernelConfig("ag", 0, 128, 256, 64, 2, 1, "cooperative"),
           KernelConfig("ag", 1, 256, 128, 64, 2, 1, "cooperative"),
           KernelConfig("ag", 2, 128, 128, 64, 2, 1, "pingpong"),
           KernelConfig("ag", 3, 256, 128, 64, 1, 2, "cooperative")],
    "rs": [KernelConfig("rs", 0, 128, 256, 64, 2, 1, "cooperative"),
           KernelConfig("rs", 1, 256, 128, 64, 2, 1, "cooperative"),
           KernelConfig("rs", 2, 256, 128, 64, 1, 2, "cooperative")],
}


def _field(e, *names):
    for n in names:
        v = e.get(n) if isinstance(e, dict) else getattr(e, n, None)
        if v is not None:
            return v
    return None


def _dims(v, n: int) -> Optional[Tuple[int, ...]]:
    if v is None:
        return None
    vals = [int(x) for x in re.findall(r"\d+", v)] if isinstance(v, str) else [int(x) for x in v]
    return tuple(vals[:n]) + (1,) * (n - len(vals)) if vals else None


def _dtype_pairs(v) -> Tuple[Tuple[str, str], ...]:
    if v is None:
        return (("bf16", "bf16"),)
    pairs = []
    for item in ([v] if isinstance(v, str) else v):
        parts = re.split(r"[^a-z0-9]+", item.lower()) if isinstance(item, str) else list(item)
        parts = [_dt(p) for p in parts if p]
        pairs.append((parts[0], parts[-1]))
    return tuple(pairs)


def _parse_entry(op: str, e) -> KernelConfig:
    tile = _dims(_field(e, "tile"), 3) or (_field(e, "tile_m"), _field(e, "tile_n"), _field(e, "tile_k") or 64)
    cluster = _dims(_field(e, "cluster"), 2) or (_field(e, "cluster_m") or 1, _field(e, "cluster_n") or 1)
    sched = str(_field(e, "schedule", "kernel_schedule") or "cooperative").lower()
    return KernelConfig(op, int(_field(e, "id", "config", "index")), int(tile[0]), int(tile[1]), int(tile[2]),
                        int(cluster[0]), int(cluster[1]), "pingpong" if "ping" in sched else "cooperative",
                        _dtype_pairs(_field(e, "dtypes", "variants", "dtype_variants")))


def _from_table(op: str) -> Tuple[Optional[List[KernelConfig]], str]:
    """The published configuration table (flux/ops/fused_configs.py), read through whichever of
    its plausible shapes it has: ``configs(op)``, a dict ``CONFIGS[op]`` or ``AG_CONFIGS`` /
    ``RS_CONFIGS``, entries as dicts or objects (id, tile, cluster, schedule, dtypes)."""
    try:
        mod = importlib.import_module("flux.ops.fused_configs")
    except ImportError:
        return None, "built-in list (no flux.ops.fused_configs)"
    long = {"ag": "ag_gemm", "rs": "gemm_rs"}[op]
    raw = None
    for name in ("configs", "fused_configs", "get_configs"):
        if callable(getattr(mod, name, None)):
            raw = getattr(mod, name)(op)
            break
    for name in ("CONFIGS", "FUSED_CONFIGS"):
        if raw is None and isinstance(getattr(mod, name, None), dict):
            raw = getattr(mod, name).get(op) or getattr(mod, name).get(long)
    if raw is None:
        raw = getattr(mod, f"{op.upper()}_CONFIGS", None)
    try:
        entries = list(raw.values()) if isinstance(raw, dict) else list(raw)
        cfgs = [_parse_entry(op, e) for e in entries]
    except Exception as e:  # noqa: BLE001  (an unreadable table must not break the op: fall back, say why)
        return None, f"built-in list (flux.ops.fused_configs unreadable: {type(e).__name__}: {e})"
    return (cfgs, "flux.ops.fused_configs") if cfgs else (None, "built-in list (empty table)")


def _built_filter():
    """{(op, id)} or {(op, id, in, out)} that flux._C reports built, or None where it cannot say
    (``torch.ops.flux.fused_kernels_built()``: strings such as 'ag:3:bf16:fp32', or a dict)."""
    try:
        fn = getattr(torch.ops.flux, "fused_kernels_built")
        res = fn()
    except Exception:  # noqa: BLE001  (no such op in this build: every listed configuration counts as built)
        return None
    items = []
    if isinstance(res, dict):  # {op: [id, ...]} or {op: {id: ["bf16:fp32", ...]}}
        for op, ids in res.items():
            for i in ids:
                dts = ids[i] if isinstance(ids, dict) else [""]
                items += [f"{op}:{i}:{d}" for d in dts]
    else:
        items = [str(x) for x in res]
    out = set()
    for s in items:
        toks = [t for t in re.split(r"[^a-z0-9]+", s.lower()) if t]
        # 'ag_gemm' splits into 'ag', 'gemm' and 'gemm_rs' into 'gemm', 'rs': the op is found either way.
        ops = [_OP_ALIASES[t] for t in toks if t in _OP_ALIASES]
        ids = [int(t) for t in toks if t.isdigit()]
        dts = [_DT[t] for t in toks if t in _DT]
        if ops and ids:
            out.add((ops[0], ids[0]) + ((dts[0], dts[-1]) if dts else ()))
    return out or None


_CONFIGS: Dict[str, Tuple[List[KernelConfig], str, bool]] = {}


def _extension_loaded() -> bool:
    try:
        getattr(torch.ops.flux, "ag_gemm_fused_")
        return True
    except (AttributeError, RuntimeError):
        return False


def kernel_configs(op: str, dtype=None, out_dtype=None) -> List[KernelConfig]:
    """The configurations of ``op`` built for (dtype -> out_dtype) (all of them without dtypes)."""
    op = _op(op)
    if op not in _CONFIGS or not _CONFIGS[op][2]:
        cfgs, source = _from_table(op)
        if cfgs is None:
            cfgs = _BUILTIN[op]
        built = _built_filter()
        if built is not None:
            keep = []
            for c in cfgs:
                pairs = tuple(p for p in c.dtypes if (op, c.id, *p) in built)
                if (op, c.id) in built:
                    pairs = c.dtypes
                if pairs:
                    keep.append(dataclasses.replace(c, dtypes=pairs))
            cfgs = keep
        # Kept once flux._C is loaded (its answer is final); read again until then.
        _CONFIGS[op] = (cfgs, source, _extension_loaded())
    cfgs = _CONFIGS[op][0]
    if dtype is None:
        return list(cfgs)
    pair = (_dt(dtype), _dt(out_dtype if out_dtype is not None else dtype))
    return [c for c in cfgs if pair in c.dtypes]


def config_source(op: str) -> str:
    kernel_configs(op)
    return _CONFIGS[_op(op)][1]


def reset() -> None:
    _CONFIGS.clear()
