"""An expert-parallel mixture-of-experts layer on flux.moe_dispatch / flux.moe_combine.

    x [T, H] -> router (top-k) -> moe_dispatch -> per local expert: SwiGLU MLP (grouped GEMMs)
             -> moe_combine (the top-k outputs of each token, weighted and summed) -> [T, H]

Each rank of the group holds E/W experts (rank r: global experts r*E/W .. (r+1)*E/W - 1) and
routes its own T tokens; the dispatch brings every token to the ranks of its chosen experts and
the combine brings the expert outputs back. With ``chunks`` > 1 the tokens go in blocks, the
communication of one block on a side CUDA stream while the experts compute another (``MoE``).
"""
import contextlib
import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flux
from flux.nn._init import _shared_seed, uniform_lines
from flux.ops.grouped_mm import grouped_mm, grouped_mm_padded, slab_kernels_ready
from flux.runtime import group_name, resolve_group

# Derived seeds of the three weights: each is a lines-by-seed matrix (uniform_lines) of its own.
_ROUTER_SEED, _W13_SEED, _W2_SEED = 0x2545F491, 0x9E3779B9, 0x7F4A7C15


class FluxDispatcher:
    """The default dispatcher of ``MoE``: flux.moe_dispatch and flux.moe_combine. Another object
    with the same two methods, signatures and layouts can stand in for it (the benchmarks pass an
    all-to-all baseline); its handle needs a ``counts_host`` attribute (a list, or None). A
    dispatcher whose bounded slabs are zeros past the counts says so with ``zero_padded = True``,
    and ``MoE`` then does not mask them again. ``read_counts`` is flux.moe_dispatch's: ``MoE``
    passes False where its own router chose the ids (valid by construction), so that a group of
    one rank dispatches without a host read; other dispatchers are called without it."""

    zero_padded = True  # dispatch() asks for zeros (zero_pad=True) unless MoE skips the padding rows

    @staticmethod
    def dispatch(x, topk_idx, topk_weights, num_experts, *, group=None, max_tokens_per_rank=None,
                 read_counts=True, zero_pad=True):
        return flux.moe_dispatch(x, topk_idx, topk_weights, num_experts, group=group,
                                 max_tokens_per_rank=max_tokens_per_rank, read_counts=read_counts,
                                 zero_pad=zero_pad)

    @staticmethod
    def combine(y, handle):
        return flux.moe_combine(y, handle)


