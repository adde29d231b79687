"""The ``symm`` strategy of flux.moe_dispatch / flux.moe_combine: rows moved through the group's
symmetric workspace (CUDA, NCCL groups).

No NCCL call: the ranks exchange their per-expert counts and then their rows through the group's
symmetric workspace (flux.runtime.symm), SMs writing straight into the peers' buffers over NVLink
(``torch.ops.flux.moe_scatter_rows_``, csrc/moe/moe_rows.cu), ordered by flux's token-carrying
barrier (``Runtime.enqueue_barrier``: bounded, naming the peer on a timeout). flux/ops/moe.py
holds the API, the argument checks, the weighted sum, autograd and the interface this class
implements (``SymmStrategy``: see ``_AllToAll`` there); this module only moves rows, with
arguments already checked to agree across ranks.

Workspace regions (byte offsets, 256-aligned, the same on every rank):

    counts   [W, E] int32      row s: rank s's number of (token, slot) pairs per global expert
    rows     [rows_cap, H]     rows arriving here: dispatch (and ``to_experts``): the rows of our
                               experts, in recv_x's layout; ``to_sources``: our own pairs' rows
                               back from the experts, at their index in our send order. In the
                               moved tensor's dtype, copied as bytes (an fp8 dispatch moves uint8
                               rows of packed fp8 values and scales, H their byte length)
    tags     [rows_cap] int32  dispatch: per arriving row, its index in its sender's send order

Dispatch on rank r (T tokens, K slots; E experts, E_l = E / W per rank)::

    sort the T*K (token, slot) pairs by expert, stably (token, then slot), -1 slots last:
        the send order (send_pairs: the valid pairs; bounded: all T*K, the invalid ones padding)
    counts_r = per-expert counts                      [E]
    barrier                                           nobody still reads our workspace
    counts_r into row r of every rank's counts        (a small copy per rank)
    barrier                                           every rank's counts are in
    C = counts [W, E]; unbounded: read on the host (it sizes the output), bounded: never
    send-order pair i, expert g, lands on rank d = g // E_l, local expert e = g % E_l, at
        unbounded  (rows of d's experts before e) + sum_{s<r} C[s, g] + (i's rank among our pairs to g)
        bounded    e * W * C_max                  + sum_{s<r} C[s, g] + (i's rank among our pairs to g)
    (bounded: zero our rows region)
    barrier                                           the destinations are free
    scatter x[token(i)] to rank d's rows region there, the tag i beside it
    barrier                                           every row has landed
    recv_x = a copy of our rows region (the next call reuses the region)

``to_sources`` (combine, dispatch's backward) sends each arriving row back to its sender, at the
tag, between two barriers; ``to_experts`` (combine's backward) repeats dispatch's movement for
other rows. The routing is kept in the handle's ``recv_dest``: for each arriving row its sender
and tag (``sender << 32 | tag``, -1: no row), then for each send-order pair its destination
(``rank << 32 | row``, -1: none). The bounded variant reads nothing on the host, so the whole
exchange can be captured in a CUDA graph.
"""
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from flux.runtime import runtime as _runtime
from flux.runtime import symm

