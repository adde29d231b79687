"""Grouped GEMMs over the local experts of a mixture-of-experts layer (no communication), in the
two layouts of ``flux.moe_dispatch``:

    grouped_mm(x [R, K], w [E, N, K] or [E, K, N], counts)      (unbounded dispatch)
        out[o_e : o_e + counts[e]] = x[o_e : o_e + counts[e]] @ W_e^T,  o_e = counts[:e].sum()
    grouped_mm_padded(x [E, C, K], w, counts=None) -> [E, C, N]  (bounded dispatch)
        a batched GEMM; with counts, rows at or past counts[e] count as zeros (skip_padding=True:
        are not computed, flux's masked kernels where they run)

Implementations (``grouped_mm_impl`` tells which a call takes): ``cutlass``, flux's CUTLASS
grouped kernels (csrc/moe/grouped_gemm.cuh; bf16, sm 9.0, where built), each product (forward,
dx, dW) taking the built configuration the rule ``cutlass_config`` picks for its rows per
expert, or torch's kernel where the rule finds none faster; ``kernel``, torch's
``torch._grouped_mm`` with a backward written here, where torch runs it natively (bf16, sm 9.x or
10.x, 16-byte strides and pointers); ``loop``, one ``torch.mm`` per expert with rows, everywhere
else (it needs the counts on the host); ``triton``, a contiguous-grouped Triton prototype
(flux/ops/_triton_gmm.py), and ``hybrid``, the kernel's forward and dx with the Triton weight
gradient, each only when asked for (``impl=`` or FLUX_GROUPED_MM).
A kernel call that raises falls back to the loop for that device, dtype and layout, with a
warning, once. Conditions and gradients: docs/api.md ("Grouped GEMMs").
"""
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from flux import envs, fused_configs

WEIGHT_LAYOUTS = ("nk", "kn")
IMPLS = ("auto", "cutlass", "kernel", "loop", "triton", "hybrid")

Counts = Union[torch.Tensor, Sequence[int]]

# Compute capability majors where torch._grouped_mm's K-grouped product (the weight gradient)
# writes zeros for a group without rows, so no mask pass is needed (tests/test_grouped_mm_triton.py
# checks it on the GPU with a NaN-poisoned allocator); elsewhere (10.x) such groups are masked.
_EMPTY_GROUPS_ZEROED = (9,)
_capabilities: Dict[torch.device, Tuple[int, int]] = {}


def _capability(device: torch.device) -> Tuple[int, int]:
    """The compute capability of a CUDA ``device``, asked once per device (every call needs it)."""
    cap = _capabilities.get(device)
    if cap is None:
        cap = _capabilities[device] = torch.cuda.get_device_capability(device)
    return cap


def _zeroes_empty_groups(device: torch.device) -> bool:
    """Whether torch._grouped_mm's weight gradient on ``device`` writes zeros for empty groups."""
    return _capability(device)[0] in _EMPTY_GROUPS_ZEROED


_kernel_failed: Dict[Tuple, str] = {}  # (device, dtype, layout) -> why torch._grouped_mm raised there
_cutlass_failed: Dict[torch.device, str] = {}  # device -> why flux's grouped kernel raised there
_built: List[frozenset] = []  # the grouped GEMMs flux._C holds, once asked

# The rule over flux's grouped GEMMs (flux/fused_configs.py GROUPED), from H200 measurements
# against torch._grouped_mm on the MoE layer's products (bench/bench_grouped_mm.py, every product
# and, with --wgrad, the weight gradient alone): flux's kernels up to ROWS_MAX rows per expert,
# torch's above (at 4096 rows per expert torch's kernel was as fast or faster: forward and dx, and
# the weight gradient of W13, 2.51 against 2.96 ms). Forward and dx: configuration 0 (64x256
# ping-pong); dW: configuration 3 (128x256, cluster 2x1) up to WGRAD_SMALL rows per expert,
# configuration 2 (128x128 ping-pong, cluster 2x1) above.
ROWS_MAX = 1024
WGRAD_SMALL = 256
_triton_import: List[str] = []  # why flux.ops._triton_gmm did not import ("" where it did), once known


def grouped_built() -> frozenset:
    """The (configuration, kind) grouped GEMMs built into flux._C (empty without it)."""
    if not _built:
        _built.append(fused_configs.grouped_built())
    return _built[0]