class MoE(nn.Module):
    """A top-k mixture of SwiGLU experts, the experts split over ``group`` (expert parallelism).

    ``forward(x)``: ``x [T, H]`` or ``[..., H]`` (this rank's tokens; the ranks may hold different
    numbers of tokens) -> the same shape::

        p = softmax(x @ router.weight^T)                      [T, E]   (fp32 or wider)
        w, idx = topk(p, top_k)                               weights and global expert ids
        w = w / w.sum(-1)           (renormalize=True, the default: the k weights sum to 1)
        out[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])
        expert_e(v) = (silu(v @ W1_e^T) * (v @ W3_e^T)) @ W2_e^T

    Renormalising over the k chosen experts (Mixtral's choice) keeps the output's scale
    independent of how peaked the router is; with ``top_k=1`` it makes every weight 1, so the
    router gets no gradient from the output (``renormalize=False`` keeps the softmax
    probabilities, as Switch Transformer does).

    Parameters (this rank's shards only):
        router.weight  [E, H]          replicated (``nn.Linear(H, E, bias=False)``); its gradient
                                       is this rank's tokens' share: all-reduce it over the
                                       data-parallel ranks like any replicated parameter
        w13            [E/W, 2F, H]    rows 0..F-1: W1 (gate), rows F..2F-1: W3 (up), per expert
                                       in nn.Linear's layout (global experts rank*E/W onward)
        w2             [E/W, H, F]     the down projection, nn.Linear's layout
    The expert weights' gradients are complete on their owner rank (the dispatch's backward
    brings every rank's token gradients back to it).

    Initialisation: nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for each matrix, drawn shard by
    shard as flux.nn's tensor-parallel layers do: w13 and w2 are lines of the full
    ``[E*2F, H]`` and ``[E*H, F]`` matrices of ``uniform_lines`` (each line a function of the seed
    and its index), so for a given ``seed`` every group size holds slices of the same full layer
    (``MoE.full_weights``), and each rank allocates and draws only its own experts. ``seed=None``:
    the group's first rank draws one and broadcasts it (a collective).

    ``max_tokens_per_rank=C``: the bounded dispatch (``[E/W, W*C, H]`` per-expert slabs; no host
    synchronisation in the dispatch; every rank's T must be at most C); the experts run over the
    slabs (``grouped_mm_padded``): with flux's masked grouped kernels (bf16 on sm 9.0, where
    built, and slabs at most half full on average: ``skip_padding``) only each expert's counted
    rows, flux's dispatch then leaving the rest unwritten (``zero_pad=False``); elsewhere as
    batched GEMMs, the rows past each expert's count the dispatch's zeros (masked first for a
    dispatcher without ``zero_padded``). On CUDA groups the
    dispatch reports a rank over C (or bad ids) without a host read, every rank getting zeros;
    the layer then reads that verdict after the combine (one host synchronisation) and raises the
    same FluxInputError on every rank, except while a CUDA graph is being captured.
    None: the unbounded dispatch (rows grouped by expert) and ``grouped_mm``; with this class's
    router and flux's dispatcher, without the host read of the counts (``read_counts=False``: on a
    group of one rank the rows are sized for the worst case, T * K, which a top-k router fills).

    ``chunks=c``: overlap the token movement with the expert GEMMs. This rank's T tokens are
    routed together, then split into c blocks of consecutive tokens (the first ``T % c`` blocks one
    token longer; blocks of 0 tokens when T < c, including T = 0), each dispatched, computed and
    combined on its own; the outputs are concatenated in token order. The arithmetic of every
    token is that of ``chunks=1`` (its routing, its experts' rows, its combine); only the grouping
    of rows into GEMMs differs. On CUDA the blocks are pipelined::

        side stream (all communication):  D0  D1  C0  D2  C1  ...  D(c-1)  C(c-2)  C(c-1)
        caller's stream (experts):             E0      E1      ...       E(c-1)

    so block i+1's dispatch and block i-1's combine run while block i's experts compute (events
    order each block's dispatch -> experts -> combine; the tensors one stream makes and the other
    reads are recorded on the reader's stream, so the caching allocator does not hand them out
    again before the reader is done). All communication goes through one side stream per device
    and group, shared by every MoE layer: two dispatches or combines on one group never run
    concurrently (flux's MoE strategies order the reuse of their workspace with barriers on the
    stream they are called on, so only within one stream). The host issues block i's experts
    before block i+1's dispatch, so the unbounded dispatch's host read of its counts waits while
    the GPU has work queued. The backward pass is not pipelined by the layer: autograd runs each
    dispatch's and combine's backward on the side stream (where their forward ran) and the
    experts' on the caller's, in its own order. On the CPU the same blocks run in the same order,
    one after the other. Every rank must use the same c (each block is one collective dispatch
    and combine on every rank). Bounded (``max_tokens_per_rank=C``): each block is a bounded
    dispatch with ``ceil(C / c)`` tokens per rank, which every block satisfies when T <= C (the
    limit is per block: a T a little over C whose blocks fit runs).

    The overlap has not been measured yet. Choosing c: with D, X and C the whole forward's
    dispatch, experts and combine times (D and C share the side stream), the pipeline takes about
    ``(D + X + C) / c + (c - 1) / c * max(X, D + C)`` against ``D + X + C`` unchunked: it hides at
    most ``min(X, D + C)``, half of it at c = 2, three quarters at c = 4. Each block also costs a
    dispatch's and a combine's fixed costs (the argument check's all-gather, barriers, and in the
    unbounded variant a host synchronisation) and makes the expert GEMMs smaller (each expert's
    rows split c ways: keep a few hundred rows per local expert per block), and the symm
    strategy's row copies run on SMs that the GEMMs then share. So: c = 2 where the communication
    and the experts take comparable times, 4 for large T; measure the layer's step at c = 1, 2
    and 4 and keep the fastest.

    ``dispatcher``: the object whose ``dispatch`` and ``combine`` move the tokens (default
    ``FluxDispatcher``: flux.moe_dispatch / flux.moe_combine).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *,
                 group: Optional[dist.ProcessGroup] = None, seed: Optional[int] = None, dtype=None, device=None,
                 max_tokens_per_rank: Optional[int] = None, renormalize: bool = True, chunks: int = 1,
                 dispatcher=None):
        super().__init__()
        name = "flux.nn.MoE"
        self.group = resolve_group(group, name)
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if min(hidden, ffn, num_experts, top_k) <= 0:
            raise ValueError(f"{name}: hidden, ffn, num_experts and top_k must be positive, got "
                             f"{hidden}, {ffn}, {num_experts}, {top_k}")
        if num_experts % world:
            raise ValueError(f"{name}: num_experts={num_experts} is not divisible by the group size {world}")
        if top_k > num_experts:
            raise ValueError(f"{name}: top_k={top_k} is more than num_experts={num_experts}")
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"{name}: chunks must be a positive int, got {chunks!r}")
        if max_tokens_per_rank is not None and max_tokens_per_rank <= 0:
            raise ValueError(f"{name}: max_tokens_per_rank must be positive or None, got {max_tokens_per_rank}")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.local_experts = num_experts // world
        self.first_expert = rank * self.local_experts
        self.max_tokens_per_rank, self.renormalize, self.chunks = max_tokens_per_rank, renormalize, chunks
        self.dispatcher = dispatcher if dispatcher is not None else FluxDispatcher()

        seed = _shared_seed(seed, self.group)
        opts = dict(device=device, dtype=dtype if dtype is not None else torch.get_default_dtype())
        el, f, h = self.local_experts, ffn, hidden
        self.router = nn.Linear(hidden, num_experts, bias=False, **opts)
        with torch.no_grad():
            self.router.weight.copy_(uniform_lines(seed ^ _ROUTER_SEED, 0, num_experts, h, 1 / math.sqrt(h)))
        w13 = uniform_lines(seed ^ _W13_SEED, self.first_expert * 2 * f, el * 2 * f, h, 1 / math.sqrt(h))
        w2 = uniform_lines(seed ^ _W2_SEED, self.first_expert * h, el * h, f, 1 / math.sqrt(f))
        self.w13 = nn.Parameter(w13.view(el, 2 * f, h).to(**opts))
        self.w2 = nn.Parameter(w2.view(el, h, f).to(**opts))

    @staticmethod
    def full_weights(hidden: int, ffn: int, num_experts: int, seed: int) -> Dict[str, torch.Tensor]:
        """The whole layer of which ``MoE(..., seed=seed)`` holds slices at any group size (float32,
        CPU): ``router [E, H]``, ``w13 [E, 2F, H]``, ``w2 [E, H, F]``. Draws every expert: for
        tests and small layers."""
        h, f, e = hidden, ffn, num_experts
        return {"router": uniform_lines(seed ^ _ROUTER_SEED, 0, e, h, 1 / math.sqrt(h)),
                "w13": uniform_lines(seed ^ _W13_SEED, 0, e * 2 * f, h, 1 / math.sqrt(h)).view(e, 2 * f, h),
                "w2": uniform_lines(seed ^ _W2_SEED, 0, e * h, f, 1 / math.sqrt(f)).view(e, h, f)}

    @torch.no_grad()
    def load_full_(self, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> "MoE":
        """Copy this rank's share of a whole layer (``router [E, H]``, ``w13 [E, 2F, H]``,
        ``w2 [E, H, F]``, as ``full_weights`` gives) into the parameters; returns self."""
        lo, hi = self.first_expert, self.first_expert + self.local_experts
        for p, full, shape in ((self.router.weight, router, (self.num_experts, self.hidden)),
                               (self.w13, w13, (self.num_experts, 2 * self.ffn, self.hidden)),
                               (self.w2, w2, (self.num_experts, self.hidden, self.ffn))):
            if tuple(full.shape) != shape:
                raise ValueError(f"flux.nn.MoE.load_full_: expected a full weight of shape {shape}, "
                                 f"got {tuple(full.shape)}")
            p.copy_(full if p is self.router.weight else full[lo:hi])
        return self

    def route(self, x: torch.Tensor):
        """``(topk_idx [T, k] int64, topk_weights [T, k])`` for ``x [T, H]``: the softmax over the
        router's logits in fp32 (or wider, for float64 inputs; ``router_logits``), its top k,
        renormalised over the k when ``renormalize``. The weights stay in that precision
        (moe_combine accumulates in fp32)."""
        probs = router_logits(x, self.router.weight).softmax(dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return idx, weights

    def experts(self, recv_x: torch.Tensor, counts: torch.Tensor, counts_host=None, *,
                zero_padded: bool = False, skip_padding: Optional[bool] = None) -> torch.Tensor:
        """The local experts' SwiGLU MLPs on the dispatched rows, in the dispatch's layout:
        ``[R, H]`` grouped by expert (``counts`` rows each) or ``[E/W, W*C, H]`` slabs (bounded;
        rows past ``counts[e]`` ignored). Slabs where flux's masked grouped kernels run
        (``skip_padding``; None: wherever they run): only the counted rows are computed (GEMM,
        SwiGLU, GEMM), the outputs past them undefined; else batched GEMMs with those rows masked
        to zero, their outputs zero. ``zero_padded``: the slabs' rows past the counts are known to
        be zeros, which give zero outputs and gradients as they are, so they are not masked (a
        pass over the slabs saved; the results are the same)."""
        if recv_x.dim() == 3:
            if skip_padding is None:
                skip_padding = slab_kernels_ready(recv_x, self.w13) and slab_kernels_ready(recv_x, self.w2)
            if skip_padding and isinstance(counts, torch.Tensor) and counts.dtype == torch.int64 \
                    and counts.device == recv_x.device:
                h = grouped_mm_padded(recv_x, self.w13, counts, skip_padding=True)
                return grouped_mm_padded(swiglu(h, counts), self.w2, counts, skip_padding=True)
            h = grouped_mm_padded(recv_x, self.w13, None if zero_padded else counts)
            return grouped_mm_padded(swiglu(h), self.w2)
        h = grouped_mm(recv_x, self.w13, counts, counts_host=counts_host)
        return grouped_mm(swiglu(h), self.w2, counts, counts_host=counts_host)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"flux.nn.MoE: input has {x.shape[-1]} features, the layer {self.hidden}")
        shape = x.shape
        x2 = x.reshape(-1, self.hidden)
        idx, weights = self.route(x2)
        if self.chunks > 1:
            return self._forward_chunked(x2, idx, weights).reshape(shape)
        cap = self.max_tokens_per_rank
        skip = cap is not None and self.skip_padding(x2, cap)
        recv_x, counts, handle = self._dispatch(x2, idx, weights, cap, skip)
        y = self.experts(recv_x, counts, getattr(handle, "counts_host", None), zero_padded=self._zero_padded(),
                         skip_padding=skip)
        out = self.dispatcher.combine(y, handle)
        self._check(x2, [handle])
        return out.reshape(shape)

    def _dispatch(self, x, idx, weights, cap, skip=False):
        """The dispatcher's dispatch. Unbounded, with flux's dispatcher and this class's router (its
        top-k ids are in range and distinct, so no data error can arise), without the host read of
        the counts on a group of one rank (``read_counts=False``: T * K rows, the counts on the
        device, which the grouped GEMMs take as they are)."""
        kw = {}
        if cap is None and isinstance(self.dispatcher, FluxDispatcher) and type(self).route is MoE.route:
            kw["read_counts"] = False
        if skip and isinstance(self.dispatcher, FluxDispatcher):
            kw["zero_pad"] = False  # the masked experts read only the counted rows
        return self.dispatcher.dispatch(x, idx, weights, self.num_experts, group=self.group, max_tokens_per_rank=cap,
                                        **kw)

    def skip_padding(self, x: torch.Tensor, cap: int) -> bool:
        """Whether a bounded forward of the tokens ``x [T, H]`` (at most ``cap`` per rank) runs
        the experts on flux's masked grouped kernels, which compute only each slab's counted rows,
        so that flux's dispatch need not zero the rest: where they run (x's device and dtype) and
        at most half of the slab rows can be expected to carry data (T * top_k <= E * C / 2,
        the rows a rank receives from ranks like it over its E/W * W * C slab rows). Fuller slabs
        (8 experts, top-8: every row) have little padding to skip, and there the batched GEMM
        over whole slabs measured faster."""
        if x.shape[0] * self.top_k * 2 > self.num_experts * cap:
            return False
        return slab_kernels_ready(x, self.w13) and slab_kernels_ready(x, self.w2)

    def _zero_padded(self) -> bool:
        return bool(getattr(self.dispatcher, "zero_padded", False))

    def _check(self, x: torch.Tensor, handles) -> None:
        """Raise, on every rank alike, what a bounded dispatch on a CUDA group reported without a
        host read (a rank over its block's max_tokens_per_rank, bad expert ids: every rank then got
        zeros): read here (a host synchronisation), except while a CUDA graph is being captured,
        where the zeros stand (the caller checks its inputs before capturing)."""
        if self.max_tokens_per_rank is None or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        for handle in handles:
            check = getattr(handle, "check", None)
            if check is not None:
                check()

    def _forward_chunked(self, x2: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``chunks`` > 1 (class docstring): ``[T, H]`` routed tokens -> ``[T, H]``, block by block.
        The collective calls are the same on every rank: for c blocks, dispatch 0, then for each
        block i dispatch i+1 (if any) and combine i."""
        c = self.chunks
        sizes = _block_sizes(x2.shape[0], c)
        cap = None if self.max_tokens_per_rank is None else -(-self.max_tokens_per_rank // c)
        blocks = list(zip(x2.split(sizes), idx.split(sizes), weights.split(sizes)))
        streams = _Streams(x2.device, self.group)
        streams.side_waits((x2, idx, weights))  # the routing, computed on the caller's stream

        skips = [cap is not None and self.skip_padding(b[0], cap) for b in blocks]

        def dispatch(i):
            with streams.comm():
                out = self._dispatch(*blocks[i], cap, skips[i])
            return out, streams.mark(side=True)

        outs, handles = [], []
        pending = dispatch(0)
        for i in range(c):
            (recv_x, counts, handle), received = pending
            streams.main_waits((recv_x, counts), received)
            y = self.experts(recv_x, counts, getattr(handle, "counts_host", None), zero_padded=self._zero_padded(),
                             skip_padding=skips[i])
            computed = streams.mark(side=False)
            if i + 1 < c:
                pending = dispatch(i + 1)  # queued before combine i: it runs while experts i compute
            streams.side_waits((y,), computed)
            with streams.comm():
                outs.append(self.dispatcher.combine(y, handle))
            handles.append(handle)
        streams.main_waits(outs)
        self._check(x2, handles)
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn}, num_experts={self.num_experts} "
                f"({self.local_experts} per rank, from {self.first_expert}), top_k={self.top_k}, "
                f"renormalize={self.renormalize}, max_tokens_per_rank={self.max_tokens_per_rank}, chunks={self.chunks}")


