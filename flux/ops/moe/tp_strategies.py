"""The tensor-parallel MoE ops' strategies (flux/ops/moe/tp_routing.py: the routing, the checks
and the choice): the local pieces (scatter the rows of a rank's pairs, sum a token's slots in fp32,
the grouped GEMM and its weight gradient), each strategy's part 1 (all-gather, scatter, grouped
GEMM) and part 2 (grouped GEMM, gather back, reduce-scatter) as ``_AG_SCATTER`` /
``_MM_GATHER_RS``, and the checked implementations the public functions (``tp``) call.
"""
from typing import List, Optional

import torch
import torch.distributed as dist

from flux.ops._checks import check_collectively, check_every_call
from flux.ops.grouped_mm import _gmm, _offsets, grouped_mm, grouped_mm_impl
from flux.ops.moe.tp_routing import (OP, WEIGHT_LAYOUTS, TpMoeRouting, _choose_strategy, _make_routing, _signature_ag,
                                     _signature_rs)
from flux.runtime import all_gather_dim0, reduce_scatter_dim0


# --------------------------------------------------------------------------------------
# Local pieces


def _flip(layout: str) -> str:
    # A weight [E, N, K] read as "kn" is [E, K_in=N, N_out=K]: the backward's product d out @ W_e.
    return "kn" if layout == "nk" else "nk"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scatter_rows(tokens: torch.Tensor, local: torch.Tensor, k: int, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``tokens[local // K]`` (times ``scale[local]``, in fp32 or wider, then rounded back): the
    rows of the pairs ``local`` (pair indices into ``tokens``' ``[T', K]``)."""
    rows = tokens[torch.div(local, k, rounding_mode="floor")]
    if scale is None:
        return rows
    acc = _acc_dtype(tokens.dtype)
    return (rows.to(acc) * scale[local].to(acc)[:, None]).to(tokens.dtype)


def _sum_slots(rows: torch.Tensor, pos: torch.Tensor, weights: Optional[torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum over valid k of weights[t, k] * rows[pos[t, k]]`` (weights None: 1), ``pos``
    ``[T', K]`` with ``len(rows)`` for no row; accumulated in fp32 (fp64 for fp64) from slot 0 on
    (a fixed order: the same on every device), returned in ``dtype``."""
    acc = _acc_dtype(dtype)
    n = rows.shape[0]
    ext = torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])
    valid = pos < n
    out = torch.zeros((pos.shape[0], rows.shape[1]), dtype=acc, device=rows.device)
    zero = torch.zeros((), dtype=acc, device=rows.device)
    for k in range(pos.shape[1]):
        v = valid[:, k:k + 1]
        # where, not a product: a NaN weight in a -1 slot must not count
        w = v.to(acc) if weights is None else torch.where(v, weights[:, k:k + 1].to(acc), zero)
        out += w * ext[pos[:, k]].to(acc)
    return out.to(dtype)


def _mm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, counts_host: List[int],
        layout: str) -> torch.Tensor:
    return grouped_mm(rows.contiguous(), weight, counts, counts_host=counts_host, weight_layout=layout)


def _weight_grad(a: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                 counts_host: List[int], layout: str) -> torch.Tensor:
    """The gradient of a grouped weight for ``out_e = a_e @ W_e^T`` ("nk") or ``a_e @ W_e`` ("kn"):
    ``g_e^T a_e`` ``[N, K]`` or ``a_e^T g_e`` ``[K, N]`` per expert (zero for an expert without
    rows); a ``[P, K]`` the GEMM's input rows, g ``[P, N]`` its output's gradient."""
    nk = layout == "nk"
    a, g = a.contiguous(), g.contiguous()
    if grouped_mm_impl(a, weight, layout, impl="kernel")[0] == "kernel":
        try:
            offs = _offsets(counts, False, a.device, weight.shape[0], OP)
            dw = _gmm(g.t(), a, offs) if nk else _gmm(a.t(), g, offs)
            # the kernel may leave an expert without rows unwritten
            return dw.masked_fill((counts.to(a.device) == 0).view(-1, 1, 1), 0)
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # a refusal of the kernel (an older torch): the loop below, as grouped_mm falls back
    dw = torch.zeros(weight.shape, dtype=a.dtype, device=a.device)
    start = 0
    for e, c in enumerate(counts_host):
        if c:
            ae, ge = a[start:start + c], g[start:start + c]
            dw[e] = ge.t() @ ae if nk else ae.t() @ ge
        start += c
    return dw


