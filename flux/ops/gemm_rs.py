"""flux.gemm_rs: the reduce-scatter after a row-parallel GEMM.

Meaning (the unfused reference, ``gemm_rs_ref``)::

    out = reduce_scatter(input @ W, dim=0) (+ bias)

The bias is added once, after the reduction, as Megatron's RowParallelLinear does. The
op is ``torch.ops.flux.gemm_rs``, with a fake implementation for torch.compile and an
autograd formula (backward is an AllGather+GEMM for the input's gradient and a local
GEMM for the weight's). Strategies, chosen per call by flux.autotune:

  sequential   one GEMM, then NCCL reduce-scatter (gloo: all-reduce and slice), then the
               bias. The reference, the CPU path and the fallback.
"""
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from flux import autotune
from flux.ops._checks import Signature, check_collectively
from flux.ops._common import check_gemm_args, local_gemm, weight_nk_shape
from flux.runtime import group_device, group_from_name, group_name, reduce_scatter_dim0, resolve_group

OP = "flux.gemm_rs"

Strategy = Callable[..., torch.Tensor]


def _sequential(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    n, k = weight_nk_shape(weight, weight_layout)
    partial = local_gemm(input.reshape(-1, k), weight, None, weight_layout, out_dtype)
    out = reduce_scatter_dim0(partial.reshape(*input.shape[:-1], n), group)
    if bias is not None:
        out += bias
    return out


STRATEGIES: Dict[str, Strategy] = {"sequential": _sequential}


def available_strategies(device: torch.device):
    """Names of the strategies that can run on ``device`` (always 'sequential' first)."""
    return [name for name in STRATEGIES if name == "sequential" or device.type == "cuda"]


def gemm_rs_ref(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``reduce_scatter(input @ W, dim=0) (+ bias)`` with torch.matmul and torch.distributed, unchecked."""
    return _sequential(input, weight, bias, resolve_group(group, OP), weight_layout, out_dtype)


def _check(input, weight, bias, group, weight_layout, out_dtype) -> None:
    sig = Signature(OP)
    check_gemm_args(sig, input, weight, bias, weight_layout, out_dtype, group_device(group).type)
    world = dist.get_world_size(group)
    if input.dim() >= 1 and input.shape[0] % world != 0:
        sig.fail(f"input.shape[0] = {input.shape[0]} (M) is not divisible by the group size {world}")
    check_collectively(sig, group)


def run_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                 out_dtype: Optional[torch.dtype] = None, check: bool = True) -> torch.Tensor:
    """Run one named strategy (benchmarks, tests, the autotuner): same arguments and
    result as ``flux.gemm_rs``, bypassing the dispatcher and the strategy choice."""
    group = resolve_group(group, OP)
    if name not in STRATEGIES:
        raise ValueError(f"{OP}: unknown strategy {name!r}; known: {sorted(STRATEGIES)}")
    if check:
        _check(input, weight, bias, group, weight_layout, out_dtype)
    return STRATEGIES[name](input, weight, bias, group, weight_layout, out_dtype)


@torch.library.custom_op("flux::gemm_rs", mutates_args=())
def _gemm_rs_op(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                weight_layout: str, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    group = group_from_name(group_name)
    _check(input, weight, bias, group, weight_layout, out_dtype)
    n, k = weight_nk_shape(weight, weight_layout)
    rows = input.numel() // input.shape[-1] if input.shape[-1] else 0
    name = autotune.choose("gemm_rs", available_strategies(input.device), m=rows, n=n, k=k,
                           dtype=input.dtype, world=dist.get_world_size(group))
    return STRATEGIES[name](input, weight, bias, group, weight_layout, out_dtype)


@_gemm_rs_op.register_fake
def _gemm_rs_fake(input, weight, bias, group_name, weight_layout, out_dtype):
    world = dist.get_world_size(group_from_name(group_name))
    n, _ = weight_nk_shape(weight, weight_layout)
    return input.new_empty((input.shape[0] // world, *input.shape[1:-1], n), dtype=out_dtype or input.dtype)


def _setup_context(ctx, inputs, output):
    input, weight, bias, gname, weight_layout, out_dtype = inputs
    ctx.gname, ctx.weight_layout, ctx.has_bias = gname, weight_layout, bias is not None
    ctx.save_for_backward(input, weight)


def _backward(ctx, grad_out):
    from flux.ops.ag_gemm import ag_gemm  # the two op families are each other's backward

    input, weight = ctx.saved_tensors
    group = group_from_name(ctx.gname)
    layout = ctx.weight_layout
    n, k = weight_nk_shape(weight, layout)
    grad_out = grad_out.to(input.dtype).contiguous()
    grad_input = grad_weight = grad_bias = None
    need_w = ctx.needs_input_grad[1]
    if ctx.needs_input_grad[0] or need_w:
        # d input = all_gather(grad_out) @ W: W [N, K] read as [K_in=N, N_out=K] is the other layout.
        grad_input, gathered = ag_gemm(grad_out, weight, group=group, weight_layout="kn" if layout == "nk" else "nk",
                                       return_gathered=True)
        if need_w:
            g2d, a2d = gathered.reshape(-1, n), input.reshape(-1, k)
            grad_weight = g2d.t() @ a2d if layout == "nk" else a2d.t() @ g2d
        if not ctx.needs_input_grad[0]:
            grad_input = None
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_out.reshape(-1, n).sum(0)
    return grad_input, grad_weight, grad_bias, None, None, None


torch.library.register_autograd("flux::gemm_rs", _backward, setup_context=_setup_context)


def gemm_rs(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
            out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Multiply ``input`` by ``weight``, sum the products over ``group`` and keep this rank's rows.

    Same as ``reduce_scatter(input @ W, dim=0) (+ bias)`` (see ``gemm_rs_ref``).

    Args:
        input: ``[M, K_local]`` or N-D ``[M, ..., K_local]`` (scattered on dim 0); M divisible
            by the group size; contiguous; bf16, fp16, fp32 (or fp64 through the reference).
        weight: this rank's ``[N, K_local]`` (``weight_layout="nk"``, as ``nn.Linear.weight``)
            or ``[K_local, N]`` (``"kn"``); contiguous; same dtype as ``input``.
        bias: ``[N]`` in the output dtype, added once after the reduction, or None.
        group: the tensor-parallel process group (default: the world).
        weight_layout: ``"nk"`` or ``"kn"``.
        out_dtype: dtype of the result (default: ``input.dtype``).

    Returns:
        ``[M / world, ..., N]``: rows ``rank * M / world`` to ``(rank + 1) * M / world`` of the sum.

    Raises:
        FluxInputError, on every rank of the group alike and before any data moves, when
        the arguments are invalid on some rank or differ between ranks.
    """
    group = resolve_group(group, OP)
    return torch.ops.flux.gemm_rs(input, weight, bias, group_name(group), weight_layout, out_dtype)