class _RouterLogits(torch.autograd.Function):
    """``x @ w^T`` of 16-bit ``x [T, H]`` and ``w [E, H]`` (one dtype, CUDA) as fp32 logits, on
    tensor cores with fp32 accumulation: each product of two 16-bit values is exact in fp32, so the
    logits are those of the fp32 product of the converted operands up to the order of the sums,
    without an fp32 copy of x (a pass over it, and that copy kept for the backward). Backward: the
    logits' gradient rounded to x's dtype, then the two 16-bit products (fp32 accumulation), as a
    mixed-precision linear layer computes its gradients."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.to(x.dtype)
        dx = g @ w if ctx.needs_input_grad[0] else None
        dw = g.t() @ x if ctx.needs_input_grad[1] else None
        return dx, dw


_MIXED_LOGITS_FAILED = []  # set once torch.mm(..., out_dtype=) has raised here (older torch)


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The router's logits ``x [T, H] @ w [E, H]^T`` in fp32 (float64 for float64 x).
    bf16 / fp16 on CUDA: ``_RouterLogits`` (16-bit operands, fp32 accumulation and output);
    elsewhere both operands converted first (``F.linear`` in the wider dtype)."""
    if (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and x.dim() == 2
            and not _MIXED_LOGITS_FAILED):
        try:
            return _RouterLogits.apply(x, w)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):
            _MIXED_LOGITS_FAILED.append(True)
    ct = torch.promote_types(x.dtype, torch.float32)
    return F.linear(x.to(ct), w.to(ct))


