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


def default_strategy(op: str, available: Sequence[str], *, m: int, n: int, k: int, dtype: torch.dtype,
                     world: int) -> str:
    """The analytic default: the reference path is the only strategy so far."""
    return "sequential"


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
