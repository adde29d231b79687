"""flux: fused compute-communication kernels for tensor-parallel PyTorch layers.

Public API:
    flux.ag_gemm(input, weight, bias=None, *, group=None, weight_layout="nk", out_dtype=None,
                 return_gathered=False, out=None)    all_gather(input, dim=0) @ W (+ bias)
    flux.gemm_rs(input, weight, bias=None, *, group=None, weight_layout="nk", out_dtype=None, out=None)
                                             reduce_scatter(input @ W, dim=0) (+ bias)
    flux.ag_gemm_ref, flux.gemm_rs_ref       their unfused references
    flux.moe_dispatch(x, topk_idx, topk_weights, num_experts, *, group=None, max_tokens_per_rank=None,
                      fp8=False, zero_pad=False, read_counts=True)
                                             -> (recv_x, counts, handle): expert-parallel MoE dispatch
    flux.moe_combine(y, handle) -> out       its inverse, summing with the routing weights
    flux.moe_dispatch_ref, flux.moe_combine_ref, flux.MoeHandle
    flux.FluxInputError                      bad arguments, raised alike on every rank
    flux.cuda_kernels_available()            whether flux's CUDA kernels can run here (flux._C
                                             loaded and a GPU visible)
    flux.ag_scatter_grouped_mm, flux.grouped_mm_gather_rs, flux.TpMoeRouting (and the _refs)
                                             the tensor-parallel MoE MLP's two halves (imported on first use)
    flux.nn.ColumnParallelLinear, flux.nn.RowParallelLinear, flux.nn.MoE    tensor-parallel and MoE layers
                                             (flux.nn is imported on first use)
    flux.integrations.megatron / .compile / .vllm    framework adapters (imported on first use)
"""
from flux._version import __version__
from flux.runtime import cuda_kernels_available, extension_error

extension_error()  # load flux._C (if built) before the ops are used

from flux.ops._checks import FluxInputError  # noqa: E402
from flux.ops.ag_gemm import ag_gemm, ag_gemm_ref  # noqa: E402
from flux.ops.gemm_rs import gemm_rs, gemm_rs_ref  # noqa: E402
from flux.ops.moe import MoeHandle, moe_combine, moe_combine_ref, moe_dispatch, moe_dispatch_ref  # noqa: E402

# The TP MoE ops are imported on first use: their module applies torch.compiler.disable, which
# imports torch._dynamo (seconds; more than half of ``import torch`` again).
_TP_MOE = ("TpMoeRouting", "ag_scatter_grouped_mm", "ag_scatter_grouped_mm_ref", "grouped_mm_gather_rs",
           "grouped_mm_gather_rs_ref")


def __getattr__(name):
    # Submodules imported on first use: ``import flux`` then ``flux.nn.ColumnParallelLinear``.
    import importlib

    if name in ("nn", "integrations"):
        return importlib.import_module(f"flux.{name}")
    if name in _TP_MOE:
        value = getattr(importlib.import_module("flux.ops.moe.tp"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flux' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | {"nn", "integrations"})


__all__ = [
    "FluxInputError",
    "MoeHandle",
    "TpMoeRouting",
    "__version__",
    "ag_gemm",
    "ag_gemm_ref",
    "ag_scatter_grouped_mm",
    "ag_scatter_grouped_mm_ref",
    "cuda_kernels_available",
    "gemm_rs",
    "gemm_rs_ref",
    "grouped_mm_gather_rs",
    "grouped_mm_gather_rs_ref",
    "moe_combine",
    "moe_combine_ref",
    "moe_dispatch",
    "moe_dispatch_ref",
]
