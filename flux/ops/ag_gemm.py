"""flux.ag_gemm: the all-gather before a column-parallel GEMM.

Meaning (the unfused reference, ``ag_gemm_ref``)::

    out = torch.cat(all_gather(input), dim=0) @ W (+ bias)

The op is ``torch.ops.flux.ag_gemm`` (made by flux/ops/_gemm_op.py, as gemm_rs), with a fake
implementation for torch.compile and an autograd formula (backward is a GEMM+ReduceScatter for
the input's gradient and a local GEMM for the weight's, over the gathered input saved by the
forward). The first call of a problem checks, chooses and plans (the slow path); later calls of
the same problem run its plan from C++ (flux/ops/_plans.py, csrc/ag_gemm/ag_gemm_plan.cpp).
Strategies, chosen per problem by flux.autotune (timelines and ordering: docs/design.md §5):

  sequential   NCCL/gloo all-gather, then one GEMM: the reference, the CPU path, the fallback.
  decomposed   one cuBLAS GEMM per rank's row block, the local block first (from the input)
               while the copy engine pushes this rank's shard to every peer, each GEMM after
               the signal of the block it reads; ``first8=f`` (W = 2) splits the local rows.
  oneshot      small M: push the shard to every peer, then one GEMM over the gathered rows.
  fused        one persistent CUTLASS GEMM over all gathered rows whose tile scheduler serves
               this rank's rows first and waits (bounded) on each peer's flag before its rows;
               bf16, weight_layout "nk", K and N multiples of 8, else 'decomposed'.
"""
from typing import Optional

import torch
import torch.distributed as dist

from flux.ops._common import deliver, local_gemm, weight_nk_shape
from flux.ops._gemm_op import GEMM_OPS, GemmOp
from flux.runtime import (all_gather_dim0, reduce_scatter_dim0, resolve_group, traceable_all_gather_dim0,
                          traceable_reduce_scatter_dim0)

OP = "flux.ag_gemm"
NAME = "ag_gemm"


def _sequential(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: dist.ProcessGroup, weight_layout: str, out_dtype: Optional[torch.dtype],
                need_gathered: bool, out: Optional[torch.Tensor] = None):
    """The reference in Python: all-gather (NCCL or gloo), then one GEMM."""
    gathered = all_gather_dim0(input, group)
    n, k = weight_nk_shape(weight, weight_layout)
    res = local_gemm(gathered.reshape(-1, k), weight, bias, weight_layout, out_dtype)
    return deliver(res.reshape(*gathered.shape[:-1], n), out), gathered


def ag_gemm_ref(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                out_dtype: Optional[torch.dtype] = None, return_gathered: bool = False):
    """``all_gather(input, dim=0) @ W (+ bias)`` with torch.distributed and torch.matmul, unchecked."""
    group = resolve_group(group, OP)
    out, gathered = _sequential(input, weight, bias, group, weight_layout, out_dtype, return_gathered)
    return (out, gathered) if return_gathered else out


def _grads(needs, grad_out, grad_gathered, input, weight, gathered, group, layout, has_bias, eager):
    """(d input, d weight, d bias) of ``out = all_gather(input) @ W (+ bias)``: d input is a
    GEMM+ReduceScatter (flux.gemm_rs), d weight a local GEMM over the gathered input (gathered
    again where the forward did not keep it)."""
    n, k = weight_nk_shape(weight, layout)
    grad_bias = grad_out.reshape(-1, n).sum(0) if has_bias and needs[2] else None
    grad_out = grad_out.to(input.dtype).contiguous()
    grad_input = grad_weight = None
    if needs[0]:
        # d input = reduce_scatter(grad_out @ W): W [N, K] read as [K_in=N, N_out=K] is the other layout.
        grad_input = GEMM_OPS["gemm_rs"].public(grad_out, weight, group=group,
                                                weight_layout="kn" if layout == "nk" else "nk")
        if grad_gathered is not None and grad_gathered.numel() > 0:
            rs = reduce_scatter_dim0 if eager else traceable_reduce_scatter_dim0
            grad_input = grad_input + rs(grad_gathered.to(input.dtype), group)
    if needs[1]:
        if gathered is None or gathered.numel() == 0:
            gathered = (all_gather_dim0 if eager else traceable_all_gather_dim0)(input, group)
        g2d, a2d = grad_out.reshape(-1, n), gathered.reshape(-1, k)
        grad_weight = g2d.t() @ a2d if layout == "nk" else a2d.t() @ g2d
    return grad_input, grad_weight, grad_bias


_AG = GemmOp(NAME, reference=_sequential, gathers=True, grads=_grads,
             out_shape=lambda input, n, world: (input.shape[0] * world, *input.shape[1:-1], n),
             check=lambda sig, input, group: None, rows=lambda local_rows, world: local_rows * world)
STRATEGIES = _AG.strategies
available_strategies = _AG.available_strategies


def prepare_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                     group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                     out_dtype: Optional[torch.dtype] = None, return_gathered: bool = False,
                     out: Optional[torch.Tensor] = None, check: bool = True, **params):
    """A zero-argument callable that enqueues one call of strategy ``name`` (with its
    parameters) on these very tensors and returns ``(out, gathered or None)``: the plan is made
    once, here (benchmarks, tests, the autotuner). Collective, like the op."""
    return _AG.prepare_strategy(name, input, weight, bias, group, weight_layout, out_dtype, return_gathered, out,
                                check, params)


def run_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                 out_dtype: Optional[torch.dtype] = None, return_gathered: bool = False, check: bool = True,
                 **params):
    """Run one named strategy with its parameters, if any (benchmarks, tests, the autotuner):
    same arguments and result as ``flux.ag_gemm``, bypassing the choice."""
    out, gathered = prepare_strategy(name, input, weight, bias, group=group, weight_layout=weight_layout,
                                     out_dtype=out_dtype, return_gathered=return_gathered, check=check, **params)()
    return (out, gathered) if return_gathered else out


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
        out_dtype: dtype of ``out`` (default: ``input.dtype``); fp32 from bf16/fp16 runs the
            GEMMs on the tensor cores with an fp32 output.
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
    return _AG.public_call(input, weight, bias, group, weight_layout, out_dtype, return_gathered, out)

_AG.public = ag_gemm