def _p2p(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup):
    """Send ``send`` to group rank ``dst`` and receive ``recv`` from ``src`` (one NCCL group call;
    on gloo, host transfers). Returns the works: ``wait()`` makes the current stream wait (NCCL)
    or blocks (gloo)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, group=group, group_peer=dst),
                                   dist.P2POp(dist.irecv, recv, group=group, group_peer=src)])


# --------------------------------------------------------------------------------------
# Strategies. Part 1's computation: (out [P, N], gathered input [T, H] or None); ``scale``:
# the gathered routing weights as ``[T * K]`` (part 2's backward) or None.


def _ag_scatter_sequential(x, weight, layout, routing, scale, keep_gathered):
    gathered = all_gather_dim0(x, routing.group)
    rows = _scatter_rows(gathered, routing.pairs, routing.topk, scale)
    out = _mm(rows, weight, routing.counts, routing.counts_host, layout)
    return out, gathered if keep_gathered else None


def _part1_blocks(x, weight, layout, routing, scale):
    """(out [P, N], block): ``block(s, shard)`` computes the rows of rank s's tokens from its
    shard ``[T_l, H]`` (scatter, grouped GEMM) into their expert-major places in out."""
    tl, k = routing.tokens_per_rank, routing.topk
    blocks = routing.blocks()
    n = weight.shape[1] if layout == "nk" else weight.shape[2]
    out = x.new_empty((routing.num_rows, n))

    def block(s, shard):
        b = blocks[s]
        sc = None if scale is None else scale[s * tl * k:(s + 1) * tl * k]
        y = _mm(_scatter_rows(shard, b.local, k, sc), weight, b.counts, b.counts_host, layout)
        out.index_copy_(0, b.rows, y)
    return out, block


def _part2_blocks(h, weight, layout, routing, wg, keep_partial):
    """(partial [P, N] or None, block, N): ``block(d)`` is the partial sums of rank d's tokens,
    ``[T_l, N]`` in h's dtype (grouped GEMM of their rows, weighted sum over slots), its GEMM rows
    also written into partial when kept."""
    tl = routing.tokens_per_rank
    blocks = routing.blocks()
    n = weight.shape[1] if layout == "nk" else weight.shape[2]
    partial = h.new_empty((routing.num_rows, n)) if keep_partial else None

    def block(d):
        b = blocks[d]
        y = _mm(h[b.rows], weight, b.counts, b.counts_host, layout)
        if partial is not None:
            partial.index_copy_(0, b.rows, y)
        return _sum_slots(y, b.pos, None if wg is None else wg[d * tl:(d + 1) * tl], h.dtype).contiguous()
    return partial, block, n


def _ag_scatter_chunked(x, weight, layout, routing, scale, keep_gathered):
    group, world, rank = routing.group, routing.world, routing.rank
    tl = routing.tokens_per_rank
    x = x.contiguous()
    out, block = _part1_blocks(x, weight, layout, routing, scale)
    gathered = x.new_empty((world, tl, x.shape[1]))
    # Every transfer is enqueued first (they run one after the other on NCCL's stream): step i
    # brings rank r - i's shard while this rank's goes to r + i.
    works = [_p2p(x, (rank + i) % world, gathered[(rank - i) % world], (rank - i) % world, group)
             for i in range(1, world)]
    block(rank, x)  # this rank's own tokens, straight from x, while the shards travel
    for i in range(1, world):
        for w in works[i - 1]:
            w.wait()
        s = (rank - i) % world
        block(s, gathered[s])
    if not keep_gathered:
        return out, None
    gathered[rank].copy_(x)
    return out, gathered.view(world * tl, x.shape[1])


# Part 2's computation: (out [T_l, H], partial [P, H] or None); ``wg``: the gathered routing
# weights ``[T, K]``, or None for unit weights (part 1's backward).


def _mm_gather_rs_sequential(h, weight, layout, routing, wg, keep_partial):
    partial = _mm(h, weight, routing.counts, routing.counts_host, layout)
    y = _sum_slots(partial, routing.pair_rows(), wg, h.dtype)
    return reduce_scatter_dim0(y, routing.group), partial if keep_partial else None


def _mm_gather_rs_chunked(h, weight, layout, routing, wg, keep_partial):
    group, world, rank = routing.group, routing.world, routing.rank
    tl = routing.tokens_per_rank
    partial, block, n = _part2_blocks(h, weight, layout, routing, wg, keep_partial)
    recv = h.new_empty((world, tl, n))

    works, sent = [], []
    for i in range(1, world):  # the peers' tokens first, each sent while the next block computes
        d = (rank + i) % world
        y = block(d)
        sent.append(y)  # kept alive until its transfer is waited for
        works.append(_p2p(y, d, recv[(rank - i) % world], (rank - i) % world, group))
    own = block(rank)
    for ws in works:
        for w in ws:
            w.wait()
    acc = _acc_dtype(h.dtype)
    out = torch.zeros((tl, n), dtype=acc, device=h.device)
    for s in range(world):  # rank order: the same sum on every rank and for every strategy order
        out += (own if s == rank else recv[s]).to(acc)
    return out.to(h.dtype), partial


# The decomposed strategy: chunked's blocks, its transfers by the copy engine into the group's
# symmetric workspace (flux.runtime: begin_exchange / send / wait_from / end_exchange).


def _exchange(group, nbytes: int, phase: str, routing, width: int, dtype: torch.dtype):
    """The runtime and workspace of ``group`` (grown to ``nbytes``, collectively: every rank asks
    the same), after the exchange's entry barrier."""
    from flux.ops.moe.symm import _token
    from flux.runtime import runtime as _runtime
    from flux.runtime import symm

    rt = _runtime.get(group, nbytes)
    ws = symm.get_workspace(group, 1)
    rt.begin_exchange(_token(phase, routing.num_experts, width, routing.topk, dtype, routing.tokens_per_rank))
    return rt, ws


