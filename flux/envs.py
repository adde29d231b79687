"""Every FLUX_* environment variable flux reads: name, type, default and meaning, in one table.

Each is read through its ``Var.get()`` here, never with ``os.environ`` elsewhere. Reads are
live (tests and launchers set them at run time). The GEMM ops read them on the slow path only
(their hot path reads no environment); the MoE ops read FLUX_STRATEGY_MOE, and
flux.ops.grouped_mm FLUX_GROUPED_MM, on every call (a dictionary lookup each).
``python -m flux.envs`` prints the table.
"""
import dataclasses
import os
from typing import Callable, Dict, Optional


def _one(text: str) -> bool:
    return text == "1"


def _flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], object]
    default: object
    meaning: str

    def get(self):
        text = os.environ.get(self.name)
        return self.default if text is None or text == "" else self.parse(text)


VARS: Dict[str, Var] = {}


def _var(name: str, parse, default, meaning: str) -> Var:
    VARS[name] = Var(name, parse, default, meaning)
    return VARS[name]


AUTOTUNE = _var("FLUX_AUTOTUNE", _one, False,
                "1: an op call whose problem has no cache entry tunes it on the spot (collectively)")
CACHE_DIR = _var("FLUX_CACHE_DIR", str, None, "the tuning cache's folder (default ~/.cache/flux)")
CHECK_EVERY_CALL = _var("FLUX_CHECK_EVERY_CALL", _one, False,
                        "1: every call runs the slow path (checks across ranks, no plans): debugging")
CHECK_TIMEOUT_S = _var("FLUX_CHECK_TIMEOUT_S", float, 60.0, "seconds the cross-rank argument check waits for peers")
TIMEOUT_MS = _var("FLUX_TIMEOUT_MS", int, 30000, "milliseconds a GPU wait for a peer's signal lasts before it fails")
GLOO_CUDA = _var("FLUX_GLOO_CUDA", _one, False,
                 "tests only: gloo groups carry CUDA tensors, so that ranks may share a GPU (flux.testing)")
KERNELS = _var("FLUX_KERNELS", str, "default",
                "build time, read by setup.py: the fused GEMM kernels compiled, e.g. 'default,ag:*:fp16' "
                "(flux/fused_configs.py)")
GROUPED_MM = _var("FLUX_GROUPED_MM", str, None,
                  "cutlass (flux's grouped kernels for every product), kernel (torch._grouped_mm only), triton (the "
                  "Triton prototype) or hybrid (torch._grouped_mm with the Triton weight gradient): "
                  "flux.ops.grouped_mm with impl='auto' takes it where it can run")
VLLM = _var("FLUX_VLLM", _flag, False, "1: the vLLM plugin swaps in flux's layers (flux/integrations/vllm.py)")
STRATEGY_PREFIX = "FLUX_STRATEGY_"  # FLUX_STRATEGY_<OP>: a forced strategy label, below
for _op in ("AG_GEMM", "GEMM_RS", "MOE", "MOE_TP"):
    _var(STRATEGY_PREFIX + _op, str, None,
         f"forces the strategy of {_op.lower()} (a strategy label, the same on every rank)")


def forced_strategy(op: str) -> Optional[str]:
    """FLUX_STRATEGY_<OP>: the label forced for ``op`` in this process, or None."""
    return VARS[STRATEGY_PREFIX + op.upper()].get()


if __name__ == "__main__":
    for v in VARS.values():
        print(f"{v.name:24} default {v.default!r:8} {v.meaning}")
