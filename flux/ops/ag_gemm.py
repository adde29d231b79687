"""flux.ag_gemm: the all-gather before a column-parallel GEMM.

Meaning (the unfused reference, ``ag_gemm_ref``)::

    out = torch.cat(all_gather(input), dim=0) @ W (+ bias)

The op is ``torch.ops.flux.ag_gemm``, with a fake implementation for torch.compile and
an autograd formula (backward is a GEMM+ReduceScatter for the input's gradient and a
local GEMM for the weight's). Strategies, chosen per call by flux.autotune:

  sequential   NCCL/gloo all-gather, then one GEMM. The reference, the CPU path and the
               fallback.
  decomposed   the GEMM in one row block per rank (cuBLAS); the local block first, straight
               from the input, while the copy engine pushes this rank's shard into every
               peer's symmetric workspace, each transfer followed by a signal. Stream timeline
               on rank r of W (blocks named by the rank whose rows they are)::

                 comm:     [barrier] [copy shard -> r+1][put r+1] [copy -> r+2][put r+2] ...
                 signal:                              [wait r-1] [wait r-2] ...
                 current:  [wait barrier started][GEMM r (from input)] [GEMM r-1] [GEMM r-2] ...

               The barrier proves that every peer's earlier GEMMs on its workspace are done
               before this rank overwrites it; each put follows its copy in stream order, and
               each wait (on a third stream, from the end of the first push; the current stream
               passes an event) precedes the GEMM that reads that block. The first GEMM reads only the
               input, so it need not wait for the barrier to pass, only for the barrier kernel
               to hold an SM (the default): otherwise, where the GEMM gets the SMs
               first, the barrier kernel, and with it every push of this rank, waits for the
               whole GEMM. ``wait_barrier=1`` waits for the barrier to pass (the former way).
               ``first8=f`` (world size 2): the first GEMM takes f eighths of the local rows, the
               second every other row, the rest of the local rows copied into the own slot next
               to the peer's (a split of the rows that cuBLAS may tile better than one block per
               rank; the autotuner tries f = 4, 6, 7).
  oneshot      for small M, where splitting the GEMM would read the weight W times: the
               copy engine pushes the shard to every peer, then one GEMM over the gathered
               workspace once every peer's shard is in::

                 comm:     [barrier] [copy -> r+1][put r+1] [copy -> r+2][put r+2] ...
                 current:  [wait barrier][copy own shard] [wait all peers] [one GEMM over all rows]

  fused        one persistent CUTLASS GEMM over all gathered rows (csrc/ag_gemm/), its
               tile scheduler serving this rank's rows first and making every tile of a peer's
               rows wait (bounded) for that peer's flag; the copy engine pushes the shard to
               every peer, each transfer followed by a flag write that needs no SM (the GEMM
               holds them all)::

                 current:  [zero own flags] [wait barrier][copy own shard] [fused GEMM .....]
                 comm:     [barrier] [copy -> r+1][flag r+1] [copy -> r+2][flag r+2] ...

               The GEMM starts after the barrier (a barrier kernel could not get an SM once the
               persistent GEMM runs); the barrier also proves every peer zeroed its flags and
               finished its previous GEMM on its workspace. bf16, weight_layout "nk", K and N
               multiples of 8; otherwise the call runs 'decomposed'.
"""
import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from flux import autotune
from flux.autotune.space import Candidate
from flux.ops._checks import Signature, check_collectively
from flux.ops._checks import FluxInputError
from flux.ops._common import (aligned16, can_skip_dispatcher, check_gemm_args, check_out_arg, check_same_device,
                              choose_and_check, deliver, fused_ineligible, gemm_into, local_gemm, log_fallback,
                              output, overlap_ineligible, weight_nk_shape)
from flux.runtime import (all_gather_dim0, gloo_carries_cuda, group_device, group_from_name, group_name, resolve_group,
                          symm, traceable_all_gather_dim0, traceable_reduce_scatter_dim0)

OP = "flux.ag_gemm"

# A strategy computes (out, gathered) from checked arguments; ``gathered`` may be None
# when not asked for. Every strategy computes the same function as the reference.
Strategy = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]


