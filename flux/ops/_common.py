"""Pieces shared by the op families: argument checks and the local GEMM."""
from typing import Optional

import torch
import torch.nn.functional as F

from flux import envs
from flux.ops._checks import Signature, dtype_code

WEIGHT_LAYOUTS = ("nk", "kn")
# dtypes the ops accept; the fused CUDA strategies support a subset (bf16, fp16).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def weight_nk_shape(weight: torch.Tensor, layout: str):
    """(N, K) of the weight in either layout."""
    return (weight.shape[0], weight.shape[1]) if layout == "nk" else (weight.shape[1], weight.shape[0])


def check_gemm_args(sig: Signature, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    weight_layout: str, out_dtype: Optional[torch.dtype], device_type: str) -> None:
    """Local checks shared by ag_gemm and gemm_rs; problems are recorded in ``sig``."""
    sig.add("weight_layout", WEIGHT_LAYOUTS.index(weight_layout) if weight_layout in WEIGHT_LAYOUTS else -1)
    sig.add("input.dtype", dtype_code(input.dtype))
    sig.add("weight.dtype", dtype_code(weight.dtype))
    sig.add("bias is given", bias is not None)
    sig.add("bias.dtype", dtype_code(bias.dtype if bias is not None else None))
    sig.add("out_dtype", dtype_code(out_dtype))
    sig.add_shape("input", input.shape)
    sig.add_shape("weight", weight.shape)
    if weight_layout not in WEIGHT_LAYOUTS:
        sig.fail(f"weight_layout must be 'nk' ([N, K], as nn.Linear) or 'kn' ([K, N]), got {weight_layout!r}")
        return
    if input.dim() < 2:
        sig.fail(f"input must have at least 2 dimensions ([M, K] or [..., K]), got shape {tuple(input.shape)}")
    if weight.dim() != 2:
        sig.fail(f"weight must be 2-D ({'[N, K]' if weight_layout == 'nk' else '[K, N]'}), got shape {tuple(weight.shape)}")
        return
    n, k = weight_nk_shape(weight, weight_layout)
    if input.dim() >= 2 and input.shape[-1] != k:
        hint = ""
        if input.shape[-1] == n:  # the other layout would fit: name it
            other = "kn" if weight_layout == "nk" else "nk"
            hint = (f"; a {'[K, N]' if other == 'kn' else '[N, K]'} weight takes weight_layout={other!r}"
                    f"{' (the default is nk)' if weight_layout == 'nk' else ''}")
        sig.fail(f"input has K={input.shape[-1]} (last dimension) but weight "
                 f"{'[N, K]' if weight_layout == 'nk' else '[K, N]'} = {tuple(weight.shape)} has K={k}"
                 f" in weight_layout={weight_layout!r}{hint}")
    if input.dtype not in SUPPORTED_DTYPES:
        sig.fail(f"input dtype {input.dtype} is not supported (use one of {[str(d) for d in SUPPORTED_DTYPES]})")
    if weight.dtype != input.dtype:
        sig.fail(f"weight dtype {weight.dtype} differs from input dtype {input.dtype}")
    out_dt = out_dtype or input.dtype
    if out_dt not in SUPPORTED_DTYPES:
        sig.fail(f"out_dtype {out_dt} is not supported")
    if bias is not None:
        if bias.shape != (n,):
            sig.fail(f"bias must have shape ({n},) (N), got {tuple(bias.shape)}")
        if bias.dtype != out_dt:
            sig.fail(f"bias dtype {bias.dtype} differs from the output dtype {out_dt}")
        if bias.device != input.device:
            sig.fail(f"bias is on {bias.device} but input is on {input.device}")
    if weight.device != input.device:
        sig.fail(f"weight is on {weight.device} but input is on {input.device}")
    if input.device.type != device_type:
        sig.fail(f"input is on {input.device} but the process group communicates on {device_type} "
                 f"(NCCL groups take CUDA tensors, gloo groups CPU tensors)")
    if input.device.type == "cuda" and input.device.index != torch.cuda.current_device():
        sig.fail(f"input is on {input.device} but the current CUDA device is {torch.cuda.current_device()} "
                 "(call torch.cuda.set_device first)")
    if not input.is_contiguous():
        sig.fail(f"input must be contiguous (strides {input.stride()} for shape {tuple(input.shape)})")
    if not weight.is_contiguous():
        sig.fail(f"weight must be contiguous in its declared layout {weight_layout!r} (strides {weight.stride()}); "
                 f"a transposed view of an [N, K] weight is weight_layout='{'nk' if weight_layout == 'kn' else 'kn'}' "
                 "of the original tensor")