_ALIGN = 256
_SHIFT = 32


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def usable(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """None where this strategy can run for ``group``'s tensors on ``device`` (the group's device,
    flux.runtime.group_device: never an argument not yet checked), else the reason it cannot; the
    same on every rank: it depends on the group and the device type only."""
    if device.type != "cuda":
        return "the tensors are not on a GPU"
    if dist.get_world_size(group) < 2:
        return "a group of one rank"
    if not symm.available(group):
        return "no symmetric workspace for this group (it needs flux._C, a GPU and an NCCL group)"
    if not hasattr(torch.ops.flux, "moe_scatter_rows_"):
        return "flux._C predates moe_scatter_rows_ (rebuild flux)"
    return None


def _token(phase: str, num_experts: int, hidden: int, k: int, dtype: torch.dtype, cap: Optional[int]) -> int:
    """The barriers' token: op code 3 (the MoE ops) in the top two bits, a CRC of what every rank
    must agree on (not T, which may differ between ranks) in the rest; never 0."""
    text = f"moe:{phase}:{num_experts}:{hidden}:{k}:{dtype}:{cap}"
    return (3 << 30) | (zlib.crc32(text.encode()) & 0x3FFFFFFF) | 1


def _regions(world: int, num_experts: int, rows_cap: int, row_bytes: int):
    """(rows offset, tags offset, total bytes); the counts region is at 0."""
    rows_off = _align(world * num_experts * 4)
    tags_off = rows_off + _align(rows_cap * row_bytes)
    return rows_off, tags_off, tags_off + _align(rows_cap * 4)


def _encode(major: torch.Tensor, minor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, (major << _SHIFT) | minor, torch.full_like(minor, -1))


def _decode(code: torch.Tensor):
    """(major, minor) of codes; major -1 where the code is -1."""
    major = torch.where(code >= 0, code >> _SHIFT, torch.full_like(code, -1))
    return major, code & ((1 << _SHIFT) - 1)


def _move(rows: torch.Tensor, src_rows, dst_code: torch.Tensor, tags, group, token: int, rows_cap: int,
          num_experts: int, zero_first: bool):
    """Every row i with dst_code[i] >= 0 (rows[src_rows[i]], or rows[i]) into its rank's rows
    region at its row, tags beside them; barriers before and after. Returns (workspace, rows
    offset, tags offset)."""
    world = dist.get_world_size(group)
    row_bytes = rows.shape[-1] * rows.element_size()
    rows_off, tags_off, total = _regions(world, num_experts, rows_cap, row_bytes)
    rt = _runtime.get(group, total)  # grows collectively: every rank asks for the same size
    ws = symm.get_workspace(group, 1)
    if zero_first:  # rows of the region that nobody writes read as zeros
        ws.view(dist.get_rank(group), [rows_cap * row_bytes], torch.uint8, rows_off).zero_()
    dst_rank, dst_row = _decode(dst_code)
    rt.enqueue_barrier(token)
    torch.ops.flux.moe_scatter_rows_(rows, src_rows, dst_rank, dst_row, tags, ws.buffer_ptrs_dev, world,
                                     ws.base_offset + rows_off, ws.base_offset + tags_off)
    rt.enqueue_barrier(token)
    return ws, rows_off, tags_off


class SymmStrategy:
    """flux/ops/moe.py's strategy interface over the symmetric workspace (module docstring)."""

    name = "symm"

    @staticmethod
    def gather_small(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """``[W, n]``: every rank's int64 ``t`` ``[n]``, through the counts region between two
        barriers (no NCCL call and no host read, so the bounded dispatch's deferred verdict can
        be captured in a CUDA graph with the rest)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = t.numel()
        rt = _runtime.get(group, _align(world * n * 8))
        ws = symm.get_workspace(group, 1)
        token = _token("gather", n, 0, 0, t.dtype, None)
        rt.enqueue_barrier(token)
        for p in range(world):
            ws.view(p, [world, n], torch.int64)[rank].copy_(t.reshape(-1).to(torch.int64))
        rt.enqueue_barrier(token)
        return ws.view(rank, [world, n], torch.int64).clone()

    @staticmethod
    def dispatch(x, topk_idx, num_experts, group, capacity, any_error):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        t, k = topk_idx.shape
        h = x.shape[-1]
        el = num_experts // world
        dev = x.device
        x = x.contiguous()
        token = _token("dispatch", num_experts, h, k, x.dtype, capacity)
        idx = topk_idx.reshape(-1).to(torch.int64)
        ok = (idx >= 0) & (idx < num_experts)
        if any_error is not None:  # a rank's data was invalid: every rank sends nothing
            ok &= ~any_error
        key = torch.where(ok, idx, torch.full_like(idx, num_experts))  # invalid slots sort last
        key_sorted, order = torch.sort(key, stable=True)
        # (bincount would read its input's maximum on the host: no graph capture)
        counts_full = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
        counts_full.scatter_add_(0, key, torch.ones_like(key))
        send_counts = counts_full[:num_experts].to(torch.int32)
        first_of_key = torch.cumsum(counts_full, 0) - counts_full
        valid = key_sorted < num_experts
        g = torch.where(valid, key_sorted, torch.zeros_like(key_sorted))
        rank_in_expert = torch.arange(t * k, device=dev) - first_of_key[key_sorted]

        # The counts: our row into every rank's counts region, between two barriers.
        rt = _runtime.get(group, _regions(world, num_experts, 0, 0)[2])
        ws = symm.get_workspace(group, 1)
        rt.enqueue_barrier(token)
        for p in range(world):
            ws.view(p, [world, num_experts], torch.int32)[rank].copy_(send_counts)
        rt.enqueue_barrier(token)
        counts = ws.view(rank, [world, num_experts], torch.int32).to(torch.int64)  # a copy, [W, E]
        before_us = counts[:rank].sum(0)  # rows of expert g from the senders before us
        mine = counts[:, rank * el:(rank + 1) * el]  # [W, E_l]: what we receive

        if capacity is None:
            host = counts.tolist()  # the unbounded variant's one host synchronisation
            per_expert = [sum(host[s][e] for s in range(world)) for e in range(num_experts)]
            starts, rows_of_rank = [], []
            for d in range(world):
                acc = 0
                for e in range(d * el, (d + 1) * el):
                    starts.append(acc)
                    acc += per_expert[e]
                rows_of_rank.append(acc)
            expert_start = torch.tensor(starts, dtype=torch.int64, device=dev)
            rows_cap = max(rows_of_rank)
            n_recv = rows_of_rank[rank]
            n_send = sum(host[rank])
            sizes = per_expert[rank * el:(rank + 1) * el] + [sum(row) for row in host] + [rows_cap]
        else:
            expert_start = (torch.arange(num_experts, device=dev) % el) * (world * capacity)
            rows_cap = n_recv = el * world * capacity
            n_send = t * k
            sizes = []
        send_code = _encode(torch.div(g, el, rounding_mode="floor"), expert_start[g] + before_us[g] + rank_in_expert,
                            valid)[:n_send]
        tags = torch.arange(n_send, device=dev, dtype=torch.int32)
        ws, rows_off, tags_off = _move(x, torch.div(order[:n_send], k, rounding_mode="floor"), send_code, tags,
                                       group, token, rows_cap, num_experts, zero_first=capacity is not None)
        arrived_tags = ws.view(rank, [n_recv], torch.int32, tags_off).to(torch.int64)
        if capacity is None:
            recv_x = ws.view(rank, [n_recv, h], x.dtype, rows_off).clone()
            # Senders of the arriving rows: per local expert, blocks of C[s, e] rows, s = 0 .. W-1.
            senders = torch.arange(world, device=dev).repeat(el)
            sender = torch.repeat_interleave(senders, mine.t().reshape(-1), output_size=n_recv)
            arrived = torch.ones(n_recv, dtype=torch.bool, device=dev)
        else:
            span = world * capacity
            recv_x = ws.view(rank, [el, span, h], x.dtype, rows_off).clone()
            # Row j of local expert e came from the sender s with cum[s-1] <= j < cum[s].
            cum = torch.cumsum(mine.t(), 1).contiguous()  # [E_l, W]
            j = torch.arange(span, device=dev).expand(el, span).contiguous()
            sender = torch.searchsorted(cum, j, right=True).reshape(-1)
            arrived = (j < cum[:, -1:]).reshape(-1)
        recv_code = _encode(sender, arrived_tags, arrived)
        send_pairs = torch.where(valid, order, torch.full_like(order, t * k))[:n_send].contiguous()
        return recv_x, mine.sum(0), send_pairs, torch.cat([recv_code, send_code]), sizes

    @staticmethod
    def fake_dispatch(x, topk_idx, num_experts, world, capacity):
        el, h, k = num_experts // world, x.shape[-1], topk_idx.shape[-1]
        i64 = dict(dtype=torch.int64, device=x.device)
        if capacity is None:
            ctx = torch.library.get_ctx()
            r, s = ctx.new_dynamic_size(), ctx.new_dynamic_size()
            return (x.new_empty((r, h)), torch.empty(el, **i64), torch.empty(s, **i64), torch.empty(r + s, **i64),
                    el + world + 1)
        n_recv, n_send = el * world * capacity, topk_idx.shape[0] * k
        return (x.new_empty((el, world * capacity, h)), torch.empty(el, **i64), torch.empty(n_send, **i64),
                torch.empty(n_recv + n_send, **i64), 0)

    @staticmethod
    def _recv_rows(handle) -> int:
        n = 1
        for s in handle.recv_shape[:-1]:
            n *= s
        return n

    @staticmethod
    def to_experts(rows, handle):
        """``[S, H]`` rows in send order -> recv_x's layout on their experts' ranks."""
        group, h = handle.group, rows.shape[-1]
        n_recv = SymmStrategy._recv_rows(handle)
        send_code = handle.recv_dest[n_recv:]
        if handle.bounded:
            rows_cap = n_recv
        else:
            rows_cap = handle.host_extra()[handle.world]
        token = _token("to_experts", handle.num_experts, h, handle.topk, rows.dtype, handle.max_tokens_per_rank)
        ws, rows_off, _ = _move(rows.contiguous(), None, send_code, None, group, token, rows_cap, handle.num_experts,
                                zero_first=handle.bounded)
        out = ws.view(dist.get_rank(group), [n_recv, h], rows.dtype, rows_off).clone()
        return out.view(*handle.recv_shape[:-1], h)

    @staticmethod
    def to_sources(y, handle):
        """recv_x-layout rows -> ``[S, H]`` back on their senders, in send order (padding zero)."""
        group, h = handle.group, y.shape[-1]
        n_recv = SymmStrategy._recv_rows(handle)
        s = handle.send_pairs.shape[0]
        if handle.bounded:
            landing = handle.max_tokens_per_rank * handle.topk
        else:
            landing = max(handle.host_extra()[:handle.world])
        token = _token("to_sources", handle.num_experts, h, handle.topk, y.dtype, handle.max_tokens_per_rank)
        ws, rows_off, _ = _move(y.reshape(-1, h).contiguous(), None, handle.recv_dest[:n_recv], None, group, token, landing,
                                handle.num_experts, zero_first=False)
        # Padding rows (bounded: -1 slots) were never written: zeros, not whatever the region held.
        # A bounded call with T > C on some rank (reported by handle.check()) has more send-order
        # rows than the region holds; nothing was sent then, and the rows past it are zeros too.
        n = min(s, landing)
        back = ws.view(dist.get_rank(group), [n, h], y.dtype, rows_off)
        if n < s:
            back = torch.cat([back, back.new_zeros((s - n, h))])
        real = (handle.send_pairs < handle.num_tokens * handle.topk)[:, None]
        return torch.where(real, back, torch.zeros((), dtype=y.dtype, device=y.device))
