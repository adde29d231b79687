"""flux.gemm_rs: the reduce-scatter after a row-parallel GEMM.

Meaning (the unfused reference, ``gemm_rs_ref``)::

    out = reduce_scatter(input @ W, dim=0) (+ bias)

The bias is added once, after the reduction, as Megatron's RowParallelLinear does. The
op is ``torch.ops.flux.gemm_rs``, with a fake implementation for torch.compile and an
autograd formula (backward is an AllGather+GEMM for the input's gradient and a local
GEMM for the weight's). Strategies, chosen per call by flux.autotune:

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

               The peer blocks' GEMMs write local staging buffers, so only the copies and the
               own block's GEMM (into this rank's workspace) wait for the barrier to pass; the
               first GEMM waits only for the barrier kernel to hold an SM (the default;
               ``wait_barrier=1``: the barrier on the current stream, the former way).

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
import math
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from flux import autotune
from flux.autotune.space import Candidate
from flux.ops._checks import Signature, check_collectively
from flux.ops._checks import FluxInputError  # noqa: F401
from flux.ops._common import (aligned16, can_skip_dispatcher, check_gemm_args, check_out_arg, check_same_device,
                              choose_and_check, deliver, fused_ineligible, gemm_into, local_gemm, log_fallback,
                              output, overlap_ineligible, weight_nk_shape)
from flux.runtime import group_device, group_from_name, group_name, reduce_scatter_dim0, resolve_group, symm

OP = "flux.gemm_rs"

Strategy = Callable[..., torch.Tensor]


def _sequential(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    n, k = weight_nk_shape(weight, weight_layout)
    partial = local_gemm(input.reshape(-1, k), weight, None, weight_layout, out_dtype)
    res = reduce_scatter_dim0(partial.reshape(*input.shape[:-1], n), group)
    if bias is not None:
        res += bias
    return deliver(res, out)


def _row_splits(rows: int, chunks: int):
    """Boundaries of ``chunks`` nearly equal row ranges of [0, rows)."""
    chunks = max(1, min(chunks, rows))
    return [(rows * i // chunks, rows * (i + 1) // chunks) for i in range(chunks)]


def default_chunks(world: int) -> int:
    # One block per destination. Two sub-blocks per destination (so that the last push is
    # half as long) measured slower on 2xH200: four GEMMs of M/4 rows lose more to wave
    # quantisation and weight re-reads than the shorter tail gains (docs/design.md).
    return 1


def _decomposed_impl(input, weight, bias, group, weight_layout, out_dtype, out=None, *, p2p: bool, name: str,
                     chunks: Optional[int] = None, wait_barrier: int = 0, kernel_put: int = 0,
                     side_wait: int = 1):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = "world size 1" if world == 1 else overlap_ineligible(OP, name, input, group, out_dtype)
    if reason:
        log_fallback(OP, name, reason)
        return _sequential(input, weight, bias, group, weight_layout, out_dtype, out)
    n, k = weight_nk_shape(weight, weight_layout)
    a = input.reshape(-1, k)
    rows = a.shape[0] // world
    splits = _row_splits(rows, chunks or default_chunks(world))
    if len(splits) > symm.MAX_DATA_CHANNELS:
        raise ValueError(f"{OP}: {name} takes at most {symm.MAX_DATA_CHANNELS} chunks, got {len(splits)}")
    # Everything is allocated before the first signal, so that an allocation failure cannot
    # leave a signal half sent. The staging blocks live until the current stream has waited
    # for the copies that read them (freeing one earlier would let the allocator hand its
    # memory to a later GEMM while the copy engine still reads it).
    ws = symm.get_workspace(group, world * rows * n * a.element_size())
    slots = ws.view(rank, (world, rows, n), a.dtype)  # slot p: rank p's partial of this rank's rows
    out = output(out, (rows, n), a.dtype, a.device)
    staging = [] if p2p else [[torch.empty((r1 - r0, n), dtype=a.dtype, device=a.device) for r0, r1 in splits]
                              for _ in range(1, world)]
    current, comm = torch.cuda.current_stream(), symm.comm_stream()
    after_barrier = None
    first_pushed = None if p2p else torch.cuda.Event()
    if p2p or wait_barrier:  # p2p: the first GEMM already writes into a peer's workspace
        ws.barrier()  # every peer has finished reading its slots in the previous call
    else:
        after_barrier = ws.barrier_on(comm, started=True)
        ws.wait_started()  # the first GEMM may not take every SM before the barrier kernel runs
    for step in range(1, world):
        peer = (rank + step) % world
        dest_slot = ws.view(peer, (world, rows, n), a.dtype)[rank]
        for c, (r0, r1) in enumerate(splits):
            block = a[peer * rows + r0:peer * rows + r1]
            if p2p:
                gemm_into(dest_slot[r0:r1], block, weight, None, weight_layout)  # stores go over NVLink
                ws.put(peer, symm.DATA_CHANNEL + c, kernel=bool(kernel_put))
            else:
                staged = gemm_into(staging[step - 1][c], block, weight, None, weight_layout)
                comm.wait_stream(current)
                with torch.cuda.stream(comm):
                    dest_slot[r0:r1].copy_(staged)  # copy engine, over NVLink
                    ws.put(peer, symm.DATA_CHANNEL + c, kernel=bool(kernel_put))
                    if step == 1 and c == 0:
                        first_pushed.record()
    sources = [(rank - step) % world for step in range(1, world)]
    channels = [symm.DATA_CHANNEL + c for c in range(len(splits))]
    # As in ag_gemm's decomposed: the waits on the signal stream, from the end of the first push
    # (the own block's GEMM is placed by then), so the reduction follows the last GEMM through an
    # event, without a wait kernel in between. p2p (no pushes on the communication stream) and
    # side_wait=0: the waits on the current stream.
    arrived = symm.waits_on_side(ws, sources, first_pushed, channels) if side_wait and not p2p else None
    if after_barrier is not None:
        current.wait_event(after_barrier)  # long passed: a peer may read this workspace until then
    gemm_into(slots[rank], a[rank * rows:(rank + 1) * rows], weight, None, weight_layout)
    if arrived is not None:
        current.wait_event(arrived[-1])  # the signal stream runs its waits in order
    else:
        for ch in channels:
            for src in sources:
                ws.wait(src, ch)
    torch.ops.flux.reduce_chunks_(out, slots, bias)  # fp32, rank order, bias once, one rounding
    if not p2p:
        current.wait_stream(comm)  # the staging blocks are freed after this, in stream order
    del staging
    return out.view(input.shape[0] // world, *input.shape[1:-1], n)


def _decomposed(input, weight, bias, group, weight_layout, out_dtype, out=None, chunks: Optional[int] = None,
                wait_barrier: int = 0, kernel_put: int = 0, side_wait: int = 1):
    return _decomposed_impl(input, weight, bias, group, weight_layout, out_dtype, out, p2p=False,
                            name="decomposed", chunks=chunks, wait_barrier=wait_barrier, kernel_put=kernel_put,
                            side_wait=side_wait)


def _decomposed_p2p(input, weight, bias, group, weight_layout, out_dtype, out=None, chunks: Optional[int] = None,
                    kernel_put: int = 0):
    return _decomposed_impl(input, weight, bias, group, weight_layout, out_dtype, out, p2p=True,
                            name="decomposed_p2p", chunks=chunks, kernel_put=kernel_put)


def ring_steps(rank: int, world: int):
    """The fused strategy's ring on ``rank``: for each step s = 0 .. W-1, (the row block it
    computes, the inbox slot holding rank - 1's sum so far of that block or None, the slot of
    rank + 1's inbox it sends its result to or None). Block rank - s - 1 (mod W): rank - 1
    computed the same block one step earlier, and the last step's block is the rank's own."""
    return [((rank - s - 1) % world, s - 1 if s >= 1 else None, s if s < world - 1 else None)
            for s in range(world)]


def _fused_ineligible(input, weight, group, weight_layout, out_dtype) -> Optional[str]:
    if dist.get_world_size(group) == 1:
        return "world size 1"
    if input.numel() == 0:
        return "no rows"
    return fused_ineligible(OP, input, weight, group, weight_layout, out_dtype)


def _fused(input, weight, bias, group, weight_layout, out_dtype, out=None, segments: int = 8, config: int = 0,
           swizzle: int = 1):
    reason = _fused_ineligible(input, weight, group, weight_layout, out_dtype)
    if reason:
        log_fallback(OP, "fused", reason, to="decomposed")
        return _decomposed(input, weight, bias, group, weight_layout, out_dtype, out)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    n, k = weight_nk_shape(weight, weight_layout)
    a = input.reshape(-1, k)
    rows = a.shape[0] // world
    seg_rows = -(-rows // max(1, min(segments, rows)))
    nseg = -(-rows // seg_rows)
    # A ring (ring_steps): at step s this rank computes the rows of block b_s, its GEMM adding (for
    # s >= 1) the sum so far of that block from rank - 1 (inbox slot s - 1), and passes the result
    # to rank + 1 (its inbox slot s); the last step's block is this rank's own, written to the
    # output with the bias.
    steps = ring_steps(rank, world)
    blocks = [b for b, _, _ in steps]
    # Everything is allocated, and operands at odd offsets copied to 16-byte aligned buffers (TMA),
    # before the first signal, so that nothing can fail after the pushes began.
    ws = symm.get_workspace(group, max(1, world - 1) * rows * n * a.element_size())
    if (world - 1) * nseg > ws.max_segments():
        raise ValueError(f"{OP}: fused with {nseg} segments at world size {world} needs {(world - 1) * nseg} "
                         f"segment flags, the workspace has {ws.max_segments()}")
    inbox = ws.view(rank, (world - 1, rows, n), a.dtype)  # [s - 1]: the sum of block b_s from rank - 1
    outbox = ws.view(nxt, (world - 1, rows, n), a.dtype)  # [s]: this rank's step-s result, on rank + 1
    flags = ws.segment_flags((world - 1) * nseg)  # [(s - 1) * nseg + j]: segment j of inbox[s - 1] is in
    dest = out if out is None or out.data_ptr() % 16 == 0 else None
    res = output(dest, (rows, n), a.dtype, a.device)
    a_blocks = [aligned16(a[b * rows:(b + 1) * rows]) for b in blocks[1:]]
    w_ok, b_ok = aligned16(weight), aligned16(bias)
    staging = [torch.empty((rows, n), dtype=a.dtype, device=a.device) for _ in range(world - 1)]
    current, comm = torch.cuda.current_stream(), symm.comm_stream()
    # Zeroed after this rank's previous fused GEMMs (the flags' only readers) and before the
    # barrier, which rank - 1 passes before it sets any of them for this call.
    flags.zero_()
    ws.barrier_on(comm, started=True)  # rank + 1's previous fused GEMMs no longer read its inbox
    ws.wait_started()

    def push(step: int):
        slot = steps[step][2]
        comm.wait_stream(current)
        with torch.cuda.stream(comm):
            for j in range(0 if symm.transfers_dropped() else nseg):  # (a test hook can send nothing)
                r0, r1 = j * seg_rows, min(rows, (j + 1) * seg_rows)
                outbox[slot, r0:r1].copy_(staging[step][r0:r1])  # copy engine, over NVLink
                # A stream write (no SM: the fused GEMM holds them all).
                ws.set_segment_flag(nxt, slot * nseg + j)

    try:
        gemm_into(staging[0], a[blocks[0] * rows:(blocks[0] + 1) * rows], weight, None, weight_layout)
        push(0)
        for step in range(1, world):
            _, slot, send = steps[step]
            last = send is None
            torch.ops.flux.gemm_rs_fused_(res if last else staging[step], a_blocks[step - 1], w_ok,
                                          b_ok if last else None, inbox[slot], flags[slot * nseg:(slot + 1) * nseg],
                                          seg_rows, rank, prev, symm.timeout_ms(), symm.error_record_ptr(), 1,
                                          swizzle, config)
            if not last:
                push(step)
    finally:
        current.wait_stream(comm)  # the staging buffers are freed after this, in stream order, whatever happened
        del staging
    out = res if out is None or dest is not None else deliver(res, out)
    return out.view(input.shape[0] // world, *input.shape[1:-1], n)


def _oneshot(input, weight, bias, group, weight_layout, out_dtype, out=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = "world size 1" if world == 1 else overlap_ineligible(OP, "oneshot", input, group, out_dtype)
    if reason:
        log_fallback(OP, "oneshot", reason)
        return _sequential(input, weight, bias, group, weight_layout, out_dtype, out)
    n, k = weight_nk_shape(weight, weight_layout)
    a = input.reshape(-1, k)
    rows = a.shape[0] // world
    ws = symm.get_workspace(group, a.shape[0] * n * a.element_size())
    ws.barrier()
    gemm_into(ws.view(rank, (a.shape[0], n), a.dtype), a, weight, None, weight_layout)
    ws.barrier()
    out = output(out, (rows, n), a.dtype, a.device)
    torch.ops.flux.reduce_peers_(out, ws.buffer_ptrs_dev, world, ws.base_offset + rank * rows * n * a.element_size(),
                                 bias)
    return out.view(input.shape[0] // world, *input.shape[1:-1], n)


STRATEGIES: Dict[str, Strategy] = {
    "sequential": _sequential,
    "oneshot": _oneshot,
    "decomposed": _decomposed,
    "decomposed_p2p": _decomposed_p2p,
    "fused": _fused,
}


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


def run_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                 out_dtype: Optional[torch.dtype] = None, check: bool = True, **params) -> torch.Tensor:
    """Run one named strategy with its parameters, if any (benchmarks, tests, the autotuner):
    same arguments and result as ``flux.gemm_rs``, bypassing the dispatcher and the choice."""
    group = resolve_group(group, OP)
    if name not in STRATEGIES:
        raise ValueError(f"{OP}: unknown strategy {name!r}; known: {sorted(STRATEGIES)}")
    if check:
        _check(input, weight, bias, group, weight_layout, out_dtype)
    return STRATEGIES[name](input, weight, bias, group, weight_layout, out_dtype, **params)


def _gemm_rs_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                weight_layout: str, out_dtype: Optional[torch.dtype],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    group = group_from_name(group_name)
    sig = _signature(input, weight, bias, group, weight_layout, out_dtype)
    if sig.error is None:
        n, _ = weight_nk_shape(weight, weight_layout)
        world = dist.get_world_size(group)
        check_out_arg(sig, out, (input.shape[0] // world, *input.shape[1:-1], n), out_dtype or input.dtype, input,
                      (input, weight, bias))
    else:
        sig.add("out is given", out is not None)
    rows = input.numel() // input.shape[-1] if input.dim() >= 1 and input.shape[-1] else 0
    problem, cand, tune_now = choose_and_check(sig, "gemm_rs", input, weight, weight_layout, out_dtype, group, rows)

    def run(c, dest=None):
        return STRATEGIES[c.strategy](input, weight, bias, group, weight_layout, out_dtype, dest, **c.kwargs)

    if tune_now:  # tuned on scratch outputs: the caller's out is written once, below
        cand = Candidate.parse(autotune.tune(problem, run, group, input.device)["choice"])
    return run(cand, None if out is None else out.view(math.prod(out.shape[:-1]), out.shape[-1]))


def _gemm_rs_op_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                     weight_layout: str, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return _gemm_rs_impl(input, weight, bias, group_name, weight_layout, out_dtype)


def _gemm_rs_out_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                      weight_layout: str, out_dtype: Optional[torch.dtype], out: torch.Tensor) -> None:
    _gemm_rs_impl(input, weight, bias, group_name, weight_layout, out_dtype, out)


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
    from flux.ops.ag_gemm import ag_gemm  # the two op families are each other's backward

    input, weight = ctx.saved_tensors
    group = group_from_name(ctx.gname)
    layout = ctx.weight_layout
    n, k = weight_nk_shape(weight, layout)
    grad_bias = grad_out.reshape(-1, n).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    grad_out = grad_out.to(input.dtype).contiguous()
    grad_input = grad_weight = None
    need_w = ctx.needs_input_grad[1]
    if ctx.needs_input_grad[0] or need_w:
        # d input = all_gather(grad_out) @ W: W [N, K] read as [K_in=N, N_out=K] is the other layout.
        grad_input, gathered = ag_gemm(grad_out, weight, group=group, weight_layout="kn" if layout == "nk" else "nk",
                                       return_gathered=True)
        if need_w:
            g2d, a2d = gathered.reshape(-1, n), input.reshape(-1, k)
            grad_weight = g2d.t() @ a2d if layout == "nk" else a2d.t() @ g2d
        if not ctx.needs_input_grad[0]:
            grad_input = None
    return grad_input, grad_weight, grad_bias, None, None, None


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
        out_dtype: dtype of the result (default: ``input.dtype``).
        out: a contiguous tensor of the result's shape and dtype to write the result into
            (then returned); no autograd.

    Returns:
        ``[M / world, ..., N]``: rows ``rank * M / world`` to ``(rank + 1) * M / world`` of the sum.

    Raises:
        FluxInputError, on every rank of the group alike and before any data moves, when
        the arguments are invalid on some rank or differ between ranks.
    """
    group = resolve_group(group, OP)
    if out is not None:
        direct = can_skip_dispatcher(input, weight, bias, out, grad_matters=False)
        if direct:
            _gemm_rs_impl(input, weight, bias, group_name(group), weight_layout, out_dtype, out)
        else:
            torch.ops.flux.gemm_rs_out(input, weight, bias, group_name(group), weight_layout, out_dtype, out)
        return out
    op = _gemm_rs_op_impl if can_skip_dispatcher(input, weight, bias) else torch.ops.flux.gemm_rs
    return op(input, weight, bias, group_name(group), weight_layout, out_dtype)