def check_out_arg(sig, out: Optional[torch.Tensor], expected_shape, dtype: torch.dtype, input: torch.Tensor,
                  others=()) -> None:
    """Local checks of a caller's ``out`` tensor (recorded in ``sig``)."""
    sig.add("out is given", out is not None)
    if out is None:
        return
    sig.add_shape("out", out.shape)
    if tuple(out.shape) != tuple(expected_shape):
        sig.fail(f"out has shape {tuple(out.shape)}, expected {tuple(expected_shape)}")
    if out.dtype != dtype:
        sig.fail(f"out has dtype {out.dtype}, expected {dtype}")
    if out.device != input.device:
        sig.fail(f"out is on {out.device} but input is on {input.device}")
    if not out.is_contiguous():
        sig.fail(f"out must be contiguous (strides {out.stride()})")
    if torch.is_grad_enabled() and (out.requires_grad or any(t is not None and t.requires_grad for t in others)):
        sig.fail("out= does not support autograd (as torch's out= variants); call without out")

    def span(t):
        start = t.data_ptr()
        return start, start + t.numel() * t.element_size()
    o0, o1 = span(out)
    for name, t in zip(("input", "weight", "bias"), others):
        if t is not None and t.device == out.device and t.numel() and out.numel():
            t0, t1 = span(t)
            if o0 < t1 and t0 < o1:
                sig.fail(f"out overlaps {name} in memory")


def check_same_device(op: str, input, weight, bias) -> None:
    """Local device check for the fake (meta) implementations, which also serve tensors on
    the meta device and so never reach the collective check: a mix of devices raises here."""
    from flux.ops._checks import FluxInputError

    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != input.device:
            raise FluxInputError(f"{op}: {name} is on {t.device} but input is on {input.device}")


def local_gemm(a2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], weight_layout: str,
               out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """a2d @ W (+ bias) with W in either layout; computed in the input dtype (cuBLAS
    accumulates in fp32), or in fp32 when a wider out_dtype is asked for."""
    w_nk = weight if weight_layout == "nk" else weight.t()
    out_dt = out_dtype or a2d.dtype
    if out_dt == a2d.dtype:
        return F.linear(a2d, w_nk, bias)
    acc = torch.promote_types(out_dt, torch.float32)
    out = F.linear(a2d.to(acc), w_nk.to(acc), bias.to(acc) if bias is not None else None)
    return out.to(out_dt)


def deliver(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``result`` written into the caller's ``out`` when one was given (reference paths,
    which compute into their own tensors)."""
    if out is None:
        return result
    out.view(result.shape).copy_(result)
    return out.view(result.shape)


def refuse_capture(op: str) -> None:
    """The slow path (checks through the store, the choice, workspace growth) cannot run inside a
    CUDA graph capture: raise a clear error there instead of breaking the capture."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        from flux.ops._checks import FluxInputError

        raise FluxInputError(
            f"{op}: this call has no plan yet, and its first call (argument check across ranks, strategy "
            "choice, workspace) cannot be captured in a CUDA graph: call it once eagerly with the same "
            "shapes, dtypes and options before capturing (with FLUX_CHECK_EVERY_CALL=1 no call can be captured)")


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # Parameter disables __torch_function__: a plain tensor here


