"""The ``sequential`` strategy of flux.moe_dispatch / moe_combine (formerly named ``all_to_all``,
after the collective it runs): the reference strategy and the CPU path, rows moved by
``all_to_all_single`` on NCCL or gloo, then the compute (docs/api.md, MoE strategies).
"""
from typing import List

import torch
import torch.distributed as dist

from flux.ops.moe.handle import MoeHandle, _all_to_all, _extend, _place


class _AllToAll:
    """Rows moved by ``all_to_all_single`` (NCCL or gloo); see the module docstring."""

    name = "sequential"

    @staticmethod
    def dispatch(x, topk_idx, num_experts, group, capacity, any_error):
        """(recv_x, counts, send_pairs, recv_dest, host ints) of one dispatch: see MoeHandle; the
        host ints are meta's tail (unbounded: counts, then the send and receive split sizes;
        bounded: none). ``any_error`` is a device bool (the deferred verdict) or None: when true,
        nothing is sent (every rank sees the same verdict, so the exchange stays matched)."""
        world = dist.get_world_size(group)
        el = num_experts // world
        t, k = topk_idx.shape
        h = x.shape[-1]
        dev = x.device
        idx = topk_idx.reshape(-1).to(torch.int64)
        ok = (idx >= 0) & (idx < num_experts)
        if any_error is not None:
            ok &= ~any_error
        key = torch.where(ok, idx, num_experts)  # invalid slots sort last, and count nowhere
        key_sorted, order = torch.sort(key, stable=True)  # by expert, then pair t * K + k
        send_counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
        send_counts.scatter_add_(0, key, torch.ones_like(key))
        send_counts = send_counts[:num_experts].contiguous()  # [W * E_l], by (destination, expert)
        recv_counts = torch.empty_like(send_counts)
        _all_to_all(recv_counts, send_counts, None, None, group)
        rc = recv_counts.view(world, el)  # [source, expert]
        counts = rc.sum(0)
        if capacity is None:
            host = torch.cat([send_counts, recv_counts]).tolist()  # the host read that sizes the rows
            sc, rch = host[:num_experts], host[num_experts:]
            send_splits = [sum(sc[d * el:(d + 1) * el]) for d in range(world)]
            recv_splits = [sum(rch[s * el:(s + 1) * el]) for s in range(world)]
            n_send, n_recv = sum(send_splits), sum(recv_splits)
            send_pairs = order[:n_send].contiguous()
            # Received rows come by (source, expert, token, slot); row j of block (s, e) goes to
            # the start of expert e + the rows of e from sources before s + j.
            e_start = counts.cumsum(0) - counts
            s_start = rc.cumsum(0) - rc
            base = (e_start[None, :] + s_start).reshape(-1)
            flat = rc.reshape(-1)
            block = torch.repeat_interleave(torch.arange(world * el, device=dev), flat, output_size=n_recv)
            block_start = flat.cumsum(0) - flat
            recv_dest = base[block] + torch.arange(n_recv, device=dev) - block_start[block]
            rows = _extend(x)[torch.div(send_pairs, k, rounding_mode="floor")]
            received = x.new_empty((n_recv, h))
            _all_to_all(received, rows, recv_splits, send_splits, group)
            recv_x = _place(received, recv_dest, n_recv)
            return recv_x, counts, send_pairs, recv_dest, _expert_totals(rch, world, el) + send_splits + recv_splits
        # Bounded: blocks of P rows per destination, placed on the device.
        p = capacity * min(k, el)
        per_rank = send_counts.view(world, el).sum(1)
        rank_start = torch.cat([per_rank.cumsum(0) - per_rank, per_rank.sum().reshape(1)])
        dest_rank = torch.div(key_sorted, el, rounding_mode="floor")  # W for invalid slots
        within = torch.arange(t * k, device=dev) - rank_start[dest_rank]
        slot = torch.where((dest_rank < world) & (within < p), dest_rank * p + within,
                           torch.full_like(within, world * p))
        send_pairs = torch.full((world * p + 1,), t * k, dtype=torch.int64, device=dev)
        send_pairs.scatter_(0, slot, order)
        send_pairs = send_pairs[:world * p].clone()
        rows = _extend(x)[torch.div(send_pairs, k, rounding_mode="floor")]
        received = x.new_empty((world * p, h))
        _all_to_all(received, rows, None, None, group)
        # Row j of source s's block belongs to the expert e with incl[s, e-1] <= j < incl[s, e]
        # (E_l: padding), at place s_start[s, e] + j - excl[s, e] of e's W*C rows.
        incl = rc.cumsum(1)
        j = torch.arange(p, device=dev).expand(world, p).contiguous()
        e = torch.searchsorted(incl, j, right=True)  # [W, P]
        zero_col = rc.new_zeros((world, 1))
        excl = torch.cat([incl - rc, zero_col], 1)
        s_start = torch.cat([rc.cumsum(0) - rc, zero_col], 1)
        place = s_start.gather(1, e) + j - excl.gather(1, e)
        rows_per_expert = world * capacity
        n_out = el * rows_per_expert
        recv_dest = torch.where((e < el) & (place < rows_per_expert), e * rows_per_expert + place,
                                torch.full_like(place, n_out)).reshape(-1)
        recv_x = _place(received, recv_dest, n_out).view(el, rows_per_expert, h)
        return recv_x, counts, send_pairs, recv_dest, []

    @staticmethod
    def fake_dispatch(x, topk_idx, num_experts, world, capacity, read_counts=True):  # read_counts: one rank only
        """Fake (meta) outputs of ``dispatch`` for torch.compile: the same shapes, R and S
        dynamic in the unbounded variant."""
        el, h, k = num_experts // world, x.shape[-1], topk_idx.shape[-1]
        i64 = dict(dtype=torch.int64, device=x.device)
        if capacity is None:
            ctx = torch.library.get_ctx()
            r, n_send = ctx.new_dynamic_size(), ctx.new_dynamic_size()
            return (x.new_empty((r, h)), torch.empty(el, **i64), torch.empty(n_send, **i64), torch.empty(r, **i64),
                    el + 2 * world)
        n = world * capacity * min(k, el)
        return (x.new_empty((el, world * capacity, h)), torch.empty(el, **i64), torch.empty(n, **i64),
                torch.empty(n, **i64), 0)

    @staticmethod
    def _splits(handle: MoeHandle):
        """(send split sizes, receive split sizes): lists of W ints (unbounded), None (bounded)."""
        if handle.bounded:
            return None, None
        extra, w = handle.host_extra(), handle.world
        return extra[:w], extra[w:2 * w]

    @staticmethod
    def to_experts(rows: torch.Tensor, handle: MoeHandle) -> torch.Tensor:
        """Send rows (``[S, H]``, send order) -> recv_x's layout on their experts' ranks."""
        send_splits, recv_splits = _AllToAll._splits(handle)
        received = rows.new_empty((handle.recv_dest.shape[0], rows.shape[-1]))
        _all_to_all(received, rows, recv_splits, send_splits, handle.group)
        n = 1
        for s in handle.recv_shape[:-1]:
            n *= s
        return _place(received, handle.recv_dest, n).view(*handle.recv_shape[:-1], rows.shape[-1])

    @staticmethod
    def to_sources(y: torch.Tensor, handle: MoeHandle) -> torch.Tensor:
        """recv_x-layout rows -> ``[S, H]`` back on their sources, in send order (the inverse of
        to_experts; padding rows zero)."""
        h = y.shape[-1]
        back = _extend(y.reshape(-1, h))[handle.recv_dest]
        out = y.new_empty((handle.send_pairs.shape[0], h))
        send_splits, recv_splits = _AllToAll._splits(handle)
        _all_to_all(out, back, send_splits, recv_splits, handle.group)
        return out


def _expert_totals(rch: List[int], world: int, el: int) -> List[int]:
    """Per-expert totals of a [W * E_l] list of per-(source, expert) counts."""
    return [sum(rch[s * el + e] for s in range(world)) for e in range(el)]
