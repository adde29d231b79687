"""The tensor-parallel MoE ops' routing, checks and choice of strategy (flux.ag_scatter_grouped_mm
/ flux.grouped_mm_gather_rs: the two halves of a tensor-parallel MoE layer, expert tensor
parallelism under sequence parallelism; docs/api.md "Tensor-parallel MoE" gives the layout, the
row order and the meaning, docs/design.md the strategies' schedules).

The T tokens are sharded on dim 0 over the W ranks (``T = W * T_l``); every rank holds all E
experts with each expert's FFN dimension split over the ranks. Part 1 all-gathers the tokens and
their routing and runs one grouped GEMM over the valid (token, slot) pairs laid out expert-major
(P rows, the same on every rank); part 2 runs the second grouped GEMM, sums each token's slots
with its routing weights (fp32, slot 0 first) and reduce-scatters. ``TpMoeRouting`` (part 1's
second output) carries the gathered routing for part 2 and both backward passes; building it
reads the counts on the host (P sizes the output).

Here: the routing, the checks (part 1: every call, one all-gather of a verdict; part 2:
``check_collectively``) and the choice (``STRATEGIES``: ``sequential``, the reference and the CPU
path; ``chunked``, blocks per rank overlapped with NCCL point-to-point; ``decomposed``, the same
blocks through the symmetric workspace; ``_choose_strategy`` picks one, the same on every rank;
``FLUX_STRATEGY_MOE_TP`` forces one). ``tp_strategies`` runs them; ``tp`` holds the public
functions, their autograd and the dispatcher ops. flux imports these modules on first use.
"""
import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from flux import envs
from flux.ops._checks import FluxInputError, Signature, dtype_code
from flux.ops._common import SUPPORTED_DTYPES
from flux.runtime import group_device
from flux.strategies import canonical_strategy

OP = "flux.ag_scatter_grouped_mm"
OP_RS = "flux.grouped_mm_gather_rs"
STRATEGIES = ("sequential", "chunked", "decomposed")  # former names: flux/strategies.py
STRATEGY_ENV = "FLUX_STRATEGY_MOE_TP"
# Token-shard elements (T_l * H) from which an overlapped strategy is chosen, from
# OVERLAP_MIN_WORLD ranks. At two H200s 'sequential' beat the overlapped strategies in every
# measured cell (T_l * H from 4M to 29M elements; docs/performance.md, TP MoE at two GPUs), so two
# ranks never overlap by default; above two the threshold is a first guess (T_l = 512 at H = 4096),
# not measured.
OVERLAP_MIN_SHARD = 1 << 21
OVERLAP_MIN_WORLD = 3
WEIGHT_LAYOUTS = ("nk", "kn")
_INDEX_DTYPES = (torch.int64, torch.int32)


# --------------------------------------------------------------------------------------
# The routing


@dataclasses.dataclass(eq=False)
class _Block:
    """The rows of one rank's tokens (source rank in part 1, destination rank in part 2)."""

    rows: torch.Tensor       # int64 [P_s]: the rows (expert-major positions), increasing by expert
    local: torch.Tensor      # int64 [P_s]: their pairs within that rank's shard, t_l * K + k
    counts: torch.Tensor     # int64 [E] on the device: rows per expert
    counts_host: List[int]   # the same on the host
    pos: torch.Tensor        # int64 [T_l, K]: each pair's index in ``rows`` (P_s: no row)


