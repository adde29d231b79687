"""The machinery the GEMM op families (flux/ops/ag_gemm.py, gemm_rs.py) share: ``GemmOp``.

An op file gives its reference, its own checks, its output shape and its gradients; GemmOp
makes of them the slow path (check, exchange, choose or tune, run, leave a plan), the
forward that serves a plan or the slow path, the strategy runners for benchmarks and tests,
and, through flux/ops/_opdef.py, the custom op, its out= variant, the fakes and autograd.

The two families are each other's backward: a gradient reaches the other family through
``GEMM_OPS[name].public``, filled in when its module is imported (flux/ops/__init__.py
imports both), so neither op module imports the other. The hot path (``public_call``) is a
lookup and one C++ entry.
"""
import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from flux import autotune
from flux.autotune.space import Candidate
from flux.ops import _plans
from flux.ops._checks import FluxInputError, Signature, check_collectively_given
from flux.ops._common import (call_mode, check_gemm_args, check_out_arg, check_same_device, choose_and_check,
                              problem_of, refuse_capture, weight_nk_shape)
from flux.ops._opdef import define_op
from flux.runtime import group_device, group_from_name, group_name, resolve_group, runtime, symm
from flux.strategies import OP_CODES, TABLES

LAYOUT, DTYPE = _plans.LAYOUT_CODES, _plans.DTYPE_CODES
GEMM_OPS: Dict[str, "GemmOp"] = {}
# group -> the runtime whose plans serve the hot path of calls on that group (the default
# group under dist.group.WORLD).
_hot: Dict[object, object] = {}


def forget_plans() -> None:
    """Drop every plan (tests; after changing strategies or caches mid-process): of every
    runtime, also one whose first planned call raised before it served the hot path."""
    for rt in runtime.made():
        rt.clear_plans()
    _hot.clear()


autotune.on_change(forget_plans)  # a forced strategy, a reset or a new tuned entry changes what plans hold


def _local_rows(input: torch.Tensor) -> int:
    """Rows of this rank's input (all dimensions but the last)."""
    return input.numel() // input.shape[-1] if input.dim() >= 1 and input.shape[-1] else 0


def _group(g) -> dist.ProcessGroup:
    """The op's group argument: its name (the dispatcher's op) or the group (the eager path)."""
    return group_from_name(g) if isinstance(g, str) else g


