"""flux.ag_scatter_grouped_mm / flux.grouped_mm_gather_rs, the two halves of a tensor-parallel MoE
layer: the public functions, their eager autograd, and the dispatcher ops
``torch.ops.flux.ag_scatter_grouped_mm`` / ``grouped_mm_gather_rs`` (and their ``_backward`` ops)
built with ``define_op``: fake implementations (part 1's row count P is a dynamic size) and
registered autograd, so torch.compile, fake tensors and tensor subclasses reach them. The routing
travels through the ops as its tensors: the gathered ``topk_idx [T, K]``, ``pairs [P]`` and the
per-(source rank, expert) counts as a CPU int64 ``[W * E]`` tensor (host data, no device read).
``tp_routing`` holds the routing, the checks and the choice, ``tp_strategies`` the strategies;
the names below are the module's interface (``flux.ops.moe_tp`` is this module). flux imports it
on first use (it imports torch._dynamo).
"""
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from flux.ops._common import call_mode
from flux.ops._opdef import define_op
from flux.ops.moe.tp_routing import (OP, OP_RS, OVERLAP_MIN_SHARD, STRATEGIES, STRATEGY_ENV,  # noqa: F401
                                     TpMoeRouting, _choose_strategy, _is_gloo, _make_routing, _should_overlap,
                                     decomposed_usable)
from flux.ops.moe.tp_strategies import (_AG_SCATTER, _MM_GATHER_RS, _acc_dtype, _ag_scatter_impl, _flip, _mm,
                                        _mm_gather_rs_impl, _scatter_rows, _weight_grad)
from flux.runtime import (all_gather_dim0, differentiable_all_gather_dim0, differentiable_reduce_scatter_dim0,
                          group_from_name, group_name, reduce_scatter_dim0, resolve_group)

_I64 = torch.int64


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _source_counts_tensor(r: TpMoeRouting) -> torch.Tensor:
    """The routing's per-(source rank, expert) counts as a CPU int64 ``[W * E]`` tensor."""
    if r._source_counts_cpu is None:
        r._source_counts_cpu = torch.tensor(r.source_counts, dtype=_I64).reshape(-1)
    return r._source_counts_cpu


def _routing_from(group: dist.ProcessGroup, num_experts: int, tokens_per_rank: int, topk_idx: torch.Tensor,
                  pairs: torch.Tensor, source_counts: torch.Tensor) -> TpMoeRouting:
    """The TpMoeRouting of an op's routing tensors (no device read: the counts are host data).
    Fake tensors (tracing) give a routing without host lists."""
    world, k = dist.get_world_size(group), topk_idx.shape[-1]
    if _is_fake(source_counts):
        return TpMoeRouting(group, num_experts, tokens_per_rank, k, topk_idx,
                            torch.empty(num_experts, dtype=_I64, device=pairs.device), [], [], pairs,
                            _source_counts_cpu=source_counts)
    sc = source_counts.view(world, num_experts)
    source = sc.tolist()
    counts_host = [sum(source[s][e] for s in range(world)) for e in range(num_experts)]
    sc_dev = sc.to(pairs.device)
    return TpMoeRouting(group, num_experts, tokens_per_rank, k, topk_idx, sc_dev.sum(0), counts_host, source, pairs,
                        _source_counts_dev=sc_dev, _source_counts_cpu=source_counts)


def _n_out(weight: torch.Tensor, layout: str) -> int:
    return weight.shape[1] if layout == "nk" else weight.shape[-1]


# --------------------------------------------------------------------------------------
# Dispatcher ops


