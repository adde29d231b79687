"""Strategy choice for the overlapped ops.

``choose`` is called once per op call with the problem's shape and the strategies that can
run on its device. It returns, in this order of precedence:

1. a strategy forced for the process (``force(op, name)``, or the environment variable
   ``FLUX_STRATEGY_<OP>``, e.g. ``FLUX_STRATEGY_AG_GEMM=sequential``);
2. the analytic default (``default_strategy``).

The choice depends only on arguments that every rank of the group shares (shape, dtype,
world size, and process-wide settings that must be set alike on all ranks), so every rank
makes the same choice without communicating.
"""
import logging
import os
from typing import Dict, Optional, Sequence

import torch

log = logging.getLogger("flux")

OPS = ("ag_gemm", "gemm_rs")
_forced: Dict[str, Optional[str]] = {}
_logged = set()


def force(op: str, name: Optional[str]) -> None:
    """Force strategy ``name`` for every later call of ``op`` in this process (None: undo).
    Set it alike on every rank of a group."""
    if op not in OPS:
        raise ValueError(f"flux.autotune.force: unknown op {op!r}; known: {OPS}")
    _forced[op] = name


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


def choose(op: str, available: Sequence[str], *, m: int, n: int, k: int, dtype: torch.dtype, world: int) -> str:
    """The strategy for one call of ``op`` (see the module docstring)."""
    name = _forced.get(op) or os.environ.get(f"FLUX_STRATEGY_{op.upper()}")
    if name:
        if name in available:
            return name
        if (op, name) not in _logged:  # a fallback logs its reason once
            _logged.add((op, name))
            log.warning("flux.%s: forced strategy %r cannot run here (available: %s); using the default",
                        op, name, list(available))
    return default_strategy(op, available, m=m, n=n, k=k, dtype=dtype, world=world)
