"""A contiguous-grouped GEMM in Triton (``grouped_mm(..., impl="triton")``; opt-in prototype).

The rows of each expert are contiguous in ``x [R, K]`` (``offs``: int32 cumulative row ends, as
for ``torch._grouped_mm``). ``tile_plan`` cuts them, on the device and without a host
synchronisation, into M tiles that each lie inside one expert's rows: expert e gets
``ceil(count_e / BLOCK_M)`` tiles from its first row, so there are at most
``ceil(R / BLOCK_M) + E`` tiles, a bound known from shapes alone; the unused ones are empty
(``row_start == row_end``). A persistent kernel walks (tile, N block) pairs and computes
``out[row_start:row_end, n-block] = x[rows] @ W_e`` with expert e's weight, rows past
``row_end`` masked: no per-group descriptor and no padded copy of x.

The weight gradient is K-grouped: one program per (expert, N block, K block) sums
``dy_e^T x_e`` over that expert's rows in BLOCK_M steps, bounds read from ``offs`` on the
device; an expert without rows stores zeros. dx is the forward kernel with the weight's
strides swapped (``dy_e @ W_e``). Both layouts of the weight ("nk" ``[E, N, K]``, "kn"
``[E, K, N]``) are strides. fp32 accumulation; the output has x's dtype (bf16, fp16 or fp32,
the last with IEEE fp32 products, no TF32).

Runs on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which the tests use.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): fixed, but for the weight gradient in bf16 / fp16 on CUDA.
_FWD_GPU = (128, 128, 64, 8, 8, 3)
_WGRAD_GPU = (64, 128, 128, 0, 8, 3)  # (BLOCK_M rows per step, BLOCK_P, BLOCK_Q, -, warps, stages)
# The weight gradient on CUDA in bf16 / fp16 is autotuned over these (the first the fixed one), per
# (P, Q, rows per expert rounded to a power of two), on its first call for each: that call times the
# five (it synchronises, so it must not be the first inside a CUDA-graph capture), and dW's bits may
# differ between processes that tuned to different configurations.
_WGRAD_TUNE = ((64, 128, 128, 8, 3), (128, 128, 128, 8, 3), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3),
               (32, 128, 128, 4, 4))
_FWD_CPU = (16, 16, 16, 2, 4, 1)  # the interpreter: small tiles, several per expert
_WGRAD_CPU = (16, 16, 16, 0, 4, 1)


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"


def tile_plan(offs: torch.Tensor, rows: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_row_start, tile_row_end, tile_expert), int32 on ``offs``' device, of length
    ``ceil(rows / block_m) + E``; tile t covers rows [start, end) of one expert, the tiles in
    expert order; unused tiles are empty (start == end == 0). Torch ops only (no sync)."""
    experts = offs.shape[0]
    length = (rows + block_m - 1) // block_m + experts
    if experts == 0:
        empty = torch.zeros(length, dtype=torch.int32, device=offs.device)
        return empty, empty, empty
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    cum = tiles.cumsum(0)  # tiles of experts 0..e
    t = torch.arange(length, device=offs.device, dtype=torch.int64)
    e = torch.searchsorted(cum, t, right=True).clamp_(max=experts - 1)
    used = t < cum[-1]
    # tile t of expert e (its j-th, j = t - first tile of e) starts at row o_e + j * block_m
    base = (ends - counts) - (cum - tiles) * block_m
    start = torch.where(used, base[e] + t * block_m, 0)
    end = torch.where(used, torch.minimum(start + block_m, ends[e]), 0)
    return start.to(torch.int32), end.to(torch.int32), e.to(torch.int32)


