"""The ``symm`` strategy of flux.moe_dispatch / flux.moe_combine: rows moved through the group's
symmetric workspace (CUDA, NCCL groups).

No NCCL call: the ranks exchange their per-expert counts and then their rows through the group's
symmetric workspace (flux.runtime.symm), SMs writing straight into the peers' buffers over NVLink
(``torch.ops.flux.moe_scatter_rows_``, csrc/moe/moe_rows.cu), ordered by flux's token-carrying
barrier (``Runtime.enqueue_barrier``: bounded, naming the peer on a timeout). The rest of the
package (flux/ops/moe/strategies.py) holds the checks, the weighted sum, autograd and the
interface this class implements (``SymmStrategy``; ``_AllToAll`` is the model); this module only
moves rows, with arguments already checked to agree across ranks.

The unbounded dispatch sorts this rank's pairs by expert (the send order), exchanges (counts, T)
through every rank's header region between two barriers, reads the counts on the host (they size
recv_x), sends each token's row once per destination rank and a (send index, token) tag per pair,
and after a closing barrier copies the other ranks' pairs into recv_x. The bounded dispatch
(csrc/moe/moe_bounded.cu, ``_Bounded``) moves the same with flags instead of the closing barrier
and nothing read on the host (CUDA-graph capturable). ``to_sources`` sends each arriving row back
to its sender at its tag; ``to_experts`` moves one row per pair to the row dispatch gave it. The
handle's ``recv_dest`` keeps the routing: per arriving row ``sender << 32 | tag``, then per
send-order pair ``rank << 32 | row`` (-1: none). Workspace regions and the schedule:
docs/design.md (MoE dispatch and combine, unbounded ``symm``).
"""
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from flux.runtime import runtime as _runtime
from flux.runtime import symm