class GemmOp:
    """One GEMM op family. ``gathers``: the op can also return its gathered input (ag_gemm).

    reference(input, weight, bias, group, weight_layout, out_dtype[, need_gathered], out=None)
        the unfused computation: (out, gathered) where ``gathers``, else out
    out_shape(input, n, world)  the output's shape
    check(sig, input, group)    the family's own argument checks (recorded in ``sig``)
    rows(m_local_rows, world)   the Problem's M (all rows the GEMM spans)
    grads(needs, grad_out, grad_gathered, input, weight, gathered, group, layout, has_bias, eager)
    """

    def __init__(self, name: str, *, reference: Callable, out_shape: Callable, check: Callable, rows: Callable,
                 grads: Callable, gathers: bool):
        self.name, self.OP, self.code = name, f"flux.{name}", OP_CODES[name]
        self.strategies = tuple(TABLES[name])
        self.reference, self.out_shape, self.check, self.rows, self.grads = reference, out_shape, check, rows, grads
        self.gathers = gathers
        self.public: Optional[Callable] = None  # the op's public function, set by its module
        self.parts = define_op(name, self._op_forward(), self._op_fake(), save=self._save, backward=self._backward,
                               out_forward=self._op_out_forward(), out_fake=self._out_fake)
        GEMM_OPS[name] = self

    # ---- strategies, for benchmarks, tests and the tuner ---------------------------------------
    def available_strategies(self, device: torch.device):
        """Names of the strategies that can run on ``device`` (always 'sequential' first)."""
        from flux.runtime import cuda_kernels_available

        overlapped = device.type == "cuda" and cuda_kernels_available()
        return [name for name in self.strategies if name == "sequential" or overlapped]

    def _reference(self, input, weight, bias, group, weight_layout, out_dtype, gathered):
        extra = (gathered,) if self.gathers else ()
        return functools.partial(self.reference, input, weight, bias, group, weight_layout, out_dtype, *extra)

    def signature(self, input, weight, bias, group, weight_layout, out_dtype) -> Signature:
        sig = Signature(self.OP)
        check_gemm_args(sig, input, weight, bias, weight_layout, out_dtype, group_device(group).type)
        self.check(sig, input, group)
        return sig

    def prepare_strategy(self, name: str, input, weight, bias, group, weight_layout, out_dtype, gathered, out, check,
                         params):
        group = resolve_group(group, self.OP)
        if name not in self.strategies:
            raise ValueError(f"{self.OP}: unknown strategy {name!r}; known: {list(self.strategies)}")
        no_symm = symm.why_unavailable(group)
        if check:
            check_collectively_given(self.signature(input, weight, bias, group, weight_layout, out_dtype), group,
                                     no_symm)
        world = dist.get_world_size(group)
        problem = problem_of(self.name, input, weight, weight_layout, out_dtype, world,
                             self.rows(_local_rows(input), world))
        return _plans.prepare(self.name, Candidate.of(name, **params), problem, no_symm, input, weight, bias, group,
                              weight_layout, out_dtype, gathered, out,
                              self._reference(input, weight, bias, group, weight_layout, out_dtype, gathered))

    # ---- the slow path and the forward -----------------------------------------------------------
    def slow(self, input, weight, bias, group, weight_layout, out_dtype, gathered, out=None):
        """Check, exchange, choose (or tune), run, and leave a plan for the hot path."""
        refuse_capture(self.OP)
        world = dist.get_world_size(group)
        sig = self.signature(input, weight, bias, group, weight_layout, out_dtype)
        if sig.error is None:
            n, _ = weight_nk_shape(weight, weight_layout)
            check_out_arg(sig, out, self.out_shape(input, n, world), out_dtype or input.dtype, input,
                          (input, weight, bias))
            if out is not None and gathered:
                sig.fail("out= cannot be combined with return_gathered=True")
        else:
            sig.add("out is given", out is not None)
        problem, cand, tune_now, no_symm = choose_and_check(sig, self.name, input, weight, weight_layout, out_dtype,
                                                            group, self.rows(_local_rows(input), world))
        reference = self._reference(input, weight, bias, group, weight_layout, out_dtype, gathered)
        if tune_now:  # tuned on scratch outputs: the caller's out is written once, below
            def prepare(c, dest=None):
                return _plans.prepare(self.name, c, problem, no_symm, input, weight, bias, group, weight_layout,
                                      out_dtype, gathered, dest, reference)
            cand = Candidate.parse(autotune.tune(problem, lambda c, dest=None: prepare(c, dest)(), group,
                                                 input.device, prepare=prepare)["choice"])
        result, rt = _plans.run_and_remember(self.name, cand, problem, no_symm, input, weight, bias, group,
                                             weight_layout, out_dtype, gathered, out, reference)
        if rt is not None:
            _hot[group] = rt
        return result

    def _planned(self, input, weight, bias, group, weight_layout, out_dtype, gathered, out):
        """The result of this problem's plan, run from C++, or None where no plan serves it."""
        rt = _hot.get(dist.group.WORLD if group is None else group)
        if rt is None:
            return None
        return rt.call(self.code, input, weight, bias, out, LAYOUT.get(weight_layout, -1), DTYPE.get(out_dtype, -2),
                       gathered)

    def forward(self, input, weight, bias, group, weight_layout, out_dtype, gathered=False, out=None):
        """The plan of this problem if there is one, else the slow path."""
        r = self._planned(input, weight, bias, group, weight_layout, out_dtype, gathered, out)
        return r if r is not None else self.slow(input, weight, bias, group, weight_layout, out_dtype, gathered, out)

    def public_call(self, input, weight, bias, group, weight_layout, out_dtype, gathered, out):
        """The public function's body. Hot path: a plan made by an earlier call of the same problem,
        enqueued from C++; anything it does not serve goes to ``call``."""
        mode = call_mode(input, weight, bias, out)
        if mode == 0:
            r = self._planned(input, weight, bias, group, weight_layout, out_dtype, gathered, out)
            if r is not None:
                if out is not None:
                    return out
                return (r if gathered else r[0]) if self.gathers else r
        return self.call(mode, input, weight, bias, group, weight_layout, out_dtype, gathered, out)

    def call(self, mode: int, input, weight, bias, group, weight_layout, out_dtype, gathered, out):
        """A public call that its plan did not serve (mode: flux.ops._common.call_mode)."""
        group = resolve_group(group, self.OP)
        if out is not None and gathered:
            raise FluxInputError(f"{self.OP}: out= cannot be combined with return_gathered=True")
        # The slow path serves plain calls, and refuses out= with tensors that need gradients (mode 1)
        # on every rank alike.
        if mode == 0 or (mode == 1 and out is not None):
            r = self.slow(input, weight, bias, group, weight_layout, out_dtype, gathered, out)
        elif out is not None:
            self.parts.out_op(input, weight, bias, group_name(group), weight_layout, out_dtype, out)
        elif mode == 1:  # ag_gemm keeps the gathered input where the weight's gradient needs it
            extra = (gathered or weight.requires_grad,) if self.gathers else ()
            r = self.parts.function.apply(input, weight, bias, group, weight_layout, out_dtype, *extra)
        else:
            extra = (gathered,) if self.gathers else ()
            r = self.parts.op(input, weight, bias, group_name(group), weight_layout, out_dtype, *extra)
        if out is not None:
            return out
        return (r if gathered else r[0]) if self.gathers else r

    # ---- the pieces of the custom op ---------------------------------------------------------------
    def _op_forward(self):
        me = self
        if self.gathers:
            def forward(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                        weight_layout: str, out_dtype: Optional[torch.dtype],
                        return_gathered: bool) -> Tuple[torch.Tensor, torch.Tensor]:
                out, gathered = me.forward(input, weight, bias, _group(group_name), weight_layout, out_dtype,
                                           return_gathered)
                return out, gathered if return_gathered and gathered is not None else input.new_empty((0,))
            return forward

        def forward(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                    weight_layout: str, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
            return me.forward(input, weight, bias, _group(group_name), weight_layout, out_dtype)
        return forward

    def _op_fake(self):
        def fake(input, weight, bias, group_name, weight_layout, out_dtype, return_gathered=False):
            check_same_device(self.OP, input, weight, bias)
            n, _ = weight_nk_shape(weight, weight_layout)
            shape = self.out_shape(input, n, dist.get_world_size(_group(group_name)))
            out = input.new_empty(shape, dtype=out_dtype or input.dtype)
            if not self.gathers:
                return out
            gathered = input.new_empty((shape[0], *input.shape[1:])) if return_gathered else input.new_empty((0,))
            return out, gathered
        return fake

    def _op_out_forward(self):
        me = self

        def forward_out(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_name: str,
                        weight_layout: str, out_dtype: Optional[torch.dtype], out: torch.Tensor) -> None:
            me.forward(input, weight, bias, _group(group_name), weight_layout, out_dtype, False, out)
        return forward_out

    def _out_fake(self, input, weight, bias, group_name, weight_layout, out_dtype, out):
        check_same_device(self.OP, input, weight, bias)
        return None

    def _save(self, ctx, inputs, output):
        input, weight, bias, group, weight_layout = inputs[:5]
        ctx.group, ctx.weight_layout, ctx.has_bias = group, weight_layout, bias is not None
        gathered = output[1] if self.gathers and inputs[6] else None
        ctx.save_for_backward(input, weight, gathered)

    def _backward(self, ctx, grad_out, grad_gathered=None):
        input, weight, gathered = ctx.saved_tensors
        if grad_out is None:  # only the gathered input was used (eager path: grads not materialized)
            n, _ = weight_nk_shape(weight, ctx.weight_layout)
            world = dist.get_world_size(_group(ctx.group))
            grad_out = input.new_zeros(self.out_shape(input, n, world))
        grads = self.grads(ctx.needs_input_grad, grad_out, grad_gathered, input, weight, gathered, _group(ctx.group),
                           ctx.weight_layout, ctx.has_bias, getattr(ctx, "eager", False))
        return (*grads, None, None, None) + ((None,) if self.gathers else ())