def _ag_scatter_decomposed(x, weight, layout, routing, scale, keep_gathered):
    world, rank = routing.world, routing.rank
    tl = routing.tokens_per_rank
    x = x.contiguous()
    out, block = _part1_blocks(x, weight, layout, routing, scale)
    slot = x.numel() * x.element_size()
    rt, ws = _exchange(routing.group, world * slot, "tp_ag", routing, x.shape[1], x.dtype)
    try:  # end_exchange also on an error: x may be freed only after its copies
        for i in range(1, world):  # this rank's shard into slot `rank` of every peer, r + 1 first
            rt.send(x, (rank + i) % world, rank * slot, False)
        block(rank, x)  # this rank's own tokens, straight from x, while the shards travel
        shards = {rank: x}
        for i in range(1, world):
            s = (rank - i) % world
            rt.wait_from(s)
            shards[s] = ws.view(rank, [tl, x.shape[1]], x.dtype, s * slot)
            block(s, shards[s])
        gathered = torch.cat([shards[s] for s in range(world)]) if keep_gathered else None  # a copy
    finally:
        rt.end_exchange()
    return out, gathered


def _mm_gather_rs_decomposed(h, weight, layout, routing, wg, keep_partial):
    world, rank = routing.world, routing.rank
    tl = routing.tokens_per_rank
    partial, block, n = _part2_blocks(h, weight, layout, routing, wg, keep_partial)
    slot = tl * n * h.element_size()
    rt, ws = _exchange(routing.group, world * slot, "tp_rs", routing, n, h.dtype)

    sent = []
    try:  # end_exchange also on an error: the sent blocks may be freed only after their copies
        for i in range(1, world):  # the peers' tokens first, each pushed while the next block computes
            d = (rank + i) % world
            y = block(d)
            sent.append(y)  # alive until end_exchange
            rt.send(y, d, rank * slot, True)
        own = block(rank)
        acc = _acc_dtype(h.dtype)
        out = torch.zeros((tl, n), dtype=acc, device=h.device)
        for s in range(world):  # rank order: the same sum on every rank and for every strategy
            if s != rank:
                rt.wait_from(s)
            out += (own if s == rank else ws.view(rank, [tl, n], h.dtype, s * slot)).to(acc)
    finally:
        rt.end_exchange()
    return out.to(h.dtype), partial


_AG_SCATTER = {"sequential": _ag_scatter_sequential, "chunked": _ag_scatter_chunked,
               "decomposed": _ag_scatter_decomposed}
_MM_GATHER_RS = {"sequential": _mm_gather_rs_sequential, "chunked": _mm_gather_rs_chunked,
                 "decomposed": _mm_gather_rs_decomposed}


# --------------------------------------------------------------------------------------
# Implementations (checked)


def _ag_scatter_impl(x, topk_idx, weight, group, layout, keep_gathered):
    """Check, route, run. Returns (out, routing, gathered or None, strategy)."""
    ok = isinstance(x, torch.Tensor) and x.dim() == 2
    strategy, why = _choose_strategy(x.device, group, x.shape[0], x.shape[1]) if ok else ("sequential", None)
    check_every_call(_signature_ag(x, topk_idx, weight, group, layout, strategy, why), group)
    idx = all_gather_dim0(topk_idx.to(torch.int64), group)
    routing = _make_routing(idx, weight.shape[0], x.shape[0], group, check=True)
    out, gathered = _AG_SCATTER[strategy](x, weight, layout, routing, None, keep_gathered)
    return out, routing, gathered, strategy


def _mm_gather_rs_impl(h, weight, routing, topk_weights, group, layout, keep_partial):
    """Check, gather the routing weights, run. Returns (out, gathered weights, partial or None,
    strategy)."""
    hidden = -1
    if isinstance(weight, torch.Tensor) and weight.dim() == 3 and layout in WEIGHT_LAYOUTS:
        hidden = weight.shape[1] if layout == "nk" else weight.shape[2]
    tl = routing.tokens_per_rank if isinstance(routing, TpMoeRouting) else 0
    device = h.device if isinstance(h, torch.Tensor) else torch.device("cpu")
    strategy, why = _choose_strategy(device, group, tl, hidden)
    check_collectively(_signature_rs(h, weight, routing, topk_weights, group, layout, strategy, why), group)
    wg = all_gather_dim0(topk_weights, group)
    out, partial = _MM_GATHER_RS[strategy](h.contiguous(), weight, layout, routing, wg, keep_partial)
    return out, wg, partial, strategy


