"""The strategies of flux.moe_dispatch / moe_combine (``sequential``, ``symm``, ``local``; see
docs/api.md for what each does and how they map to the GEMM ops' strategies), the choice of one
per call (the same on every rank), and the implementations the public functions and the
dispatcher ops run: checks, the strategy's move, the handle, the weighted sum and the gradients.
A strategy is an object with ``dispatch`` / ``fake_dispatch`` / ``to_sources`` / ``to_experts``
(``_AllToAll`` is the model); ``symm`` adds ``dispatch_bounded`` / ``combine_bounded``, and
``local`` (its kernels compute the data verdict) ``dispatch_local`` / ``combine`` /
``combine_backward``.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from flux import envs
from flux.ops._checks import FluxInputError, check_collectively
from flux.ops.moe import local as _moe_local
from flux.ops.moe import symm as _moe_symm
from flux.ops.moe.all_to_all import _AllToAll
from flux.ops.moe.checks import _check_deferred, _check_host, _data_message, _deferred_host_code, _signature
from flux.ops.moe.fp8 import _pack_fp8, _unpack_fp8
from flux.ops.moe.handle import (OP, STRATEGIES, MoeHandle, _acc_dtype, _rows_from_tokens, _sum_slots)
from flux.ops.moe.local import LocalStrategy
from flux.ops.moe.symm import SymmStrategy
from flux.runtime import group_device, group_name, resolve_group
from flux.runtime.groups import cuda_group
from flux.strategies import canonical_strategy

STRATEGY_ENV = "FLUX_STRATEGY_MOE"  # forces a strategy (the same on every rank, or the check fails)
_FORCED_VAR = envs.VARS[STRATEGY_ENV]  # read live, also on the hot path (a plan key holds it)


def _strategy_name(name) -> str:
    """A strategy name as a user gives it (``run_strategy``'s name, FLUX_STRATEGY_MOE), former
    names read as the current ones (``all_to_all``: ``sequential``; flux/strategies.py)."""
    return canonical_strategy("moe", name)


def _forced() -> str:
    return _strategy_name(_FORCED_VAR.get())


_STRATEGY_IMPLS = {"sequential": _AllToAll, "symm": SymmStrategy, "local": LocalStrategy}


def available_strategies(device: torch.device) -> List[str]:
    """Names of the strategies that can run on ``device`` (``symm``: a GPU with flux's kernels;
    its group must also have a symmetric workspace, see ``_moe_symm.usable``)."""
    from flux.runtime import cuda_kernels_available

    gpu = device.type == "cuda" and cuda_kernels_available()
    return ["sequential"] + (["symm", "local"] if gpu else [])


def run_strategy(name: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                 group: Optional[dist.ProcessGroup] = None, max_tokens_per_rank: Optional[int] = None,
                 fp8: bool = False, zero_pad: bool = False):
    """``flux.moe_dispatch`` through the named strategy, bypassing the choice (benchmarks, tests);
    checked as the op, no autograd; fp8: recv_x is ``(recv_fp8, recv_scales)`` as from the op.
    Combine the result with ``flux.moe_combine``. ``name`` may be a former name (``all_to_all``)."""
    name = _strategy_name(name)
    if name not in STRATEGIES:
        raise ValueError(f"{OP}: unknown strategy {name!r}; known: {list(STRATEGIES)}")
    recv_x, counts, handle = _dispatch_impl(x, topk_idx, topk_weights, num_experts, resolve_group(group, OP),
                                            max_tokens_per_rank, strategy=name, fp8=fp8, zero_pad=bool(zero_pad))
    return (_unpack_fp8(recv_x, handle.hidden) if fp8 else recv_x), counts, handle


def _choose_strategy(x, group: dist.ProcessGroup, bounded: bool, num_experts=None, topk_idx=None) -> str:
    """The strategy of one call: the same on every rank (it depends only on the group, its device
    and whether the call is bounded, which the ranks share, never on ``x``, which is not checked
    yet): a bounded call takes ``symm`` wherever it can run (a CUDA group with a symmetric
    workspace), an unbounded one and every call elsewhere the reference ``sequential`` (at two
    H200s the unbounded ``symm`` path, ~100 launches a call, lost to the all-to-all in every
    measured cell: docs/performance.md, MoE at two GPUs). It is part
    of the checked signature, so ranks that would choose differently get an error, not a hang.
    A group of one rank on CUDA takes ``local`` (flux/ops/moe/local.py) where its kernels take
    num_experts and K (at most 1024 experts, K <= 64).
    ``FLUX_STRATEGY_MOE=sequential|symm|local`` forces one (a forced one that cannot run raises;
    ``all_to_all``, the former name of ``sequential``, is read as it)."""
    forced = _forced()
    dev = group_device(group)
    why_local = _moe_local.usable(group, dev)
    if why_local is None and not _moe_local.fits(num_experts, topk_idx):
        why_local = "more than 1024 experts or K > 64"
    if forced == "local":
        if why_local is not None:
            raise FluxInputError(f"{OP}: {STRATEGY_ENV}=local, but it cannot run here: {why_local}")
        return forced
    if not forced and why_local is None:
        return "local"
    why = _moe_symm.usable(group, dev)
    if forced:
        if forced not in STRATEGIES:
            raise FluxInputError(f"{OP}: {STRATEGY_ENV}={forced!r} is not a strategy ({', '.join(STRATEGIES)})")
        if forced == "symm" and why is not None:
            raise FluxInputError(f"{OP}: {STRATEGY_ENV}=symm, but it cannot run here: {why}")
        return forced
    return "symm" if why is None and bounded else "sequential"


# --------------------------------------------------------------------------------------
# Implementations


def _dispatch_impl(x, topk_idx, topk_weights, num_experts, group, capacity, *, defer_verdict=None,
                   strategy=None, fp8=False, zero_pad=False, read_counts=True):
    """Check (see the module docstring), choose a strategy, dispatch. Returns
    ``(recv_x, counts, handle)``; the handle's topk_weights is the argument. ``defer_verdict``:
    report data errors through ``handle.check()`` instead of raising (default: the bounded
    variant on CUDA groups). ``fp8``: x is quantised and moved as packed byte rows, and recv_x
    is the received byte rows (uint8 ``[..., _packed_width(H)]``; ``_unpack_fp8`` splits them).
    ``zero_pad=False``: the bounded variant may leave recv_x's rows past the counts unwritten.
    ``read_counts=False``: the unbounded variant of the ``local`` strategy reads nothing on the
    host (recv_x has the worst case's T * K rows, the verdict deferred); other strategies ignore it."""
    worst = capacity is None and not read_counts
    if _LOCAL_PLANS and defer_verdict is None and (strategy is None or strategy == "local"):
        plan = _LOCAL_PLANS.get(_local_plan_key(x, topk_idx, topk_weights, num_experts, group, capacity, fp8,
                                                worst))
        if plan is not None:  # the hot path: a lookup, one C++ entry, the handle
            return _run_local(LocalStrategy, x, topk_idx, topk_weights, num_experts, group, capacity, plan.defer,
                              fp8, zero_pad, 0, plan.meta, worst)
    bounded = capacity is not None
    plannable = defer_verdict is None  # only the public functions' own choice is remembered
    if defer_verdict is None:
        defer_verdict = bounded and cuda_group(group)
    sig = _signature(x, topk_idx, topk_weights, num_experts, group, capacity, fp8)
    name = strategy or _choose_strategy(x, group, bounded, num_experts, topk_idx)
    sig.add("strategy", STRATEGIES.index(name))
    impl = _STRATEGY_IMPLS[name]
    if getattr(impl, "checks_data", False):
        return _dispatch_local(impl, sig, x, topk_idx, topk_weights, num_experts, group, capacity,
                               defer_verdict or worst, fp8, zero_pad, plannable, worst)
    # A strategy with dispatch_bounded exchanges the data verdict along with the rows.
    fused = bounded and hasattr(impl, "dispatch_bounded")
    host_code, local, any_error = 0, None, None
    if defer_verdict and bounded:
        if fused:
            host_code, local = _deferred_host_code(sig, x, group, capacity)
        else:
            verdict, local = _check_deferred(sig, x, topk_idx, num_experts, group, capacity)
            any_error = (verdict != 0).any()
        if local is not None:  # stand-ins of no tokens, of the agreed H and K (see _deferred_host_code)
            x = x.new_zeros((0, x.shape[-1]))
            topk_idx = topk_idx.new_zeros((0, topk_idx.shape[-1]))
            topk_weights = topk_weights.new_zeros((0, topk_idx.shape[-1]))
    else:
        if bounded and sig.error is None and x.shape[0] > capacity:
            sig.fail(f"x has T = {x.shape[0]} tokens, more than max_tokens_per_rank = {capacity}")
        _check_host(sig, topk_idx, num_experts, group)
        verdict = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=x.device)
    rows = _pack_fp8(x) if fp8 else x  # after the checks: H and the dtype are known good
    if fused:
        recv_x, counts, send_pairs, recv_dest, sizes, verdict = impl.dispatch_bounded(
            rows, topk_idx, num_experts, group, capacity, host_code, zero_pad)
    else:
        recv_x, counts, send_pairs, recv_dest, sizes = impl.dispatch(rows, topk_idx, num_experts, group, capacity,
                                                                     any_error)
    meta = torch.tensor([STRATEGIES.index(name)] + list(sizes), dtype=torch.int64)
    h = x.shape[1]
    handle = MoeHandle(group, name, num_experts, x.shape[0], topk_idx.shape[1], h, capacity, topk_weights,
                       send_pairs, recv_dest, meta, verdict, tuple(recv_x.shape[:-1]) + (h,), fp8)
    return recv_x, counts, handle


def _dispatch_local(impl, sig, x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8, zero_pad,
                    plannable=False, worst=False):
    """_dispatch_impl for a strategy whose kernels compute the data verdict (``local``: one rank):
    the signature is checked alone (check_collectively: no peer, nothing to exchange once it was
    seen), the ids and duplicates by the layout kernels: read with the counts (unbounded, which
    raises before any row moves) or reported through ``handle.check()`` (bounded, and unbounded
    at the worst case, ``worst``: deferred). ``plannable``: a valid call leaves a plan
    (_LOCAL_PLANS) that serves the calls like it."""
    host_code, clean = 0, sig.error is None
    if capacity is not None and defer:
        host_code, local = _deferred_host_code(sig, x, group, capacity)
        if local is not None:  # stand-ins of no tokens, as in _dispatch_impl
            x = x.new_zeros((0, x.shape[-1]))
            topk_idx = topk_idx.new_zeros((0, topk_idx.shape[-1]))
            topk_weights = topk_weights.new_zeros((0, topk_idx.shape[-1]))
    else:
        if capacity is not None and sig.error is None and x.shape[0] > capacity:
            sig.fail(f"x has T = {x.shape[0]} tokens, more than max_tokens_per_rank = {capacity}")
        check_collectively(sig, group)
    plan = _LocalPlan(defer, impl.name, capacity is not None or worst)
    if plannable and clean and host_code == 0:  # the call's plan is valid: later calls like it skip the checks
        key = _local_plan_key(x, topk_idx, topk_weights, num_experts, group, capacity, fp8, worst)
        if key is not None:
            _LOCAL_PLANS[key] = plan
    return _run_local(impl, x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8, zero_pad, host_code,
                      plan.meta, worst)


class _LocalPlan:
    """What a checked local dispatch leaves for the calls like it: whether the verdict is deferred
    (the bounded variant on a CUDA group, the unbounded one at its worst case), and, where no
    counts are read (``no_read``), the handles' meta tensor (the strategy index only; shared,
    nobody writes it)."""

    __slots__ = ("defer", "meta")

    def __init__(self, defer: bool, name: str, no_read: bool):
        self.defer = defer
        self.meta = torch.tensor([STRATEGIES.index(name)], dtype=torch.int64) if no_read else None


# Plans (_LocalPlan) of local dispatches whose host-side checks passed, by _local_plan_key (the
# group object itself, not its id, which a later group could reuse): a call with the same key
# passes those checks too (it differs only in T, within the same bounds, and in the data, which
# the layout kernels check every call), so it goes straight to the kernels.
_LOCAL_PLANS = {}


def _local_plan_key(x, topk_idx, topk_weights, num_experts, group, capacity, fp8, worst=False):
    """What the host-side checks of a local dispatch depend on (all but T and the data), or None
    for arguments that always take the checked path (not plain tensors, shapes that are not
    ``[T, H]`` / ``[T, K]`` / ``[T, K]``, T > C, a num_experts or C that is not an int). A
    forced strategy (FLUX_STRATEGY_MOE, read live) is part of it."""
    if type(x) is not torch.Tensor or type(topk_idx) is not torch.Tensor or type(topk_weights) is not torch.Tensor:
        return None
    xs, s = x.shape, topk_idx.shape
    if len(xs) != 2 or len(s) != 2 or xs[0] != s[0] or topk_weights.shape != s or type(num_experts) is not int:
        return None
    if capacity is not None and (type(capacity) is not int or xs[0] > capacity):
        return None
    return (group, num_experts, capacity, fp8, worst, x.dtype, x.device, xs[1], s[1], topk_idx.dtype,
            topk_idx.device, topk_weights.dtype, topk_weights.device,
            torch.cuda.current_device() if x.is_cuda else -1, _FORCED_VAR.get())


def _run_local(impl, x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8, zero_pad, host_code, meta,
               worst=False):
    """The kernels of a checked local dispatch, the verdict, the handle (``meta``: the shared meta
    tensor of the handles without host counts: bounded, or unbounded at the worst case)."""
    recv_x, counts, send_pairs, recv_dest, counts_host, verdict, code = impl.dispatch_local(
        _pack_fp8(x) if fp8 else x, topk_idx, num_experts, capacity, host_code, zero_pad, not worst)
    if capacity is not None and not defer:  # a verdict that is not deferred is read (a synchronisation; worst defers)
        code = int(verdict[0])
    if code:
        raise FluxInputError(f"{OP}: invalid arguments on rank {dist.get_rank(group)}: "
                             + (_data_message(topk_idx, num_experts) or "invalid topk_idx"))
    h = x.shape[1]
    if counts_host is not None:
        meta = torch.tensor([STRATEGIES.index(impl.name)] + counts_host, dtype=torch.int64)
    shape = (num_experts, capacity, h) if capacity is not None else (recv_x.shape[0], h)
    handle = MoeHandle(group, impl.name, num_experts, x.shape[0], topk_idx.shape[1], h, capacity, topk_weights,
                       send_pairs, recv_dest, meta, verdict, shape, fp8)
    return recv_x, counts, handle


_FUSED_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _combine_impl(y, weights, handle, need_returned: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out ``[T, H]`` in y's dtype, y's rows back on this rank ``[S, H]`` in send order, or None
    when not needed and the strategy sums as the rows arrive)."""
    impl = _STRATEGY_IMPLS[handle.strategy]
    if hasattr(impl, "combine") and impl.kernel_dtype(y.dtype):
        return impl.combine(y, weights, handle, need_returned)
    if handle.bounded and hasattr(impl, "combine_bounded") and y.dtype in _FUSED_SUM_DTYPES:
        return impl.combine_bounded(y, weights, handle, need_returned)
    returned = impl.to_sources(y.contiguous(), handle)
    return _sum_slots(returned, weights, handle, y.dtype), returned


def _dispatch_backward(grad_recv, handle, x_dtype) -> torch.Tensor:
    """d x: the gradients of a token's copies moved back and summed (combine with weights 1)."""
    if grad_recv.dtype == x_dtype:
        return _combine_impl(grad_recv, None, handle, need_returned=False)[0]
    rows = _STRATEGY_IMPLS[handle.strategy].to_sources(grad_recv.contiguous(), handle)
    return _sum_slots(rows, None, handle, x_dtype)


def _combine_backward(needs, grad_out, grad_returned, y_dtype, weights, returned, handle, traceable=False):
    """(d y, d topk_weights) of ``out = combine(y)``; grad_returned: the gradient of the rows
    returned alongside (the dispatcher op's second output), or None. ``traceable``: move the
    rows through the dispatcher op flux::moe_to_experts (the registered autograd formula, which
    AOT autograd traces with fake tensors), not through the strategy's collectives directly."""
    grad_y = grad_w = None
    impl = _STRATEGY_IMPLS[handle.strategy]
    if (hasattr(impl, "combine_backward") and not traceable and grad_returned is None
            and grad_out.dtype == y_dtype and impl.kernel_dtype(y_dtype)
            and (not needs[1] or (returned is not None and returned.dtype == y_dtype))):
        grad_y, grad_w = impl.combine_backward(grad_out, weights, returned, handle, needs[1])
        return (grad_y if needs[0] else None), (grad_w.to(weights.dtype) if needs[1] else None)
    if needs[0]:
        rows = _rows_from_tokens(grad_out, handle, weights, dtype=_acc_dtype(y_dtype))
        if grad_returned is not None:
            rows = rows + grad_returned.to(rows.dtype)
        rows = rows.to(y_dtype)
        if traceable:
            grad_y = torch.ops.flux.moe_to_experts(rows, handle.recv_dest, handle.meta, group_name(handle.group),
                                                   handle.num_experts, handle.max_tokens_per_rank,
                                                   list(handle.recv_shape))
        else:
            grad_y = _STRATEGY_IMPLS[handle.strategy].to_experts(rows, handle)
    if needs[1]:
        acc = _acc_dtype(grad_out.dtype)
        tok = _rows_from_tokens(grad_out, handle)
        per_row = (returned.to(acc) * tok.to(acc)).sum(-1)
        t, k = handle.num_tokens, handle.topk
        gw = torch.zeros(t * k + 1, dtype=acc, device=per_row.device)
        gw = gw.scatter(0, handle.send_pairs, per_row)  # each valid pair once; padding to the last slot
        grad_w = gw[:t * k].view(t, k).to(weights.dtype)
    return grad_y, grad_w
