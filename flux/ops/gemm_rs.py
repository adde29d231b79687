"""flux.gemm_rs: the reduce-scatter after a row-parallel GEMM.

Meaning (the unfused reference, ``gemm_rs_ref``)::

    out = reduce_scatter(input @ W, dim=0) (+ bias)

The bias is added once, after the reduction, as Megatron's RowParallelLinear does. The
op is ``torch.ops.flux.gemm_rs``, with a fake implementation for torch.compile and an
autograd formula (backward is an AllGather+GEMM for the input's gradient and a local
GEMM for the weight's). The first call of a problem checks, chooses and plans (the slow
path); later calls of the same problem run its plan from C++ (flux/ops/_plans.py,
csrc/gemm_rs/gemm_rs_plan.cpp). Strategies, chosen per problem by flux.autotune:

  sequential   one GEMM, then NCCL reduce-scatter (gloo: all-reduce and slice), then the
               bias. The reference, the CPU path and the fallback.
  decomposed   the GEMM in one row block per rank (cuBLAS): the blocks of peers first, in a
               rotated order, each pushed by the copy engine into its owner's symmetric
               workspace while the next block computes; this rank's own block last, straight
               into its own slot; then one pass sums the W slots in rank order, in fp32, and
               adds the bias (flux::reduce_chunks_). Stream timeline on rank r of W::

                 current:  [wait barrier started][GEMM r+1][GEMM r+2] ... [GEMM r] [reduce + bias]
                 comm:     [barrier]           [copy -> r+1, put] [copy -> r+2, put] ...
                 signal:                                       [wait r-1][wait r-2] ...

               The peer blocks' GEMMs write this rank's staging (in its workspace, after the
               slots), so only the copies and the own block's GEMM (into this rank's slot) wait
               for the barrier to pass; the first GEMM waits only for the barrier kernel to hold
               an SM. With one peer (W = 2) and one chunk its wait follows the push on the comm
               stream, which then ends with the event the reduction waits for.

               ``chunks`` > 1 splits each block into sub-blocks, each pushed and signalled on
               its own channel (a shorter last transfer, more GEMM launches).

  decomposed_p2p  the same, but each peer block's GEMM writes its result straight into the
               owner's workspace over NVLink (no staging buffer, no copy engine); the put
               follows the GEMM on the current stream.
  fused        a ring of W GEMMs, one per row block, the reduction folded into their epilogues:
               at step s this rank computes block b_s = rank - s - 1 (mod W); step 0 is a cuBLAS
               GEMM into a staging buffer; every later step is one persistent CUTLASS GEMM whose
               epilogue adds C = the sum so far of that block, pushed by rank - 1 at its step
               s - 1 (csrc/gemm_rs/rs_fused.cuh), each tile's epilogue waiting (bounded) for the
               flags of the C segments it reads. Each result but the last is pushed by the copy
               engine to rank + 1 in ``segments`` row segments, each followed by a segment flag (a
               stream write, no SM). The last step's block is this rank's own, written to the
               output with the bias. No reduction pass after the last GEMM. At W = 2::

                 current:  [zero own flags][wait barrier started][GEMM peer rows] [fused GEMM own rows + C + bias ....]
                 comm:     [barrier]                                  [copy seg 0][flag 0] [copy seg 1][flag 1] ...

               Above two ranks the sum is rounded to the input dtype at every hop, as NCCL's
               ring reduce-scatter does (W = 2: once).

  oneshot      for small M: one GEMM of the whole partial into this rank's workspace, a
               barrier, then each rank sums its rows of every rank's partial, read over NVLink
               by SM loads (flux::reduce_peers_), and adds the bias::

                 current:  [barrier][one GEMM -> own workspace][barrier][reduce from all peers]

               The entry barrier keeps a rank from overwriting its partial while a peer may
               still be reading the previous call's.
"""
import functools
from typing import Optional

import torch
import torch.distributed as dist

from flux import autotune
from flux.autotune.space import Candidate
from flux.ops import _plans
from flux.ops._checks import FluxInputError, Signature, check_collectively  # noqa: F401
from flux.ops._common import (call_mode, check_gemm_args, check_out_arg, check_same_device, choose_and_check,
                              deliver, local_gemm, refuse_capture, weight_nk_shape)
