"""fp8 dispatch: block quantisation (one fp32 scale per 128 elements of a row, float8_e4m3fn
values; DeepSeek-V3's activations) and the packed byte rows that carry it: a token's H fp8
bytes, then its H / 128 scales' bytes, then zeros to a multiple of 16 bytes (docs/api.md).
"""
from typing import Optional, Tuple

import torch

from flux.ops._checks import FluxInputError

# fp8 dispatch: blocks of 128 elements along H, one fp32 scale each (DeepSeek-V3's activations).
FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_FP8_AMAX_MIN = 1e-4  # an all-zero block still gets a finite, nonzero scale
_FP8_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROW_ALIGN = 16  # bytes: the packed rows' length is a multiple, so rows copy in 16-byte vectors


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