class _SwiGLUKernel(torch.autograd.Function):
    """swiglu through flux's kernels (csrc/moe/moe_swiglu.cu): one pass forward, one backward;
    with counts, only the counted rows of each slab of ``slab`` rows."""

    @staticmethod
    def forward(ctx, h, counts=None, slab=0):
        ctx.slab = slab
        ctx.save_for_backward(h, counts)
        return torch.ops.flux.moe_swiglu(h, counts, slab)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        h, counts = ctx.saved_tensors
        return torch.ops.flux.moe_swiglu_backward(grad.contiguous(), h, counts, ctx.slab), None, None


_SWIGLU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def swiglu(h: torch.Tensor, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``h [..., 2F]`` (gate: the first F features, up: the last F) ->
    ``[..., F]``. On CUDA with flux's kernels (bf16, fp16, fp32) one fused pass each way, computed
    in fp32 and rounded once (torch's two ops round silu(gate) to h's dtype in between);
    elsewhere those two ops. ``counts`` (int64 ``[E]`` on h's device, h ``[E, C, 2F]`` slabs):
    the kernels compute only the rows below ``counts[e]`` of each slab, the rest of the output
    (and of the gradient) left undefined; without the kernels every row is computed."""
    if (h.is_cuda and h.dtype in _SWIGLU_DTYPES and h.is_contiguous() and h.dim() >= 1 and h.shape[-1] % 2 == 0
            and _has_swiglu_kernel()):
        f = h.shape[-1] // 2
        if counts is not None and h.dim() == 3 and counts.dtype == torch.int64 and counts.device == h.device \
                and counts.shape == (h.shape[0],) and h.shape[1] > 0:
            return _SwiGLUKernel.apply(h.reshape(-1, 2 * f), counts.contiguous(), h.shape[1]).view(*h.shape[:-1], f)
        return _SwiGLUKernel.apply(h.reshape(-1, 2 * f)).view(*h.shape[:-1], f)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _has_swiglu_kernel() -> bool:
    return hasattr(torch.ops.flux, "moe_swiglu")


def _block_sizes(tokens: int, chunks: int):
    """``chunks`` token counts summing to ``tokens``, the first ``tokens % chunks`` one larger."""
    return [tokens // chunks + (1 if i < tokens % chunks else 0) for i in range(chunks)]


# The chunked forward's communication stream of each (CUDA device, group), shared by every MoE
# layer: dispatches and combines on one group (and, through autograd, their backward passes)
# then run one after another on one stream, as the strategies' barriers need.
_COMM_STREAMS: Dict[Tuple[int, str], "torch.cuda.Stream"] = {}


def _comm_stream(device: torch.device, group: dist.ProcessGroup) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, group_name(group))
    stream = _COMM_STREAMS.get(key)
    if stream is None:
        stream = _COMM_STREAMS[key] = torch.cuda.Stream(device=index)
    return stream


def _record(tensors, stream) -> None:
    """Tell the caching allocator that ``stream`` reads these CUDA tensors (nested tuples and
    lists too: an fp8 dispatch's recv_x is a pair)."""
    for t in tensors:
        if isinstance(t, (tuple, list)):
            _record(t, stream)
        elif isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


class _Streams:
    """The chunked forward's two streams on CUDA: communication on the side stream
    (``_comm_stream``), the experts on the caller's (current) stream, ordered by events; every
    tensor that one makes and the other reads is recorded on the reader. On the CPU there is one
    order, the host's, and every method does nothing."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.side = _comm_stream(device, group)

    def comm(self):
        """Context in which the communication is issued (on the side stream)."""
        return torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()

    def mark(self, side: bool):
        """An event recorded now on the side (or the caller's) stream; None on the CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.side if side else self.main)
        return event

    def side_waits(self, tensors, event=None) -> None:
        """The side stream waits for the caller's stream (everything queued on it so far, or up to
        ``event``) and may then read ``tensors``, made there."""
        if self.cuda:
            self._wait(self.side, self.main, tensors, event)

    def main_waits(self, tensors, event=None) -> None:
        """The caller's stream waits for the side stream (all of it, or up to ``event``) and may
        then read ``tensors``, made there."""
        if self.cuda:
            self._wait(self.main, self.side, tensors, event)

    @staticmethod
    def _wait(waiter, other, tensors, event) -> None:
        if event is None:
            waiter.wait_stream(other)
        else:
            waiter.wait_event(event)
        _record(tensors, waiter)


__all__ = ["FluxDispatcher", "MoE", "router_logits", "swiglu"]
