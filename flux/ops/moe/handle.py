"""The names every part of flux.moe_dispatch / moe_combine shares: the op names, the strategy
names, the verdict codes, ``MoeHandle`` (what combine and both backward passes need of a
dispatch), the collectives the strategies use, and the row pieces of the weighted sum and the
gradients, computed from the handle's ``send_pairs`` on the sending side (docs/api.md, MoE).
"""
import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from flux.ops._checks import FluxInputError
from flux.runtime import all_gather_dim0

OP = "flux.moe_dispatch"
OP_COMBINE = "flux.moe_combine"
STRATEGIES = ("sequential", "symm", "local")  # docs/api.md: strategies; former names: flux/strategies.py
_INDEX_DTYPES = (torch.int64, torch.int32)

# Codes of the data-dependent verdict (bits), which the bounded variant on CUDA groups
# exchanges on the device and reports only through MoeHandle.check().
_BAD_ID, _DUPLICATE, _OVER_CAPACITY, _LOCAL_ARGS = 2, 4, 8, 16
_CODE_TEXT = {
    _LOCAL_ARGS: "its arguments are invalid (that rank logged the details on the 'flux' logger)",
    _BAD_ID: "topk_idx holds an expert id outside [-1, num_experts)",
    _DUPLICATE: "a row of topk_idx lists an expert twice (a token may list an expert at most once)",
    _OVER_CAPACITY: "x.shape[0] (T) exceeds max_tokens_per_rank",
}


# --------------------------------------------------------------------------------------
# The handle


@dataclasses.dataclass(eq=False)
class MoeHandle:
    """What ``moe_combine`` (and both backward passes) need of a ``moe_dispatch`` call.

    Fields (``S``: rows this rank sent; unbounded: one per valid slot, bounded (sequential):
    ``W * P`` with ``P = C * min(K, E_l)``, the unused ones padding):

        group                the process group
        strategy             the strategy that moved the rows (one of ``STRATEGIES``)
        num_experts          E, global
        num_tokens           T, this rank's tokens
        topk                 K
        hidden               H
        max_tokens_per_rank  C (bounded variant) or None (unbounded)
        topk_weights         ``[T, K]`` floating: the dispatch's argument itself (combine's
                             weights, with their autograd history)
        send_pairs           int64 ``[S]`` on x's device: the (token, slot) pair ``t * K + k``
                             of each sent row, in send order (by destination expert, then
                             token, then slot); padding rows hold ``T * K``. Every strategy
                             provides it: the weighted sum and the gradients are computed from
                             it (``_sum_slots``, ``_rows_from_tokens``)
        recv_dest            int64 on x's device, the strategy's own routing on the receiving
                             side. sequential: ``[N]``, N the rows received in the exchange (R,
                             bounded ``W * P``): for each received row (in the exchange's order:
                             by source rank, then expert, token, slot) its row in recv_x viewed
                             as ``[-1, H]``; padding rows hold ``recv_x.numel() / H`` (one past
                             the end)
        meta                 int64 on the CPU: ``[strategy index]``, then, unbounded, the E_l
                             counts and whatever the strategy needs on the host (sequential:
                             the W send and the W receive split sizes)
        verdict              int64 ``[W]`` on x's device: each rank's error code (0: valid);
                             nonzero only in the bounded variant on CUDA groups, which
                             reports through ``check()``
        recv_shape           recv_x's shape: ``(R, H)`` or ``(E_l, W * C, H)`` (fp8: recv_fp8's;
                             y of combine has it)
        fp8                  whether the rows moved as fp8 (``moe_dispatch(..., fp8=True)``;
                             the strategy then moved the packed byte rows, S and the routing
                             as without fp8)

    Derived: ``world``, ``num_local_experts``, ``bounded``, ``counts_host`` (list of E_l ints;
    None when bounded).
    """

    group: dist.ProcessGroup
    strategy: str
    num_experts: int
    num_tokens: int
    topk: int
    hidden: int
    max_tokens_per_rank: Optional[int]
    topk_weights: Optional[torch.Tensor]
    send_pairs: torch.Tensor
    recv_dest: torch.Tensor
    meta: torch.Tensor
    verdict: torch.Tensor
    recv_shape: Tuple[int, ...]
    fp8: bool = False

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def bounded(self) -> bool:
        return self.max_tokens_per_rank is not None

    @property
    def counts_host(self) -> Optional[List[int]]:
        """Rows per local expert as a Python list (unbounded); None for the bounded variant and
        for ``read_counts=False``, whose counts stay on the device."""
        if self.bounded or self.meta.numel() < 1 + self.num_local_experts:
            return None
        return self.meta[1:1 + self.num_local_experts].tolist()

    def host_extra(self) -> List[int]:
        """The strategy's host-side integers (unbounded; see ``meta``)."""
        return self.meta[1 + self.num_local_experts:].tolist()

    def check(self) -> None:
        """Raise the dispatch's FluxInputError, the same on every rank, if some rank's data
        was invalid (only the bounded variant on CUDA groups, and the unbounded one with
        ``read_counts=False`` on one rank, defer this; reading the verdict synchronises with the
        device)."""
        codes = self.verdict.tolist()
        if any(codes):
            raise FluxInputError(_deferred_message(codes, self))

    def __repr__(self) -> str:
        kind = f"bounded C={self.max_tokens_per_rank}" if self.bounded else "unbounded"
        if self.fp8:
            kind += ", fp8"
        return (f"MoeHandle({self.strategy}, {kind}, E={self.num_experts}, W={self.world}, T={self.num_tokens}, "
                f"K={self.topk}, H={self.hidden}, recv_shape={tuple(self.recv_shape)})")