from flux.runtime import group_device, group_from_name, group_name, reduce_scatter_dim0, resolve_group

OP = "flux.gemm_rs"
NAME = "gemm_rs"
STRATEGIES = ("sequential", "oneshot", "decomposed", "decomposed_p2p", "fused")
_LAYOUT, _DTYPE = _plans.LAYOUT_CODES, _plans.DTYPE_CODES


def _sequential(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference in Python: one GEMM, then the reduce-scatter (NCCL; gloo: all-reduce and
    slice), then the bias."""
    n, k = weight_nk_shape(weight, weight_layout)
    partial = local_gemm(input.reshape(-1, k), weight, None, weight_layout, out_dtype)
    res = reduce_scatter_dim0(partial.reshape(*input.shape[:-1], n), group)
    if bias is not None:
        res += bias
    return deliver(res, out)


def ring_steps(rank: int, world: int):
    """The fused strategy's ring on ``rank``: for each step s = 0 .. W-1, (the row block it
    computes, the inbox slot holding rank - 1's sum so far of that block or None, the slot of
    rank + 1's inbox it sends its result to or None). Block rank - s - 1 (mod W): rank - 1
    computed the same block one step earlier, and the last step's block is the rank's own.
    csrc/gemm_rs/gemm_rs_plan.cpp runs this schedule."""
    return [((rank - s - 1) % world, s - 1 if s >= 1 else None, s if s < world - 1 else None)
            for s in range(world)]


def available_strategies(device: torch.device):
    """Names of the strategies that can run on ``device`` (always 'sequential' first)."""
    from flux.runtime import cuda_kernels_available

    overlapped = device.type == "cuda" and cuda_kernels_available()
    return [name for name in STRATEGIES if name == "sequential" or overlapped]


def gemm_rs_ref(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``reduce_scatter(input @ W, dim=0) (+ bias)`` with torch.matmul and torch.distributed, unchecked."""
    return _sequential(input, weight, bias, resolve_group(group, OP), weight_layout, out_dtype)


def _signature(input, weight, bias, group, weight_layout, out_dtype) -> Signature:
    sig = Signature(OP)
    check_gemm_args(sig, input, weight, bias, weight_layout, out_dtype, group_device(group).type)
    world = dist.get_world_size(group)
    if input.dim() >= 1 and input.shape[0] % world != 0:
        sig.fail(f"input.shape[0] = {input.shape[0]} (M) is not divisible by the group size {world}")
    return sig


def _check(input, weight, bias, group, weight_layout, out_dtype) -> None:
    check_collectively(_signature(input, weight, bias, group, weight_layout, out_dtype), group)


def prepare_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                     group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                     out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
                     check: bool = True, **params):
    """A zero-argument callable that enqueues one call of strategy ``name`` (with its
    parameters) on these very tensors and returns the result: the plan is made once, here
    (benchmarks, tests, the autotuner). Collective, like the op."""
    group = resolve_group(group, OP)
    if name not in STRATEGIES:
        raise ValueError(f"{OP}: unknown strategy {name!r}; known: {list(STRATEGIES)}")
    if check:
        _check(input, weight, bias, group, weight_layout, out_dtype)
    reference = functools.partial(_sequential, input, weight, bias, group, weight_layout, out_dtype)
    return _plans.prepare(NAME, Candidate.of(name, **params), input, weight, bias, group, weight_layout, out_dtype,
                          False, out, reference)


def run_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                 out_dtype: Optional[torch.dtype] = None, check: bool = True, **params) -> torch.Tensor:
    """Run one named strategy with its parameters, if any (benchmarks, tests, the autotuner):
    same arguments and result as ``flux.gemm_rs``, bypassing the choice."""
    return prepare_strategy(name, input, weight, bias, group=group, weight_layout=weight_layout,
                            out_dtype=out_dtype, check=check, **params)()


