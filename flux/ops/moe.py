"""flux.moe_dispatch / flux.moe_combine: expert-parallel MoE token dispatch and combine.

Meaning. The group's W ranks own ``num_experts`` experts in equal shares: rank r owns the
global experts ``[r * E_l, (r + 1) * E_l)``, ``E_l = num_experts / W`` ("local experts" 0 ..
E_l - 1 on r). Each rank has its own T tokens (T may differ between ranks, T = 0 allowed) and,
for each token, K routing slots: ``topk_idx[t, k]`` (a global expert, or -1: no expert) with
``topk_weights[t, k]``. A token lists an expert at most once.

``moe_dispatch`` sends every valid (token, slot) pair to the rank owning its expert: each such
pair becomes one row of ``recv_x`` (a copy of ``x[t]``), and the rows are laid out
*expert-major*::

    for local expert e = 0 .. E_l - 1:
        for source rank s = 0 .. W - 1:
            for token t = 0 .. T_s - 1 (index on s):
                for slot k = 0 .. K - 1:
                    if topk_idx_s[t, k] == rank * E_l + e:  one row  x_s[t]

so expert e's rows are contiguous (``counts[e]`` of them), ready for a grouped GEMM.
``moe_combine(y, handle)`` is the inverse: y holds one row per received pair (the experts'
outputs, in recv_x's layout), and each rank gets back, for its own tokens::

    out[t] = sum over valid k of topk_weights[t, k] * y[row of (t, k)]    (fp32 accumulation)

Two variants. *Unbounded* (``max_tokens_per_rank=None``): recv_x is ``[R, H]`` with R the
number of rows received; the host learns the per-expert counts (a host synchronisation) to size
it. *Bounded* (``max_tokens_per_rank=C``): fixed shapes for CUDA graphs and decode; recv_x is
``[E_l, W * C, H]``, expert e's rows first in its block, zeros after; no host synchronisation
in the data movement. W*C rows per expert always suffice: each of the W sources has at most
T <= C tokens and each token lists an expert at most once.

fp8 dispatch (``fp8=True``, DeepSeek-V3's recipe). x (bf16, fp16 or fp32; H a multiple of 128)
is quantised before it moves: each block of 128 elements of a row gets one fp32 scale, ``amax /
448`` (448: the largest float8_e4m3fn; amax clamped to at least 1e-4, so an all-zero block gets
a finite scale), and its elements become ``float8_e4m3fn(x / scale)`` (``quantize_fp8``). Each
token travels as one byte row: its H fp8 bytes, then its H / 128 scales' bytes, then zero bytes
up to a multiple of 16 (so the symm strategy copies it in 16-byte vectors), viewed as uint8; a
strategy moves that row tensor like any other (both strategies copy rows of any dtype as bytes),
and the receiver splits it again. recv_x is then the pair ``(recv_fp8, recv_scales)``: ``[R, H]``
float8_e4m3fn and ``[R, H / 128]`` float32 (bounded: ``[E_l, W*C, H]`` and ``[E_l, W*C, H/128]``,
zeros past the counts), a row's scales beside its rows for a block-scaled GEMM, or
``dequantize_fp8`` (``fp8 * scale``) for anything else. Combine is unchanged (y in the experts'
output dtype, e.g. bf16). An fp8 dispatch moves ``H + H/32`` bytes per row where bf16 moves
``2H``: 48% fewer.

Unchecked references: ``moe_dispatch_ref`` / ``moe_combine_ref`` (all-gather everything, then
select locally: simple and slow, for tests and for comparing strategies).

Strategies (``STRATEGIES``; ``_choose_strategy`` picks one per call, the same on every rank,
and ``_dispatch_impl`` / ``_combine_impl`` run it). A strategy is an object (``_AllToAll`` is
the model) with

  dispatch(x, topk_idx, E, group, C, any_error)  -> (recv_x, counts, send_pairs, recv_dest, host ints)
  fake_dispatch(x, topk_idx, E, W, C)            -> the same as fake tensors (+ the number of host ints)
  to_sources(y, handle)   recv_x-layout rows -> ``[S, H]`` rows back on their sources, in send order
  to_experts(rows, handle)  the inverse: ``[S, H]`` rows in send order -> recv_x's layout

called with arguments already checked; the weighted sum of combine and every gradient are
computed here from ``send_pairs`` and those two moves, so a strategy only moves data (see
MoeHandle for what the tensors mean):

  all_to_all   the reference strategy and the CPU path, on NCCL or gloo. The sender sorts its
               valid pairs by destination expert (stable: by expert, then token, then slot), the
               ranks exchange per-expert counts (``all_to_all_single`` of W x E_l int64), then
               the rows (``all_to_all_single`` with split sizes), and the receiver reorders
               them from source-major to expert-major. Combine moves y's rows back with the
               reverse all_to_all and sums each token's slots in fp32, slot 0 first (a fixed
               order: deterministic on every device).
               Unbounded: the counts are read on the host (one synchronisation) to size the
               row exchange exactly. Bounded: nothing is read on the host: every rank sends
               each peer a block of P = C * min(K, E_l) rows (a source sends at most T * min(K,
               E_l) rows to one rank), the unused rows zero; the receiver finds each row's
               expert and place from the exchanged counts (searchsorted) on the device. The
               padding costs bandwidth: W * P rows are sent where T * K (at most) are needed.
               (Written to run on NCCL without a host read; so far run on gloo only, where the
               same code runs.)

  symm         (flux/ops/_moe_symm.py) CUDA groups with a symmetric workspace: counts and rows
               move through the workspace, SMs writing rows straight into the peers' buffers
               over NVLink between flux's bounded barriers; no NCCL call, and in the bounded
               variant no host read and no padding rows (positions come from the exchanged
               counts on the device). Chosen wherever it can run.

  local        (flux/ops/_moe_local.py, csrc/moe/moe_local.cu) a group of one rank on CUDA: the
               dispatch is a permutation within the GPU: layout kernels (counts, each pair's
               row, each row's pair; the data verdict with them) and one row-gather kernel; combine
               one kernel (fp32, slot 0 first), its backward one kernel. Unbounded: one host read
               (counts and verdict together); bounded: none (CUDA-graph capturable). Chosen
               automatically there; a call whose host-side checks passed before with the same key
               (all but T and the data) skips them (``_local_plan_key``).

The handle records the strategy (``meta[0]``), so combine and both backward passes use the same
one. In the deferred-verdict case a strategy sends nothing when ``any_error``.

Checks. Every dispatch validates its arguments on every rank, and the ranks agree on a verdict
before any row moves: a problem on any rank raises the same ``FluxInputError`` (naming
``flux.moe_dispatch`` and the rank) on every rank, and the group stays usable. The fields that
must agree (num_experts, max_tokens_per_rank, H, K, the dtypes and the tensors' ranks; not T)
are hashed; each rank's local verdict covers the shapes, dtypes, devices, ``num_experts % W``,
``T <= C`` and the data: ids in [-1, num_experts), no expert twice in a row.

  host verdict (unbounded; bounded on gloo): one all_gather of 2 int64 per rank (error flag,
      hash) through the group, read on the host. Measured on gloo: about 0.5 ms (two ranks on a
      busy 2-core machine, where a whole dispatch of 64 tokens took about 2 ms). On CUDA groups
      it is one synchronisation more in the unbounded variant, which synchronises for its counts
      anyway (a GPU strategy can carry the verdict in its count exchange). Only if some rank
      reports a problem do the ranks exchange their messages, through the default group's store
      (as ``flux.ops._checks``), and raise.
  deferred verdict (bounded on CUDA groups, which must not synchronise): the fields that must
      agree, and host-known local errors, go through ``check_collectively`` (a store exchange on
      a signature's first call, then remembered: the caveats of flux.ops._checks apply); the
      data-dependent verdict (bad ids, duplicates, T > C) is all-gathered on the device (one
      int64 per rank) and not read. If any rank reports a problem, every rank sends and receives
      nothing (recv_x and counts zero, combine gives zeros: no hang, no garbage), and
      ``handle.check()`` (a synchronisation; call it where convenient) raises the same
      FluxInputError on every rank.

``moe_combine`` checks y against the handle locally and raises before communicating (it
exchanges no verdict: a rank that raises there leaves its peers waiting in the collective until
the group's timeout).

Autograd: d x of dispatch is the combine of d recv_x with weights 1 (the sum of the gradients
of a token's copies); for an fp8 dispatch it is straight-through, the quantisation's rounding
ignored: the gradients of ``dequantize_fp8(recv_fp8, recv_scales)`` (summed over the calls, when
it is called more than once) are taken as d recv_x, in their own dtype (bf16 for a bf16
dequantisation), and moved back the same way (``_Fp8Grad``: recv_fp8 itself carries no gradient,
and other uses of recv_scales give x none). d y of combine is the dispatch of
``topk_weights[t, k] * d out[t]`` to the rows; d topk_weights[t, k] is ``<d out[t], y[row of (t, k)]>`` (y's rows as they came back
to the source, kept by the forward when the weights need a gradient); topk_idx has none. Eager
calls with tensors that need gradients run through ``torch.autograd.Function``; torch.compile,
fake tensors and tensor subclasses go through the dispatcher ops ``torch.ops.flux.moe_dispatch``
and ``torch.ops.flux.moe_combine`` (fake implementations: recv_x's row count is a dynamic size;
``register_autograd`` with the same formulas, whose collectives run in dispatcher ops too:
combine with weights 1 for d x, ``torch.ops.flux.moe_to_experts`` for d y). The handle does not
fit a schema, so the ops take and return its tensors (``send_pairs``, ``recv_dest``, ``meta``,
``verdict``) and the public functions wrap them in a ``MoeHandle``. With ``fp8`` the op returns
the received byte rows (uint8) and ``moe_dispatch`` splits them; the straight-through gradient
needs the eager path's link between dequantize_fp8 and the dispatch, so through the ops an fp8
dispatch is not differentiable (``moe_dispatch`` refuses an x that needs a gradient there).
"""
import dataclasses
import logging
import os
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from flux.ops._checks import (FluxInputError, Signature, check_collectively, check_every_call, dtype_code,
                               skips_exchange_if_valid)