@triton.jit
def _tiles_kernel(x_ptr, w_ptr, out_ptr, ts_ptr, te_ptr, tx_ptr, num_tiles, N, K,
                  sxm, sxk, swe, swk, swn, som, son, num_progs,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[rows of tile, n-block] = x[rows] @ B_e, B_e[k, n] at w + e*swe + k*swk + n*swn."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    total = num_tiles * n_blocks
    width = GROUP_M * n_blocks
    for pid in range(tl.program_id(0), total, num_progs):
        # GROUP_M consecutive tiles (mostly one expert's) share each N block of its weight.
        first = (pid // width) * GROUP_M
        size = tl.minimum(num_tiles - first, GROUP_M)
        t = first + (pid % width) % size
        nb = (pid % width) // size
        row_start = tl.load(ts_ptr + t)
        row_end = tl.load(te_ptr + t)
        if row_start < row_end:
            e = tl.load(tx_ptr + t).to(tl.int64)
            rm = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
            rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            m_ok = rm < row_end
            n_ok = rn < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                k_ok = kk < K
                a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                b = tl.load(w_ptr + e * swe + kk[:, None] * swk + rn[None, :] * swn,
                            mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["avg_rows"])
def _wgrad_kernel(a_ptr, b_ptr, c_ptr, offs_ptr, P, Q, sam, sap, sbm, sbq, sce, scp, scq, avg_rows,
                  BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    """C_e[p-block, q-block] = sum over expert e's rows m of A[m, p] * B[m, q]; zeros without rows.
    avg_rows: the autotuning key's rows per expert (unused in the kernel)."""
    e = tl.program_id(0)
    rp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    rq = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_ok = rp < P
    q_ok = rq < Q
    row_end = tl.load(offs_ptr + e)
    row_start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rm = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_ok = rm < row_end
        at = tl.load(a_ptr + rm[None, :] * sam + rp[:, None] * sap, mask=p_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rm[:, None] * sbm + rq[None, :] * sbq, mask=m_ok[:, None] & q_ok[None, :], other=0.0)
        if UPCAST:
            at = at.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(at, b, acc, input_precision=PRECISION)
    tl.store(c_ptr + e.to(tl.int64) * sce + rp[:, None] * scp + rq[None, :] * scq,
             acc.to(c_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


_wgrad_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": m, "BLOCK_P": p, "BLOCK_Q": q}, num_warps=w, num_stages=st)
             for m, p, q, w, st in _WGRAD_TUNE],
    key=["P", "Q", "avg_rows"], restore_value=["c_ptr"])(_wgrad_kernel)


def _dot_args(t: torch.Tensor) -> dict:
    """PRECISION: IEEE products for fp32 operands (no TF32). UPCAST: the interpreter's tl.dot
    gives wrong bf16 products, so there the tiles are cast to fp32 first: the same result, as a
    product of two bf16 or fp16 values is exact in fp32 and the sum is fp32 either way."""
    upcast = _interpreted(t) and t.dtype != torch.float32
    return {"PRECISION": "ieee" if t.dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def _num_progs(device: torch.device, total: int) -> int:
    if device.type == "cuda":
        return max(1, min(total, torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(total, 3))  # the interpreter: few programs, so that each walks several pairs


def _tiles_mm(x, w, plan, swe, swk, swn, n_out, cfg, out=None) -> torch.Tensor:
    """[R, n_out]: x @ B_e per tile of ``plan``, B_e[k, n] at strides (swk, swn) in w[e]
    (into ``out`` where given: the tests poison it)."""
    bm, bn, bk, group, warps, stages = cfg
    if x.dtype == torch.float32 and x.device.type == "cuda":
        stages = min(stages, 2)  # fp32 operands: three stages of 128x64 + 64x128 tiles fill shared memory
    if out is None:
        out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    ts, te, tx = plan
    total = ts.shape[0] * triton.cdiv(n_out, bn)
    if x.shape[0] == 0 or n_out == 0:
        return out
    progs = _num_progs(x.device, total)
    _tiles_kernel[(progs,)](x, w, out, ts, te, tx, ts.shape[0], n_out, x.shape[1],
                            x.stride(0), x.stride(1), swe, swk, swn, out.stride(0), out.stride(1), progs,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, **_dot_args(x),
                            num_warps=warps, num_stages=stages)
    return out


def _wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, w_shape, weight_layout: str,
           dw=None) -> torch.Tensor:
    """dW in ``w``'s layout: dy_e^T x_e ([N, K], "nk") or its transpose ([K, N], "kn"), every
    element written (zeros for an expert without rows), into ``dw`` where given."""
    bm, bp, bq, _, warps, stages = _WGRAD_CPU if _interpreted(x) else _WGRAD_GPU
    if x.dtype == torch.float32 and x.device.type == "cuda":
        stages = min(stages, 2)  # as in _tiles_mm: fp32 tiles of three stages fill shared memory
    if dw is None:
        dw = torch.empty(w_shape, dtype=x.dtype, device=x.device)
    n, k = dy.shape[1], x.shape[1]
    # dw[e, n, k] at e*s0 + n*scp + k*scq whichever layout dw has.
    scp, scq = (dw.stride(1), dw.stride(2)) if weight_layout == "nk" else (dw.stride(2), dw.stride(1))
    if w_shape[0] == 0 or n == 0 or k == 0:
        return dw.zero_()
    avg = 1 << max(0, (x.shape[0] // max(1, w_shape[0])).bit_length() - 1)  # rows per expert, a power of two
    args = (dy, x, dw, offs, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), dw.stride(0), scp, scq, avg)
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        _wgrad_tuned[lambda meta: (w_shape[0], triton.cdiv(n, meta["BLOCK_P"]), triton.cdiv(k, meta["BLOCK_Q"]))](
            *args, **_dot_args(x))
        return dw
    grid = (w_shape[0], triton.cdiv(n, bp), triton.cdiv(k, bq))
    _wgrad_kernel[grid](*args, BLOCK_M=bm, BLOCK_P=bp, BLOCK_Q=bq, **_dot_args(x), num_warps=warps, num_stages=stages)
    return dw


def _strides(w: torch.Tensor, weight_layout: str) -> Tuple[int, int, int]:
    """(expert, N, K) strides of w in either layout."""
    return (w.stride(0), w.stride(1), w.stride(2)) if weight_layout == "nk" else (w.stride(0), w.stride(2), w.stride(1))


class _GroupedMMTriton(torch.autograd.Function):
    """The Triton kernels' forward and backward, mirroring ``_GroupedMMKernel``: gradients for x
    and w, not for the offsets."""

    @staticmethod
    def forward(ctx, x, w, offs, weight_layout):
        cfg = _FWD_CPU if _interpreted(x) else _FWD_GPU
        plan = tile_plan(offs, x.shape[0], cfg[0])
        se, sn, sk = _strides(w, weight_layout)
        n = w.shape[1] if weight_layout == "nk" else w.shape[2]
        ctx.weight_layout, ctx.cfg = weight_layout, cfg
        ctx.save_for_backward(x, w, offs, *plan)
        return _tiles_mm(x, w, plan, se, sk, sn, n, cfg)  # out = x_e @ W_e^T: B_e[k, n] = W_e[n, k]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w, offs, *plan = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx = dy_e @ W_e: B_e[n, k] = W_e[n, k], the strides swapped
            se, sn, sk = _strides(w, ctx.weight_layout)
            dx = _tiles_mm(dy, w, plan, se, sn, sk, x.shape[1], ctx.cfg)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(dy, x, offs, w.shape, ctx.weight_layout)
        return dx, dw, None, None


def _clamped(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 offsets clamped into [0, rows] and made non-decreasing, on the device."""
    offs = torch.cummax(offs.to(torch.int64).clamp(0, rows), 0).values if offs.numel() else offs
    return offs.to(torch.int32).contiguous()


def wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, w_shape, weight_layout: str = "nk") -> torch.Tensor:
    """The weight gradient alone, in ``w_shape`` and ``weight_layout``: ``dy_e^T x_e`` per expert
    over rows ``[offs[e-1], offs[e])`` (offsets clamped as in ``grouped_mm_triton``), zeros for
    an expert without rows. For ``grouped_mm(..., impl="hybrid")``'s backward."""
    return _wgrad(dy.contiguous(), x.contiguous(), _clamped(offs, x.shape[0]), w_shape, weight_layout)


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, weight_layout: str = "nk") -> torch.Tensor:
    """``[R, N]``: rows ``[offs[e-1], offs[e])`` of ``x [R, K]`` times ``W_e^T``; ``offs`` int32
    cumulative row ends on x's device (not checked, which would take a synchronisation: rows past
    ``offs[-1]`` are left unwritten, and offsets past R or decreasing are clamped into [0, R] and
    made non-decreasing on the device, so no kernel reads or writes outside x, out or dW).
    Differentiable in x and w. Checks are the caller's (``flux.ops.grouped_mm``)."""
    return _GroupedMMTriton.apply(x.contiguous(), w, _clamped(offs, x.shape[0]), weight_layout)


__all__ = ["grouped_mm_triton", "tile_plan", "wgrad"]
