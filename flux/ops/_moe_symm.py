"""The symmetric-memory strategy of flux.moe_dispatch / flux.moe_combine (CUDA, NCCL groups).

No NCCL call: the ranks exchange their per-expert counts and then their rows through the group's
symmetric workspace (flux.runtime.symm), SMs writing straight into the peers' buffers over NVLink
(``torch.ops.flux.moe_scatter_rows_``, csrc/moe/moe_rows.cu), ordered by flux's token-carrying
barrier (``Runtime.enqueue_barrier``: bounded, naming the peer on a timeout). flux/ops/moe.py
holds the API, the argument checks, the reference strategy and autograd; this module only moves
data, and is called with arguments already checked to agree across ranks.

Workspace regions (byte offsets, 256-aligned, the same on every rank):

    counts   [W, E] int32        row s: rank s's number of (token, slot) pairs per global expert
    rows     [rows_cap, H]       dispatch: the rows this rank receives, in the output's layout;
                                 combine: the expert outputs of this rank's own pairs land here
    tags     [rows_cap] int32    dispatch: per received row, its index among its sender's pairs

Dispatch on rank r (T tokens, K slots; E experts, E_l = E / W on each rank)::

    sort the T*K (token, slot) pairs by expert, stably (token order, then slot), -1 slots last
    counts_r = per-expert counts                       [E]
    barrier                                            nobody still reads our workspace
    counts_r into row r of every rank's counts region  (a small copy per rank)
    barrier                                            every rank's counts are in
    C = counts [W, E]; the unbounded variant copies it to the host (it sizes the output)
    pair i, expert g, on rank d = g // E_l as local expert e = g % E_l, lands at
        unbounded  (rows of d's experts before e) + sum_{s<r} C[s, g] + (i's rank among our pairs to g)
        bounded    e * W * cap                   + sum_{s<r} C[s, g] + (i's rank among our pairs to g)
    scatter x[token(i)] to rank d's rows region there, the tag i beside it
    barrier                                            every row has landed
    recv_x = a copy of our rows region (the next call reuses it)

Combine sends each received row's expert output back to its sender, into the sender's rows
region at the tag, between two barriers; the sender sums its pairs' outputs, weighted by their
topk_weights, in fp32, per token. The bounded variant never reads a count on the host: the
positions are computed on the device and rows of invalid slots are skipped by the kernel (a
destination rank of -1), so the whole exchange can be captured in a CUDA graph.
"""
import zlib
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from flux.runtime import runtime as _runtime
from flux.runtime import symm

_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def usable(group: dist.ProcessGroup, x: torch.Tensor) -> Optional[str]:
    """None where this strategy can run, else the reason it cannot."""
    if x.device.type != "cuda":
        return "the tensors are not on a GPU"
    if dist.get_world_size(group) < 2:
        return "a group of one rank"
    if not symm.available(group):
        return "no symmetric workspace for this group (it needs flux._C, a GPU and an NCCL group)"
    if not hasattr(torch.ops.flux, "moe_scatter_rows_"):
        return "flux._C predates moe_scatter_rows_ (rebuild flux)"
    return None


def _token(phase: int, num_experts: int, hidden: int, k: int, dtype: torch.dtype, cap: Optional[int]) -> int:
    """The barriers' token: op code 3 (the MoE ops) in the top two bits, a CRC of what every rank
    must agree on (not T, which may differ between ranks) in the rest; never 0."""
    text = f"moe:{phase}:{num_experts}:{hidden}:{k}:{dtype}:{cap}"
    return (3 << 30) | (zlib.crc32(text.encode()) & 0x3FFFFFFF) | 1


@dataclass
class SymmState:
    """What combine needs from one dispatch: the routing as this strategy laid it out."""
    num_experts: int
    hidden: int
    k: int
    tokens: int                       # T on this rank
    cap: Optional[int]                # max_tokens_per_rank (bounded) or None
    order: torch.Tensor               # [T*K] int64: flat slot index t*K+k of sorted pair i
    sorted_valid: torch.Tensor        # [T*K] bool: sorted pair i has an expert
    recv_src: torch.Tensor            # per received row (R rows; bounded: E_l*W*cap), its sender (-1: no row)
    recv_tags: torch.Tensor           # per received row, its index among its sender's sorted pairs
    pairs_per_rank: Optional[List[int]]  # unbounded: every rank's number of valid pairs