def call_mode(*tensors) -> int:
    """How a public op call is served:

    0  plain eager tensors, nothing to record for autograd: the op's own path (a plan from C++,
       or the slow path);
    1  plain eager tensors of which some need gradients: the op's autograd.Function (the
       dispatcher's Python custom-op layer would cost ~0.1-0.2 ms of host time per call);
    2  anything else (torch.compile, fake/functional modes, torch-function modes, tensor
       subclasses): torch.ops.flux, whose fake implementation and autograd formula apply.
    """
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return 2
    if torch._C._len_torch_dispatch_stack() > 0:
        return 2
    grad = torch.is_grad_enabled()
    mode = 0
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN:
            return 2
        if grad and t.requires_grad:
            mode = 1
    return mode


_fused_built = None


def _fused_kernels_built() -> bool:
    global _fused_built
    if _fused_built is None:
        from flux.runtime import cuda_kernels_available

        _fused_built = cuda_kernels_available() and bool(torch.ops.flux.ag_gemm_fused_supported())
    return _fused_built


def problem_of(op: str, input: torch.Tensor, weight: torch.Tensor, weight_layout: str,
               out_dtype: Optional[torch.dtype], world: int, m_total: int):
    """The autotuner's Problem (flux.autotune.space) of one call on ``world`` ranks; None for an
    empty one (M, N or K zero: nothing to choose or overlap, the reference serves it)."""
    from flux.autotune.space import Problem

    n, k = weight_nk_shape(weight, weight_layout)
    if min(m_total, n, k) <= 0:
        return None
    cuda = input.device.type == "cuda"
    return Problem(op, m_total, n, k, input.dtype, world, weight_layout,
                   out_dtype is not None and out_dtype != input.dtype, input.device.type,
                   sm90=cuda and torch.cuda.get_device_capability(input.device) == (9, 0),
                   fused_built=cuda and _fused_kernels_built(),
                   out_dtype=out_dtype if out_dtype != input.dtype else None,
                   # FLUX_GLOO_CUDA places rank r on GPU r % count (flux.testing)
                   shared_gpu=cuda and envs.GLOO_CUDA.get() and world > torch.cuda.device_count())


def choose_and_check(sig, op: str, input: torch.Tensor, weight: torch.Tensor, weight_layout: str,
                     out_dtype: Optional[torch.dtype], group, m_total: int):
    """Choose the call's candidate (flux.autotune), put it into the signature, and check the
    signature across ranks (raising the same FluxInputError everywhere on any problem,
    including ranks that would choose differently). Returns (problem, candidate, tune_now,
    no_symm): problem is None for an empty call; tune_now is True, on every rank alike, when
    the call must tune its problem first; no_symm is why the group has no symmetric workspace
    (flux.runtime.symm.why_unavailable, None: it has one), asked once here for the check and
    the plan (flux/ops/_plans.py)."""
    import torch.distributed as dist

    from flux import autotune
    from flux.autotune.space import Candidate
    from flux.ops._checks import check_collectively_given
    from flux.runtime import cuda_kernels_available, symm

    problem, cand, tune = None, Candidate("sequential"), False
    if sig.error is None:
        problem = problem_of(op, input, weight, weight_layout, out_dtype, dist.get_world_size(group), m_total)
        if problem is not None:
            cand = autotune.choose(problem, input.device)
            tune = autotune.tuning_requested(problem, input.device)
    # A rank without flux._C would run its overlapped strategies' fallback (NCCL) while its
    # peers wait for signals: make that a mismatch the check reports instead.
    sig.add("flux._C loaded", cuda_kernels_available())
    sig.add("strategy", autotune.candidate_code(cand))
    sig.add("tunes now", tune)
    no_symm = symm.why_unavailable(group)
    check_collectively_given(sig, group, no_symm)
    return problem, cand, tune, no_symm
