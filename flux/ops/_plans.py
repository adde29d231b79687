"""Plans: what the slow path of an op call leaves behind so that later calls are one C++ entry.

The first call of a problem (shapes, dtypes, layout, bias, out, options, group) runs the slow
path in the op module: every argument check, the cross-rank signature exchange, the strategy
choice (or tuning) and the growth of the symmetric workspace. It then makes a *plan* in the
group's C++ runtime (flux._C.Runtime, csrc/runtime/runtime.h) and remembers it under the key
of the call's tensors. Every later call of the same problem is ``runtime.call(...)``: a key
lookup in C++ and the plan's copies, signals, waits and GEMMs enqueued from there.

Each plan has a token, a hash of the problem and the chosen strategy, the same on every rank
that makes the same call; the entry barrier of every call carries it, so ranks that make
different calls after a cached one fail at once, naming each other (csrc/runtime/signals.cu).

Strategies run in C++ on CUDA groups with symmetric memory (NCCL; gloo only under
FLUX_GLOO_CUDA=1, tests). 'sequential' runs in C++ on NCCL groups; elsewhere (CPU, gloo, no
flux._C) it runs in Python through the op's reference, and no plan is made.
"""
import dataclasses
import functools
import zlib
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from flux import envs
from flux.autotune.space import Candidate, strategy_params
from flux.runtime import runtime
from flux.strategies import (DTYPE_CODES, OP_CODES, PARAM_DEFAULTS, PARAM_ORDER, STRATEGY_CODES, Problem,
                             fused_ag_swizzle, param_error, resolve, warn_once, wide_out_ok)

LAYOUT_CODES = {"nk": 0, "kn": 1}


def _log_once(op: str, strategy: str, reason: str, to: str) -> None:
    warn_once(f"flux.{op}: strategy {strategy!r} falls back to {to!r}: {reason}")


def effective(op: str, cand: Candidate, p: Optional[Problem], no_symm: Optional[str]) -> Candidate:
    """The candidate that will actually run problem ``p`` (None: an empty call): the strategy
    table's rules (flux/strategies.py) on it, with ``no_symm`` (why the group has no symmetric
    workspace, None: it has one); each fallback logs its reason once."""
    if cand.strategy == "sequential":
        return cand
    why = param_error(op, cand.strategy, cand.kwargs)
    if why is not None:
        raise ValueError(f"flux.{op}: {why}")
    if p is None:
        return Candidate("sequential")  # nothing to overlap: the reference serves empty problems
    if p.device_type == "cuda":
        p = dataclasses.replace(p, no_symm=no_symm)
    name, kw = resolve(p, cand.strategy, cand.kwargs, lambda frm, why, to: _log_once(op, frm, why, to))
    return Candidate.of(name, **kw)


def in_cxx(cand: Candidate, input: torch.Tensor, weight: torch.Tensor, group, out_dtype,
           no_symm: Optional[str] = None) -> bool:
    """Whether ``cand`` (already effective) runs in the C++ runtime (else the Python reference)."""
    if input.device.type != "cuda" or input.numel() == 0 or weight.numel() == 0:
        return False
    if not wide_out_ok(input.dtype, out_dtype) or no_symm is not None:
        return False
    if cand.strategy == "sequential":
        return "nccl" in str(dist.get_backend(group)).lower() and dist.get_world_size(group) > 1
    return True


def kernel_params(p: Problem, device: torch.device) -> Dict[str, int]:
    """The fused kernel's config, raster and swizzle for problem ``p``: the kernel tuner's choice
    (flux.autotune.kernels.choose_config) for the kernel's rows (ag_gemm: all gathered rows, its
    bands of M tiles within one rank's block, ``fused_ag_swizzle``; gemm_rs: one rank's block)."""
    from flux.autotune.kernels import choose_config

    m = p.m if p.op == "ag_gemm" else p.rows
    out = p.out_dtype if p.out_dtype is not None else p.dtype
    config, raster, swizzle = choose_config(p.op, m, p.n, p.k, p.dtype, out, device)
    if p.op == "ag_gemm":
        swizzle = fused_ag_swizzle(p, config, swizzle)
    return {"config": config, "raster": raster, "swizzle": swizzle}