def _sequential(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype],
                need_gathered: bool, out: Optional[torch.Tensor] = None):
    gathered = all_gather_dim0(input, group)
    n, k = weight_nk_shape(weight, weight_layout)
    res = local_gemm(gathered.reshape(-1, k), weight, bias, weight_layout, out_dtype)
    return deliver(res.reshape(*gathered.shape[:-1], n), out), gathered


def _push_shard(ws, a: torch.Tensor, rank: int, world: int, level_flags: bool = False, started: bool = False,
                kernel_put: bool = False):
    """Enqueue, on the communication stream after the current stream's work so far: the
    entry barrier, then copy-engine pushes of this rank's shard ``a`` ([rows, K]) into slot
    ``rank`` of every peer's workspace ([world, rows, K]), in rotated order (rank+1 first),
    each followed by a signal: a self-resetting put, or a level flag for the fused kernel
    (both stream writes, which need no SM; ``kernel_put``: the put as a kernel, for the ablation).
    ``started``: the barrier raises its "started" slot, which the caller must consume
    (``ws.wait_started()``). Returns (the communication stream, an event recorded right after
    the barrier, an event recorded right after the first push)."""
    rows, k = a.shape
    comm = symm.comm_stream()
    after_barrier = ws.barrier_on(comm, started=started)
    first_pushed = torch.cuda.Event()
    with torch.cuda.stream(comm):
        for step in range(1, 1 if symm.transfers_dropped() else world):  # (a test hook can send nothing)
            peer = (rank + step) % world
            ws.view(peer, (world, rows, k), a.dtype)[rank].copy_(a)  # copy engine, over NVLink
            if level_flags:
                ws.set_flag(peer)
            else:
                ws.put(peer, kernel=kernel_put)
            if step == 1:
                first_pushed.record()
        if symm.transfers_dropped() or world == 1:
            first_pushed.record()
    return comm, after_barrier, first_pushed


def _decomposed(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype],
                need_gathered: bool, out: Optional[torch.Tensor] = None, wait_barrier: int = 0,
                kernel_put: int = 0, side_wait: int = 1, first8: int = 8):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = "world size 1" if world == 1 else overlap_ineligible(OP, "decomposed", input, group, out_dtype)
    if reason:
        log_fallback(OP, "decomposed", reason)
        return _sequential(input, weight, bias, group, weight_layout, out_dtype, need_gathered, out)
    n, k = weight_nk_shape(weight, weight_layout)
    a = input.reshape(-1, k)
    rows = a.shape[0]
    lead = _lead_rows(rows, world, first8)
    ws = symm.get_workspace(group, world * rows * k * a.element_size())
    slots = ws.view(rank, (world, rows, k), a.dtype)  # slot p: rank p's shard, pushed by p
    out = output(out, (world * rows, n), a.dtype, a.device)
    comm, after_barrier, first_pushed = _push_shard(ws, a, rank, world, started=not wait_barrier,
                                                    kernel_put=bool(kernel_put))
    # first8 < 8 (world size 2): the first GEMM takes `lead` of the local rows (rank 0 its first,
    # rank 1 its last), the second every other row, the rest of the local rows lying next to the
    # peer's in the workspace once copied into the own slot. That copy stays within this GPU, and
    # such copies wait for free SMs (bench/probe_copy_sm.py): it runs as the first GEMM winds down.
    lo, hi = (0, lead) if rank == 0 else (rows - lead, rows)
    own_copied = None
    if lead < rows:
        r0, r1 = (lead, rows) if rank == 0 else (0, rows - lead)
        own_copied = torch.cuda.Event()
        with torch.cuda.stream(comm):  # after the barrier: nobody reads this slot of an earlier call
            slots[rank, r0:r1].copy_(a[r0:r1])
            own_copied.record()
    sources = [(rank - step) % world for step in range(1, world)]  # the peer whose step-th push comes here
    # The waits for the peers' shards run on the signal stream, from when this rank's first push
    # is done (the local GEMM's CTAs are all placed by then, so a wait kernel cannot take an SM
    # from it): a one-warp kernel beside the GEMM's CTAs sees each signal while the GEMM runs, and
    # the current stream passes an event instead of launching a wait kernel between two GEMMs
    # (~3 us each on 2xH200, bench/profile_ops.py). side_wait=0: the waits on the current stream.
    arrived = symm.waits_on_side(ws, sources, first_pushed) if side_wait else None
    # The local GEMM must not start before the barrier kernel holds an SM. Else it races the
    # barrier kernel for the SMs: where the GEMM wins on one rank, that rank's barrier, and so
    # its pushes, wait for the whole local GEMM, and the peers' second GEMMs wait for those
    # pushes (measured on 2xH200, 16384x8192x4096: 1.65 ms instead of 1.38). Waiting for the
    # kernel to run costs a launch; waiting for it to pass also costs the peers' arrival.
    if not wait_barrier:
        ws.wait_started()
    else:
        torch.cuda.current_stream().wait_event(after_barrier)
    gemm_into(out[rank * rows + lo:rank * rows + hi], a[lo:hi], weight, bias, weight_layout)
    for i, src in enumerate(sources):
        if arrived is not None:
            torch.cuda.current_stream().wait_event(arrived[i])
        else:
            ws.wait(src)
        if own_copied is None:
            gemm_into(out[src * rows:(src + 1) * rows], slots[src], weight, bias, weight_layout)
    if own_copied is not None:  # one GEMM over the peer's rows and the rest of this rank's
        torch.cuda.current_stream().wait_event(own_copied)
        g0, g1 = (lead, world * rows) if rank == 0 else (0, world * rows - lead)
        gemm_into(out[g0:g1], slots.view(world * rows, k)[g0:g1], weight, bias, weight_layout)
    gathered = None
    if need_gathered:
        gathered = torch.empty((world, rows, k), dtype=a.dtype, device=a.device)
        gathered.copy_(slots)  # every slot but this rank's own is filled (the waits above)
        gathered[rank].copy_(a)
        gathered = gathered.view(world * input.shape[0], *input.shape[1:])
    torch.cuda.current_stream().wait_stream(comm)  # later barriers and frees come after the copies
    return out.view(world * input.shape[0], *input.shape[1:-1], n), gathered


