"""Unchecked references of flux.moe_dispatch / moe_combine: all-gather every rank's rows and
routing, then select locally (simple and slow: tests, and comparing strategies).
"""
from typing import Optional

import torch
import torch.distributed as dist

from flux.ops.moe.fp8 import _pack_fp8, _unpack_fp8
from flux.ops.moe.handle import OP, _acc_dtype, _all_gather_small
from flux.runtime import resolve_group


def _gather_padded(t: torch.Tensor, rows: int, fill, group) -> torch.Tensor:
    """[W, rows, ...]: every rank's t padded with ``fill`` to ``rows`` rows."""
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return _all_gather_small(torch.cat([t, pad]), group)


def _ref_routing(topk_idx, num_experts, group):
    """Every rank's T and topk_idx ([W, Tmax, K], padded with -1)."""
    sizes = _all_gather_small(torch.tensor([topk_idx.shape[0]], device=topk_idx.device), group).reshape(-1).tolist()
    return sizes, _gather_padded(topk_idx.to(torch.int64), max(sizes), -1, group)


def moe_dispatch_ref(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                     group: Optional[dist.ProcessGroup] = None, max_tokens_per_rank: Optional[int] = None,
                     fp8: bool = False):
    """``(recv_x, counts)`` of ``moe_dispatch``, by all-gathering every rank's x (fp8: its
    quantised rows) and topk_idx and selecting this rank's rows; unchecked, no handle, no
    autograd."""
    group = resolve_group(group, OP)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    el = num_experts // world
    h = x.shape[-1]
    if fp8:
        x = _pack_fp8(x)
    sizes, idx_all = _ref_routing(topk_idx, num_experts, group)
    x_all = _gather_padded(x, max(sizes), 0, group)  # [W, Tmax, H]
    blocks, counts = [], []
    for e in range(el):
        src, tok, _ = (idx_all == rank * el + e).nonzero(as_tuple=True)  # lexicographic: (source, token, slot)
        blocks.append(x_all[src, tok])
        counts.append(src.shape[0])
    if max_tokens_per_rank is not None:
        c = world * max_tokens_per_rank
        blocks = [torch.cat([b, b.new_zeros((c - b.shape[0], x.shape[-1]))]) for b in blocks]
        recv_x = torch.stack(blocks) if blocks else x.new_zeros((0, c, x.shape[-1]))
    else:
        recv_x = torch.cat(blocks)
    if fp8:
        recv_x = _unpack_fp8(recv_x, h)
    return recv_x, torch.tensor(counts, dtype=torch.int64, device=x.device)


def moe_combine_ref(y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                    group: Optional[dist.ProcessGroup] = None,
                    max_tokens_per_rank: Optional[int] = None) -> torch.Tensor:
    """``moe_combine`` of ``y`` for the dispatch of these topk_idx / topk_weights, by all-gathering
    every rank's y and routing and summing this rank's tokens' rows in fp32; unchecked."""
    group = resolve_group(group, OP)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    el = num_experts // world
    h = y.shape[-1]
    sizes, idx_all = _ref_routing(topk_idx, num_experts, group)
    n_rows = _all_gather_small(torch.tensor([y.reshape(-1, h).shape[0]], device=y.device), group).reshape(-1)
    y_all = _gather_padded(y.reshape(-1, h), int(n_rows.max()), 0, group)  # [W, rows, H]
    acc = _acc_dtype(y.dtype)
    out = torch.zeros((topk_idx.shape[0], h), dtype=acc, device=y.device)
    for g in range(num_experts):
        d, e = divmod(g, el)
        src, tok, slot = (idx_all == g).nonzero(as_tuple=True)
        if max_tokens_per_rank is not None:
            start = e * world * max_tokens_per_rank
        else:
            start = int((idx_all >= d * el).logical_and(idx_all < g).sum())  # rows of d's experts before e
        mine = (src == rank).nonzero(as_tuple=True)[0]
        for i in mine.tolist():
            t, k = int(tok[i]), int(slot[i])
            out[t] += topk_weights[t, k].to(acc) * y_all[d, start + i].to(acc)
    return out.to(y.dtype)