_ALIGN = 256
_SHIFT = 32
MOE_CHANNEL = 1  # the signal pad channel of the bounded moves' flags (flux/runtime/symm.py: data channels)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def usable(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """None where this strategy can run for ``group``'s tensors on ``device`` (the group's device,
    flux.runtime.group_device: never an argument not yet checked), else the reason it cannot; the
    same on every rank: it depends on the group and the device type only."""
    why = symm.unusable(group, device)
    if why is not None:
        return why
    if not hasattr(torch.ops.flux, "moe_scatter_rows_"):
        return "flux._C predates moe_scatter_rows_ (rebuild flux)"
    return None


def _token(phase: str, num_experts: int, hidden: int, k: int, dtype: torch.dtype, cap: Optional[int]) -> int:
    """The barriers' token: op code 3 (the MoE ops, the tensor-parallel ones too: their phases are
    "tp_ag" and "tp_rs") in the top two bits, a CRC of what every rank
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
          num_experts: int, local_out: Optional[torch.Tensor] = None):
    """Every row i with dst_code[i] >= 0 (rows[src_rows[i]], or rows[i]) into its rank's rows
    region at its row, tags beside them; barriers before and after. ``local_out``: the rows for
    this rank go there instead, at their row (tags still to the region). Returns (workspace, rows
    offset, tags offset)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    row_bytes = rows.shape[-1] * rows.element_size()
    rows_off, tags_off, total = _regions(world, num_experts, rows_cap, row_bytes)
    rt = _runtime.get(group, total)  # grows collectively: every rank asks for the same size
    ws = symm.get_workspace(group, 1)
    dst_rank, dst_row = _decode(dst_code)
    rt.enqueue_barrier(token)
    torch.ops.flux.moe_scatter_rows_(rows, src_rows, dst_rank, dst_row, tags, ws.buffer_ptrs_dev, world,
                                     ws.base_offset + rows_off, ws.base_offset + tags_off, local_out, rank, rows_cap)
    rt.enqueue_barrier(token)
    return ws, rows_off, tags_off


def _collect(out: torch.Tensor, ws, rows_off: int, sender: torch.Tensor, rank: int) -> torch.Tensor:
    """After a _move with ``local_out=out``: the rows other ranks sent (``sender`` per row of out,
    its source rank) copied from our rows region into out, in one pass; returns out."""
    n = out.shape[0]
    if n:
        landed = ws.view(rank, list(out.shape), out.dtype, rows_off)
        keep = torch.where(sender != rank, rank, -1)  # int64: our rank (into out), or -1 (already there)
        torch.ops.flux.moe_scatter_rows_(landed, None, keep, torch.arange(n, device=out.device), None,
                                         ws.buffer_ptrs_dev, ws.world, 0, 0, out, rank, n)
    return out


class _TokenRows:
    """The unbounded dispatch's move of token rows (module docstring), in two halves around the
    host read of the counts: what does not depend on the counts is computed before it (while the
    GPU runs the counts' barriers), and after it the entry barrier is enqueued first, so the GPU
    works on it while the host builds the pairs' destinations."""

    def __init__(self, x, topk_idx, order, valid, dest, k: int, el: int, group):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        t, dev = x.shape[0], x.device
        self.x, self.group, self.t = x, group, t
        if t:
            # Which other ranks each token goes to: entry (t, d) of [T, W] is rank d or -1.
            owner = torch.where(topk_idx >= 0, torch.div(topk_idx.to(torch.int64), el, rounding_mode="floor"),
                                self.world)
            goes = torch.zeros((t, self.world + 1), dtype=torch.bool, device=dev).scatter_(1, owner, True)
            goes = goes[:, :self.world]
            goes[:, self.rank] = False
            entry = torch.arange(t * self.world, device=dev)
            self.tok = torch.div(entry, self.world, rounding_mode="floor")
            self.tok_dst = torch.where(goes.reshape(-1), entry % self.world, -1)
        self.src_token = torch.div(order, k, rounding_mode="floor")  # per send-order pair
        self.tok32 = self.src_token.to(torch.int32).reshape(-1, 1)
        self.tags = torch.arange(order.shape[0], device=dev, dtype=torch.int32)
        self.dest = dest
        self.own = torch.where(valid & (dest == self.rank), self.rank, -1)

    def enter(self, tokens_of, rows_cap: int, token: int):
        """Grow the workspace for this call (collectively: the sizes are the same everywhere) and
        enqueue the entry barrier. Returns the workspace."""
        row_bytes = self.x.shape[-1] * self.x.element_size()
        self.tokens_of, self.rows_cap, self.token = tokens_of, rows_cap, token
        self.off = {"rows": 0, "tags": _align(sum(tokens_of) * row_bytes)}
        self.off["tokens"] = self.off["tags"] + _align(rows_cap * 4)
        rt = _runtime.get(self.group, self.off["tokens"] + _align(rows_cap * 4))
        self.rt, self.ws = rt, symm.get_workspace(self.group, 1)
        rt.enqueue_barrier(token)
        return self.ws

    def move(self, n_send: int, dst_row, recv_x):
        """Token rows to the other ranks, every pair's (send index, token) to its row on its
        expert's rank, our own pairs' rows into recv_x; then the closing barrier."""
        ws, base, world, rank = self.ws, self.ws.base_offset, self.world, self.rank
        if self.t:
            first = sum(self.tokens_of[:rank])
            torch.ops.flux.moe_scatter_rows_(self.x, self.tok, self.tok_dst, first + self.tok, None,
                                             ws.buffer_ptrs_dev, world, base + self.off["rows"], 0, None, -1,
                                             sum(self.tokens_of))
        if n_send:  # the first n_send pairs of the send order are the valid ones
            torch.ops.flux.moe_scatter_rows_(self.tok32[:n_send], None, self.dest[:n_send], dst_row,
                                             self.tags[:n_send], ws.buffer_ptrs_dev, world, base + self.off["tokens"],
                                             base + self.off["tags"], None, -1, self.rows_cap)
            torch.ops.flux.moe_scatter_rows_(self.x, self.src_token[:n_send], self.own[:n_send], dst_row, None,
                                             ws.buffer_ptrs_dev, world, 0, 0, recv_x, rank, recv_x.shape[0])
        self.rt.enqueue_barrier(self.token)


class SymmStrategy:
    """flux/ops/moe/strategies.py's strategy interface over the symmetric workspace (module docstring)."""

    name = "symm"

    @staticmethod
    def dispatch(x, topk_idx, num_experts, group, capacity, any_error):
        """The unbounded dispatch (the bounded one is dispatch_bounded)."""
        assert capacity is None and any_error is None
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        t, k = topk_idx.shape
        h = x.shape[-1]
        el = num_experts // world
        dev = x.device
        x = x.contiguous()
        token = _token("dispatch", num_experts, h, k, x.dtype, capacity)
        # The bounded variant's routing kernel, with a capacity that holds any expert's pairs (T):
        # send order, and each pair's expert and rank among its expert's pairs, from its block row.
        n, cap = t * k, max(t, 1)
        order = torch.empty(n, dtype=torch.int64, device=dev)
        block = torch.empty(n, dtype=torch.int64, device=dev)
        send_counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
        scratch = [torch.empty(n, dtype=torch.int64, device=dev), torch.empty(1, dtype=torch.int64, device=dev)]
        torch.ops.flux.moe_route_(topk_idx.to(torch.int64).contiguous(), num_experts, world, rank, cap, 0, order,
                                  block, scratch[0], send_counts, scratch[1])
        valid = block >= 0
        dest, row = _decode(block)
        g = torch.where(valid, dest * el + torch.div(row, world * cap, rounding_mode="floor"), torch.zeros_like(row))
        rank_in_expert = row % cap
        moves = _TokenRows(x, topk_idx, order, valid, dest, k, el, group)  # what needs no counts, queued now

        # The counts and our T: our row into every rank's [W, E + 1] header region, between two
        # barriers.
        e1 = num_experts + 1
        rt = _runtime.get(group, _align(world * e1 * 4))
        ws = symm.get_workspace(group, 1)
        header = torch.cat([send_counts, torch.full((1,), t, dtype=torch.int32, device=dev)])
        rt.enqueue_barrier(token)
        for p in range(world):
            ws.view(p, [world, e1], torch.int32)[rank].copy_(header)
        rt.enqueue_barrier(token)
        allc = ws.view(rank, [world, e1], torch.int32).to(torch.int64)  # a copy, [W, E + 1]
        counts = allc[:, :num_experts]
        before_us = counts[:rank].sum(0)  # rows of expert g from the senders before us
        mine = counts[:, rank * el:(rank + 1) * el]  # [W, E_l]: what we receive
        senders = torch.arange(world, device=dev).repeat(el)

        every = allc.tolist()  # the unbounded variant's one host synchronisation
        host = [r[:num_experts] for r in every]
        tokens_of = [r[num_experts] for r in every]
        per_expert = [sum(host[s][e] for s in range(world)) for e in range(num_experts)]
        starts, rows_of_rank = [], []
        for d in range(world):
            acc = 0
            for e in range(d * el, (d + 1) * el):
                starts.append(acc)
                acc += per_expert[e]
            rows_of_rank.append(acc)
        rows_cap = max(rows_of_rank)
        n_recv = rows_of_rank[rank]
        n_send = sum(host[rank])
        ws = moves.enter(tokens_of, rows_cap, token)  # the GPU takes the entry barrier meanwhile
        sizes = per_expert[rank * el:(rank + 1) * el] + [sum(row) for row in host] + [rows_cap]
        expert_start = torch.tensor(starts, dtype=torch.int64, device=dev)
        dst_row = (expert_start[g] + before_us[g] + rank_in_expert)[:n_send]  # the valid pairs come first
        send_code = _encode(dest[:n_send], dst_row, valid[:n_send])
        recv_x = torch.empty((n_recv, h), dtype=x.dtype, device=dev)
        moves.move(n_send, dst_row, recv_x)
        off = moves.off
        # Arrived pairs: per local expert, blocks of C[s, e] rows, s = 0 .. W-1; each carries its
        # send index and its token on the sender, whose row came once into our token rows.
        sender = torch.repeat_interleave(senders, mine.t().reshape(-1), output_size=n_recv)
        arrived_tags = ws.view(rank, [n_recv], torch.int32, off["tags"]).to(torch.int64)
        if n_recv:
            arrived_tok = ws.view(rank, [n_recv], torch.int32, off["tokens"]).to(torch.int64)
            tok_base = torch.tensor([0] + tokens_of[:-1], dtype=torch.int64, device=dev).cumsum(0)
            landed = ws.view(rank, [max(sum(tokens_of), 1), h], x.dtype, off["rows"])
            keep = torch.where(sender != rank, rank, -1)  # our own pairs' rows are in recv_x already
            torch.ops.flux.moe_scatter_rows_(landed, tok_base[sender] + arrived_tok, keep,
                                             torch.arange(n_recv, device=dev), None, ws.buffer_ptrs_dev, world, 0,
                                             0, recv_x, rank, n_recv)
        recv_code = _encode(sender, arrived_tags, torch.ones(n_recv, dtype=torch.bool, device=dev))
        return recv_x, mine.sum(0), order[:n_send].contiguous(), torch.cat([recv_code, send_code]), sizes

    @staticmethod
    def fake_dispatch(x, topk_idx, num_experts, world, capacity, read_counts=True):  # read_counts: one rank only
        el, h, k = num_experts // world, x.shape[-1], topk_idx.shape[-1]
        i64 = dict(dtype=torch.int64, device=x.device)
        if capacity is None:
            ctx = torch.library.get_ctx()
            r, s = ctx.new_dynamic_size(), ctx.new_dynamic_size()
            return (x.new_empty((r, h)), torch.empty(el, **i64), torch.empty(s, **i64), torch.empty(r + s, **i64),
                    el + world + 1)
        n_recv, n_send = el * world * capacity, topk_idx.shape[0] * k
        return (x.new_empty((el, world * capacity, h)), torch.empty(el, **i64), torch.empty(n_send, **i64),
                torch.empty(_bounded_dest_len(n_recv, n_send, world, el), **i64), 0)

    @staticmethod
    def _recv_rows(handle) -> int:
        n = 1
        for s in handle.recv_shape[:-1]:
            n *= s
        return n

    # ----------------------------------------------------------------------------------
    # The bounded variant: csrc/moe/moe_bounded.cu (see _Bounded)

    @staticmethod
    def dispatch_bounded(x, topk_idx, num_experts, group, capacity, host_code, zero_pad=True):
        """The bounded dispatch, which also exchanges the ranks' error codes: returns
        ``(recv_x, counts, send_pairs, recv_dest, [], verdict)``. host_code: this rank's host-known
        code (flux/ops/moe/handle.py: _LOCAL_ARGS, _OVER_CAPACITY or 0); the route kernel adds the data
        verdict, and a rank with a nonzero code sends nothing; when any rank's code is nonzero,
        every rank's outputs are zeros (counts, recv_x) and -1 / padding (routing). zero_pad=False:
        recv_x's rows past the counts are not written (all of them on an error)."""
        b = _Bounded(group, num_experts, capacity, topk_idx.shape[-1])
        t, k, h = topk_idx.shape[0], topk_idx.shape[-1], x.shape[-1]
        n = t * k
        dev = x.device
        dest = torch.empty(_bounded_dest_len(b.n_recv, n, b.world, b.el), dtype=torch.int64, device=dev)
        recv_code, send_code, pair_pos, cmat = _bounded_views(dest, b.n_recv, n)
        send_pairs = torch.empty(n, dtype=torch.int64, device=dev)
        send_counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
        code = torch.empty(1, dtype=torch.int64, device=dev)
        idx64 = topk_idx.to(torch.int64).contiguous()
        torch.ops.flux.moe_route_(idx64, num_experts, b.world, b.rank, capacity, host_code, send_pairs, send_code,
                                  pair_pos, send_counts, code)
        x = x.contiguous()
        ws = b.enter(x, "dispatch")
        b.send(ws, x, send_pairs, k, send_code, True, send_counts, code, topk_idx=idx64)
        recv_x = torch.empty((b.el, b.world * capacity, h), dtype=x.dtype, device=dev)
        counts = torch.empty(b.el, dtype=torch.int64, device=dev)
        verdict = torch.empty(b.world, dtype=torch.int64, device=dev)
        b.recv_pack(ws, recv_x, recv_code, counts, verdict, None, cmat, send_code, send_pairs, pair_pos, zero_pad,
                    token_rows=True)
        return recv_x, counts, send_pairs, dest, [], verdict

    @staticmethod
    def combine_bounded(y, weights, handle, need_returned):
        """The bounded combine (y in float32, bfloat16 or float16): ``(out [T, H] in y's dtype,
        y's rows back in send order [S, H] or None)``, out[t] the weighted sum of its slots'
        rows (weights None: 1), equal bitwise to flux/ops/moe/handle.py's _sum_slots."""
        b = _Bounded(handle.group, handle.num_experts, handle.max_tokens_per_rank, handle.topk)
        n = handle.num_tokens * handle.topk
        recv_code, _, pair_pos, _ = _bounded_views(handle.recv_dest, b.n_recv, n)
        y = y.reshape(-1, y.shape[-1]).contiguous()
        ws = b.enter(y, "to_sources")
        b.send(ws, y, None, 1, recv_code, False, None, None)
        out = torch.empty((handle.num_tokens, y.shape[-1]), dtype=y.dtype, device=y.device)
        w = None if weights is None else weights.detach().to(torch.float32).contiguous()
        b.recv_sum(ws, out, w, pair_pos, n)
        return out, (SymmStrategy._returned(ws, b, y, handle) if need_returned else None)

    @staticmethod
    def _returned(ws, b, y, handle):
        """After a bounded move back: the rows in send order, zeros for padding."""
        h, s = y.shape[-1], handle.send_pairs.shape[0]
        # A call with T > C on some rank (reported by handle.check()) has more send-order rows
        # than the region holds; nothing was sent then, and the rows past it are zeros too.
        n = min(s, b.landing)
        back = ws.view(b.rank, [n, h], y.dtype, b.offsets(y)[1])
        if n < s:
            back = torch.cat([back, back.new_zeros((s - n, h))])
        real = (handle.send_pairs < handle.num_tokens * handle.topk)[:, None]
        return torch.where(real, back, torch.zeros((), dtype=y.dtype, device=y.device))

    # ----------------------------------------------------------------------------------

    @staticmethod
    def to_experts(rows, handle):
        """``[S, H]`` rows in send order -> recv_x's layout on their experts' ranks."""
        group, h = handle.group, rows.shape[-1]
        n_recv = SymmStrategy._recv_rows(handle)
        rows = rows.contiguous()
        if handle.bounded:
            b = _Bounded(group, handle.num_experts, handle.max_tokens_per_rank, handle.topk)
            _, send_code, _, cmat = _bounded_views(handle.recv_dest, n_recv, handle.num_tokens * handle.topk)
            ws = b.enter(rows, "to_experts")
            b.send(ws, rows, None, 1, send_code, False, None, None)
            out = torch.empty((n_recv, h), dtype=rows.dtype, device=rows.device)
            b.recv_pack(ws, out, None, None, None, cmat, None, None, None, None)
            return out.view(*handle.recv_shape[:-1], h)
        send_code = handle.recv_dest[n_recv:]
        rows_cap = handle.host_extra()[handle.world]
        token = _token("to_experts", handle.num_experts, h, handle.topk, rows.dtype, handle.max_tokens_per_rank)
        out = torch.empty((n_recv, h), dtype=rows.dtype, device=rows.device)
        ws, rows_off, _ = _move(rows, None, send_code, None, group, token, rows_cap, handle.num_experts,
                                local_out=out)
        return _collect(out, ws, rows_off, _decode(handle.recv_dest[:n_recv])[0], dist.get_rank(group))

    @staticmethod
    def to_sources(y, handle):
        """recv_x-layout rows -> ``[S, H]`` back on their senders, in send order (padding zero)."""
        group, h = handle.group, y.shape[-1]
        n_recv = SymmStrategy._recv_rows(handle)
        y = y.reshape(-1, h).contiguous()
        if handle.bounded:
            b = _Bounded(group, handle.num_experts, handle.max_tokens_per_rank, handle.topk)
            recv_code = _bounded_views(handle.recv_dest, n_recv, handle.num_tokens * handle.topk)[0]
            ws = b.enter(y, "to_sources")
            b.send(ws, y, None, 1, recv_code, False, None, None)
            b.wait(ws)
            return SymmStrategy._returned(ws, b, y, handle)
        s = handle.send_pairs.shape[0]
        landing = max(handle.host_extra()[:handle.world])
        token = _token("to_sources", handle.num_experts, h, handle.topk, y.dtype, handle.max_tokens_per_rank)
        ws, rows_off, _ = _move(y, None, handle.recv_dest[:n_recv], None, group, token, landing, handle.num_experts)
        back = ws.view(dist.get_rank(group), [s, h], y.dtype, rows_off)
        real = (handle.send_pairs < handle.num_tokens * handle.topk)[:, None]
        return torch.where(real, back, torch.zeros((), dtype=y.dtype, device=y.device))


def _bounded_dest_len(n_recv: int, n_send: int, world: int, el: int) -> int:
    return n_recv + 2 * n_send + world * el


def _bounded_views(dest: torch.Tensor, n_recv: int, n_send: int):
    """The bounded handle's recv_dest: (recv_code [R], send_code [S], pair_pos [S], counts
    [W * E_l]). recv_code: per recv_x row, ``sender << 32 | its index in the sender's send order``
    (-1: padding); send_code: per send-order row, ``rank << 32 | row in that rank's [E_l, W, C]
    blocks`` (-1: none); pair_pos: per (token, slot) pair, its send index (S: no row); counts:
    ``[s, e]`` the rows rank s sent to our local expert e (zeros after an error)."""
    return (dest[:n_recv], dest[n_recv:n_recv + n_send], dest[n_recv + n_send:n_recv + 2 * n_send],
            dest[n_recv + 2 * n_send:])


_DONE: dict = {}  # (group name, device) -> int32 [2]: the send and receive kernels' block counters


class _Bounded:
    """One bounded move over the workspace (csrc/moe/moe_bounded.cu): the entry barrier, then
    the send kernel (rows into the destinations' [E_l, W, C] blocks or, back, at their send
    index; the last block writes the counts and sets every rank's flag to 1 + its code), then a
    receive kernel that waits for every rank's flag (bounded, naming the missing rank)."""

    def __init__(self, group, num_experts: int, capacity: int, k: int):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.el = num_experts // self.world
        self.num_experts, self.capacity, self.k = num_experts, capacity, k
        self.n_recv = self.el * self.world * capacity
        self.landing = capacity * k  # rows back: one per (token, slot) of at most C tokens

    def offsets(self, rows: torch.Tensor):
        """(counts, rows, tags, tokens, total) byte offsets for rows of ``rows``' width and dtype
        (a dispatch's token rows, W * C, fit in the rows region too)."""
        row_bytes = rows.shape[-1] * rows.element_size()
        cap = max(self.n_recv, self.landing)
        rows_off = _align(self.world * self.el * 4)
        tags_off = rows_off + _align(cap * row_bytes)
        tok_off = tags_off + _align(cap * 4)
        return 0, rows_off, tags_off, tok_off, tok_off + _align(cap * 4)

    def enter(self, rows: torch.Tensor, phase: str):
        rt = _runtime.get(self.group, self.offsets(rows)[4])  # grows collectively: the same size everywhere
        ws = symm.get_workspace(self.group, 1)
        key = (self.group.group_name, rows.device.index)
        if key not in _DONE:
            _DONE[key] = torch.zeros(2, dtype=torch.int32, device=rows.device)
        self.done = _DONE[key]
        rt.enqueue_barrier(_token(phase, self.num_experts, rows.shape[-1], self.k, rows.dtype, self.capacity))
        return ws

    def send(self, ws, rows, order, k, dst_code, tags, counts, code, topk_idx=None):
        """topk_idx (dispatch): send token rows, each once per rank owning one of its experts,
        and a (send index, token) tag pair per (token, slot); recv_pack then reads through them."""
        c, r, t, tok, _ = self.offsets(rows)
        base = ws.base_offset
        torch.ops.flux.moe_send_(rows, order, k, dst_code, tags, counts, code, self.done[0:1], ws.buffer_ptrs_dev,
                                 ws.pads_dev, self.world, self.rank, self.el, base + r, base + t, base + c,
                                 MOE_CHANNEL, topk_idx, self.capacity, base + tok)

    def recv_pack(self, ws, out, recv_code, counts_out, verdict, counts_in, counts_save, send_code, send_pairs,
                  pair_pos, zero_pad=True, token_rows=False):
        c, r, t, tok, _ = self.offsets(out)
        torch.ops.flux.moe_recv_pack_(out.view(self.n_recv, -1), recv_code, counts_out, verdict, counts_in,
                                      counts_save, send_code, send_pairs, pair_pos, self.done[1:2],
                                      ws.buffer.data_ptr(), ws.pads_dev, self.world, self.rank, self.el, self.capacity,
                                      r, t, c, MOE_CHANNEL, symm.timeout_ms(), zero_pad, tok if token_rows else -1)

    def recv_sum(self, ws, out, weights, pair_pos, n_send):
        torch.ops.flux.moe_recv_sum_(out, weights, pair_pos, n_send, self.done[1:2], ws.buffer.data_ptr(), ws.pads_dev,
                                     self.world, self.rank, self.offsets(out)[1], MOE_CHANNEL, symm.timeout_ms())

    def wait(self, ws):
        """Only the receive kernel's wait (a sum over no tokens)."""
        out = torch.empty((0, 1), dtype=torch.float32, device=ws.device)
        pos = torch.empty(0, dtype=torch.int64, device=ws.device)
        self.recv_sum(ws, out, None, pos, 0)