def _ag_forward(x: torch.Tensor, topk_idx: torch.Tensor, weight: torch.Tensor, group_name: str,
                weight_layout: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [P, N], the gathered topk_idx [T, K] int64, pairs [P], source counts CPU [W * E])."""
    out, r, _, _ = _ag_scatter_impl(x, topk_idx, weight, group_from_name(group_name), weight_layout, False)
    return out, r.topk_idx, r.pairs, _source_counts_tensor(r).clone()


def _ag_fake(x, topk_idx, weight, group_name, weight_layout):
    world = dist.get_world_size(group_from_name(group_name))
    p = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((p, _n_out(weight, weight_layout))),
            torch.empty((world * x.shape[0], topk_idx.shape[-1]), dtype=_I64, device=x.device),
            torch.empty(p, dtype=_I64, device=x.device), torch.empty(world * weight.shape[0], dtype=_I64))


def _ag_save(ctx, inputs, output):
    x, _, weight, gname, layout = inputs
    ctx.args = (gname, layout)
    ctx.save_for_backward(x, weight, *output[1:])


def _ag_backward(ctx, grad_out, *_):
    x, weight, idx, pairs, sc = ctx.saved_tensors
    need_x, need_w = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[2])
    if grad_out is None or not (need_x or need_w):
        return None, None, None, None, None
    gx, gw = torch.ops.flux.ag_scatter_grouped_mm_backward(grad_out, x, weight, idx, pairs, sc, *ctx.args, need_x,
                                                           need_w)
    return (gx if need_x else None), None, (gw if need_w else None), None, None


def _ag_bwd_forward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, topk_idx: torch.Tensor,
                    pairs: torch.Tensor, source_counts: torch.Tensor, group_name: str, weight_layout: str,
                    need_x: bool, need_w: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d x, d weight) of part 1 (zeros for one not needed), as _AgScatterFunction.backward."""
    group = group_from_name(group_name)
    r = _routing_from(group, weight.shape[0], x.shape[0], topk_idx, pairs, source_counts)
    strategy, _ = _choose_strategy(x.device, group, x.shape[0], x.shape[1])
    g = grad_out.to(weight.dtype).contiguous()
    gx = torch.zeros_like(x)
    gw = torch.zeros_like(weight)
    if need_x:  # part 2's computation with unit weights, the weight flipped
        gx = _MM_GATHER_RS[strategy](g, weight, _flip(weight_layout), r, None, False)[0].to(x.dtype)
    if need_w:
        gathered = all_gather_dim0(x.contiguous(), group)
        gw = _weight_grad(_scatter_rows(gathered, r.pairs, r.topk, None), g, weight, r.counts, r.counts_host,
                          weight_layout)
    return gx, gw


def _ag_bwd_fake(grad_out, x, weight, topk_idx, pairs, source_counts, group_name, weight_layout, need_x, need_w):
    return torch.empty_like(x), torch.empty_like(weight)


def _rs_forward(h: torch.Tensor, weight: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor,
                pairs: torch.Tensor, source_counts: torch.Tensor, group_name: str,
                weight_layout: str) -> torch.Tensor:
    group = group_from_name(group_name)
    tl = topk_weights.shape[0] if topk_weights.dim() == 2 else 0
    r = _routing_from(group, weight.shape[0], tl, topk_idx, pairs, source_counts)
    return _mm_gather_rs_impl(h, weight, r, topk_weights, group, weight_layout, False)[0]


def _rs_fake(h, weight, topk_weights, topk_idx, pairs, source_counts, group_name, weight_layout):
    return h.new_empty((topk_weights.shape[0], _n_out(weight, weight_layout)))


def _rs_save(ctx, inputs, output):
    h, weight, tw, idx, pairs, sc, gname, layout = inputs
    ctx.args = (gname, layout)
    ctx.save_for_backward(h, weight, tw, idx, pairs, sc)


def _rs_backward(ctx, grad_out):
    h, weight, tw, idx, pairs, sc = ctx.saved_tensors
    need = [bool(n) for n in ctx.needs_input_grad[:3]]
    if grad_out is None or not any(need):
        return (None,) * 8
    grads = torch.ops.flux.grouped_mm_gather_rs_backward(grad_out, h, weight, tw, idx, pairs, sc, *ctx.args, *need)
    return tuple(g if n else None for g, n in zip(grads, need)) + (None,) * 5


