"""One module per op family: schema (torch.library), fake implementation, the unfused
reference, and the choice among strategies.

The modules keep their names (``flux.ops.ag_gemm`` is the module, with ``STRATEGIES``,
``available_strategies`` and ``run_strategy``); the public functions are in ``flux``.
"""
from flux.ops import ag_gemm, gemm_rs  # noqa: F401  (registers torch.ops.flux.ag_gemm / gemm_rs)
from flux.ops import moe  # noqa: F401  (registers torch.ops.flux.moe_dispatch / moe_combine)
from flux.ops._checks import FluxInputError


def __getattr__(name):
    # flux.ops.moe_tp (tensor-parallel MoE, the module flux.ops.moe.tp) is imported on first use:
    # it imports torch._dynamo.
    if name == "moe_tp":
        import importlib

        return importlib.import_module("flux.ops.moe.tp")
    raise AttributeError(f"module 'flux.ops' has no attribute {name!r}")


__all__ = ["FluxInputError", "ag_gemm", "gemm_rs", "moe", "moe_tp"]
