"""flux.moe_dispatch / flux.moe_combine: the public functions, their eager autograd, and the
dispatcher ops ``torch.ops.flux.moe_dispatch`` / ``moe_combine`` / ``moe_to_experts`` (fake
implementations and registered autograd, so torch.compile reaches them). Meaning, layout,
variants, checks and gradients: docs/api.md (MoE).
"""
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from flux.ops._checks import FluxInputError
from flux.ops._common import call_mode
from flux.ops.moe import strategies as _strategies
from flux.ops.moe.checks import _check_combine
from flux.ops.moe.fp8 import _Fp8Grad, _packed_width, _unpack_fp8
from flux.ops.moe.handle import OP, STRATEGIES, MoeHandle, _acc_dtype
from flux.ops.moe.strategies import (_STRATEGY_IMPLS, _combine_backward, _combine_impl, _dispatch_backward,
                                     _dispatch_impl)
from flux.runtime import group_from_name, group_name, resolve_group


# --------------------------------------------------------------------------------------
# Eager autograd


class _DispatchFunction(torch.autograd.Function):
    """Outputs ``(recv_x, counts, handle)``; fp8: ``(recv_fp8, recv_scales, counts, handle)``, the
    gradient of recv_x then collected by dequantize_fp8 in ``ctx.fp8_grad`` (straight-through)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, num_experts, group, capacity, fp8, zero_pad, read_counts):
        recv_x, counts, handle = _dispatch_impl(x, topk_idx, topk_weights, num_experts, group, capacity, fp8=fp8,
                                                zero_pad=zero_pad, read_counts=read_counts)
        ctx.handle, ctx.x_dtype, ctx.fp8_grad = handle, x.dtype, None
        if not fp8:
            return recv_x, counts, handle
        q, scales = _unpack_fp8(recv_x, handle.hidden)
        ctx.mark_non_differentiable(q)
        ctx.fp8_grad = _Fp8Grad()
        return q, scales, counts, handle

    @staticmethod
    def backward(ctx, *grads):
        grad_x = None
        if ctx.needs_input_grad[0]:
            if ctx.fp8_grad is None:
                grad_recv = grads[0]
            else:  # straight-through: the dequantised rows' gradient; zeros if none reached them
                grad_recv = ctx.fp8_grad.take()
                if grad_recv is None:
                    grad_recv = torch.zeros(ctx.handle.recv_shape, dtype=ctx.x_dtype,
                                            device=ctx.handle.send_pairs.device)
            # Every rank runs this collective whenever autograd reaches the node, with or without
            # a gradient, as it runs the forward's.
            grad_x = _dispatch_backward(grad_recv, ctx.handle, ctx.x_dtype)
        return grad_x, None, None, None, None, None, None, None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, handle):
        out, returned = _combine_impl(y, weights, handle, need_returned=ctx.needs_input_grad[1])
        ctx.handle, ctx.y_dtype = handle, y.dtype
        # The returned rows are kept only for the weights' gradient.
        ctx.save_for_backward(weights, returned if ctx.needs_input_grad[1] else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weights, returned = ctx.saved_tensors
        grad_y, grad_w = _combine_backward(ctx.needs_input_grad[:2], grad_out, None, ctx.y_dtype, weights,
                                           returned, ctx.handle)
        return grad_y, grad_w, None


# --------------------------------------------------------------------------------------
# The dispatcher-visible ops (torch.compile, fake tensors, tensor subclasses). The handle
# travels as its tensors; the group as its name.


def _handle_from(group, num_experts, max_tokens_per_rank, topk_weights, send_pairs, recv_dest, meta, verdict,
                 recv_shape, hidden, fp8=False) -> MoeHandle:
    strategy = STRATEGIES[int(meta[0])] if meta.device.type == "cpu" and not _is_fake(meta) else STRATEGIES[0]
    t, k = topk_weights.shape
    return MoeHandle(group, strategy, num_experts, t, k, hidden, max_tokens_per_rank, topk_weights, send_pairs,
                     recv_dest, meta, verdict, tuple(recv_shape), fp8)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


@torch.library.custom_op("flux::moe_dispatch", mutates_args=())
def _moe_dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                     group_name: str, max_tokens_per_rank: Optional[int], fp8: bool = False, zero_pad: bool = False,
                     read_counts: bool = True
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8: recv_x is the received packed byte rows (uint8), which moe_dispatch splits."""
    recv_x, counts, h = _dispatch_impl(x, topk_idx, topk_weights, num_experts, group_from_name(group_name),
                                       max_tokens_per_rank, fp8=fp8, zero_pad=zero_pad, read_counts=read_counts)
    if h.strategy == "local":  # counts, verdict, send_pairs and recv_dest are views of one tensor there:
        # outputs must not alias
        return recv_x, counts.clone(), h.send_pairs.clone(), h.recv_dest.clone(), h.meta, h.verdict.clone()
    return recv_x, counts, h.send_pairs, h.recv_dest, h.meta, h.verdict