def token(op: str, cand: Candidate, input, weight, bias, weight_layout, out_dtype, gathered, world: int) -> int:
    """Non-zero 32-bit hash of the problem and strategy; its top two bits name the op."""
    text = repr((op, cand.label, tuple(input.shape), str(input.dtype), tuple(weight.shape), str(weight.dtype),
                 None if bias is None else (tuple(bias.shape), str(bias.dtype)), weight_layout, str(out_dtype),
                 bool(gathered), world))
    return ((OP_CODES[op] + 1) << 30) | (zlib.crc32(text.encode()) & 0x3FFFFFFF)


def _plan(op: str, cand: Candidate, problem: Optional[Problem], no_symm: Optional[str], input, weight, bias, group,
          weight_layout, out_dtype, gathered):
    """(runtime, plan) that run this call with ``cand``, or None where the Python reference runs
    it. Collective where it makes a plan (the workspace may grow)."""
    c = effective(op, cand, problem, no_symm)
    if not in_cxx(c, input, weight, group, out_dtype, no_symm):
        return None  # in C++ only non-empty calls: ``problem`` is not None below
    tok = token(op, c, input, weight, bias, weight_layout, out_dtype, gathered, problem.world)
    kw = c.kwargs
    if c.strategy == "fused" and "config" not in kw:
        kw = {**kernel_params(problem, input.device), **kw}
    params = [int(kw.get(name, PARAM_DEFAULTS[name])) for name in PARAM_ORDER]
    return runtime.make_plan(group, OP_CODES[op], STRATEGY_CODES[c.strategy], params, tok, input, weight, bias,
                             weight_layout == "nk", DTYPE_CODES.get(out_dtype, -1), gathered)


def prepare(op: str, cand: Candidate, problem: Optional[Problem], no_symm: Optional[str], input: torch.Tensor,
            weight: torch.Tensor, bias, group, weight_layout: str, out_dtype, gathered: bool,
            out: Optional[torch.Tensor], reference: Callable) -> Callable[[], object]:
    """A zero-argument callable that enqueues this call with ``cand``: through a plan of the
    group's C++ runtime, or the Python ``reference(out)`` where no plan applies. ``problem``:
    the call's Problem (flux.ops._common.problem_of, None: empty); ``no_symm``:
    flux.runtime.symm.why_unavailable(group). Collective (it may grow the workspace): every
    rank of the group calls it at the same point."""
    known = strategy_params(op, cand.strategy)
    if not set(cand.kwargs) <= known:
        raise TypeError(f"flux.{op}: strategy {cand.strategy!r} takes the parameters {sorted(known)}, "
                        f"not {sorted(set(cand.kwargs) - known)}")
    made = _plan(op, cand, problem, no_symm, input, weight, bias, group, weight_layout, out_dtype, gathered)
    if made is None:
        return functools.partial(reference, out)
    rt, plan = made
    return functools.partial(rt.run, plan, input, weight, bias, out)


def run_and_remember(op: str, cand: Candidate, problem: Optional[Problem], no_symm: Optional[str], input, weight,
                     bias, group, weight_layout, out_dtype, gathered, out, reference: Callable):
    """The slow path's last step: run ``cand`` (``problem``, ``no_symm``: as ``prepare``). Returns
    (result, runtime): the runtime holds the call's plan for the hot path where it runs in C++
    (unless FLUX_CHECK_EVERY_CALL=1, which keeps every call on the slow path), else None."""
    made = _plan(op, cand, problem, no_symm, input, weight, bias, group, weight_layout, out_dtype, gathered)
    if made is None:
        return reference(out), None
    rt, plan = made
    if envs.CHECK_EVERY_CALL.get():
        return rt.run(plan, input, weight, bias, out), None
    rt.add_plan(plan, input, weight, bias, out, LAYOUT_CODES[weight_layout], DTYPE_CODES.get(out_dtype, -1), gathered)
    return rt.run(plan, input, weight, bias, out), rt


__all__ = ["DTYPE_CODES", "LAYOUT_CODES", "OP_CODES", "STRATEGY_CODES", "prepare", "run_and_remember"]
