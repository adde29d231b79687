"""flux.moe_dispatch / flux.moe_combine: expert-parallel MoE token dispatch and combine.

The group's W ranks own ``num_experts`` experts in equal shares; ``moe_dispatch`` sends every
valid (token, slot) pair to the rank owning its expert, laid out expert-major for a grouped GEMM,
and ``moe_combine`` brings the experts' outputs back, summed with the routing weights in fp32.
docs/api.md (MoE) is the reference: layout, the bounded and unbounded variants, fp8 dispatch,
the checks, autograd, and the strategies (``sequential``, ``symm``, ``local``).

Modules: ``api`` (the public functions, autograd, the dispatcher ops), ``handle`` (MoeHandle,
the shared names and row pieces), ``checks``, ``strategies`` (the choice and the
implementations), one module per strategy (``all_to_all``: the ``sequential`` strategy; ``symm``,
``local``), ``fp8`` and ``reference``. The names below are the package's interface (``flux.ops.moe.<name>``).
The tensor-parallel MoE ops (``tp_routing``, ``tp_strategies``, ``tp``) are imported on first use.
"""
from flux.ops.moe import local, symm  # noqa: F401  (the strategies' modules)
from flux.ops.moe.api import moe_combine, moe_dispatch
from flux.ops.moe.checks import _check_combine  # noqa: F401
from flux.ops.moe.fp8 import FP8_BLOCK, FP8_DTYPE, _pack_fp8, _packed_width, _unpack_fp8, dequantize_fp8, quantize_fp8
from flux.ops.moe.handle import OP, OP_COMBINE, STRATEGIES, MoeHandle
from flux.ops.moe.reference import moe_combine_ref, moe_dispatch_ref
from flux.ops.moe.strategies import (_LOCAL_PLANS, STRATEGY_ENV, _choose_strategy, _dispatch_impl,  # noqa: F401
                                     available_strategies, run_strategy)
from flux.runtime import group_name  # noqa: F401  (tests name groups through the module)

__all__ = ["FP8_BLOCK", "FP8_DTYPE", "OP", "OP_COMBINE", "STRATEGIES", "STRATEGY_ENV", "MoeHandle",
           "available_strategies", "dequantize_fp8", "moe_combine", "moe_combine_ref", "moe_dispatch",
           "moe_dispatch_ref", "quantize_fp8", "run_strategy"]
