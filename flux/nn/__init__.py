"""Tensor-parallel drop-in layers built on flux's overlapped ops.

    ColumnParallelLinear   y = all_gather(x, dim 0) @ W_shard^T + b_shard   (flux.ag_gemm)
    RowParallelLinear      y = reduce_scatter(x @ W_shard^T, dim 0) + b     (flux.gemm_rs)

With sequence parallelism (Megatron's layout), activations between the two are sharded on
dim 0 (the sequence); a Column -> activation -> Row pair is an MLP whose only communication is
the all-gather and the reduce-scatter that flux overlaps with the GEMMs. Both layers are
ordinary nn.Modules with autograd (the backward of one op is the other op).
"""
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from flux.ops.ag_gemm import ag_gemm
from flux.ops.gemm_rs import gemm_rs
from flux.nn._init import _shared_seed, uniform_lines  # noqa: F401  (uniform_lines: part of flux.nn)
from flux.nn.moe import MoE
from flux.runtime import resolve_group


def _shard(t: torch.Tensor, dim: int, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % world:
        raise ValueError(f"flux.nn: {what} has {t.shape[dim]} along dim {dim}, not divisible by the group size {world}")
    return t.chunk(world, dim=dim)[rank].contiguous()


class _ParallelLinear(nn.Module):
    """The shared part: a (sharded) weight, an optional bias, the group. ``_weight_dim`` is the
    weight dimension split over the group; ``_bias_split`` whether the bias is split too.

    Initialisation is nn.Linear's distribution (U(-1/sqrt(in_features), 1/sqrt(in_features)) for
    the weight and the bias), made shard by shard: each rank allocates and draws only its own
    shard, and for a given ``seed`` the shards of any group size are slices of the same full
    layer (the weight drawn line by line along the split dimension). ``seed=None``: the group's
    first rank draws one from its default generator and broadcasts it (a collective)."""

    _weight_dim: int
    _bias_split: bool

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Optional[dist.ProcessGroup] = None, device=None, dtype=None, seed: Optional[int] = None):
        super().__init__()
        name = f"flux.nn.{type(self).__name__}"
        self.group = resolve_group(group, name)
        self.in_features, self.out_features = in_features, out_features
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self._check_split(name, world)
        seed = _shared_seed(seed, self.group)
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        opts = dict(device=device, dtype=dtype if dtype is not None else torch.get_default_dtype())
        if self._weight_dim == 0:  # [out/W, in]: this rank's lines (rows) of the full weight
            per = out_features // world
            w = uniform_lines(seed, rank * per, per, in_features, bound)
        else:  # [out, in/W]: drawn as lines of the transposed weight, [in/W, out]
            per = in_features // world
            w = uniform_lines(seed, rank * per, per, out_features, bound).t()
        self.weight = nn.Parameter(w.to(**opts).contiguous())
        if not bias:
            self.bias = None
        else:
            full = uniform_lines(seed ^ 0x5BD1E995, 0, 1, out_features, bound)[0]  # the full bias, O(out)
            b = full.chunk(world)[rank] if self._bias_split else full
            self.bias = nn.Parameter(b.to(**opts).contiguous())

    def _check_split(self, name: str, world: int) -> None:
        split = (self.out_features, "out_features") if self._weight_dim == 0 else (self.in_features, "in_features")
        if split[0] % world:
            raise ValueError(f"{name}: {split[1]}={split[0]} is not divisible by the group size {world}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[dist.ProcessGroup] = None):
        """This rank's shard of an existing (replicated) nn.Linear."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m._take(linear, group)
        return m

    def _take(self, linear: nn.Linear, group: Optional[dist.ProcessGroup]) -> None:
        name = f"flux.nn.{type(self).__name__}"
        self.group = resolve_group(group, name)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._check_split(name, dist.get_world_size(self.group))
        self.weight = nn.Parameter(_shard(linear.weight.data, self._weight_dim, self.group, "weight"))
        if linear.bias is None:
            self.bias = None
        elif self._bias_split:
            self.bias = nn.Parameter(_shard(linear.bias.data, 0, self.group, "bias"))
        else:
            self.bias = nn.Parameter(linear.bias.data.clone())

    def extra_repr(self) -> str:
        per = self.weight.shape[self._weight_dim]
        ins = f"in_features={self.in_features}" + (f" ({per} per rank)" if self._weight_dim == 1 else "")
        outs = f"out_features={self.out_features}" + (f" ({per} per rank)" if self._weight_dim == 0 else "")
        return f"{ins}, {outs}, bias={self.bias is not None}"


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the output features split over ``group``
    and the input sharded on dim 0 (sequence parallel): input ``[M/W, ..., in_features]``,
    output ``[M, ..., out_features / W]``. Weight ``[out_features / W, in_features]``, bias
    ``[out_features / W]``."""

    _weight_dim, _bias_split = 0, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ag_gemm(x, self.weight, self.bias, group=self.group)


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the input features split over ``group``
    and the output reduce-scattered on dim 0 (sequence parallel): input
    ``[M, ..., in_features / W]``, output ``[M/W, ..., out_features]``. Weight
    ``[out_features, in_features / W]``; the bias is replicated and added once, after the
    reduction (its gradient is this rank's rows' share: sum it over the group, as Megatron
    does for sequence-parallel parameters)."""

    _weight_dim, _bias_split = 1, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm_rs(x, self.weight, self.bias, group=self.group)


__all__ = ["ColumnParallelLinear", "MoE", "RowParallelLinear"]