def _regions(world: int, num_experts: int, rows_cap: int, row_bytes: int):
    """(counts offset 0, rows offset, tags offset, total bytes)."""
    counts_bytes = _align(world * num_experts * 4)
    rows_off = counts_bytes
    tags_off = rows_off + _align(rows_cap * row_bytes)
    return rows_off, tags_off, tags_off + _align(rows_cap * 4)


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup,
             cap: Optional[int]):
    """(recv_x, counts [E_l] int64 on the device, counts as a list or None (bounded), SymmState).

    x [T, H]; topk_idx [T, K] (ids in [0, E) or -1, no expert twice in a row); recv_x [R, H]
    (unbounded) or [E_l, W * cap, H] (bounded: rows past an expert's count are zero)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens, hidden = x.shape
    k = topk_idx.shape[1]
    experts_local = num_experts // world
    dev = x.device
    x = x.contiguous()
    row_bytes = hidden * x.element_size()
    token = _token(0, num_experts, hidden, k, x.dtype, cap)

    flat = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))  # -1 sorts last
    key_sorted, order = torch.sort(key, stable=True)
    # (bincount would read its input's maximum on the host: no graph capture)
    counts_full = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    send_counts = counts_full[:num_experts].to(torch.int32)
    first_of_key = torch.cumsum(counts_full, 0) - counts_full
    sorted_valid = key_sorted < num_experts
    g = torch.where(sorted_valid, key_sorted, torch.zeros_like(key_sorted))
    rank_in_expert = torch.arange(key_sorted.numel(), device=dev) - first_of_key[key_sorted]

    bounded_rows = experts_local * world * cap if cap is not None else 0
    rt = _runtime.get(group, _regions(world, num_experts, bounded_rows, row_bytes)[2])
    ws = symm.get_workspace(group, 1)
    rt.enqueue_barrier(token)
    for p in range(world):
        ws.view(p, [world, num_experts], torch.int32)[rank].copy_(send_counts)
    rt.enqueue_barrier(token)
    counts = ws.view(rank, [world, num_experts], torch.int32).to(torch.int64)  # a copy: [W, E]
    before_us = counts[:rank].sum(0)  # [E]: rows of expert g from the senders before us
    mine = counts[:, rank * experts_local:(rank + 1) * experts_local]  # [W, E_l]: what we receive

    if cap is None:
        host = counts.tolist()  # the unbounded variant's one host synchronisation
        per_expert = [sum(host[s][e] for s in range(world)) for e in range(num_experts)]
        starts, rows_of_rank = [], []
        for d in range(world):
            acc = 0
            for e in range(d * experts_local, (d + 1) * experts_local):
                starts.append(acc)
                acc += per_expert[e]
            rows_of_rank.append(acc)
        expert_start = torch.tensor(starts, dtype=torch.int64, device=dev)
        rows_cap = max(rows_of_rank)
        pairs_per_rank = [sum(row) for row in host]
        # Grown collectively if needed: every rank computes the same size from the same counts.
        rt = _runtime.get(group, _regions(world, num_experts, rows_cap, row_bytes)[2])
        ws = symm.get_workspace(group, 1)
        counts_host = [per_expert[rank * experts_local + e] for e in range(experts_local)]
    else:
        expert_start = (torch.arange(num_experts, device=dev) % experts_local) * (world * cap)
        rows_cap, pairs_per_rank, counts_host = bounded_rows, None, None
    rows_off, tags_off, _ = _regions(world, num_experts, rows_cap, row_bytes)

    dst_rank = torch.where(sorted_valid, torch.div(g, experts_local, rounding_mode="floor"),
                           torch.full_like(g, -1))
    dst_row = expert_start[g] + before_us[g] + rank_in_expert
    src_rows = torch.div(order, k, rounding_mode="floor")
    tags = torch.arange(order.numel(), device=dev, dtype=torch.int32)
    if cap is not None:
        # Rows past an expert's count read as zeros: cleared before the barrier lets peers write.
        ws.view(rank, [rows_cap * row_bytes], torch.uint8, rows_off).zero_()
    rt.enqueue_barrier(token)
    torch.ops.flux.moe_scatter_rows_(x, src_rows, dst_rank, dst_row, tags, ws.buffer_ptrs_dev, world,
                                     ws.base_offset + rows_off, ws.base_offset + tags_off)
    rt.enqueue_barrier(token)

    recv_counts = mine.sum(0)  # [E_l]
    if cap is None:
        total = sum(counts_host)
        recv_x = ws.view(rank, [total, hidden], x.dtype, rows_off).clone()
        recv_tags = ws.view(rank, [total], torch.int32, tags_off).to(torch.int64)
        # Senders of the rows: per local expert, blocks of C[s, e] rows from s = 0 .. W-1.
        senders = torch.arange(world, device=dev).repeat(experts_local)
        recv_src = torch.repeat_interleave(senders, mine.t().reshape(-1), output_size=total)
    else:
        span = world * cap
        recv_x = ws.view(rank, [experts_local, span, hidden], x.dtype, rows_off).clone()
        recv_tags = ws.view(rank, [experts_local * span], torch.int32, tags_off).to(torch.int64)
        # Row j of local expert e came from the sender s with cum[s-1] <= j < cum[s]; rows past
        # the expert's count have no sender (-1).
        cum = torch.cumsum(mine.t(), 1).contiguous()  # [E_l, W]
        j = torch.arange(span, device=dev).expand(experts_local, span).contiguous()
        src = torch.searchsorted(cum, j, right=True)
        recv_src = torch.where(j < cum[:, -1:], src, torch.full_like(src, -1)).reshape(-1)
    state = SymmState(num_experts, hidden, k, tokens, cap, order, sorted_valid, recv_src, recv_tags, pairs_per_rank)
    return recv_x, recv_counts, counts_host, state


def combine(y: torch.Tensor, topk_weights: torch.Tensor, state: SymmState, group: dist.ProcessGroup) -> torch.Tensor:
    """[T, H] in y's dtype: out[t] = sum over t's valid slots k of topk_weights[t, k] * (the
    expert output of the row slot (t, k) was dispatched to), accumulated in fp32.

    y: the expert outputs in dispatch's recv_x layout ([R, H], or [E_l, W * cap, H])."""
    world = dist.get_world_size(group)
    hidden, k, tokens = state.hidden, state.k, state.tokens
    rows = y.reshape(-1, hidden).contiguous()
    row_bytes = hidden * rows.element_size()
    token = _token(1, state.num_experts, hidden, k, y.dtype, state.cap)
    landing = max(state.pairs_per_rank) if state.cap is None else state.cap * k
    rows_off, _, total = _regions(world, state.num_experts, landing, row_bytes)
    rt = _runtime.get(group, total)
    ws = symm.get_workspace(group, 1)
    rt.enqueue_barrier(token)
    torch.ops.flux.moe_scatter_rows_(rows, None, state.recv_src, state.recv_tags, None, ws.buffer_ptrs_dev, world,
                                     ws.base_offset + rows_off, 0)
    rt.enqueue_barrier(token)
    n = state.order.numel()  # T*K sorted pairs; the valid ones first
    if state.cap is None:
        n = state.pairs_per_rank[dist.get_rank(group)]
    own = ws.view(dist.get_rank(group), [max(n, 0), hidden], y.dtype, rows_off)
    order, valid = state.order[:n], state.sorted_valid[:n]
    w = topk_weights.reshape(-1)[order].to(torch.float32)
    # Rows of invalid pairs were never written (they may hold anything, NaN included): masked out.
    contrib = torch.where(valid[:, None], own.to(torch.float32) * w[:, None], torch.zeros((), device=y.device))
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=y.device)
    out.index_add_(0, torch.div(order, k, rounding_mode="floor"), contrib)
    return out.to(y.dtype)
