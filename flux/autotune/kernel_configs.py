"""The fused kernels' built configurations, read from the table flux/fused_configs.py.

``kernel_configs(op, dtype, out_dtype)`` lists the KernelConfig (id, tile, cluster, schedule,
(input, output) dtypes) of op 'ag' (csrc/ag_gemm/) or 'rs' (csrc/gemm_rs/) built for those
dtypes: where flux._C answers ``torch.ops.flux.fused_kernels_built()``, what it reports built;
otherwise what the default build holds (each configuration's ``default`` dtype variants).
``config_source(op)`` says which of the two it was. The fused strategies are eligible for a
dtype pair only where this list is non-empty (flux/strategies.py).
"""
import dataclasses
from typing import Dict, List, Tuple

import torch

from flux import fused_configs as table

OPS = table.OPS
_OP_ALIASES = {"ag": "ag", "ag_gemm": "ag", "rs": "rs", "gemm_rs": "rs"}
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
       "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
       "fp32": "fp32", "float32": "fp32", "float": "fp32"}
_SCHED_TAG = {"persistent": "", "streamk": "/sk", "streamk-all": "/ska"}  # in choice descriptions


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
    """One configuration: a tile_m x tile_n x tile_k tile, a cluster_m x cluster_n cluster, a
    schedule ('cooperative' or 'pingpong'), the (input, output) dtypes built and the tile
    scheduler ('persistent'; 'streamk': K split among CTAs where tiles are fewer than SMs, by
    CUTLASS's heuristic; 'streamk-all': split on every shape; 'splitk': the persistent kernel over
    ``splits`` slices of K, then a reduction pass); ``operands`` 'swapped': the kernel computes
    out^T = weight @ a^T (flux/fused_configs.py), the tile still named as (rows, columns) of out."""
    op: str
    id: int
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int
    cluster_n: int
    schedule: str
    dtypes: Tuple[Tuple[str, str], ...] = (("bf16", "bf16"),)
    scheduler: str = "persistent"
    splits: int = 1
    operands: str = "ab"

    @classmethod
    def of(cls, op: str, c: "table.FusedConfig", dtypes: Tuple[Tuple[str, str], ...]) -> "KernelConfig":
        """The configuration ``c`` of the table (flux/fused_configs.py) built for ``dtypes``."""
        return cls(op, c.id, *c.tile, *c.cluster, c.schedule, dtypes, c.scheduler, c.splits, c.operands)

    def __post_init__(self):
        if self.op not in OPS or self.id < 0 or self.schedule not in ("cooperative", "pingpong"):
            raise ValueError(f"KernelConfig: bad op, id or schedule: {self}")
        if self.scheduler not in table.SCHEDULERS or (self.stream_k and self.schedule != "cooperative"):
            raise ValueError(f"KernelConfig: bad scheduler (stream-K is cooperative only): {self}")
        if (self.scheduler == "splitk") != (self.splits > 1) or not 1 <= self.splits <= table.MAX_SPLITS:
            raise ValueError(f"KernelConfig: split-K needs 2..{table.MAX_SPLITS} splits, and only it: {self}")
        if self.operands not in table.OPERANDS:
            raise ValueError(f"KernelConfig: bad operands (one of {table.OPERANDS}): {self}")
        if min(self.tile_m, self.tile_n, self.tile_k) < 16 or self.cluster_m * self.cluster_n not in (1, 2, 4):
            raise ValueError(f"KernelConfig: bad tile or cluster: {self}")

    @property
    def stream_k(self) -> bool:
        return self.scheduler.startswith("streamk")

    def applies(self, m: int, n: int, k: int) -> bool:
        """Whether it runs an m x n x k problem (flux/fused_configs.py FusedConfig.applies)."""
        return table.FusedConfig(self.id, (self.tile_m, self.tile_n, self.tile_k), (self.cluster_m, self.cluster_n),
                                 self.schedule, (), self.scheduler, self.splits,
                                 operands=self.operands).applies(m, n, k)

    @property
    def desc(self) -> str:
        """As cached choices name it: a choice applies only to the same tile, cluster, schedule, scheduler and
        operand order ("/sw": swapped)."""
        tag = f"/k{self.splits}" if self.scheduler == "splitk" else _SCHED_TAG[self.scheduler]
        tag += "/sw" if self.operands == "swapped" else ""
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k}/{self.cluster_m}x{self.cluster_n}/"
                f"{'pp' if self.schedule == 'pingpong' else 'coop'}{tag}")


def _built():
    """(set of (op, id, variant) built, source): flux._C's answer where it gives one (an empty
    answer is an answer), else the default build's selection."""
    try:
        text = torch.ops.flux.fused_kernels_built()
    except (AttributeError, RuntimeError):
        return frozenset(table.select("default")), "the table's default build (flux._C does not say)"
    return table.parse_built(text), "torch.ops.flux.fused_kernels_built()"


_CONFIGS: Dict[str, Tuple[List[KernelConfig], str, bool]] = {}


def _extension_loaded() -> bool:
    try:
        getattr(torch.ops.flux, "fused_kernels_built")
        return True
    except (AttributeError, RuntimeError):
        return False


def kernel_configs(op: str, dtype=None, out_dtype=None) -> List[KernelConfig]:
    """The configurations of ``op`` built for (dtype -> out_dtype) (every built one without dtypes)."""
    op = _op(op)
    if op not in _CONFIGS or not _CONFIGS[op][2]:
        built, source = _built()
        cfgs = []
        for c in table.CONFIGS[op]:
            pairs = tuple(table.DTYPE_IO[v] for v in table.DTYPES if (op, c.id, v) in built)
            if pairs:
                cfgs.append(KernelConfig.of(op, c, pairs))
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