def _rs_bwd_forward(grad_out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, topk_weights: torch.Tensor,
                    topk_idx: torch.Tensor, pairs: torch.Tensor, source_counts: torch.Tensor, group_name: str,
                    weight_layout: str, need_h: bool, need_w: bool,
                    need_tw: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d h, d weight, d topk_weights) of part 2 (zeros for one not needed), as
    _GroupedMmGatherRsFunction.backward; the partial products are recomputed for d topk_weights."""
    group = group_from_name(group_name)
    r = _routing_from(group, weight.shape[0], topk_weights.shape[0], topk_idx, pairs, source_counts)
    strategy, _ = _choose_strategy(h.device, group, r.tokens_per_rank, _n_out(weight, weight_layout))
    wg = all_gather_dim0(topk_weights.contiguous(), group)
    g = grad_out.to(h.dtype).contiguous()
    gh, gw, gtw = torch.zeros_like(h), torch.zeros_like(weight), torch.zeros_like(topk_weights)
    dy = None
    if need_h:
        gh, dy = _AG_SCATTER[strategy](g, weight, _flip(weight_layout), r, wg.reshape(-1), need_w or need_tw)
    elif need_w or need_tw:
        dy = all_gather_dim0(g, group)
    if need_w:
        gw = _weight_grad(h, _scatter_rows(dy, r.pairs, r.topk, wg.reshape(-1)), weight, r.counts, r.counts_host,
                          weight_layout)
    if need_tw:
        acc = _acc_dtype(h.dtype)
        partial = _mm(h, weight, r.counts, r.counts_host, weight_layout)
        per_row = (partial.to(acc) * _scatter_rows(dy, r.pairs, r.topk, None).to(acc)).sum(-1)
        gsum = torch.zeros(r.num_tokens * r.topk, dtype=acc, device=h.device).index_copy_(0, r.pairs, per_row)
        gtw = reduce_scatter_dim0(gsum.view(r.num_tokens, r.topk), group).to(topk_weights.dtype)
    return gh, gw, gtw


def _rs_bwd_fake(grad_out, h, weight, topk_weights, topk_idx, pairs, source_counts, group_name, weight_layout,
                 need_h, need_w, need_tw):
    return torch.empty_like(h), torch.empty_like(weight), torch.empty_like(topk_weights)


def _no_grad_save(ctx, inputs, output):
    pass


def _no_grad_backward(ctx, *grads):
    raise RuntimeError("flux: the TP MoE backward ops have no gradient of their own")


_AG_BWD_OP = define_op("ag_scatter_grouped_mm_backward", _ag_bwd_forward, _ag_bwd_fake, save=_no_grad_save,
                       backward=_no_grad_backward)
_RS_BWD_OP = define_op("grouped_mm_gather_rs_backward", _rs_bwd_forward, _rs_bwd_fake, save=_no_grad_save,
                       backward=_no_grad_backward)
_AG_OP = define_op("ag_scatter_grouped_mm", _ag_forward, _ag_fake, save=_ag_save, backward=_ag_backward)
_RS_OP = define_op("grouped_mm_gather_rs", _rs_forward, _rs_fake, save=_rs_save, backward=_rs_backward)


# --------------------------------------------------------------------------------------
# Eager autograd


class _AgScatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, weight, group, layout):
        keep = bool(ctx.needs_input_grad[2])
        out, routing, gathered, strategy = _ag_scatter_impl(x, topk_idx, weight, group, layout, keep)
        ctx.routing, ctx.layout, ctx.strategy = routing, layout, strategy
        ctx.save_for_backward(weight, gathered)
        return out, routing

    @staticmethod
    def backward(ctx, grad_out, _grad_routing):
        weight, gathered = ctx.saved_tensors
        r, layout = ctx.routing, ctx.layout
        g = grad_out.to(weight.dtype).contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # part 2's computation with unit weights, the weight flipped
            grad_x, _ = _MM_GATHER_RS[ctx.strategy](g, weight, _flip(layout), r, None, False)
        if ctx.needs_input_grad[2]:
            grad_w = _weight_grad(_scatter_rows(gathered, r.pairs, r.topk, None), g, weight, r.counts,
                                  r.counts_host, layout)
        return grad_x, None, grad_w, None, None


class _GroupedMmGatherRsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, topk_weights, routing, group, layout):
        keep = bool(ctx.needs_input_grad[2])
        out, wg, partial, strategy = _mm_gather_rs_impl(h, weight, routing, topk_weights, group, layout, keep)
        ctx.routing, ctx.layout, ctx.strategy, ctx.w_dtype = routing, layout, strategy, topk_weights.dtype
        ctx.save_for_backward(h, weight, wg, partial)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, wg, partial = ctx.saved_tensors
        r, layout = ctx.routing, ctx.layout
        need_h, need_w, need_tw = ctx.needs_input_grad[:3]
        g = grad_out.to(h.dtype).contiguous()
        grad_h = grad_w = grad_tw = None
        dy = None  # all_gather(d out), [T, H]
        if need_h:  # part 1's computation on d out, each row scaled by its weight, the weight flipped
            grad_h, dy = _AG_SCATTER[ctx.strategy](g, weight, _flip(layout), r, wg.reshape(-1),
                                                   need_w or need_tw)
        elif need_w or need_tw:
            dy = all_gather_dim0(g, r.group)
        if need_w:
            grad_w = _weight_grad(h, _scatter_rows(dy, r.pairs, r.topk, wg.reshape(-1)), weight, r.counts,
                                  r.counts_host, layout)
        if need_tw:
            acc = _acc_dtype(h.dtype)
            per_row = (partial.to(acc) * _scatter_rows(dy, r.pairs, r.topk, None).to(acc)).sum(-1)
            gw = torch.zeros(r.num_tokens * r.topk, dtype=acc, device=h.device).index_copy_(0, r.pairs, per_row)
            # each rank's partial holds its F shard's share: the sum over ranks, this rank's tokens
            grad_tw = reduce_scatter_dim0(gw.view(r.num_tokens, r.topk), r.group).to(ctx.w_dtype)
        return grad_h, grad_w, grad_tw, None, None, None


# --------------------------------------------------------------------------------------
# Public API


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def ag_scatter_grouped_mm(x: torch.Tensor, topk_idx: torch.Tensor, weight: torch.Tensor, *,
                          group: Optional[dist.ProcessGroup] = None,
                          weight_layout: str = "nk") -> Tuple[torch.Tensor, TpMoeRouting]:
    """All-gather the tokens and their routing, scatter the (token, slot) pairs into expert-major
    order, and multiply each expert's rows by this rank's shard of that expert's weight.

    Same as ``X, I = all_gather(x), all_gather(topk_idx); out = cat([X[tokens of e] @ W_e^T for e])``
    (see ``ag_scatter_grouped_mm_ref`` and the module docstring for the row order).

    Args:
        x: ``[T_l, H]`` this rank's tokens (the same T_l on every rank); bf16, fp16, fp32 or fp64.
        topk_idx: ``[T_l, K]`` int64 or int32: global expert ids in ``[0, E)``, or -1 (slot unused).
        weight: this rank's shard, ``[E, N, H]`` (``weight_layout="nk"``: nn.Linear per expert, e.g.
            w13's ``[E, 2F/W, H]``) or ``[E, H, N]`` (``"kn"``); x's dtype and device; E is the
            number of experts.
        group: the tensor-parallel process group (default: the world); NCCL for CUDA tensors, gloo
            for CPU tensors.
        weight_layout: ``"nk"`` or ``"kn"``.

    Returns:
        ``(out, routing)``: out ``[P, N]`` in x's dtype, one row per valid gathered pair (P the same
        on every rank), by expert, then gathered token index, then slot; routing the
        ``TpMoeRouting`` for ``grouped_mm_gather_rs`` (``routing.counts`` / ``counts_host``: rows per
        expert). Differentiable in x and weight.

    Raises:
        FluxInputError, on every rank alike and before any token moves, when some rank's arguments
        are invalid (shapes, dtypes, devices, an id outside [-1, E)) or the ranks disagree on T_l,
        H, K, E, the dtype or the layout.
    """
    group = resolve_group(group, OP)
    mode = call_mode(x, topk_idx, weight)
    if mode == 1 and _needs_grad(x, weight):
        return _AgScatterFunction.apply(x, topk_idx, weight, group, weight_layout)
    if mode == 2:  # torch.compile, fake tensors, subclasses: the dispatcher op
        out, idx, pairs, sc = torch.ops.flux.ag_scatter_grouped_mm(x, topk_idx, weight, group_name(group),
                                                                   weight_layout)
        return out, _routing_from(group, weight.shape[0], x.shape[0], idx, pairs, sc)
    out, routing, _, _ = _ag_scatter_impl(x, topk_idx, weight, group, weight_layout, False)
    return out, routing


def grouped_mm_gather_rs(h: torch.Tensor, weight: torch.Tensor, routing: TpMoeRouting, topk_weights: torch.Tensor,
                         *, group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk") -> torch.Tensor:
    """Multiply each expert's rows by this rank's shard of that expert's weight, sum every token's
    slots with its routing weights, and reduce-scatter the partial sums over the group.

    Same as ``partial = cat([h[rows of e] @ W_e^T for e]); Y[t] = sum_k all_gather(topk_weights)[t, k]
    * partial[row of (t, k)]; out = reduce_scatter(Y)`` (see ``grouped_mm_gather_rs_ref``).

    Args:
        h: ``[P, F_l]`` in ``routing``'s row order (e.g. the activation of
            ``ag_scatter_grouped_mm``'s output); bf16, fp16, fp32 or fp64.
        weight: this rank's shard, ``[E, H, F_l]`` (``"nk"``: w2 per expert as nn.Linear) or
            ``[E, F_l, H]`` (``"kn"``); h's dtype and device.
        routing: the ``TpMoeRouting`` of the matching ``ag_scatter_grouped_mm`` call.
        topk_weights: ``[T_l, K]`` floating: this rank's tokens' routing weights (gathered here);
            slots with id -1 are ignored.
        group: default: the routing's group (the same group if given).
        weight_layout: ``"nk"`` or ``"kn"``.

    Returns:
        ``[T_l, H]`` in h's dtype: this rank's tokens, summed over the group's F shards. The slot
        sum is accumulated in fp32 (fp64 for fp64) from slot 0 on, rounded to h's dtype, then
        reduced. Differentiable in h, weight and topk_weights.

    Raises:
        FluxInputError, on every rank alike, when some rank's arguments are invalid (h's rows are
        not the routing's P, the weight's E is not the routing's, shapes, dtypes, devices) or the
        ranks disagree on H, the dtypes or the layout.
    """
    if group is None and isinstance(routing, TpMoeRouting):
        group = routing.group
    group = resolve_group(group, OP_RS)
    mode = call_mode(h, weight, topk_weights)
    if mode == 1 and _needs_grad(h, weight, topk_weights):
        return _GroupedMmGatherRsFunction.apply(h, weight, topk_weights, routing, group, weight_layout)
    if mode == 2 and isinstance(routing, TpMoeRouting):
        return torch.ops.flux.grouped_mm_gather_rs(h, weight, topk_weights, routing.topk_idx, routing.pairs,
                                                   _source_counts_tensor(routing), group_name(group), weight_layout)
    return _mm_gather_rs_impl(h, weight, routing, topk_weights, group, weight_layout, False)[0]


# --------------------------------------------------------------------------------------
# Unchecked references (differentiable: the gather's backward is a reduce-scatter and vice versa)


def ag_scatter_grouped_mm_ref(x: torch.Tensor, topk_idx: torch.Tensor, weight: torch.Tensor, *,
                              group: Optional[dist.ProcessGroup] = None,
                              weight_layout: str = "nk") -> Tuple[torch.Tensor, TpMoeRouting]:
    """``(out, routing)`` of ``ag_scatter_grouped_mm`` by all_gather, a per-expert selection of the
    gathered tokens and one torch.mm per expert; unchecked (ids outside [-1, E) count as -1),
    differentiable in x and weight."""
    group = resolve_group(group, OP)
    gathered = differentiable_all_gather_dim0(x, group)
    idx = all_gather_dim0(topk_idx.to(torch.int64), group)
    blocks = []
    for e in range(weight.shape[0]):
        tok, _ = (idx == e).nonzero(as_tuple=True)  # lexicographic: token, then slot
        we = weight[e]
        blocks.append(gathered[tok] @ (we.t() if weight_layout == "nk" else we))
    return torch.cat(blocks), _make_routing(idx, weight.shape[0], x.shape[0], group, check=False)


def grouped_mm_gather_rs_ref(h: torch.Tensor, weight: torch.Tensor, routing: TpMoeRouting,
                             topk_weights: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None,
                             weight_layout: str = "nk") -> torch.Tensor:
    """``grouped_mm_gather_rs`` by one torch.mm per expert over its rows, the weighted sum of the
    gathered tokens' slots (index_add, fp32 or wider) and reduce_scatter; unchecked,
    differentiable in h, weight and topk_weights. Reads only ``routing.topk_idx``."""
    group = resolve_group(group if group is not None else routing.group, OP_RS)
    idx = routing.topk_idx
    wg = differentiable_all_gather_dim0(topk_weights, group)
    acc = _acc_dtype(h.dtype)
    n = weight.shape[1] if weight_layout == "nk" else weight.shape[2]
    y = torch.zeros((idx.shape[0], n), dtype=acc, device=h.device)
    start = 0
    for e in range(weight.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        we = weight[e]
        part = h[start:start + tok.shape[0]] @ (we.t() if weight_layout == "nk" else we)
        start += tok.shape[0]
        y = y.index_add(0, tok, wg[tok, slot].to(acc)[:, None] * part.to(acc))
    return differentiable_reduce_scatter_dim0(y.to(h.dtype), group)


__all__ = ["OVERLAP_MIN_SHARD", "STRATEGIES", "STRATEGY_ENV", "TpMoeRouting", "ag_scatter_grouped_mm",
           "ag_scatter_grouped_mm_ref", "decomposed_usable", "grouped_mm_gather_rs", "grouped_mm_gather_rs_ref"]