def _deferred_message(codes: List[int], handle: "MoeHandle") -> str:
    parts = []
    for r, c in enumerate(codes):
        if c:
            texts = [t for bit, t in _CODE_TEXT.items() if c & bit]
            parts.append(f"rank {r}: " + ", ".join(texts))
    return (f"{OP}: invalid arguments on " + "; ".join(parts)
            + f" (num_experts = {handle.num_experts}, max_tokens_per_rank = {handle.max_tokens_per_rank}; "
            "nothing was sent)")


# --------------------------------------------------------------------------------------
# Collectives


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group: dist.ProcessGroup) -> None:
    """all_to_all_single along dim 0 (equal blocks when the splits are None). gloo moves CPU
    tensors (it implements all_to_all_single with split sizes, also of 0 rows); under
    FLUX_GLOO_CUDA it moves host copies of CUDA tensors."""
    if inp.is_cuda and "gloo" in str(dist.get_backend(group)).lower():
        host = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host, inp.cpu(), out_splits, in_splits, group=group)
        out.copy_(host)
        return
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)


def _all_gather_small(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[W, *t.shape]: every rank's ``t`` (a few int64)."""
    return all_gather_dim0(t.reshape(1, *t.shape), group)


# --------------------------------------------------------------------------------------
# Pieces shared by the strategies (local, on the sending side)


def _extend(rows: torch.Tensor) -> torch.Tensor:
    """rows with one zero row appended (the target of padding indices)."""
    return torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])


def _place(rows: torch.Tensor, dest: torch.Tensor, n: int) -> torch.Tensor:
    """``out[dest[i]] = rows[i]`` into n zero rows; indices >= n (padding) are dropped.
    A gather (through the inverse of dest), so each output row is written exactly once."""
    src = torch.full((n + 1,), rows.shape[0], dtype=torch.int64, device=rows.device)
    src.scatter_(0, dest.clamp(max=n), torch.arange(rows.shape[0], device=rows.device))
    return _extend(rows)[src[:n]]


def _pair_rows(handle: MoeHandle) -> torch.Tensor:
    """int64 ``[T, K]``: the sent row of each (token, slot) pair, or S (no row: -1 slots)."""
    t, k, sp = handle.num_tokens, handle.topk, handle.send_pairs
    pos = torch.full((t * k + 1,), sp.shape[0], dtype=torch.int64, device=sp.device)
    pos.scatter_(0, sp, torch.arange(sp.shape[0], device=sp.device))
    return pos[:t * k].view(t, k)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _sum_slots(rows: torch.Tensor, weights: Optional[torch.Tensor], handle: MoeHandle,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum over valid k of weights[t, k] * rows[row of (t, k)]`` (weights None: 1),
    accumulated in fp32 (fp64 for fp64), slot 0 first; ``[T, H]`` in out_dtype."""
    acc = _acc_dtype(out_dtype)
    pos = _pair_rows(handle)
    ext = _extend(rows)
    valid = pos < rows.shape[0]
    out = torch.zeros((handle.num_tokens, rows.shape[-1]), dtype=acc, device=rows.device)
    for k in range(handle.topk):
        w = valid[:, k:k + 1].to(acc)
        if weights is not None:  # where, not a product: a NaN weight of a -1 slot must not count
            w = torch.where(valid[:, k:k + 1], weights[:, k:k + 1].to(acc), torch.zeros((), dtype=acc,
                                                                                         device=w.device))
        out += w * ext[pos[:, k]].to(acc)
    return out.to(out_dtype)


def _rows_from_tokens(tokens: torch.Tensor, handle: MoeHandle, weights: Optional[torch.Tensor] = None,
                      dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The send rows: ``tokens[t]`` (times ``weights[t, k]`` when given) for each sent pair (t, k),
    zero for padding; ``[S, H]``."""
    sp = handle.send_pairs
    tok = _extend(tokens)[torch.div(sp, handle.topk, rounding_mode="floor")]
    if weights is None:
        return tok if dtype is None else tok.to(dtype)
    acc = _acc_dtype(tokens.dtype)
    w = torch.cat([weights.reshape(-1).to(acc), weights.new_zeros(1, dtype=acc)])[sp]
    return (tok.to(acc) * w[:, None]).to(dtype or tokens.dtype)