def cutlass_config(kind: str, rows_per_expert: float, forced: bool = False,
                   built: Optional[frozenset] = None) -> Optional[int]:
    """The configuration of flux's grouped GEMM for one product (``kind`` "nk" or "kn": rows
    grouped by expert, the forward and dx; "wgrad": dW) at ``rows_per_expert`` (R / E), among
    ``built`` (default: what flux._C holds); None where torch's kernel is to run it (none built
    for the kind, or the rule finds none faster; ``forced``: any built one instead)."""
    have = sorted(c for c, k in (grouped_built() if built is None else built) if k == kind)
    if not have:
        return None
    if rows_per_expert > ROWS_MAX:
        return have[0] if forced else None
    prefer = (3 if rows_per_expert <= WGRAD_SMALL else 2) if kind == "wgrad" else 0
    return prefer if prefer in have else have[0] if (forced or kind == "wgrad") else None


def _cutlass_why_not(x: torch.Tensor, w: torch.Tensor, weight_layout: str) -> str:
    """Why flux's grouped kernels cannot run this call ("" where they can)."""
    if x.device.type != "cuda":
        return f"{x.device.type} tensors"
    if x.dtype != torch.bfloat16:
        return f"{x.dtype} (flux's grouped kernels are bf16 only)"
    if _capability(x.device) != (9, 0):
        return "a device other than sm 9.0 (flux's grouped kernels are built for sm_90a)"
    if not grouped_built():
        return "flux._C holds no grouped GEMM (FLUX_KERNELS, or no extension)"
    n, k = _nk_shape(w, weight_layout)
    if n % 8 or k % 8:
        return f"N={n}, K={k}: the kernels need multiples of 8 (16-byte strides)"
    if x.shape[0] == 0 or x.shape[0] >= 2 ** 31:
        return "no rows" if x.shape[0] == 0 else "more rows than int32 offsets hold"
    failed = _cutlass_failed.get(x.device)
    return f"flux's grouped kernel raised earlier: {failed}" if failed is not None else ""


def _nk_shape(w: torch.Tensor, weight_layout: str) -> Tuple[int, int]:
    """(N, K) of a [E, N, K] ("nk") or [E, K, N] ("kn") weight."""
    return (w.shape[1], w.shape[2]) if weight_layout == "nk" else (w.shape[2], w.shape[1])