@_moe_dispatch_op.register_fake
def _moe_dispatch_fake(x, topk_idx, topk_weights, num_experts, group_name, max_tokens_per_rank, fp8=False,
                       zero_pad=False, read_counts=True):
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise FluxInputError(f"{OP}: {name} is on {t.device} but x is on {x.device}")
    group = group_from_name(group_name)
    world = dist.get_world_size(group)
    name = _strategies._choose_strategy(x, group, max_tokens_per_rank is not None, num_experts, topk_idx)
    rows = x.new_empty((x.shape[0], _packed_width(x.shape[-1])), dtype=torch.uint8) if fp8 else x
    recv_x, counts, send_pairs, recv_dest, n_host = _STRATEGY_IMPLS[name].fake_dispatch(
        rows, topk_idx, num_experts, world, max_tokens_per_rank, read_counts)
    meta = torch.empty(1 + n_host, dtype=torch.int64, device="cpu")
    return recv_x, counts, send_pairs, recv_dest, meta, torch.empty(world, dtype=torch.int64, device=x.device)


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_weights, num_experts, gname, cap = inputs[:6]
    ctx.args = (gname, num_experts, cap, tuple(topk_weights.shape), x.dtype)
    ctx.save_for_backward(*output[2:5])  # send_pairs, recv_dest, meta


def _dispatch_op_backward(ctx, grad_recv, *grad_rest):
    gname, num_experts, cap, wshape, x_dtype = ctx.args
    send_pairs, recv_dest, meta = ctx.saved_tensors
    grad_x = None
    # (an fp8 dispatch's recv_x is integer bytes: autograd gives it no gradient, grad_recv None)
    if ctx.needs_input_grad[0] and grad_recv is not None:  # combine with weights 1, through the op (traceable)
        ones = torch.ones(wshape, dtype=_acc_dtype(grad_recv.dtype), device=grad_recv.device)
        grad_x = torch.ops.flux.moe_combine(grad_recv.contiguous(), ones, send_pairs, recv_dest, meta, gname,
                                            num_experts, cap)[0].to(x_dtype)
    return grad_x, None, None, None, None, None, None, None, None


torch.library.register_autograd("flux::moe_dispatch", _dispatch_op_backward, setup_context=_dispatch_setup)


@torch.library.custom_op("flux::moe_combine", mutates_args=())
def _moe_combine_op(y: torch.Tensor, topk_weights: torch.Tensor, send_pairs: torch.Tensor, recv_dest: torch.Tensor,
                    meta: torch.Tensor, group_name: str, num_experts: int, max_tokens_per_rank: Optional[int]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    handle = _handle_from(group_from_name(group_name), num_experts, max_tokens_per_rank, topk_weights, send_pairs,
                          recv_dest, meta, torch.empty(0), y.shape, y.shape[-1])
    _check_combine(y, handle)
    out, returned = _combine_impl(y, topk_weights, handle)
    if returned is not None and returned.untyped_storage().data_ptr() == y.untyped_storage().data_ptr():
        returned = returned.clone()  # a view of y (local strategy): op outputs must not alias inputs
    return out, returned


@_moe_combine_op.register_fake
def _moe_combine_fake(y, topk_weights, send_pairs, recv_dest, meta, group_name, num_experts, max_tokens_per_rank):
    t = topk_weights.shape[0]
    return y.new_empty((t, y.shape[-1])), y.new_empty((send_pairs.shape[0], y.shape[-1]))


def _combine_setup(ctx, inputs, output):
    y, topk_weights, send_pairs, recv_dest, meta, gname, num_experts, cap = inputs
    ctx.args = (gname, num_experts, cap, tuple(y.shape), y.dtype)
    ctx.save_for_backward(topk_weights, send_pairs, recv_dest, meta, output[1])


def _combine_op_backward(ctx, grad_out, grad_returned):
    gname, num_experts, cap, y_shape, y_dtype = ctx.args
    weights, send_pairs, recv_dest, meta, returned = ctx.saved_tensors
    handle = _handle_from(group_from_name(gname), num_experts, cap, weights, send_pairs, recv_dest, meta,
                          torch.empty(0), y_shape, y_shape[-1])
    if grad_out is None:
        grad_out = returned.new_zeros((handle.num_tokens, y_shape[-1]))
    grad_y, grad_w = _combine_backward(ctx.needs_input_grad[:2], grad_out, grad_returned, y_dtype, weights, returned,
                                       handle, traceable=True)
    return grad_y, grad_w, None, None, None, None, None, None


torch.library.register_autograd("flux::moe_combine", _combine_op_backward, setup_context=_combine_setup)


@torch.library.custom_op("flux::moe_to_experts", mutates_args=())
def _moe_to_experts_op(rows: torch.Tensor, recv_dest: torch.Tensor, meta: torch.Tensor, group_name: str,
                       num_experts: int, max_tokens_per_rank: Optional[int], recv_shape: Sequence[int]) -> torch.Tensor:
    """Send rows ``[S, H]`` (send order) to recv_x's layout (``recv_shape``) on their experts'
    ranks: combine's backward for y (no autograd of its own)."""
    handle = MoeHandle(group_from_name(group_name), STRATEGIES[int(meta[0])], num_experts, 0, 1, rows.shape[-1],
                       max_tokens_per_rank, None, torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device),
                       recv_dest, meta, torch.empty(0), tuple(recv_shape))
    return _STRATEGY_IMPLS[handle.strategy].to_experts(rows.contiguous(), handle)