@dataclasses.dataclass(eq=False)
class TpMoeRouting:
    """The gathered routing of a tensor-parallel MoE layer, made by ``ag_scatter_grouped_mm``
    and used by ``grouped_mm_gather_rs`` and both backward passes. The same on every rank.

    Fields (T = W * T_l gathered tokens, P rows):

        group             the tensor-parallel process group
        num_experts       E
        tokens_per_rank   T_l
        topk              K
        topk_idx          int64 ``[T, K]`` on the device: every rank's topk_idx in rank order
        counts            int64 ``[E]`` on the device: rows per expert
        counts_host       the same as a list
        source_counts     ``[W][E]`` list: rows per (source rank, expert)
        pairs             int64 ``[P]`` on the device: the gathered pair ``t * K + k`` of each
                          row, in row order (expert-major): the permutation

    Derived: ``world``, ``rank``, ``num_tokens`` (T), ``num_rows`` (P), ``gathered_shape``
    ((T, K)), ``pair_rows()`` (the inverse permutation), ``blocks()`` (per rank's tokens).
    """

    group: dist.ProcessGroup
    num_experts: int
    tokens_per_rank: int
    topk: int
    topk_idx: torch.Tensor
    counts: torch.Tensor
    counts_host: List[int]
    source_counts: List[List[int]]
    pairs: torch.Tensor
    _source_counts_dev: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    _pair_rows: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    _blocks: Optional[List[_Block]] = dataclasses.field(default=None, repr=False)
    _source_counts_cpu: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)  # the ops' [W * E]

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def num_tokens(self) -> int:
        return self.world * self.tokens_per_rank

    @property
    def num_rows(self) -> int:
        return int(self.pairs.shape[0])

    @property
    def gathered_shape(self) -> Tuple[int, int]:
        return (self.num_tokens, self.topk)

    def pair_rows(self) -> torch.Tensor:
        """int64 ``[T, K]``: the row of each gathered (token, slot) pair, P for a slot without one."""
        if self._pair_rows is None:
            self._pair_rows = _positions(self.pairs, self.num_tokens * self.topk).view(self.num_tokens, self.topk)
        return self._pair_rows

    def blocks(self) -> List[_Block]:
        """One ``_Block`` per rank: the rows of that rank's tokens (the chunked strategy's
        indexing; made on first use, on the device, without a host read)."""
        if self._blocks is None:
            self._blocks = _make_blocks(self)
        return self._blocks

    def __repr__(self) -> str:
        return (f"TpMoeRouting(W={self.world}, E={self.num_experts}, T_l={self.tokens_per_rank}, K={self.topk}, "
                f"P={self.num_rows}, counts={self.counts_host})")