def _lead_rows(rows: int, world: int, first8: int) -> int:
    """Rows of the first GEMM of ``decomposed(first8=f)``: f eighths of the local rows (world
    size 2 only; all of them where that leaves either GEMM without rows)."""
    if first8 == 8:
        return rows
    lead = rows * first8 // 8
    if world != 2 or not 0 < lead < rows:
        log_fallback(OP, f"decomposed(first8={first8})",
                     f"needs world size 2 and 0 < {first8}/8 of {rows} rows < {rows}", to="decomposed")
        return rows
    return lead


def _oneshot(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype],
             need_gathered: bool, out: Optional[torch.Tensor] = None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = "world size 1" if world == 1 else overlap_ineligible(OP, "oneshot", input, group, out_dtype)
    if reason:
        log_fallback(OP, "oneshot", reason)
        return _sequential(input, weight, bias, group, weight_layout, out_dtype, need_gathered, out)
    n, k = weight_nk_shape(weight, weight_layout)
    a = input.reshape(-1, k)
    rows = a.shape[0]
    ws = symm.get_workspace(group, world * rows * k * a.element_size())
    slots = ws.view(rank, (world, rows, k), a.dtype)
    out = output(out, (world * rows, n), a.dtype, a.device)
    comm, after_barrier, _ = _push_shard(ws, a, rank, world)
    # This rank's own slot is written only after the barrier: a peer may still be reading this
    # region of the workspace for an earlier call of another op (gemm_rs oneshot pulls from it).
    torch.cuda.current_stream().wait_event(after_barrier)
    slots[rank].copy_(a)
    for step in range(1, world):
        ws.wait((rank - step) % world)
    gathered2d = slots.view(world * rows, k)
    gemm_into(out, gathered2d, weight, bias, weight_layout)
    gathered = gathered2d.clone().view(world * input.shape[0], *input.shape[1:]) if need_gathered else None
    torch.cuda.current_stream().wait_stream(comm)
    return out.view(world * input.shape[0], *input.shape[1:-1], n), gathered