@_moe_to_experts_op.register_fake
def _moe_to_experts_fake(rows, recv_dest, meta, group_name, num_experts, max_tokens_per_rank, recv_shape):
    return rows.new_empty(tuple(recv_shape))


# --------------------------------------------------------------------------------------
# Public API


def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                 group: Optional[dist.ProcessGroup] = None, max_tokens_per_rank: Optional[int] = None,
                 fp8: bool = False, zero_pad: bool = False, read_counts: bool = True):
    """Send each token to the ranks owning the experts it is routed to (expert parallelism).

    Args:
        x: ``[T, H]`` this rank's tokens; bf16, fp16, fp32 or fp64. T may differ between ranks
            (T = 0 allowed); H must not.
        topk_idx: ``[T, K]`` int64 or int32: global expert ids in ``[0, num_experts)``, or -1
            (no expert: the slot is skipped). A row lists an expert at most once.
        topk_weights: ``[T, K]`` floating: the routing weights, used by ``moe_combine`` (kept in
            the handle; their gradient flows through combine).
        num_experts: E, divisible by the group size W; rank r owns the global experts
            ``[r * E_l, (r + 1) * E_l)``, ``E_l = E / W``.
        group: the expert-parallel process group (default: the world).
        max_tokens_per_rank: None (unbounded variant) or C >= every rank's T (bounded variant:
            fixed shapes, no host synchronisation).
        fp8: quantise x to float8_e4m3fn with one fp32 scale per 128 elements (``quantize_fp8``)
            and move that (H + H/32 bytes per row instead of 2H for bf16); x bf16, fp16 or fp32,
            H a multiple of 128; the same on every rank.
        zero_pad: bounded variant (and ``read_counts=False``) only. False (default): recv_x's
            rows past each expert's count may be left unwritten, their contents undefined (every
            row when ``handle.check()`` reports an error), as DeepEP's low-latency layout leaves
            them: for expert kernels that read ``counts`` (a masked grouped GEMM:
            ``grouped_mm_padded(..., counts, skip_padding=True)``), or row-wise expert computation
            whose padding outputs combine never reads. True: those rows are zeros, for batched
            GEMMs over whole slabs with autograd through the experts' weights (a garbage row
            times a zero gradient can be NaN). The zeros are most of what a decode dispatch
            writes with many experts (E = 64, C = 128, top-8: 7/8 of recv_x's rows) and bound
            its time (103 of 117 MB at H = 7168 on one rank). Need not agree across ranks.
        read_counts: unbounded variant on a group of one rank (every expert on this GPU) only.
            True (default): the counts are read on the host (one synchronisation), which sizes
            recv_x to the R rows routed. False: nothing is read: recv_x has T * K rows, the worst
            case, the first R grouped by expert as above and the rest padding (zeros with
            ``zero_pad=True``); counts stay on the device, ``handle.counts_host`` is None, and
            invalid ids or duplicates are reported through ``handle.check()`` (every count zero),
            as in the bounded variant. For callers whose ids are valid by construction (a top-k
            router: R = T * K) and whose expert kernels take device counts. Ignored on larger
            groups, where the receive size needs the peers' counts.

    Returns:
        ``(recv_x, counts, handle)``:

        recv_x: in x's dtype, on x's device: one row per (token, slot) pair routed here, grouped
            by local expert (0 first), within an expert by source rank (0 .. W-1), then by the
            token's index on its source, then by slot k. Unbounded: ``[R, H]``, R the number of
            such rows. Bounded: ``[E_l, W * C, H]``, expert e's rows first in ``recv_x[e]``, the
            rest undefined (zero with ``zero_pad=True``). fp8: the pair ``(recv_fp8,
            recv_scales)``, float8_e4m3fn ``[R, H]`` (bounded ``[E_l, W * C, H]``) and float32 ``[R, H / 128]`` (``[E_l, W * C, H / 128]``), each row's
            values and block scales exactly as ``quantize_fp8`` of its token gives them on the
            source; ``dequantize_fp8(recv_fp8, recv_scales)`` is the rows in bf16.
        counts: ``[E_l]`` int64 on x's device: rows per local expert.
        handle: a ``MoeHandle`` for ``moe_combine``; ``handle.counts_host`` is counts as a list
            (unbounded; None when bounded or ``read_counts=False``).

    Autograd: d x is the sum of the gradients of the token's copies. With fp8 it is
    straight-through: the gradient that reaches ``dequantize_fp8(recv_fp8, recv_scales)``'s
    output is taken as the copies' gradient (the quantisation's rounding ignored) and summed back
    in its dtype, exactly as without fp8; recv_fp8 itself carries none, and so does recv_scales
    used other than through dequantize_fp8. Eager calls only: through the dispatcher ops
    (torch.compile, torch-function modes, tensor subclasses) an fp8 dispatch is not
    differentiable, and an x that needs a gradient there raises FluxInputError.

    Raises:
        FluxInputError, on every rank alike and before any row moves, when some rank's
        arguments are invalid (fp8: x's dtype, H not a multiple of 128) or the ranks disagree on
        num_experts, max_tokens_per_rank, fp8, H, K or the dtypes (the bounded variant on CUDA
        groups reports invalid ids, duplicates and T > C through ``handle.check()`` instead,
        having sent nothing).
    """
    group = resolve_group(group, OP)
    fp8, zero_pad, read_counts = bool(fp8), bool(zero_pad), bool(read_counts)
    mode = call_mode(x, topk_idx, topk_weights)
    if mode == 0:
        recv_x, counts, handle = _dispatch_impl(x, topk_idx, topk_weights, num_experts, group, max_tokens_per_rank,
                                                fp8=fp8, zero_pad=zero_pad, read_counts=read_counts)
        return (_unpack_fp8(recv_x, handle.hidden) if fp8 else recv_x), counts, handle
    if mode == 1:
        out = _DispatchFunction.apply(x, topk_idx, topk_weights, num_experts, group, max_tokens_per_rank, fp8,
                                      zero_pad, read_counts)
        recv_x, (counts, handle) = (out[:2] if fp8 else out[0]), out[-2:]
        handle.topk_weights = topk_weights  # the caller's tensor, with its autograd history
        return recv_x, counts, handle
    if fp8 and torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
        raise FluxInputError(f"{OP}: fp8=True is not differentiable through the dispatcher ops (torch.compile, "
                             "torch-function modes, tensor subclasses); call it eagerly for the straight-through "
                             "gradient, or pass x.detach()")
    recv_x, counts, send_pairs, recv_dest, meta, verdict = torch.ops.flux.moe_dispatch(
        x, topk_idx, topk_weights, num_experts, group_name(group), max_tokens_per_rank, fp8, zero_pad, read_counts)
    h = x.shape[-1]
    handle = _handle_from(group, num_experts, max_tokens_per_rank, topk_weights, send_pairs, recv_dest, meta, verdict,
                          tuple(recv_x.shape[:-1]) + (h,), h, fp8)
    return (_unpack_fp8(recv_x, h) if fp8 else recv_x), counts, handle