def _gemm_rs_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: dist.ProcessGroup,
                  weight_layout: str, out_dtype: Optional[torch.dtype],
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The slow path: check, exchange, choose (or tune), run, and leave a plan for the hot path."""
    refuse_capture(OP)
    sig = _signature(input, weight, bias, group, weight_layout, out_dtype)
    if sig.error is None:
        n, _ = weight_nk_shape(weight, weight_layout)
        world = dist.get_world_size(group)
        check_out_arg(sig, out, (input.shape[0] // world, *input.shape[1:-1], n), out_dtype or input.dtype, input,
                      (input, weight, bias))
    else:
        sig.add("out is given", out is not None)
    rows = input.numel() // input.shape[-1] if input.dim() >= 1 and input.shape[-1] else 0
    problem, cand, tune_now = choose_and_check(sig, NAME, input, weight, weight_layout, out_dtype, group, rows)
    reference = functools.partial(_sequential, input, weight, bias, group, weight_layout, out_dtype)
    if tune_now:  # tuned on scratch outputs: the caller's out is written once, below
        def run(c, dest=None):
            return _plans.prepare(NAME, c, input, weight, bias, group, weight_layout, out_dtype, False, dest,
                                  reference)()
        def prepare(c):
            return _plans.prepare(NAME, c, input, weight, bias, group, weight_layout, out_dtype, False, None,
                                  reference)
        cand = Candidate.parse(autotune.tune(problem, run, group, input.device, prepare=prepare)["choice"])
    return _plans.run_and_remember(NAME, cand, input, weight, bias, group, weight_layout, out_dtype, False, out,
                                   reference)


def _forward(input, weight, bias, group, weight_layout, out_dtype, out=None) -> torch.Tensor:
    """The plan of this problem if there is one, else the slow path."""
    rt = _plans.hot_runtime(group)
    if rt is not None:
        r = rt.call(1, input, weight, bias, out, _LAYOUT.get(weight_layout, -1), _DTYPE.get(out_dtype, -2), False)
        if r is not None:
            return r
    return _gemm_rs_impl(input, weight, bias, group, weight_layout, out_dtype, out)


def _grads(needs, grad_out, input, weight, group, layout, has_bias):
    """(d input, d weight, d bias) of ``out = reduce_scatter(input @ W) (+ bias)``: d input is an
    AllGather+GEMM (flux.ag_gemm) whose gathered grad_out also serves d weight's local GEMM."""
    from flux.ops.ag_gemm import ag_gemm  # the two op families are each other's backward

    n, k = weight_nk_shape(weight, layout)
    grad_bias = grad_out.reshape(-1, n).sum(0) if has_bias and needs[2] else None
    grad_out = grad_out.to(input.dtype).contiguous()
    grad_input = grad_weight = None
    if needs[0] or needs[1]:
        # d input = all_gather(grad_out) @ W: W [N, K] read as [K_in=N, N_out=K] is the other layout.
        grad_input, gathered = ag_gemm(grad_out, weight, group=group, weight_layout="kn" if layout == "nk" else "nk",
                                       return_gathered=True)
        if needs[1]:
            g2d, a2d = gathered.reshape(-1, n), input.reshape(-1, k)
            grad_weight = g2d.t() @ a2d if layout == "nk" else a2d.t() @ g2d
        if not needs[0]:
            grad_input = None
    return grad_input, grad_weight, grad_bias


class _GemmRsFunction(torch.autograd.Function):
    """Eager autograd without the dispatcher's custom-op layer (see ag_gemm's)."""

    @staticmethod
    def forward(ctx, input, weight, bias, group, weight_layout, out_dtype):
        ctx.group, ctx.layout, ctx.has_bias = group, weight_layout, bias is not None
        ctx.save_for_backward(input, weight)
        return _forward(input, weight, bias, group, weight_layout, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        input, weight = ctx.saved_tensors
        return (*_grads(ctx.needs_input_grad, grad_out, input, weight, ctx.group, ctx.layout, ctx.has_bias),
                None, None, None)


# The dispatcher-visible op (torch.compile, fake tensors, tensor subclasses).
def _gemm_rs_op_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                     weight_layout: str, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return _forward(input, weight, bias, group_from_name(group_name), weight_layout, out_dtype)


def _gemm_rs_out_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                      weight_layout: str, out_dtype: Optional[torch.dtype], out: torch.Tensor) -> None:
    _forward(input, weight, bias, group_from_name(group_name), weight_layout, out_dtype, out)


