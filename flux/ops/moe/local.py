"""The ``local`` strategy of flux.moe_dispatch / flux.moe_combine: a group of one rank on CUDA.

Every expert is on this GPU, so a dispatch is a permutation: the layout kernels (per-expert
counts, each (token, slot) pair's row, each row's pair; csrc/moe/moe_local.cu) and one kernel
that copies each token once to its rows (bounded, up to 16384 block counts: two launches in all).
The send order is the receive order (W = 1), so the handle's tensors are:

    send_pairs  int64 ``[R]`` (bounded ``[E * C]``): the pair ``t * K + k`` of each row of recv_x
                viewed as ``[-1, H]``; padding rows hold ``T * K``
    recv_dest   int64 ``[T * K]``: the row of each pair, -1 for none (the inverse of send_pairs)

and to_sources / to_experts are views. Combine is one kernel (fp32, slot 0 first), its backward
one kernel (d y and d topk_weights in one pass over the rows), and the dispatch's backward the
combine kernel with weights 1. The data verdict (ids outside [-1, E), an expert twice in a
token) is computed by the layout kernels: the unbounded variant reads it with the counts (its one
host read) and raises; the bounded one reports it through ``handle.check()`` (no host read: it
captures in a CUDA graph), every count zero and every row zero. Nothing here runs at W > 1; the
layout and row kernels are the receive side of any expert-parallel dispatch.
"""
from typing import Optional

import torch
import torch.distributed as dist

NAME = "local"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_EXPERTS = 1024  # csrc/moe/moe_local.cu: kMaxLocalExperts (the scan block holds one per expert)
_MAX_TOPK = 64  # kMaxTopk (combine stages a token's K rows in shared memory)


def usable(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """None where the strategy can run (a group of one rank on a GPU with flux's kernels), else
    why not; it depends on the group and the device type only (the same on every rank)."""
    if device.type != "cuda":
        return f"{device.type} group"
    if dist.get_world_size(group) != 1:
        return "more than one rank (the local strategy moves rows within one GPU)"
    if not hasattr(torch.ops.flux, "moe_local_dispatch"):
        return "flux._C without moe_local_dispatch (build flux with CUDA)"
    return None


def fits(num_experts, topk_idx) -> bool:
    """Whether the kernels take this shape (else the caller uses another strategy)."""
    return (isinstance(num_experts, int) and 1 <= num_experts <= _MAX_EXPERTS and isinstance(topk_idx, torch.Tensor)
            and topk_idx.dim() == 2 and 1 <= topk_idx.shape[1] <= _MAX_TOPK)


class LocalStrategy:
    """See the module docstring; the methods follow flux/ops/moe/strategies.py's strategy protocol."""

    name = NAME
    checks_data = True  # the layout kernels compute the data verdict (no separate check pass)

    @staticmethod
    def dispatch_local(x, topk_idx, num_experts, capacity, host_code, zero_pad, read_counts=True):
        """``(recv_x, counts, send_pairs, recv_dest, counts_host or None, verdict, code)``.
        Unbounded: one C++ call queues the layout, a copy of the counts and the verdict to pinned
        host memory, and the rows' move into a buffer of the worst case's T * K rows, then waits
        for the copy alone (the rows still moving: the GPU does not wait for the host's work
        after the read); ``code`` is that verdict (the caller
        raises when nonzero; recv_x is then None, and nothing moved: every pair rowless); recv_x
        and send_pairs are the first sum(counts) rows (views; rows of dropped slots, -1, are the
        buffer's unused tail). Bounded, or unbounded with ``read_counts=False`` (recv_x the whole
        buffer, rows past the counts' sum padding): nothing is read, code None, and the kernels'
        outputs are used as they come (counts and verdict views of one tensor)."""
        if capacity is not None or not read_counts:
            recv, counts, verdict, pair_row, send_pairs, _ = torch.ops.flux.moe_local_dispatch(
                x, topk_idx, num_experts, -2 if capacity is None else capacity, host_code, zero_pad)
            return recv, counts, send_pairs, pair_row, None, verdict, None
        recv, counts, verdict, pair_row, send_pairs, info = torch.ops.flux.moe_local_dispatch(
            x, topk_idx, num_experts, -3, host_code, False)
        host = info.tolist()  # the host copy the C++ call read
        code = host[num_experts]
        if code:
            return None, counts, send_pairs, pair_row, None, verdict, code
        return recv, counts, send_pairs, pair_row, host[:num_experts], verdict, 0

    @staticmethod
    def fake_dispatch(x, topk_idx, num_experts, world, capacity, read_counts=True):
        t, k = topk_idx.shape
        h = x.shape[-1]
        i64 = dict(dtype=torch.int64, device=x.device)
        if capacity is None and not read_counts:  # the worst case, T * K rows, nothing on the host
            return (x.new_empty((t * k, h)), torch.empty(num_experts, **i64), torch.empty(t * k, **i64),
                    torch.empty(t * k, **i64), 0)
        if capacity is None:
            r = torch.library.get_ctx().new_dynamic_size()
            return (x.new_empty((r, h)), torch.empty(num_experts, **i64), torch.empty(r, **i64),
                    torch.empty(t * k, **i64), num_experts)
        n = num_experts * capacity
        return (x.new_empty((num_experts, capacity, h)), torch.empty(num_experts, **i64), torch.empty(n, **i64),
                torch.empty(t * k, **i64), 0)

    @staticmethod
    def to_sources(y, handle):
        """recv_x-layout rows -> ``[S, H]`` in send order: the same rows (a copy, so that a
        dispatcher op never returns a view of its input)."""
        return y.reshape(-1, y.shape[-1]).clone()

    @staticmethod
    def to_experts(rows, handle):
        return rows.reshape(*handle.recv_shape[:-1], rows.shape[-1]).clone()

    @staticmethod
    def kernel_dtype(dtype: torch.dtype) -> bool:
        return dtype in _KERNEL_DTYPES

    @staticmethod
    def combine(y, weights, handle, need_returned):
        """(out ``[T, H]``, y's rows ``[S, H]`` (a view of y) or None). One C++ entry: the kernel
        takes y in recv_x's layout and the weights in their own dtype (converted to fp32 there
        only where they are not fp32 already); grad mode is off or no input needs a gradient
        here (the callers: the autograd.Function's forward, plain tensors, the dispatcher op)."""
        out = torch.ops.flux.moe_local_combine(y, weights, handle.recv_dest, handle.topk)
        if not need_returned:
            return out, None
        rows = y.reshape(-1, y.shape[-1])
        return out, (rows if rows.is_contiguous() else rows.contiguous())

    @staticmethod
    def combine_backward(grad_out, weights, y_rows, handle, need_w):
        """(d y in recv_x's layout, d topk_weights ``[T, K]`` fp32 or None): one pass over the
        rows; y_rows ``[S, H]`` (the forward's rows) when need_w."""
        dy, dw = torch.ops.flux.moe_local_combine_backward(
            grad_out, None if weights is None else weights.detach(), handle.recv_dest, handle.send_pairs,
            y_rows if need_w else None, handle.topk)
        grad_w = dw.view(handle.num_tokens, handle.topk) if need_w else None
        return dy.view(*handle.recv_shape[:-1], dy.shape[-1]), grad_w