def _check(x: torch.Tensor, w: torch.Tensor, weight_layout: str, x_dims: int, what: str) -> None:
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"{what}: weight_layout must be 'nk' ([E, N, K]) or 'kn' ([E, K, N]), got {weight_layout!r}")
    if x.dim() != x_dims:
        raise ValueError(f"{what}: x must be {x_dims}-D, got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"{what}: w must be 3-D ([E, N, K] or [E, K, N]), got shape {tuple(w.shape)}")
    _, k = _nk_shape(w, weight_layout)
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has K={x.shape[-1]} but w {tuple(w.shape)} ({weight_layout!r}) has K={k}")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"{what}: x and w must share dtype and device, got {x.dtype} on {x.device} "
                         f"and {w.dtype} on {w.device}")


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _triton_why_not(x: torch.Tensor) -> str:
    """Why the Triton prototype cannot run on x ("" where it can): it needs triton, and CUDA
    tensors or the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before import)."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"{x.device.type} tensors (the Triton kernels run on CUDA, or under TRITON_INTERPRET=1)"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{x.dtype} (the Triton kernels take bf16, fp16 or fp32)"
    if x.shape[0] >= 2 ** 31:
        return "more rows than int32 offsets hold"
    if not _triton_import:
        try:
            import flux.ops._triton_gmm  # noqa: F401
            _triton_import.append("")
        except (ImportError, RuntimeError) as e:  # not installed, or no backend for this machine
            _triton_import.append(f"triton does not import ({type(e).__name__}: {e})")
    return _triton_import[0]


def _resolve(impl: str) -> str:
    """``impl``, or for "auto" the implementation FLUX_GROUPED_MM asks for ("cutlass", "kernel",
    "triton", "hybrid"), if any."""
    if impl != "auto":
        return impl
    asked = envs.GROUPED_MM.get()
    if asked not in (None, "auto", "cutlass", "kernel", "triton", "hybrid"):
        raise ValueError(f"flux.grouped_mm: FLUX_GROUPED_MM must be 'cutlass', 'kernel', 'triton', 'hybrid' or "
                         f"'auto', got {asked!r}")
    return asked or "auto"


def grouped_mm_impl(x: torch.Tensor, w: torch.Tensor, weight_layout: str = "nk",
                    impl: str = "auto") -> Tuple[str, str]:
    """The implementation ``grouped_mm(x, w, ..., impl=impl)`` takes, with why where it is not
    the one asked for: ``("cutlass", "")`` where flux's grouped kernels run it (for "auto": where
    torch's kernel could run too, so that a product the rule leaves to it can),
    ``("kernel", "")`` where it would call ``torch._grouped_mm`` only, ``("triton", "")`` /
    ``("hybrid", "")`` where that one is asked for (``impl=`` or, for "auto", FLUX_GROUPED_MM)
    and can run (hybrid: where the kernel and Triton both can), else ``("loop", why not)`` (an
    explicit "cutlass", "triton" or "hybrid" call that cannot run raises instead; an "auto" one
    asked for by the environment chooses as without it). Looks at shapes, dtypes, device, what
    flux._C holds and the environment only."""
    asked = _resolve(impl)
    if asked == "loop":
        return "loop", "asked for"
    if asked == "cutlass":
        why = _cutlass_why_not(x, w, weight_layout)
        if not why or impl == "cutlass":
            return ("cutlass", "") if not why else ("loop", why)
        asked = "auto"  # asked for by FLUX_GROUPED_MM where it cannot run
    if asked in ("triton", "hybrid"):  # hybrid: the kernel's conditions, then Triton's
        why = grouped_mm_impl(x, w, weight_layout, "kernel")[1] if asked == "hybrid" else ""
        why = why or _triton_why_not(x)
        if not why:
            return asked, ""
        if impl == asked:
            return "loop", why
        # asked for by FLUX_GROUPED_MM where it cannot run: the choice of "auto", below
    if not hasattr(torch, "_grouped_mm"):
        return "loop", f"torch {torch.__version__} has no torch._grouped_mm"
    if x.device.type != "cuda":
        return "loop", f"{x.device.type} tensors"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return "loop", f"{x.dtype} (torch._grouped_mm's kernel is bf16 only)"
    major, minor = _capability(x.device)
    if major not in (9, 10):
        return "loop", f"compute capability {major}.{minor} (torch._grouped_mm's kernel needs 9.x or 10.x)"
    n, k = _nk_shape(w, weight_layout)
    if n % 8 or k % 8:
        return "loop", f"N={n}, K={k}: the kernel needs multiples of 8 (16-byte strides)"
    if x.shape[0] == 0:
        return "loop", "no rows"
    if x.shape[0] >= 2 ** 31:
        return "loop", "more rows than int32 offsets hold"
    failed = _kernel_failed.get((x.device, x.dtype, weight_layout))
    if failed is not None:
        return "loop", f"torch._grouped_mm raised earlier: {failed}"
    if asked == "auto" and not _cutlass_why_not(x, w, weight_layout):
        return "cutlass", ""
    return "kernel", ""


def _host_counts(counts: Counts, cumulative: bool, experts: int, what: str) -> List[int]:
    vals = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
    if len(vals) != experts:
        raise ValueError(f"{what}: {len(vals)} counts for {experts} experts")
    if cumulative:
        vals = [b - a for a, b in zip([0] + vals[:-1], vals)]
    if any(c < 0 for c in vals):
        raise ValueError(f"{what}: negative count in {vals}" + (" (offsets must not decrease)" if cumulative else ""))
    return vals


def _offsets(counts: Counts, cumulative: bool, device: torch.device, experts: int, what: str) -> torch.Tensor:
    """int32 cumulative row ends on ``device`` (torch._grouped_mm's ``offs``), made without a
    host synchronisation where ``counts`` is a device tensor."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(_host_counts(counts, cumulative, experts, what), dtype=torch.int64)
        cumulative = False
    if counts.dim() != 1 or counts.shape[0] != experts:
        raise ValueError(f"{what}: counts must be 1-D with one entry per expert ({experts}), got {tuple(counts.shape)}")
    counts = counts.to(device, non_blocking=True)
    offs = counts if cumulative else counts.cumsum(0)
    return offs.to(torch.int32).contiguous()


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # The kernel checks that every pointer is 16-byte aligned; a view that starts mid-row is
    # copied to a fresh (aligned) allocation.
    if not _aligned(a):
        a = a.clone()
    if not _aligned(b):
        b = b.clone()
    return torch._grouped_mm(a, b, offs=offs)


def _product(kind: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows_per_expert: float,
             cutlass: Optional[str], slab: int = 0) -> Tuple[torch.Tensor, bool]:
    """One product of the layer, and whether flux's kernel ran it. ``kind``: "nk" (a [R, K] @
    b[e]^T, b [E, N, K]), "kn" (a @ b[e], b [E, K, N]) or "wgrad" (a [R, M], b [R, N] -> [E, M, N],
    a_e^T @ b_e). ``cutlass``: None (torch's kernel), "auto" (the rule's configuration, else
    torch's kernel) or "forced" (any built configuration). ``slab`` C > 0: R = E * C rows in
    slabs, ``offs`` int64 rows per expert; flux's kernels only (the masked product)."""
    cfg = cutlass_config(kind, rows_per_expert, cutlass == "forced" or slab > 0) if cutlass else None
    if cfg is not None:
        a = a if _aligned(a) else a.clone()
        b = b if _aligned(b) else b.clone()
        return torch.ops.flux.grouped_mm_cutlass(a, b, offs, fused_configs.GROUPED_KINDS.index(kind), cfg, slab), True
    if slab:
        raise RuntimeError(f"no grouped GEMM of kind {kind!r} is built for the slab layout")
    if kind == "wgrad":
        return _gmm(a.t(), b, offs), False
    return _gmm(a, b.transpose(-2, -1) if kind == "nk" else b, offs), False


class _GroupedMMKernel(torch.autograd.Function):
    """A grouped GEMM's forward and backward for 2-D x (rows grouped by ``offs``) and a 3-D
    weight, through torch._grouped_mm or flux's kernels (``cutlass``, as in ``_product``);
    gradients for x and w (not for the offsets). ``slab`` C > 0: x is E slabs of C rows and offs
    the int64 rows per expert (``_product``); the gradient of x past them is left unwritten."""

    @staticmethod
    def forward(ctx, x, w, offs, weight_layout, empty=None, triton_wgrad=False, cutlass=None, slab=0):
        # empty: the experts without rows when the caller knows them on the host (a tuple), so the
        # backward zeroes just those weight gradients; None: unknown, every empty one is masked (a
        # pass over dW) where torch's kernel may leave them unwritten. flux's dW kernel and the
        # Triton one ("hybrid": triton_wgrad) write zeros for an expert without rows themselves.
        ctx.weight_layout, ctx.empty, ctx.triton_wgrad, ctx.cutlass = weight_layout, empty, triton_wgrad, cutlass
        ctx.slab = slab
        ctx.save_for_backward(x, w, offs)
        return _product(weight_layout, x, w, offs, x.shape[0] / w.shape[0], cutlass, slab)[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        nk = ctx.weight_layout == "nk"
        rows = x.shape[0] / w.shape[0]
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx_e = dy_e @ W_e (W_e [N, K]) or dy_e @ W_e^T (W_e [K, N])
            dx = _product("kn" if nk else "nk", dy, w, offs, rows, ctx.cutlass, ctx.slab)[0]
        if ctx.needs_input_grad[1] and ctx.triton_wgrad:
            from flux.ops._triton_gmm import wgrad
            dw = wgrad(dy, x, offs, w.shape, ctx.weight_layout)
        elif ctx.needs_input_grad[1]:  # dW_e = dy_e^T x_e ([N, K]) or x_e^T dy_e ([K, N])
            dw, ours = _product("wgrad", dy, x, offs, rows, ctx.cutlass, ctx.slab) if nk else \
                _product("wgrad", x, dy, offs, rows, ctx.cutlass, ctx.slab)
            # Only where some expert may lack rows (the common case, none known, asks nothing).
            if not ours and ctx.empty != () and not (dw.is_cuda and _zeroes_empty_groups(dw.device)):
                if ctx.empty is None:
                    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
                    dw.masked_fill_((sizes == 0).view(-1, 1, 1), 0)
                else:
                    dw[list(ctx.empty)] = 0
        return dx, dw, None, None, None, None, None, None


def _loop(x: torch.Tensor, w: torch.Tensor, counts: List[int], weight_layout: str) -> torch.Tensor:
    nk = weight_layout == "nk"
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c:
            we = w[e]
            outs.append(torch.mm(x[start:start + c], we.t() if nk else we))
        start += c
    if not outs:  # no rows at all: an empty product that still connects w to the graph
        outs.append(torch.mm(x[:0], w[0].t() if nk else w[0]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Counts, *, cumulative: bool = False,
               weight_layout: str = "nk", counts_host: Optional[Sequence[int]] = None,
               impl: str = "auto") -> torch.Tensor:
    """``[R, N]``: each expert's rows of ``x [R, K]`` times that expert's weight.

    ``counts``: rows per expert, a 1-D integer tensor (any device) or a sequence of ints, of
    length E = ``w.shape[0]`` and sum R (with ``cumulative=True``: the cumulative row ends,
    torch._grouped_mm's ``offs``, the last one R). ``w``: ``[E, N, K]`` (``weight_layout="nk"``)
    or ``[E, K, N]`` (``"kn"``). ``counts_host``: the same counts as a list, where the caller
    has them on the host (spares the loop a copy from the device). ``impl``: "auto" (flux's
    grouped kernels or torch's where ``grouped_mm_impl`` allows them, else the loop;
    FLUX_GROUPED_MM=cutlass, =kernel, =triton or =hybrid makes it that one where it can run),
    "cutlass" (flux's kernels for every product, any built configuration where the rule names
    none), "kernel" (torch._grouped_mm only), "loop", "triton" (the Triton prototype) or
    "hybrid" (torch's kernel with the Triton weight gradient), each but "loop" raising where it
    cannot run; with no rows (R = 0) every
    impl gives the empty product. Differentiable in x and w. The kernels do not check that the
    counts sum to R (it would take a synchronisation); the loop does.
    """
    what = "flux.grouped_mm"
    _check(x, w, weight_layout, 2, what)
    if impl not in IMPLS:
        raise ValueError(f"{what}: impl must be one of {IMPLS}, got {impl!r}")
    experts = w.shape[0]
    use, why = grouped_mm_impl(x, w, weight_layout, impl)
    if impl in ("kernel", "hybrid", "cutlass") and x.shape[0] == 0 and x.is_cuda:
        use = "loop"  # no rows: an empty product, the same on every rank whatever else holds
    elif impl == "kernel" and use != "kernel":
        raise ValueError(f"{what}: impl='kernel' but torch._grouped_mm cannot run here: {why}")
    elif impl in ("triton", "hybrid", "cutlass") and use != impl:
        raise ValueError(f"{what}: impl={impl!r} but it cannot run here: {why}")
    if use == "triton":
        from flux.ops._triton_gmm import grouped_mm_triton
        return grouped_mm_triton(x, w.contiguous(), _offsets(counts, cumulative, x.device, experts, what),
                                 weight_layout)
    if impl != "loop" and use in ("kernel", "hybrid", "cutlass"):
        offs = _offsets(counts, cumulative, x.device, experts, what)
        empty = None
        if counts_host is not None and len(counts_host) == experts:
            empty = tuple(e for e, c in enumerate(counts_host) if c == 0)
        if use == "cutlass":
            try:
                return _GroupedMMKernel.apply(x.contiguous(), w.contiguous(), offs, weight_layout, empty, False,
                                              "forced" if impl == "cutlass" else "auto")
            except (RuntimeError, TypeError, NotImplementedError) as e:
                if impl == "cutlass":
                    raise
                _cutlass_failed[x.device] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                warnings.warn(f"{what}: flux's grouped kernel raised ({_cutlass_failed[x.device]}); using "
                              f"torch._grouped_mm on {x.device} from now on", RuntimeWarning, stacklevel=2)
        try:
            return _GroupedMMKernel.apply(x.contiguous(), w.contiguous(), offs, weight_layout, empty,
                                          use == "hybrid")
        except (RuntimeError, TypeError, NotImplementedError) as e:
            if impl in ("kernel", "hybrid"):
                raise
            key = (x.device, x.dtype, weight_layout)
            _kernel_failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"{what}: torch._grouped_mm raised ({_kernel_failed[key]}); using a loop of "
                          f"torch.mm for {x.dtype} on {x.device} from now on", RuntimeWarning, stacklevel=2)
    if counts_host is not None:
        sizes = _host_counts(counts_host, False, experts, what)
    else:
        sizes = _host_counts(counts, cumulative, experts, what)
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"{what}: the counts {sizes} sum to {sum(sizes)}, but x has {x.shape[0]} rows")
    return _loop(x, w, sizes, weight_layout)


def grouped_mm_padded(x: torch.Tensor, w: torch.Tensor, counts: Optional[Counts] = None, *,
                      weight_layout: str = "nk", skip_padding: bool = False) -> torch.Tensor:
    """``[E, C, N]``: ``x[e] @ W_e^T`` (``"nk"``) or ``x[e] @ W_e`` (``"kn"``) for ``x [E, C, K]``,
    with no host synchronisation (capturable in a CUDA graph). Differentiable in x and w.

    ``counts`` (a 1-D tensor or sequence of E ints, or None): rows ``counts[e]`` and past of
    ``x[e]`` are ignored: masked to zero before one batched GEMM (``torch.bmm``), so they give
    zero output rows and zero gradients whatever they hold. None: every row counts, one batched
    GEMM. ``skip_padding=True`` (with counts on x's device): those rows are not computed at all,
    as a masked grouped GEMM skips them: flux's grouped kernels in the slab layout (bf16, sm 9.0,
    where built: ``grouped_mm_impl`` says "cutlass") multiply only each expert's counted rows, so
    the output's rows past the counts and the gradient of x there are undefined (left
    unwritten), and d w comes from the counted rows only; elsewhere it is the masked product
    above (zeros there, which the same contract allows). For the bounded dispatch's slabs with
    ``zero_pad=False`` and an expert computation whose padding rows nobody reads (combine reads
    only the counted rows)."""
    what = "flux.grouped_mm_padded"
    _check(x, w, weight_layout, 3, what)
    if x.shape[0] != w.shape[0]:
        raise ValueError(f"{what}: x has {x.shape[0]} experts, w has {w.shape[0]}")
    if counts is not None:
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor([int(c) for c in counts], dtype=torch.int64)
        if counts.dim() != 1 or counts.shape[0] != x.shape[0]:
            raise ValueError(f"{what}: counts must be 1-D with one entry per expert ({x.shape[0]}), "
                             f"got {tuple(counts.shape)}")
        if (skip_padding and x.is_contiguous() and counts.dtype == torch.int64 and counts.device == x.device
                and slab_kernels_ready(x, w, weight_layout)):
            e, c, k = x.shape
            out = _GroupedMMKernel.apply(x.reshape(e * c, k), w.contiguous(), counts.contiguous(), weight_layout,
                                         None, False, "forced", c)
            return out.view(e, c, out.shape[-1])
        rows = torch.arange(x.shape[1], device=x.device)
        keep = rows.view(1, -1) < counts.to(x.device, non_blocking=True).view(-1, 1)
        # where, not a product: 0 * inf or 0 * nan in an unused row would still be nan.
        x = torch.where(keep.unsqueeze(-1), x, x.new_zeros(()))
    return torch.bmm(x, w.transpose(-2, -1) if weight_layout == "nk" else w)


def slab_kernels_ready(x: torch.Tensor, w: torch.Tensor, weight_layout: str = "nk") -> bool:
    """Whether ``grouped_mm_padded(..., skip_padding=True)`` runs flux's masked kernels for slabs
    on x's device and dtype (x: any tensor there, e.g. the tokens) and weight ``w``: flux's
    grouped kernels can run (``grouped_mm_impl``) and a configuration of every kind of product
    is built. Looks at dtypes, shapes, the device and what flux._C holds only."""
    if x.numel() == 0 or x.shape[-1] == 0:
        return False
    if grouped_mm_impl(x.reshape(-1, x.shape[-1]), w, weight_layout, "cutlass")[0] != "cutlass":
        return False
    return all(cutlass_config(kind, ROWS_MAX, True) is not None for kind in fused_configs.GROUPED_KINDS)


__all__ = ["IMPLS", "WEIGHT_LAYOUTS", "grouped_mm", "grouped_mm_impl", "grouped_mm_padded", "slab_kernels_ready"]
