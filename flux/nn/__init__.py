"""Tensor-parallel drop-in layers built on flux's overlapped ops.

    ColumnParallelLinear   y = all_gather(x, dim 0) @ W_shard^T + b_shard   (flux.ag_gemm)
    RowParallelLinear      y = reduce_scatter(x @ W_shard^T, dim 0) + b     (flux.gemm_rs)

With sequence parallelism (Megatron's layout), activations between the two are sharded on
dim 0 (the sequence); a Column -> activation -> Row pair is an MLP whose only communication is
the all-gather and the reduce-scatter that flux overlaps with the GEMMs. Both layers are
ordinary nn.Modules with autograd (the backward of one op is the other op).
"""
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from flux.ops.ag_gemm import ag_gemm
from flux.ops.gemm_rs import gemm_rs
from flux.runtime import resolve_group


def _shard(t: torch.Tensor, dim: int, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % world:
        raise ValueError(f"flux.nn: {what} has {t.shape[dim]} along dim {dim}, not divisible by the group size {world}")
    return t.chunk(world, dim=dim)[rank].contiguous()


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the output features split over ``group``
    and the input sharded on dim 0 (sequence parallel): input ``[M/W, ..., in_features]``,
    output ``[M, ..., out_features / W]``. Weight ``[out_features / W, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Optional[dist.ProcessGroup] = None, device=None, dtype=None):
        super().__init__()
        self.group = resolve_group(group, "flux.nn.ColumnParallelLinear")
        world = dist.get_world_size(self.group)
        if out_features % world:
            raise ValueError(f"flux.nn.ColumnParallelLinear: out_features={out_features} is not divisible by "
                             f"the group size {world}")
        self.in_features, self.out_features = in_features, out_features
        full = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = nn.Parameter(_shard(full.weight.data, 0, self.group, "weight"))
        self.bias = nn.Parameter(_shard(full.bias.data, 0, self.group, "bias")) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[dist.ProcessGroup] = None) -> "ColumnParallelLinear":
        """This rank's shard of an existing (replicated) nn.Linear."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.group = resolve_group(group, "flux.nn.ColumnParallelLinear")
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight = nn.Parameter(_shard(linear.weight.data, 0, m.group, "weight"))
        m.bias = nn.Parameter(_shard(linear.bias.data, 0, m.group, "bias")) if linear.bias is not None else None
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ag_gemm(x, self.weight, self.bias, group=self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.weight.shape[0]} per rank), bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the input features split over ``group``
    and the output reduce-scattered on dim 0 (sequence parallel): input
    ``[M, ..., in_features / W]``, output ``[M/W, ..., out_features]``. Weight
    ``[out_features, in_features / W]``; the bias is replicated and added once, after the
    reduction (its gradient is this rank's rows' share: sum it over the group, as Megatron
    does for sequence-parallel parameters)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Optional[dist.ProcessGroup] = None, device=None, dtype=None):
        super().__init__()
        self.group = resolve_group(group, "flux.nn.RowParallelLinear")
        world = dist.get_world_size(self.group)
        if in_features % world:
            raise ValueError(f"flux.nn.RowParallelLinear: in_features={in_features} is not divisible by "
                             f"the group size {world}")
        self.in_features, self.out_features = in_features, out_features
        full = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = nn.Parameter(_shard(full.weight.data, 1, self.group, "weight"))
        self.bias = nn.Parameter(full.bias.data.clone()) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[dist.ProcessGroup] = None) -> "RowParallelLinear":
        """This rank's shard of an existing (replicated) nn.Linear."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.group = resolve_group(group, "flux.nn.RowParallelLinear")
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight = nn.Parameter(_shard(linear.weight.data, 1, m.group, "weight"))
        m.bias = nn.Parameter(linear.bias.data.clone()) if linear.bias is not None else None
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm_rs(x, self.weight, self.bias, group=self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.weight.shape[1]} per rank), "
                f"out_features={self.out_features}, bias={self.bias is not None}")


__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