_gemm_rs_op = torch.library.custom_op("flux::gemm_rs", mutates_args=())(_gemm_rs_op_impl)
# The out= variant: writes the result into the caller's contiguous tensor (no autograd).
_gemm_rs_out_op = torch.library.custom_op("flux::gemm_rs_out", mutates_args=("out",))(_gemm_rs_out_impl)


@_gemm_rs_out_op.register_fake
def _gemm_rs_out_fake(input, weight, bias, group_name, weight_layout, out_dtype, out):
    check_same_device(OP, input, weight, bias)
    return None


@_gemm_rs_op.register_fake
def _gemm_rs_fake(input, weight, bias, group_name, weight_layout, out_dtype):
    check_same_device(OP, input, weight, bias)
    world = dist.get_world_size(group_from_name(group_name))
    n, _ = weight_nk_shape(weight, weight_layout)
    return input.new_empty((input.shape[0] // world, *input.shape[1:-1], n), dtype=out_dtype or input.dtype)


def _setup_context(ctx, inputs, output):
    input, weight, bias, gname, weight_layout, out_dtype = inputs
    ctx.gname, ctx.weight_layout, ctx.has_bias = gname, weight_layout, bias is not None
    ctx.save_for_backward(input, weight)


def _backward(ctx, grad_out):
    input, weight = ctx.saved_tensors
    return (*_grads(ctx.needs_input_grad, grad_out, input, weight, group_from_name(ctx.gname), ctx.weight_layout,
                    ctx.has_bias), None, None, None)


torch.library.register_autograd("flux::gemm_rs", _backward, setup_context=_setup_context)


def gemm_rs(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
            out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Multiply ``input`` by ``weight``, sum the products over ``group`` and keep this rank's rows.

    Same as ``reduce_scatter(input @ W, dim=0) (+ bias)`` (see ``gemm_rs_ref``).

    Args:
        input: ``[M, K_local]`` or N-D ``[M, ..., K_local]`` (scattered on dim 0); M divisible
            by the group size; contiguous; bf16, fp16, fp32 (or fp64 through the reference).
        weight: this rank's ``[N, K_local]`` (``weight_layout="nk"``, as ``nn.Linear.weight``)
            or ``[K_local, N]`` (``"kn"``); contiguous; same dtype as ``input``.
        bias: ``[N]`` in the output dtype, added once after the reduction, or None.
        group: the tensor-parallel process group (default: the world).
        weight_layout: ``"nk"`` or ``"kn"``.
        out_dtype: dtype of the result (default: ``input.dtype``); fp32 from bf16/fp16 computes,
            moves and sums the partial products in fp32 (tensor-core GEMMs with an fp32 output).
        out: a contiguous tensor of the result's shape and dtype to write the result into
            (then returned); no autograd.

    Returns:
        ``[M / world, ..., N]``: rows ``rank * M / world`` to ``(rank + 1) * M / world`` of the sum.

    Raises:
        FluxInputError, on every rank of the group alike and before any data moves, when
        the arguments are invalid on some rank or differ between ranks.
    """
    # Hot path: a plan made by an earlier call of the same problem, enqueued from C++.
    rt = _plans.hot_runtime(group)
    mode = call_mode(input, weight, bias, out)
    if rt is not None and mode == 0:
        r = rt.call(1, input, weight, bias, out, _LAYOUT.get(weight_layout, -1), _DTYPE.get(out_dtype, -2), False)
        if r is not None:
            return out if out is not None else r
    group = resolve_group(group, OP)
    if out is not None:
        if mode == 2:
            torch.ops.flux.gemm_rs_out(input, weight, bias, group_name(group), weight_layout, out_dtype, out)
        else:  # the slow path refuses out= with tensors that need gradients, on every rank alike
            _gemm_rs_impl(input, weight, bias, group, weight_layout, out_dtype, out)
        return out
    if mode == 0:
        return _gemm_rs_impl(input, weight, bias, group, weight_layout, out_dtype)
    if mode == 1:
        return _GemmRsFunction.apply(input, weight, bias, group, weight_layout, out_dtype)
    return torch.ops.flux.gemm_rs(input, weight, bias, group_name(group), weight_layout, out_dtype)