def _fused_swizzle(m: int, n: int) -> int:
    # Tile order of the fused kernel (N fastest inside bands of `swizzle` M tiles), from the
    # kernel alone on H200 (bench/results/bench_fused_gemm-h200-run1.json): bands of 8 pay when
    # both dimensions are large (8192x8192x14336: 2.50 ms against 2.74 with bands of 1) and
    # cost up to 2x when there are few M tiles (the grid pads to whole bands) or few N tiles
    # (8192x8192x5120: 1.18 against 0.90 ms).
    return 8 if m >= 4096 and n >= 12288 else 1


def _fused(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype],
           need_gathered: bool, out: Optional[torch.Tensor] = None, swizzle: Optional[int] = None,
           config: int = 0):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reason = "world size 1" if world == 1 else fused_ineligible(OP, input, weight, group, weight_layout, out_dtype)
    if reason:
        log_fallback(OP, "fused", reason, to="decomposed")
        return _decomposed(input, weight, bias, group, weight_layout, out_dtype, need_gathered, out)
    n, k = weight_nk_shape(weight, weight_layout)
    a = input.reshape(-1, k)
    rows = a.shape[0]
    ws = symm.get_workspace(group, world * rows * k * a.element_size())
    full = ws.view(rank, (world * rows, k), a.dtype)
    flags = ws.flags()
    current = torch.cuda.current_stream()
    # TMA needs 16-byte aligned bases: a caller's tensors at odd offsets go through aligned
    # copies (a rank-local choice: the signals are the same either way).
    dest = out if out is None or out.data_ptr() % 16 == 0 else None
    res = output(dest, (world * rows, n), a.dtype, a.device)
    w_ok, b_ok = aligned16(weight), aligned16(bias)
    flags.zero_()  # after this rank's previous fused GEMM (the only reader) in stream order
    comm, barrier_done, _ = _push_shard(ws, a, rank, world, level_flags=True)
    current.wait_event(barrier_done)  # before the own rows land: a peer may still read this region
    full[rank * rows:(rank + 1) * rows].copy_(a)
    if gloo_carries_cuda():
        # Ranks sharing a GPU (tests only): a copy between two buffers of one GPU runs on its SMs,
        # which this persistent kernel would hold while it waits for that GPU's other rank, whose
        # kernel would likewise hold back the copy it waits for. Push before launching instead.
        current.wait_stream(comm)
    torch.ops.flux.ag_gemm_fused_(res, full, w_ok, b_ok, flags, rank, world, rows, symm.timeout_ms(),
                                  symm.error_record_ptr(), 1, swizzle or _fused_swizzle(world * rows, n), config)
    out = res if out is None or dest is not None else deliver(res, out)
    # Every peer's rows were waited for by the kernel, so the workspace holds them all now.
    gathered = full.clone().view(world * input.shape[0], *input.shape[1:]) if need_gathered else None
    current.wait_stream(comm)
    return out.view(world * input.shape[0], *input.shape[1:-1], n), gathered


STRATEGIES: Dict[str, Strategy] = {"sequential": _sequential, "decomposed": _decomposed, "oneshot": _oneshot,
                                   "fused": _fused}


def available_strategies(device: torch.device):
    """Names of the strategies that can run on ``device`` (always 'sequential' first)."""
    from flux.runtime import cuda_kernels_available

    overlapped = device.type == "cuda" and cuda_kernels_available()
    return [name for name in STRATEGIES if name == "sequential" or overlapped]


def ag_gemm_ref(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                out_dtype: Optional[torch.dtype] = None, return_gathered: bool = False):
    """``all_gather(input, dim=0) @ W (+ bias)`` with torch.distributed and torch.matmul, unchecked."""
    group = resolve_group(group, OP)
    out, gathered = _sequential(input, weight, bias, group, weight_layout, out_dtype, return_gathered)
    return (out, gathered) if return_gathered else out


def _signature(input, weight, bias, group, weight_layout, out_dtype) -> Signature:
    sig = Signature(OP)
    check_gemm_args(sig, input, weight, bias, weight_layout, out_dtype, group_device(group).type)
    return sig


