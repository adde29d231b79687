"""Process groups, collectives used by the references, and the CUDA extension loader.

Everything here sits below flux.ops: nothing in this package imports an op module.
"""
from flux.runtime.extension import cuda_kernels_available, extension_error
from flux.runtime.groups import (
    all_gather_dim0,
    differentiable_all_gather_dim0,
    differentiable_reduce_scatter_dim0,
    gloo_carries_cuda,
    group_device,
    group_from_name,
    group_name,
    reduce_scatter_dim0,
    resolve_group,
    traceable_all_gather_dim0,
    traceable_reduce_scatter_dim0,
)

__all__ = [
    "all_gather_dim0",
    "cuda_kernels_available",
    "differentiable_all_gather_dim0",
    "differentiable_reduce_scatter_dim0",
    "extension_error",
    "gloo_carries_cuda",
    "group_device",
    "group_from_name",
    "group_name",
    "reduce_scatter_dim0",
    "resolve_group",
    "traceable_all_gather_dim0",
    "traceable_reduce_scatter_dim0",
]
