"""Process-group helpers and the plain collectives the reference paths use.

Ops take a ``torch.distributed`` process group; the dispatcher-visible schemas take its
name (a string), as PyTorch's own symmetric-memory and functional-collective ops do.
"""
from typing import Optional

import torch
import torch.distributed as dist


def resolve_group(group: Optional[dist.ProcessGroup], op: str) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialized (call dist.init_process_group first)")
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return group


def group_name(group: dist.ProcessGroup) -> str:
    return group.group_name


def group_from_name(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def gloo_carries_cuda() -> bool:
    """Ranks sharing a GPU (``FLUX_GLOO_CUDA=1``, tests only; see flux.testing)."""
    from flux import envs

    return envs.GLOO_CUDA.get()


def cuda_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` communicates CUDA tensors: NCCL groups, and gloo groups under
    ``FLUX_GLOO_CUDA=1``."""
    if not torch.cuda.is_available():
        return False
    backend = str(dist.get_backend(group)).lower()
    return "nccl" in backend or ("gloo" in backend and gloo_carries_cuda())


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device on which small collectives of this group run: CUDA for NCCL groups
    (the current device), the CPU otherwise (see ``cuda_group``)."""
    if cuda_group(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_gloo(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def all_gather_dim0(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """torch.cat([t from rank 0, ..., t from rank W-1], dim=0)."""
    t = t.contiguous()
    world = dist.get_world_size(group)
    if _is_gloo(group) and t.is_cuda:  # FLUX_GLOO_CUDA: gloo gathers host copies
        return all_gather_dim0(t.cpu(), group).to(t.device)
    out = t.new_empty((t.shape[0] * world, *t.shape[1:]))
    if _is_gloo(group):
        dist.all_gather(list(out.chunk(world, dim=0)), t, group=group)
    else:
        dist.all_gather_into_tensor(out, t, group=group)
    return out


def reduce_scatter_dim0(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """sum over ranks of t, then this rank's chunk of dim 0 (t.shape[0] divisible by W)."""
    t = t.contiguous()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if _is_gloo(group) and t.is_cuda:  # FLUX_GLOO_CUDA: gloo reduces host copies
        return reduce_scatter_dim0(t.cpu(), group).to(t.device)
    if _is_gloo(group):
        # gloo has no reduce-scatter: all-reduce, then keep this rank's rows.
        t = t.clone()  # all_reduce works in place: never overwrite the caller's tensor
        dist.all_reduce(t, group=group)
        return t.chunk(world, dim=0)[rank].clone()
    out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
    dist.reduce_scatter_tensor(out, t, group=group)
    return out


def traceable_all_gather_dim0(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_gather_dim0 through functional collectives, which torch.compile can trace (used
    in backward formulas, which AOT autograd traces)."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_gather_tensor(t.contiguous(), 0, group))


def traceable_reduce_scatter_dim0(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """reduce_scatter_dim0 through functional collectives (see traceable_all_gather_dim0)."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.reduce_scatter_tensor(t.contiguous(), "sum", 0, group))


class _Dim0Collective(torch.autograd.Function):
    """all_gather_dim0 (``gather``) or reduce_scatter_dim0, each the other's backward."""

    @staticmethod
    def forward(ctx, t, group, gather):
        ctx.group, ctx.gather = group, gather
        return (all_gather_dim0 if gather else reduce_scatter_dim0)(t, group)

    @staticmethod
    def backward(ctx, grad):
        return (reduce_scatter_dim0 if ctx.gather else all_gather_dim0)(grad, ctx.group), None, None


def differentiable_all_gather_dim0(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``all_gather_dim0`` with autograd: its backward is the reduce-scatter of the gradient
    (Megatron's sequence-parallel gather; the unfused references and the baselines use it)."""
    return _Dim0Collective.apply(t, group, True)


def differentiable_reduce_scatter_dim0(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``reduce_scatter_dim0`` with autograd: its backward is the all-gather of the gradient."""
    return _Dim0Collective.apply(t, group, False)