def _check(input, weight, bias, group, weight_layout, out_dtype) -> None:
    check_collectively(_signature(input, weight, bias, group, weight_layout, out_dtype), group)


def run_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                 out_dtype: Optional[torch.dtype] = None, return_gathered: bool = False, check: bool = True,
                 **params):
    """Run one named strategy with its parameters, if any (benchmarks, tests, the autotuner):
    same arguments and result as ``flux.ag_gemm``, bypassing the dispatcher and the choice."""
    group = resolve_group(group, OP)
    if name not in STRATEGIES:
        raise ValueError(f"{OP}: unknown strategy {name!r}; known: {sorted(STRATEGIES)}")
    if check:
        _check(input, weight, bias, group, weight_layout, out_dtype)
    out, gathered = STRATEGIES[name](input, weight, bias, group, weight_layout, out_dtype, return_gathered, **params)
    return (out, gathered) if return_gathered else out


def _ag_gemm_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                weight_layout: str, out_dtype: Optional[torch.dtype],
                return_gathered: bool, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    group = group_from_name(group_name)
    world = dist.get_world_size(group)
    sig = _signature(input, weight, bias, group, weight_layout, out_dtype)
    if sig.error is None:
        n, _ = weight_nk_shape(weight, weight_layout)
        check_out_arg(sig, out, (input.shape[0] * world, *input.shape[1:-1], n), out_dtype or input.dtype, input,
                      (input, weight, bias))
    else:
        sig.add("out is given", out is not None)
    rows = input.numel() // input.shape[-1] if input.dim() >= 1 and input.shape[-1] else 0
    problem, cand, tune_now = choose_and_check(sig, "ag_gemm", input, weight, weight_layout, out_dtype, group,
                                               rows * world)

    def run(c, dest=None):
        return STRATEGIES[c.strategy](input, weight, bias, group, weight_layout, out_dtype, return_gathered,
                                      dest, **c.kwargs)

    if tune_now:  # tuned on scratch outputs: the caller's out is written once, below
        cand = Candidate.parse(autotune.tune(problem, run, group, input.device)["choice"])
    res, gathered = run(cand, None if out is None else out.view(math.prod(out.shape[:-1]), out.shape[-1]))
    if not return_gathered or gathered is None:
        gathered = input.new_empty((0,))
    return res, gathered


def _ag_gemm_op_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                     weight_layout: str, out_dtype: Optional[torch.dtype],
                     return_gathered: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ag_gemm_impl(input, weight, bias, group_name, weight_layout, out_dtype, return_gathered)


def _ag_gemm_out_impl(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                      weight_layout: str, out_dtype: Optional[torch.dtype], out: torch.Tensor) -> None:
    _ag_gemm_impl(input, weight, bias, group_name, weight_layout, out_dtype, False, out)


_ag_gemm_op = torch.library.custom_op("flux::ag_gemm", mutates_args=())(_ag_gemm_op_impl)
# The out= variant: writes the result into the caller's contiguous tensor (no autograd).
_ag_gemm_out_op = torch.library.custom_op("flux::ag_gemm_out", mutates_args=("out",))(_ag_gemm_out_impl)


@_ag_gemm_out_op.register_fake
def _ag_gemm_out_fake(input, weight, bias, group_name, weight_layout, out_dtype, out):
    check_same_device(OP, input, weight, bias)
    return None


@_ag_gemm_op.register_fake
def _ag_gemm_fake(input, weight, bias, group_name, weight_layout, out_dtype, return_gathered):
    check_same_device(OP, input, weight, bias)
    world = dist.get_world_size(group_from_name(group_name))
    n, _ = weight_nk_shape(weight, weight_layout)
    rows = input.shape[0] * world
    out = input.new_empty((rows, *input.shape[1:-1], n), dtype=out_dtype or input.dtype)
    gathered = input.new_empty((rows, *input.shape[1:])) if return_gathered else input.new_empty((0,))
    return out, gathered