def _positions(index: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[n]``: ``out[index[i]] = i``, and ``len(index)`` where no i points."""
    pos = torch.full((n,), index.shape[0], dtype=torch.int64, device=index.device)
    return pos.scatter_(0, index, torch.arange(index.shape[0], device=index.device))


def _make_blocks(r: TpMoeRouting) -> List[_Block]:
    w, tl, k = r.world, r.tokens_per_rank, r.topk
    src = torch.div(r.pairs, tl * k, rounding_mode="floor")
    # Stable: by source rank, and within a source in row order (expert, token, slot).
    order = torch.sort(src, stable=True).indices
    blocks, start = [], 0
    for s in range(w):
        n = sum(r.source_counts[s])
        rows = order[start:start + n]
        start += n
        local = r.pairs[rows] - s * tl * k
        blocks.append(_Block(rows, local, r._source_counts_dev[s], list(r.source_counts[s]),
                             _positions(local, tl * k).view(tl, k)))
    return blocks


def _make_routing(idx: torch.Tensor, num_experts: int, tokens_per_rank: int, group: dist.ProcessGroup,
                  check: bool) -> TpMoeRouting:
    """The routing of the gathered ``idx [T, K]`` (int64). One host read (the counts, and the
    number of invalid ids). ``check``: raise FluxInputError for ids outside [-1, E) (the same
    on every rank: every rank holds the same idx); else such slots count as -1."""
    world = dist.get_world_size(group)
    t, k = idx.shape
    e = num_experts
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    key = torch.where(valid, flat, torch.full_like(flat, e))
    src = torch.div(torch.arange(t * k, device=idx.device), max(tokens_per_rank * k, 1), rounding_mode="floor")
    cnt = torch.zeros(world * (e + 1) + 1, dtype=torch.int64, device=idx.device)
    cnt.scatter_add_(0, src * (e + 1) + key, torch.ones_like(key))
    cnt[-1] = ((~valid) & (flat != -1)).sum()
    host = cnt.tolist()  # the host read: P sizes the output
    if check and host[-1]:
        raise FluxInputError(_bad_ids_message(idx, num_experts, tokens_per_rank))
    source_counts = [host[s * (e + 1):s * (e + 1) + e] for s in range(world)]
    counts_host = [sum(source_counts[s][x] for s in range(world)) for x in range(e)]
    sc_dev = cnt[:-1].view(world, e + 1)[:, :e]
    order = torch.sort(key, stable=True).indices  # by expert, then gathered pair t * K + k
    pairs = order[:sum(counts_host)].contiguous()
    return TpMoeRouting(group, num_experts, tokens_per_rank, k, idx, sc_dev.sum(0), counts_host, source_counts,
                        pairs, _source_counts_dev=sc_dev)


def _bad_ids_message(idx: torch.Tensor, num_experts: int, tokens_per_rank: int) -> str:
    """Every rank's first id outside [-1, E), by rank (host read; failing calls only)."""
    host = idx.cpu()
    bad = ((host < -1) | (host >= num_experts)).nonzero().tolist()
    per_rank = {}
    for t, k in bad:
        s = t // tokens_per_rank
        if s not in per_rank:
            per_rank[s] = [t - s * tokens_per_rank, k, int(host[t, k]), 0]
        per_rank[s][3] += 1
    parts = [f"rank {s}: topk_idx[{t}, {k}] = {v} is outside [-1, {num_experts}) ({n} such entries)"
             for s, (t, k, v, n) in sorted(per_rank.items())]
    return f"{OP}: invalid arguments on " + "; ".join(parts)


# --------------------------------------------------------------------------------------
# Strategy choice


def _is_gloo(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def _should_overlap(device: torch.device, group: dist.ProcessGroup, tokens_per_rank: int, hidden: int) -> bool:
    """Whether an overlapped strategy is worth its extra launches: CUDA tensors on an NCCL group
    of at least OVERLAP_MIN_WORLD ranks, and a token shard of at least OVERLAP_MIN_SHARD elements.
    Depends only on what every rank shares (the group, the device type, T_l and H), so every rank
    decides alike."""
    if device.type != "cuda" or dist.get_world_size(group) < OVERLAP_MIN_WORLD:
        return False
    if "nccl" not in str(dist.get_backend(group)).lower():
        return False
    return tokens_per_rank * hidden >= OVERLAP_MIN_SHARD


def decomposed_usable(device: torch.device, group: dist.ProcessGroup) -> Optional[str]:
    """None where the ``decomposed`` strategy can run (CUDA tensors, a group of two or more ranks with a
    symmetric workspace, a flux._C that has the runtime's exchange), else why not; the same on
    every rank."""
    from flux.runtime import symm

    why = symm.unusable(group, device)
    if why is not None:
        return why
    import flux._C as _C

    if not hasattr(_C.Runtime, "begin_exchange"):
        return "flux._C predates Runtime.begin_exchange (rebuild flux)"
    return None


def _choose_strategy(device: torch.device, group: dist.ProcessGroup, tokens_per_rank: int,
                     hidden: int) -> Tuple[str, Optional[str]]:
    """(strategy, problem or None): FLUX_STRATEGY_MOE_TP if set; else, where ``_should_overlap``
    says so, ``decomposed`` (transfers by the copy engine, no SM taken from the GEMMs) if the group
    has a symmetric workspace, else ``chunked``; else ``sequential``. The variable's former names
    are read as the current ones (``symm``: ``decomposed``; flux/strategies.py)."""
    forced = canonical_strategy("moe_tp", envs.forced_strategy("moe_tp"))
    if forced:
        if forced not in STRATEGIES:
            return "sequential", f"{STRATEGY_ENV}={forced!r} is not one of {list(STRATEGIES)}"
        if forced == "chunked" and device.type == "cuda" and _is_gloo(group):
            return "sequential", (f"{STRATEGY_ENV}=chunked moves CUDA tensors through NCCL point-to-point "
                                  "transfers, and this group is gloo")
        if forced == "decomposed":
            why = decomposed_usable(device, group)
            if why is not None:
                return "sequential", f"{STRATEGY_ENV}=decomposed cannot run here: {why}"
        return forced, None
    if not _should_overlap(device, group, tokens_per_rank, hidden):
        return "sequential", None
    return ("decomposed" if decomposed_usable(device, group) is None else "chunked"), None


# --------------------------------------------------------------------------------------
# Checks


def _common_fields(sig: Signature, device: torch.device, group: dist.ProcessGroup, what: str) -> None:
    dev = group_device(group)
    if device.type != dev.type:
        sig.fail(f"{what} is on {device} but the process group communicates on {dev.type} "
                 "(NCCL groups take CUDA tensors, gloo groups CPU tensors)")
    elif device.type == "cuda" and device.index != torch.cuda.current_device():
        sig.fail(f"{what} is on {device} but the current CUDA device is {torch.cuda.current_device()}")


def _weight_fields(sig: Signature, weight: torch.Tensor, layout: str, k_in: int, what_in: str,
                   dtype: torch.dtype, device: torch.device) -> Optional[int]:
    """Checks of a grouped weight ``[E, N, K]`` / ``[E, K, N]`` against ``k_in``; returns N."""
    if layout not in WEIGHT_LAYOUTS:
        sig.fail(f"weight_layout must be 'nk' ([E, N, K], nn.Linear per expert) or 'kn' ([E, K, N]), got {layout!r}")
        return None
    if weight.dim() != 3:
        sig.fail(f"weight must be 3-D ({'[E, N, K]' if layout == 'nk' else '[E, K, N]'}), got shape "
                 f"{tuple(weight.shape)}")
        return None
    n, k = (weight.shape[1], weight.shape[2]) if layout == "nk" else (weight.shape[2], weight.shape[1])
    if k != k_in:
        sig.fail(f"{what_in} has {k_in} columns but weight {tuple(weight.shape)} ({layout!r}) has K={k}")
    if weight.dtype != dtype:
        sig.fail(f"weight dtype {weight.dtype} differs from the input dtype {dtype}")
    if weight.device != device:
        sig.fail(f"weight is on {weight.device} but the input is on {device}")
    return n


def _tensors_and_layout(sig: Signature, layout: str, **tensors) -> bool:
    """Records a failure unless every argument is a tensor (False), else the layout field (True)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            sig.fail(f"{name} must be a tensor, got {type(t).__name__}")
            return False
    sig.add("weight_layout", WEIGHT_LAYOUTS.index(layout) if layout in WEIGHT_LAYOUTS else -1)
    return True


def _signature_ag(x, topk_idx, weight, group, layout, strategy, why) -> Signature:
    sig = Signature(OP)
    if not _tensors_and_layout(sig, layout, x=x, topk_idx=topk_idx, weight=weight):
        return sig
    sig.add("x.dtype", dtype_code(x.dtype))
    sig.add("x.dim()", x.dim())
    sig.add("T_l (x.shape[0])", x.shape[0] if x.dim() >= 1 else -1)
    sig.add("H (x.shape[-1])", x.shape[-1] if x.dim() >= 1 else -1)
    sig.add("topk_idx.dim()", topk_idx.dim())
    sig.add("K (topk_idx.shape[-1])", topk_idx.shape[-1] if topk_idx.dim() >= 1 else -1)
    sig.add("weight.dim()", weight.dim())
    sig.add("E (weight.shape[0])", weight.shape[0] if weight.dim() >= 1 else -1)
    sig.add("strategy", STRATEGIES.index(strategy))
    if why:
        sig.fail(why)
    if x.dim() != 2:
        sig.fail(f"x must be 2-D [T_l, H], got shape {tuple(x.shape)}")
        return sig
    if x.dtype not in SUPPORTED_DTYPES:
        sig.fail(f"x dtype {x.dtype} is not supported (use one of {[str(d) for d in SUPPORTED_DTYPES]})")
    if topk_idx.dim() != 2 or topk_idx.shape[-1] < 1:
        sig.fail(f"topk_idx must be 2-D [T_l, K] with K >= 1, got shape {tuple(topk_idx.shape)}")
    elif topk_idx.shape[0] != x.shape[0]:
        sig.fail(f"topk_idx has {topk_idx.shape[0]} rows but x has {x.shape[0]} tokens")
    if topk_idx.dtype not in _INDEX_DTYPES:
        sig.fail(f"topk_idx dtype {topk_idx.dtype} is not supported (int64 or int32)")
    if topk_idx.device != x.device:
        sig.fail(f"topk_idx is on {topk_idx.device} but x is on {x.device}")
    _weight_fields(sig, weight, layout, x.shape[1], "x", x.dtype, x.device)
    if weight.dim() == 3 and weight.shape[0] < 1:
        sig.fail("weight has no expert (E = 0)")
    _common_fields(sig, x.device, group, "x")
    return sig


def _signature_rs(h, weight, routing, topk_weights, group, layout, strategy, why) -> Signature:
    sig = Signature(OP_RS)
    if not isinstance(routing, TpMoeRouting):
        sig.fail("routing must be the TpMoeRouting returned by flux.ag_scatter_grouped_mm, got "
                 f"{type(routing).__name__}")
        return sig
    if not _tensors_and_layout(sig, layout, h=h, weight=weight, topk_weights=topk_weights):
        return sig
    sig.add("h.dtype", dtype_code(h.dtype))
    sig.add("topk_weights.dtype", dtype_code(topk_weights.dtype))
    sig.add("weight.dim()", weight.dim())
    if weight.dim() == 3 and layout in WEIGHT_LAYOUTS:
        sig.add("H (the weight's N)", weight.shape[1] if layout == "nk" else weight.shape[2])
    sig.add("E (weight.shape[0])", weight.shape[0] if weight.dim() >= 1 else -1)
    sig.add("strategy", STRATEGIES.index(strategy))
    if why:
        sig.fail(why)
    if tuple(dist.get_process_group_ranks(routing.group)) != tuple(dist.get_process_group_ranks(group)):
        sig.fail("group is not the group of the routing's ag_scatter_grouped_mm")
    if h.dim() != 2:
        sig.fail(f"h must be 2-D [P, K], got shape {tuple(h.shape)}")
        return sig
    if h.shape[0] != routing.num_rows:
        sig.fail(f"h has {h.shape[0]} rows but the routing has P = {routing.num_rows}")
    if h.dtype not in SUPPORTED_DTYPES:
        sig.fail(f"h dtype {h.dtype} is not supported (use one of {[str(d) for d in SUPPORTED_DTYPES]})")
    if h.device != routing.pairs.device:
        sig.fail(f"h is on {h.device} but the routing is on {routing.pairs.device}")
    _weight_fields(sig, weight, layout, h.shape[1], "h", h.dtype, h.device)
    if weight.dim() == 3 and weight.shape[0] != routing.num_experts:
        sig.fail(f"weight has E = {weight.shape[0]} experts but the routing has {routing.num_experts}")
    if tuple(topk_weights.shape) != (routing.tokens_per_rank, routing.topk):
        sig.fail(f"topk_weights has shape {tuple(topk_weights.shape)}, expected this rank's "
                 f"[T_l, K] = [{routing.tokens_per_rank}, {routing.topk}]")
    if not topk_weights.is_floating_point():
        sig.fail(f"topk_weights must be floating, got {topk_weights.dtype}")
    if topk_weights.device != h.device:
        sig.fail(f"topk_weights is on {topk_weights.device} but h is on {h.device}")
    _common_fields(sig, h.device, group, "h")
    return sig