def moe_combine(y: torch.Tensor, handle: MoeHandle) -> torch.Tensor:
    """Bring the experts' outputs back to their tokens and sum them with the routing weights.

    Args:
        y: the experts' outputs in ``recv_x``'s layout and shape (``[R, H]`` or ``[E_l, W * C,
            H]``), any floating dtype, on the dispatch's device. Bounded: rows past
            ``counts[e]`` are ignored.
        handle: the ``MoeHandle`` of the matching ``moe_dispatch`` (same group, every rank).

    Returns:
        out: ``[T, H]`` in y's dtype, in this rank's token order:
        ``out[t] = sum over valid k of topk_weights[t, k] * y[row of (t, k)]``, accumulated in
        fp32 (fp64 for fp64 y) slot by slot from k = 0, then cast; zero for a token without a
        valid slot.

    Raises:
        FluxInputError, locally and before communicating, when y does not match the handle.
    """
    _check_combine(y, handle)
    weights = handle.topk_weights
    mode = call_mode(y, weights)
    if mode == 0:
        return _combine_impl(y, weights, handle, need_returned=False)[0]
    if mode == 1:
        return _CombineFunction.apply(y, weights, handle)
    return torch.ops.flux.moe_combine(y, weights, handle.send_pairs, handle.recv_dest, handle.meta,
                                      group_name(handle.group), handle.num_experts, handle.max_tokens_per_rank)[0]