def _setup_context(ctx, inputs, output):
    input, weight, bias, gname, weight_layout, out_dtype, return_gathered = inputs
    _, gathered = output
    ctx.gname, ctx.weight_layout, ctx.has_bias = gname, weight_layout, bias is not None
    ctx.have_gathered = return_gathered
    ctx.save_for_backward(input, weight, gathered if return_gathered else None)


def _backward(ctx, grad_out, grad_gathered):
    from flux.ops.gemm_rs import gemm_rs  # the two op families are each other's backward

    input, weight, gathered = ctx.saved_tensors
    group = group_from_name(ctx.gname)
    layout = ctx.weight_layout
    n, k = weight_nk_shape(weight, layout)
    grad_bias = grad_out.reshape(-1, n).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    grad_out = grad_out.to(input.dtype).contiguous()
    grad_input = grad_weight = None
    if ctx.needs_input_grad[0]:
        # d input = reduce_scatter(grad_out @ W): W [N, K] read as [K_in=N, N_out=K] is the other layout.
        grad_input = gemm_rs(grad_out, weight, group=group, weight_layout="kn" if layout == "nk" else "nk")
        if grad_gathered is not None and grad_gathered.numel() > 0:
            grad_input = grad_input + traceable_reduce_scatter_dim0(grad_gathered.to(input.dtype), group)
    g2d = grad_out.reshape(-1, n)
    if ctx.needs_input_grad[1]:
        if gathered is None:
            gathered = traceable_all_gather_dim0(input, group)
        a2d = gathered.reshape(-1, k)
        grad_weight = g2d.t() @ a2d if layout == "nk" else a2d.t() @ g2d
    return grad_input, grad_weight, grad_bias, None, None, None, None


torch.library.register_autograd("flux::ag_gemm", _backward, setup_context=_setup_context)


def ag_gemm(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
            group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
            out_dtype: Optional[torch.dtype] = None, return_gathered: bool = False,
            out: Optional[torch.Tensor] = None):
    """All-gather ``input`` along dim 0 across ``group``, then multiply by ``weight``.

    Same as ``torch.cat(all_gather(input), 0) @ W (+ bias)`` (see ``ag_gemm_ref``).

    Args:
        input: this rank's rows, ``[M_local, K]`` or N-D ``[M_local, ..., K]`` (gathered on
            dim 0, e.g. Megatron's sequence-parallel ``[s, b, h]``); contiguous; bf16, fp16, fp32
            (or fp64 through the reference).
        weight: ``[N, K]`` as ``nn.Linear.weight`` (``weight_layout="nk"``) or ``[K, N]``
            (``"kn"``); contiguous; same dtype as ``input``.
        bias: ``[N]`` in the output dtype, added to every row, or None.
        group: the tensor-parallel process group (default: the world); NCCL for CUDA
            tensors, gloo for CPU tensors.
        weight_layout: ``"nk"`` or ``"kn"``.
        out_dtype: dtype of ``out`` (default: ``input.dtype``).
        return_gathered: also return the gathered input (backward needs it).
        out: a contiguous tensor of the result's shape and dtype to write the result into
            (then returned); no autograd, and not with ``return_gathered``.

    Returns:
        ``out`` of shape ``[M_local * world, ..., N]``, or ``(out, gathered)`` with ``gathered``
        of shape ``[M_local * world, ..., K]``.

    Raises:
        FluxInputError, on every rank of the group alike and before any data moves, when
        the arguments are invalid on some rank or differ between ranks.
    """
    group = resolve_group(group, OP)
    if out is not None:
        direct = can_skip_dispatcher(input, weight, bias, out, grad_matters=False)
        if return_gathered:
            raise FluxInputError(f"{OP}: out= cannot be combined with return_gathered=True")
        if direct:
            _ag_gemm_impl(input, weight, bias, group_name(group), weight_layout, out_dtype, False, out)
        else:
            torch.ops.flux.ag_gemm_out(input, weight, bias, group_name(group), weight_layout, out_dtype, out)
        return out
    op = _ag_gemm_op_impl if can_skip_dispatcher(input, weight, bias) else torch.ops.flux.ag_gemm
    res, gathered = op(input, weight, bias, group_name(group), weight_layout, out_dtype, return_gathered)
    return (res, gathered) if return_gathered else res