from flux.ops import _moe_local, _moe_symm
from flux.ops._common import SUPPORTED_DTYPES, call_mode
from flux.ops._moe_local import LocalStrategy
from flux.ops._moe_symm import SymmStrategy
from flux.runtime import all_gather_dim0, group_device, group_from_name, group_name, resolve_group
from flux.runtime.groups import cuda_group

OP = "flux.moe_dispatch"
OP_COMBINE = "flux.moe_combine"
STRATEGIES = ("all_to_all", "symm", "local")
STRATEGY_ENV = "FLUX_STRATEGY_MOE"  # forces a strategy (the same on every rank, or the check fails)
_log = logging.getLogger("flux")
_INDEX_DTYPES = (torch.int64, torch.int32)

# fp8 dispatch: blocks of 128 elements along H, one fp32 scale each (DeepSeek-V3's activations).
FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_FP8_AMAX_MIN = 1e-4  # an all-zero block still gets a finite, nonzero scale
_FP8_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROW_ALIGN = 16  # bytes: the packed rows' length is a multiple, so rows copy in 16-byte vectors

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

    Fields (``S``: rows this rank sent; unbounded: one per valid slot, bounded (all_to_all):
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
                             side. all_to_all: ``[N]``, N the rows received in the exchange (R,
                             bounded ``W * P``): for each received row (in the exchange's order:
                             by source rank, then expert, token, slot) its row in recv_x viewed
                             as ``[-1, H]``; padding rows hold ``recv_x.numel() / H`` (one past
                             the end)
        meta                 int64 on the CPU: ``[strategy index]``, then, unbounded, the E_l
                             counts and whatever the strategy needs on the host (all_to_all:
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
        """Rows per local expert as a Python list (unbounded); None for the bounded variant,
        whose counts stay on the device."""
        return None if self.bounded else self.meta[1:1 + self.num_local_experts].tolist()

    def host_extra(self) -> List[int]:
        """The strategy's host-side integers (unbounded; see ``meta``)."""
        return self.meta[1 + self.num_local_experts:].tolist()

    def check(self) -> None:
        """Raise the dispatch's FluxInputError, the same on every rank, if some rank's data
        was invalid (only the bounded variant on CUDA groups defers this; reading the verdict
        synchronises with the device)."""
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
# fp8: block quantisation and the byte rows that carry it


def quantize_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows to float8_e4m3fn with one fp32 scale per block of 128 elements (the format
    of an fp8 ``moe_dispatch``; DeepSeek-V3's activations).

    Args:
        x: ``[..., H]`` floating (bf16, fp16 or fp32 for the dispatch), H a multiple of 128.

    Returns:
        ``(q, scales)``: ``q`` ``[..., H]`` float8_e4m3fn, ``scales`` ``[..., H / 128]`` float32,
        computed in fp32: for block b (elements ``128 b .. 128 b + 127``)::

            scales[..., b] = max(amax_b, 1e-4) / 448          amax_b: the block's largest |x|
            q[..., j] = float8_e4m3fn(x[..., j] / scales[..., j // 128])   (round to nearest even)

        so the block's largest element maps to +-448, fp8's largest finite value. The round trip
        ``dequantize_fp8(q, scales, torch.float32)`` is within fp8's rounding of x: ``|x' - x| <=
        2^-4 |x|`` where ``|x / scale| >= 2^-6`` (normal fp8 numbers: 3 mantissa bits), and ``<=
        2^-10 scale`` below (subnormal spacing 2^-9), up to fp32's rounding of the division and
        product.
    """
    h = x.shape[-1]
    if h % FP8_BLOCK:
        raise FluxInputError(f"flux.ops.moe.quantize_fp8: H = {h} is not a multiple of {FP8_BLOCK}")
    blocks = x.to(torch.float32).unflatten(-1, (h // FP8_BLOCK, FP8_BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp(min=_FP8_AMAX_MIN)
    scales = amax / _FP8_MAX
    q = (blocks / scales.unsqueeze(-1)).to(FP8_DTYPE).flatten(-2)
    return q, _dense(scales)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides, so that it can be viewed as another dtype; an empty tensor
    counts as contiguous whatever its strides, so it is made anew."""
    return t.contiguous() if t.numel() else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    blocks = q.to(torch.float32).unflatten(-1, (scales.shape[-1], FP8_BLOCK))
    return (blocks * scales.to(torch.float32).unsqueeze(-1)).flatten(-2).to(dtype)


class _Fp8Grad:
    """Where the straight-through gradient of an eager fp8 dispatch collects: in the backward
    pass, each ``dequantize_fp8`` of the dispatch's (recv_fp8, recv_scales) adds its output's
    gradient (``recv_x``'s shape) here, and the dispatch's backward, which autograd runs only after
    every use of its outputs has run its own, takes the sum as d recv_x."""

    def __init__(self):
        self.grad: Optional[torch.Tensor] = None

    def add(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad

    def take(self) -> Optional[torch.Tensor]:
        grad, self.grad = self.grad, None  # a second backward (retain_graph) starts from nothing
        return grad


class _DequantizeStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, scales, link, dtype):
        ctx.link = link
        return _dequantize(q, scales, dtype)

    @staticmethod
    def backward(ctx, grad):
        ctx.link.add(grad)
        # No gradient for the scales themselves; the edge to the dispatch still makes autograd run
        # the dispatch's backward, which takes the rows' gradient from the link.
        return None, None, None, None


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The rows that block-scaled fp8 values stand for: ``q[..., j] * scales[..., j // 128]``,
    computed in fp32 and returned in ``dtype``.

    Args:
        q: ``[..., H]`` float8_e4m3fn (``quantize_fp8``'s q, or recv_x[0] of an fp8 ``moe_dispatch``).
        scales: ``[..., H / 128]`` float32, the same leading shape (``quantize_fp8``'s scales, or
            recv_x[1]).
        dtype: the result's dtype (default bf16).

    Returns:
        ``[..., H]`` in ``dtype``; zero rows (the bounded dispatch's rows past the counts) stay zero.

    Autograd: for the recv_x of an eager fp8 ``moe_dispatch`` (the two tensors as returned, not
    slices or copies: the link lives on the dispatch's autograd node) the result's gradient goes
    straight through to the dispatch's x, as if the rows had moved unquantised (see
    ``moe_dispatch``). Otherwise it is the ordinary derivative: with respect to the scales (q, an
    fp8 tensor, gets none).
    """
    op = "flux.ops.moe.dequantize_fp8"
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE:
        raise FluxInputError(f"{op}: q must be a float8_e4m3fn tensor, got "
                             f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    if (not isinstance(scales, torch.Tensor) or q.dim() < 1 or scales.shape[:-1] != q.shape[:-1]
            or scales.shape[-1] * FP8_BLOCK != q.shape[-1]):
        raise FluxInputError(f"{op}: scales must have shape [..., H / {FP8_BLOCK}] with q's leading dims; got q "
                             f"{tuple(q.shape)}, scales {tuple(getattr(scales, 'shape', ()))}")
    link = None
    if torch.is_grad_enabled() and scales.requires_grad and scales.grad_fn is not None:
        link = getattr(scales.grad_fn, "fp8_grad", None)  # the dispatch's ctx (its autograd node)
    if link is not None:
        return _DequantizeStraightThrough.apply(q, scales, link, dtype)
    return _dequantize(q, scales, dtype)


def _packed_width(h: int) -> int:
    """Bytes of one token's packed row: H fp8 values, H / 128 fp32 scales, zeros to a multiple of 16."""
    n = h + 4 * (h // FP8_BLOCK)
    return n + (-n) % _ROW_ALIGN


def _pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """``[T, _packed_width(H)]`` uint8: each row of x quantised (``quantize_fp8``), its fp8 bytes,
    then its scales' bytes, then zeros."""
    q, scales = quantize_fp8(x)
    t, h = q.shape
    parts = [q.view(torch.uint8), _dense(scales).view(torch.uint8)]
    pad = _packed_width(h) - h - 4 * scales.shape[-1]
    if pad:
        parts.append(torch.zeros((t, pad), dtype=torch.uint8, device=x.device))
    return torch.cat(parts, 1)


def _unpack_fp8(rows: torch.Tensor, h: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``[..., H]`` float8_e4m3fn, ``[..., H / 128]`` float32) of packed byte rows ``[..., width]``
    (contiguous copies, ready for a GEMM)."""
    nb = h // FP8_BLOCK
    return _dense(rows[..., :h]).view(FP8_DTYPE), _dense(rows[..., h:h + 4 * nb]).view(torch.float32)


# --------------------------------------------------------------------------------------
# Checks


def _signature(x, topk_idx, topk_weights, num_experts, group, capacity, fp8=False) -> Signature:
    """The fields that must agree between ranks (not T), and the local, host-known verdict."""
    sig = Signature(OP)
    world = dist.get_world_size(group)
    ok_int = isinstance(num_experts, int) and not isinstance(num_experts, bool)
    ok_cap = capacity is None or (isinstance(capacity, int) and not isinstance(capacity, bool))
    sig.add("num_experts", num_experts if ok_int else -1)
    sig.add("max_tokens_per_rank (-1: None)", -1 if capacity is None or not ok_cap else capacity)
    sig.add("fp8", 1 if fp8 else 0)
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            sig.fail(f"{name} must be a tensor, got {type(t).__name__}")
            return sig
    sig.add("x.dim()", x.dim())
    sig.add("H (x.shape[-1])", x.shape[-1] if x.dim() >= 1 else -1)
    sig.add("x.dtype", dtype_code(x.dtype))
    sig.add("topk_idx.dim()", topk_idx.dim())
    sig.add("K (topk_idx.shape[-1])", topk_idx.shape[-1] if topk_idx.dim() >= 1 else -1)
    sig.add("topk_idx.dtype", dtype_code(topk_idx.dtype))
    sig.add("topk_weights.dtype", dtype_code(topk_weights.dtype))
    if not ok_int or num_experts <= 0:
        sig.fail(f"num_experts must be a positive int, got {num_experts!r}")
    elif num_experts % world != 0:
        sig.fail(f"num_experts = {num_experts} is not divisible by the group size {world}")
    if not ok_cap or (capacity is not None and capacity < 1):
        sig.fail(f"max_tokens_per_rank must be None or a positive int, got {capacity!r}")
    if x.dim() != 2:
        sig.fail(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        sig.fail(f"x dtype {x.dtype} is not supported (use one of {[str(d) for d in SUPPORTED_DTYPES]})")
    elif fp8 and x.dtype not in _FP8_INPUT_DTYPES:
        sig.fail(f"fp8=True quantises bf16, fp16 or fp32 x, got {x.dtype}")
    if fp8 and x.dim() >= 1 and (x.shape[-1] % FP8_BLOCK or x.shape[-1] == 0):
        sig.fail(f"fp8=True needs H (x.shape[-1]) a positive multiple of {FP8_BLOCK} (one scale per block), "
                 f"got {x.shape[-1]}")
    if topk_idx.dim() != 2 or topk_idx.shape[-1] < 1:
        sig.fail(f"topk_idx must be 2-D [T, K] with K >= 1, got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in _INDEX_DTYPES:
        sig.fail(f"topk_idx dtype {topk_idx.dtype} is not supported (int64 or int32)")
    if not topk_weights.is_floating_point():
        sig.fail(f"topk_weights must be floating, got {topk_weights.dtype}")
    if topk_weights.shape != topk_idx.shape:
        sig.fail(f"topk_weights has shape {tuple(topk_weights.shape)} but topk_idx has {tuple(topk_idx.shape)}")
    if x.dim() >= 1 and topk_idx.dim() >= 1 and topk_idx.shape[0] != x.shape[0]:
        sig.fail(f"topk_idx has {topk_idx.shape[0]} rows but x has {x.shape[0]} tokens")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != x.device:
            sig.fail(f"{name} is on {t.device} but x is on {x.device}")
    dev = group_device(group)
    if x.device.type != dev.type:
        sig.fail(f"x is on {x.device} but the process group communicates on {dev.type} "
                 "(NCCL groups take CUDA tensors, gloo groups CPU tensors)")
    elif x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
        sig.fail(f"x is on {x.device} but the current CUDA device is {torch.cuda.current_device()}")
    return sig


def _data_code(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The data-dependent verdict as an int64 scalar on topk_idx's device (no host read)."""
    idx = topk_idx.to(torch.int64)
    bad = ((idx < -1) | (idx >= num_experts)).any()
    s = idx.sort(dim=1).values
    dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()
    return bad.to(torch.int64) * _BAD_ID + dup.to(torch.int64) * _DUPLICATE


def _data_message(topk_idx: torch.Tensor, num_experts: int) -> Optional[str]:
    """A readable description of the first problem in topk_idx (host read; failing calls only)."""
    idx = topk_idx.to(torch.int64).cpu()
    bad = ((idx < -1) | (idx >= num_experts)).nonzero()
    if len(bad):
        t, k = bad[0].tolist()
        return (f"topk_idx[{t}, {k}] = {int(idx[t, k])} is outside [-1, {num_experts}) "
                f"({len(bad)} such entries)")
    for t, row in enumerate(idx.tolist()):
        seen = set()
        for e in row:
            if e >= 0 and e in seen:
                return f"topk_idx row {t} lists expert {e} twice (a token may list an expert at most once)"
            seen.add(e)
    return None


def _check_host(sig: Signature, topk_idx, num_experts, group) -> None:
    """The host-read verdict: check_every_call with the data verdict of topk_idx as the flag."""
    check_every_call(sig, group, flag=None if sig.error else _data_code(topk_idx, num_experts),
                     flag_message=lambda: _data_message(topk_idx, num_experts) or "invalid topk_idx")


def _deferred_host_code(sig: Signature, x, group, capacity) -> Tuple[int, Optional[str]]:
    """The bounded variant's checks without a host read: the fields that must agree (and
    host-known local errors) through check_collectively. Returns (this rank's host-known code:
    _LOCAL_ARGS, _OVER_CAPACITY or 0; its local error, deferred, or None): a local error whose
    peers skip the exchange (their signature was checked before) travels as the code _LOCAL_ARGS
    rather than in an exchange nobody else joins."""
    if sig.error is not None and skips_exchange_if_valid(sig, group):
        # The peers' identical, valid calls skip the store exchange (their signature was checked
        # before): this rank's local error goes into the device verdict instead, with stand-ins
        # of no tokens so that nothing it sends is read (every rank then gets zeros, and
        # handle.check() raises on every rank).
        _log.warning("%s: rank %d: %s", OP, dist.get_rank(group), sig.error)
        return _LOCAL_ARGS, sig.error
    check_collectively(sig, group)
    return (_OVER_CAPACITY if x.shape[0] > capacity else 0), None


def _check_deferred(sig: Signature, x, topk_idx, num_experts, group, capacity):
    """_deferred_host_code, then the data verdict (_data_code) all-gathered through the group.
    Returns (every rank's code, ``[W]`` int64 on x's device; this rank's local error or None)."""
    host_code, local = _deferred_host_code(sig, x, group, capacity)
    code = torch.tensor(host_code, dtype=torch.int64, device=x.device)
    if local is None:
        code = code + _data_code(topk_idx, num_experts)
    return _all_gather_small(code.reshape(1), group).reshape(-1), local


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


# --------------------------------------------------------------------------------------
# The all_to_all strategy


class _AllToAll:
    """Rows moved by ``all_to_all_single`` (NCCL or gloo); see the module docstring."""

    name = "all_to_all"

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
    def fake_dispatch(x, topk_idx, num_experts, world, capacity):
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


_STRATEGY_IMPLS = {"all_to_all": _AllToAll, "symm": SymmStrategy, "local": LocalStrategy}


def available_strategies(device: torch.device) -> List[str]:
    """Names of the strategies that can run on ``device`` (``symm``: a GPU with flux's kernels;
    its group must also have a symmetric workspace, see ``_moe_symm.usable``)."""
    from flux.runtime import cuda_kernels_available

    gpu = device.type == "cuda" and cuda_kernels_available()
    return ["all_to_all"] + (["symm", "local"] if gpu else [])


def run_strategy(name: str, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                 group: Optional[dist.ProcessGroup] = None, max_tokens_per_rank: Optional[int] = None,
                 fp8: bool = False, zero_pad: bool = True):
    """``flux.moe_dispatch`` through the named strategy, bypassing the choice (benchmarks, tests);
    checked as the op, no autograd; fp8: recv_x is ``(recv_fp8, recv_scales)`` as from the op.
    Combine the result with ``flux.moe_combine``."""
    if name not in STRATEGIES:
        raise ValueError(f"{OP}: unknown strategy {name!r}; known: {list(STRATEGIES)}")
    recv_x, counts, handle = _dispatch_impl(x, topk_idx, topk_weights, num_experts, resolve_group(group, OP),
                                            max_tokens_per_rank, strategy=name, fp8=fp8, zero_pad=bool(zero_pad))
    return (_unpack_fp8(recv_x, handle.hidden) if fp8 else recv_x), counts, handle


def _choose_strategy(x, group: dist.ProcessGroup, bounded: bool, num_experts=None, topk_idx=None) -> str:
    """The strategy of one call: the same on every rank (it depends only on the group and its
    device, which the ranks share, never on ``x``, which is not checked yet): ``symm`` wherever it
    can run (a CUDA group with a symmetric workspace), else the reference ``all_to_all``. It is part
    of the checked signature, so ranks that would choose differently get an error, not a hang.
    A group of one rank on CUDA takes ``local`` (flux/ops/_moe_local.py) where its kernels take
    num_experts and K (at most 1024 experts, K <= 64).
    ``FLUX_STRATEGY_MOE=all_to_all|symm|local`` forces one (a forced one that cannot run raises)."""
    forced = os.environ.get(STRATEGY_ENV, "")
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
    return "symm" if why is None else "all_to_all"


# --------------------------------------------------------------------------------------
# Implementations


def _dispatch_impl(x, topk_idx, topk_weights, num_experts, group, capacity, *, defer_verdict=None,
                   strategy=None, fp8=False, zero_pad=True):
    """Check (see the module docstring), choose a strategy, dispatch. Returns
    ``(recv_x, counts, handle)``; the handle's topk_weights is the argument. ``defer_verdict``:
    report data errors through ``handle.check()`` instead of raising (default: the bounded
    variant on CUDA groups). ``fp8``: x is quantised and moved as packed byte rows, and recv_x
    is the received byte rows (uint8 ``[..., _packed_width(H)]``; ``_unpack_fp8`` splits them).
    ``zero_pad=False``: the bounded variant may leave recv_x's rows past the counts unwritten."""
    bounded = capacity is not None
    if defer_verdict is None:
        defer_verdict = bounded and cuda_group(group)
    if _LOCAL_PLANS and strategy in (None, "local"):
        key = _local_plan_key(x, topk_idx, topk_weights, num_experts, group, capacity, defer_verdict, fp8)
        if key is not None and key in _LOCAL_PLANS:
            return _run_local(LocalStrategy, x, topk_idx, topk_weights, num_experts, group, capacity, defer_verdict,
                              fp8, zero_pad, 0)
    sig = _signature(x, topk_idx, topk_weights, num_experts, group, capacity, fp8)
    name = strategy or _choose_strategy(x, group, bounded, num_experts, topk_idx)
    sig.add("strategy", STRATEGIES.index(name))
    impl = _STRATEGY_IMPLS[name]
    if getattr(impl, "checks_data", False):
        return _dispatch_local(impl, sig, x, topk_idx, topk_weights, num_experts, group, capacity, defer_verdict,
                               fp8, zero_pad)
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


def _dispatch_local(impl, sig, x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8, zero_pad):
    """_dispatch_impl for a strategy whose kernels compute the data verdict (``local``: one rank):
    the signature is checked alone (check_collectively: no peer, nothing to exchange once it was
    seen), the ids and duplicates by the layout kernels: read with the counts (unbounded, which
    raises before any row moves) or reported through ``handle.check()`` (bounded, deferred)."""
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
    if clean and host_code == 0:  # the call's plan is valid: later calls like it skip the checks above
        key = _local_plan_key(x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8)
        if key is not None:
            _LOCAL_PLANS.add(key)
    return _run_local(impl, x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8, zero_pad, host_code)


# Keys (_local_plan_key) of local dispatches whose host-side checks passed (the group object itself,
# not its id, which a later group could reuse): a call with the same key
# passes them too (it differs only in T, within the same bounds, and in the data, which the layout
# kernels check every call), so it goes straight to the kernels.
_LOCAL_PLANS = set()
_LOCAL_META = {}  # bounded calls' meta tensor (the strategy index only), shared: nobody writes it


def _local_plan_key(x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8):
    """What the host-side checks of a local dispatch depend on (all but T and the data), or None
    for arguments that always take the checked path."""
    if type(x) is not torch.Tensor or type(topk_idx) is not torch.Tensor or type(topk_weights) is not torch.Tensor:
        return None
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_weights.dim() != 2:
        return None
    t = x.shape[0]
    return (group, x.dtype, x.device, torch.cuda.current_device() if x.is_cuda else -1, x.shape[1],
            topk_idx.dtype, topk_idx.device,
            topk_idx.shape[1], topk_weights.dtype, topk_weights.device, topk_weights.shape == topk_idx.shape,
            topk_idx.shape[0] == t, num_experts, capacity, capacity is None or t <= capacity, defer, fp8,
            os.environ.get(STRATEGY_ENV, ""))


def _run_local(impl, x, topk_idx, topk_weights, num_experts, group, capacity, defer, fp8, zero_pad, host_code):
    """The kernels of a checked local dispatch, the verdict, the handle."""
    rows = _pack_fp8(x) if fp8 else x
    recv_x, counts, send_pairs, recv_dest, counts_host, verdict, code = impl.dispatch_local(
        rows, topk_idx, num_experts, capacity, host_code, zero_pad)
    if capacity is not None and not defer:  # a verdict that is not deferred is read (a synchronisation)
        code = int(verdict[0])
    if code:
        raise FluxInputError(f"{OP}: invalid arguments on rank {dist.get_rank(group)}: "
                             + (_data_message(topk_idx, num_experts) or "invalid topk_idx"))
    if counts_host is None:
        meta = _LOCAL_META.get(impl.name)
        if meta is None:
            meta = _LOCAL_META[impl.name] = torch.tensor([STRATEGIES.index(impl.name)], dtype=torch.int64)
    else:
        meta = torch.tensor([STRATEGIES.index(impl.name)] + counts_host, dtype=torch.int64)
    h = x.shape[1]
    handle = MoeHandle(group, impl.name, num_experts, x.shape[0], topk_idx.shape[1], h, capacity, topk_weights,
                       send_pairs, recv_dest, meta, verdict, tuple(recv_x.shape[:-1]) + (h,), fp8)
    return recv_x, counts, handle


def _check_combine(y, handle) -> None:
    """Local checks of combine's input (no communication happens before them)."""
    if not isinstance(handle, MoeHandle):
        raise FluxInputError(f"{OP_COMBINE}: handle must be the MoeHandle returned by flux.moe_dispatch, "
                             f"got {type(handle).__name__}")
    if not isinstance(y, torch.Tensor):
        raise FluxInputError(f"{OP_COMBINE}: y must be a tensor, got {type(y).__name__}")
    if tuple(y.shape) != tuple(handle.recv_shape):
        raise FluxInputError(f"{OP_COMBINE}: y has shape {tuple(y.shape)} but the dispatch's recv_x had "
                             f"{tuple(handle.recv_shape)} (y must be in recv_x's layout)")
    if not y.is_floating_point():
        raise FluxInputError(f"{OP_COMBINE}: y must be floating, got {y.dtype}")
    if y.device != handle.send_pairs.device:
        raise FluxInputError(f"{OP_COMBINE}: y is on {y.device} but the dispatch ran on {handle.send_pairs.device}")


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


# --------------------------------------------------------------------------------------
# Eager autograd


class _DispatchFunction(torch.autograd.Function):
    """Outputs ``(recv_x, counts, handle)``; fp8: ``(recv_fp8, recv_scales, counts, handle)``, the
    gradient of recv_x then collected by dequantize_fp8 in ``ctx.fp8_grad`` (straight-through)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, num_experts, group, capacity, fp8, zero_pad):
        recv_x, counts, handle = _dispatch_impl(x, topk_idx, topk_weights, num_experts, group, capacity, fp8=fp8,
                                                zero_pad=zero_pad)
        ctx.handle, ctx.x_dtype, ctx.fp8_grad = handle, x.dtype, None
        if not fp8:
            return recv_x, counts, handle
        q, scales = _unpack_fp8(recv_x, handle.hidden)
        ctx.mark_non_differentiable(q)
        ctx.fp8_grad = _Fp8Grad()
        return q, scales, counts, handle

    @staticmethod
    def backward(ctx, *grads):
        grad_x = None
        if ctx.needs_input_grad[0]:
            if ctx.fp8_grad is None:
                grad_recv = grads[0]
            else:  # straight-through: the dequantised rows' gradient; zeros if none reached them
                grad_recv = ctx.fp8_grad.take()
                if grad_recv is None:
                    grad_recv = torch.zeros(ctx.handle.recv_shape, dtype=ctx.x_dtype,
                                            device=ctx.handle.send_pairs.device)
            # Every rank runs this collective whenever autograd reaches the node, with or without
            # a gradient, as it runs the forward's.
            grad_x = _dispatch_backward(grad_recv, ctx.handle, ctx.x_dtype)
        return grad_x, None, None, None, None, None, None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, handle):
        out, returned = _combine_impl(y, weights, handle, need_returned=ctx.needs_input_grad[1])
        ctx.handle, ctx.y_dtype = handle, y.dtype
        # The returned rows are kept only for the weights' gradient.
        ctx.save_for_backward(weights, returned if ctx.needs_input_grad[1] else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weights, returned = ctx.saved_tensors
        grad_y, grad_w = _combine_backward(ctx.needs_input_grad[:2], grad_out, None, ctx.y_dtype, weights,
                                           returned, ctx.handle)
        return grad_y, grad_w, None


# --------------------------------------------------------------------------------------
# The dispatcher-visible ops (torch.compile, fake tensors, tensor subclasses). The handle
# travels as its tensors; the group as its name.


def _handle_from(group, num_experts, max_tokens_per_rank, topk_weights, send_pairs, recv_dest, meta, verdict,
                 recv_shape, hidden, fp8=False) -> MoeHandle:
    strategy = STRATEGIES[int(meta[0])] if meta.device.type == "cpu" and not _is_fake(meta) else STRATEGIES[0]
    t, k = topk_weights.shape
    return MoeHandle(group, strategy, num_experts, t, k, hidden, max_tokens_per_rank, topk_weights, send_pairs,
                     recv_dest, meta, verdict, tuple(recv_shape), fp8)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


@torch.library.custom_op("flux::moe_dispatch", mutates_args=())
def _moe_dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                     group_name: str, max_tokens_per_rank: Optional[int], fp8: bool = False, zero_pad: bool = True
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8: recv_x is the received packed byte rows (uint8), which moe_dispatch splits."""
    recv_x, counts, h = _dispatch_impl(x, topk_idx, topk_weights, num_experts, group_from_name(group_name),
                                       max_tokens_per_rank, fp8=fp8, zero_pad=zero_pad)
    if h.strategy == "local":  # counts and verdict are views of one tensor there: outputs must not alias
        counts, verdict = counts.clone(), h.verdict.clone()
        return recv_x, counts, h.send_pairs, h.recv_dest, h.meta, verdict
    return recv_x, counts, h.send_pairs, h.recv_dest, h.meta, h.verdict


@_moe_dispatch_op.register_fake
def _moe_dispatch_fake(x, topk_idx, topk_weights, num_experts, group_name, max_tokens_per_rank, fp8=False,
                       zero_pad=True):
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise FluxInputError(f"{OP}: {name} is on {t.device} but x is on {x.device}")
    group = group_from_name(group_name)
    world = dist.get_world_size(group)
    name = _choose_strategy(x, group, max_tokens_per_rank is not None, num_experts, topk_idx)
    rows = x.new_empty((x.shape[0], _packed_width(x.shape[-1])), dtype=torch.uint8) if fp8 else x
    recv_x, counts, send_pairs, recv_dest, n_host = _STRATEGY_IMPLS[name].fake_dispatch(
        rows, topk_idx, num_experts, world, max_tokens_per_rank)
    meta = torch.empty(1 + n_host, dtype=torch.int64, device="cpu")
    return recv_x, counts, send_pairs, recv_dest, meta, torch.empty(world, dtype=torch.int64, device=x.device)


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, topk_weights, num_experts, gname, cap = inputs[:6]
    ctx.args = (gname, num_experts, cap, tuple(topk_weights.shape), x.dtype)
    ctx.save_for_backward(*output[2:5])  # send_pairs, recv_dest, meta


def _dispatch_op_backward(ctx, grad_recv, *grad_rest):
    gname, num_experts, cap, wshape, x_dtype = ctx.args
    send_pairs, recv_dest, meta = ctx.saved_tensors
    grad_x = None
    # (an fp8 dispatch's recv_x is integer bytes: autograd gives it no gradient, grad_recv None)
    if ctx.needs_input_grad[0] and grad_recv is not None:  # combine with weights 1, through the op (traceable)
        ones = torch.ones(wshape, dtype=_acc_dtype(grad_recv.dtype), device=grad_recv.device)
        grad_x = torch.ops.flux.moe_combine(grad_recv.contiguous(), ones, send_pairs, recv_dest, meta, gname,
                                            num_experts, cap)[0].to(x_dtype)
    return grad_x, None, None, None, None, None, None, None


torch.library.register_autograd("flux::moe_dispatch", _dispatch_op_backward, setup_context=_dispatch_setup)


@torch.library.custom_op("flux::moe_combine", mutates_args=())
def _moe_combine_op(y: torch.Tensor, topk_weights: torch.Tensor, send_pairs: torch.Tensor, recv_dest: torch.Tensor,
                    meta: torch.Tensor, group_name: str, num_experts: int, max_tokens_per_rank: Optional[int]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    handle = _handle_from(group_from_name(group_name), num_experts, max_tokens_per_rank, topk_weights, send_pairs,
                          recv_dest, meta, torch.empty(0), y.shape, y.shape[-1])
    _check_combine(y, handle)
    out, returned = _combine_impl(y, topk_weights, handle)
    if returned is not None and returned.untyped_storage().data_ptr() == y.untyped_storage().data_ptr():
        returned = returned.clone()  # a view of y (local strategy): op outputs must not alias inputs
    return out, returned


@_moe_combine_op.register_fake
def _moe_combine_fake(y, topk_weights, send_pairs, recv_dest, meta, group_name, num_experts, max_tokens_per_rank):
    t = topk_weights.shape[0]
    return y.new_empty((t, y.shape[-1])), y.new_empty((send_pairs.shape[0], y.shape[-1]))


def _combine_setup(ctx, inputs, output):
    y, topk_weights, send_pairs, recv_dest, meta, gname, num_experts, cap = inputs
    ctx.args = (gname, num_experts, cap, tuple(y.shape), y.dtype)
    ctx.save_for_backward(topk_weights, send_pairs, recv_dest, meta, output[1])


def _combine_op_backward(ctx, grad_out, grad_returned):
    gname, num_experts, cap, y_shape, y_dtype = ctx.args
    weights, send_pairs, recv_dest, meta, returned = ctx.saved_tensors
    handle = _handle_from(group_from_name(gname), num_experts, cap, weights, send_pairs, recv_dest, meta,
                          torch.empty(0), y_shape, y_shape[-1])
    if grad_out is None:
        grad_out = returned.new_zeros((handle.num_tokens, y_shape[-1]))
    grad_y, grad_w = _combine_backward(ctx.needs_input_grad[:2], grad_out, grad_returned, y_dtype, weights, returned,
                                       handle, traceable=True)
    return grad_y, grad_w, None, None, None, None, None, None


torch.library.register_autograd("flux::moe_combine", _combine_op_backward, setup_context=_combine_setup)


@torch.library.custom_op("flux::moe_to_experts", mutates_args=())
def _moe_to_experts_op(rows: torch.Tensor, recv_dest: torch.Tensor, meta: torch.Tensor, group_name: str,
                       num_experts: int, max_tokens_per_rank: Optional[int], recv_shape: Sequence[int]) -> torch.Tensor:
    """Send rows ``[S, H]`` (send order) to recv_x's layout (``recv_shape``) on their experts'
    ranks: combine's backward for y (no autograd of its own)."""
    handle = MoeHandle(group_from_name(group_name), STRATEGIES[int(meta[0])], num_experts, 0, 1, rows.shape[-1],
                       max_tokens_per_rank, None, torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device),
                       recv_dest, meta, torch.empty(0), tuple(recv_shape))
    return _STRATEGY_IMPLS[handle.strategy].to_experts(rows.contiguous(), handle)


@_moe_to_experts_op.register_fake
def _moe_to_experts_fake(rows, recv_dest, meta, group_name, num_experts, max_tokens_per_rank, recv_shape):
    return rows.new_empty(tuple(recv_shape))


# --------------------------------------------------------------------------------------
# Public API


def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
                 group: Optional[dist.ProcessGroup] = None, max_tokens_per_rank: Optional[int] = None,
                 fp8: bool = False, zero_pad: bool = True):
    """Send each token to the ranks owning the experts it is routed to (expert parallelism).

    Args:
        x: ``[T, H]`` this rank's tokens; bf16, fp16, fp32 or fp64. T may differ between ranks
            (T = 0 allowed); H must not.
        topk_idx: ``[T, K]`` int64 or int32: global expert ids in ``[0, num_experts)``, or -1
            (no expert: the slot is skipped). A row lists an expert at most once.
        topk_weights: ``[T, K]`` floating: the routing weights, used by ``moe_combine`` (kept in
            the handle; their gradient flows through combine).
        num_experts: E, divisible by the group size W; rank r owns the global experts
            ``[r * E_l, (r + 1) * E_l)``, ``E_l = E / W``.
        group: the expert-parallel process group (default: the world).
        max_tokens_per_rank: None (unbounded variant) or C >= every rank's T (bounded variant:
            fixed shapes, no host synchronisation).
        fp8: quantise x to float8_e4m3fn with one fp32 scale per 128 elements (``quantize_fp8``)
            and move that (H + H/32 bytes per row instead of 2H for bf16); x bf16, fp16 or fp32,
            H a multiple of 128; the same on every rank.
        zero_pad: bounded variant only. True (default): recv_x's rows past each expert's count
            are zeros. False: they may be left unwritten, their contents undefined (every row when
            ``handle.check()`` reports an error), as DeepEP's low-latency layout leaves them: for
            expert kernels that read ``counts`` (a masked grouped GEMM), or row-wise expert
            computation whose padding outputs combine never reads, without autograd through the
            experts' weights (a garbage row times a zero gradient can be NaN). The zeros are most
            of what a decode dispatch writes with many experts (E = 64, W = 2, C = 128, top-8:
            about 1/8 of recv_x's rows carry data). Need not agree across ranks.

    Returns:
        ``(recv_x, counts, handle)``:

        recv_x: in x's dtype, on x's device: one row per (token, slot) pair routed here, grouped
            by local expert (0 first), within an expert by source rank (0 .. W-1), then by the
            token's index on its source, then by slot k. Unbounded: ``[R, H]``, R the number of
            such rows. Bounded: ``[E_l, W * C, H]``, expert e's rows first in ``recv_x[e]``, the
            rest zero. fp8: the pair ``(recv_fp8, recv_scales)``, float8_e4m3fn ``[R, H]`` (bounded
            ``[E_l, W * C, H]``) and float32 ``[R, H / 128]`` (``[E_l, W * C, H / 128]``), each row's
            values and block scales exactly as ``quantize_fp8`` of its token gives them on the
            source; ``dequantize_fp8(recv_fp8, recv_scales)`` is the rows in bf16.
        counts: ``[E_l]`` int64 on x's device: rows per local expert.
        handle: a ``MoeHandle`` for ``moe_combine``; ``handle.counts_host`` is counts as a list
            (unbounded; None when bounded).

    Autograd: d x is the sum of the gradients of the token's copies. With fp8 it is
    straight-through: the gradient that reaches ``dequantize_fp8(recv_fp8, recv_scales)``'s
    output is taken as the copies' gradient (the quantisation's rounding ignored) and summed back
    in its dtype, exactly as without fp8; recv_fp8 itself carries none, and so does recv_scales
    used other than through dequantize_fp8. Eager calls only: through the dispatcher ops
    (torch.compile, torch-function modes, tensor subclasses) an fp8 dispatch is not
    differentiable, and an x that needs a gradient there raises FluxInputError.

    Raises:
        FluxInputError, on every rank alike and before any row moves, when some rank's
        arguments are invalid (fp8: x's dtype, H not a multiple of 128) or the ranks disagree on
        num_experts, max_tokens_per_rank, fp8, H, K or the dtypes (the bounded variant on CUDA
        groups reports invalid ids, duplicates and T > C through ``handle.check()`` instead,
        having sent nothing).
    """
    group = resolve_group(group, OP)
    fp8, zero_pad = bool(fp8), bool(zero_pad)
    mode = call_mode(x, topk_idx, topk_weights)
    if mode == 0:
        recv_x, counts, handle = _dispatch_impl(x, topk_idx, topk_weights, num_experts, group, max_tokens_per_rank,
                                                fp8=fp8, zero_pad=zero_pad)
        return (_unpack_fp8(recv_x, handle.hidden) if fp8 else recv_x), counts, handle
    if mode == 1:
        out = _DispatchFunction.apply(x, topk_idx, topk_weights, num_experts, group, max_tokens_per_rank, fp8,
                                      zero_pad)
        recv_x, (counts, handle) = (out[:2] if fp8 else out[0]), out[-2:]
        handle.topk_weights = topk_weights  # the caller's tensor, with its autograd history
        return recv_x, counts, handle
    if fp8 and torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
        raise FluxInputError(f"{OP}: fp8=True is not differentiable through the dispatcher ops (torch.compile, "
                             "torch-function modes, tensor subclasses); call it eagerly for the straight-through "
                             "gradient, or pass x.detach()")
    recv_x, counts, send_pairs, recv_dest, meta, verdict = torch.ops.flux.moe_dispatch(
        x, topk_idx, topk_weights, num_experts, group_name(group), max_tokens_per_rank, fp8, zero_pad)
    h = x.shape[-1]
    handle = _handle_from(group, num_experts, max_tokens_per_rank, topk_weights, send_pairs, recv_dest, meta, verdict,
                          tuple(recv_x.shape[:-1]) + (h,), h, fp8)
    return (_unpack_fp8(recv_x, h) if fp8 else recv_x), counts, handle


def moe_combine(y: torch.Tensor, handle: MoeHandle) -> torch.Tensor:
    """Bring the experts' outputs back to their tokens and sum them with the routing weights.

    Args:
        y: the experts' outputs in ``recv_x``'s layout and shape (``[R, H]`` or ``[E_l, W * C,
            H]``), any floating dtype, on the dispatch's device. Bounded: rows past
            ``counts[e]`` are ignored.
        handle: the ``MoeHandle`` of the matching ``moe_dispatch`` (same group, every rank).

    Returns:
        out: ``[T, H]`` in y's dtype, in this rank's token order:
        ``out[t] = sum over valid k of topk_weights[t, k] * y[row of (t, k)]``, accumulated in
        fp32 (fp64 for fp64 y) slot by slot from k = 0, then cast; zero for a token without a
        valid slot.

    Raises:
        FluxInputError, locally and before communicating, when y does not match the handle.
    """
    _check_combine(y, handle)
    weights = handle.topk_weights
    mode = call_mode(y, weights)
    if mode == 0:
        return _combine_impl(y, weights, handle, need_returned=False)[0]
    if mode == 1:
        return _CombineFunction.apply(y, weights, handle)
    return torch.ops.flux.moe_combine(y, weights, handle.send_pairs, handle.recv_dest, handle.meta,
                                      group_name(handle.group), handle.num_experts, handle.max_tokens_per_rank)[0]


# --------------------------------------------------------------------------------------
# Unchecked references: gather everything, select locally


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
