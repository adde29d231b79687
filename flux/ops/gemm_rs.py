"""flux.gemm_rs: the reduce-scatter after a row-parallel GEMM.

Meaning (the unfused reference, ``gemm_rs_ref``)::

    out = reduce_scatter(input @ W, dim=0) (+ bias)

The bias is added once, after the reduction, as Megatron's RowParallelLinear does. The op is
``torch.ops.flux.gemm_rs`` (made by flux/ops/_gemm_op.py), with a fake implementation for
torch.compile and an autograd formula (backward is an AllGather+GEMM for the input's gradient
and a local GEMM for the weight's). The first call of a problem checks, chooses and plans (the
slow path); later calls run its plan from C++ (flux/ops/_plans.py, csrc/gemm_rs/gemm_rs_plan.cpp).
Strategies, chosen per problem by flux.autotune (timelines and ordering: docs/design.md §5):

  sequential      one GEMM, NCCL reduce-scatter (gloo: all-reduce and slice), the bias.
  decomposed      one cuBLAS GEMM per destination's row block, peers' first, each pushed by the
                  copy engine to its owner while the next computes; the own block last; then one
                  pass sums the W slots in rank order in fp32 and adds the bias. ``chunks`` > 1
                  splits each block, one signal channel per part.
  decomposed_p2p  the same, the peer blocks' GEMMs writing straight into the owners' workspaces.
  fused           a ring of W GEMMs whose epilogues add the partial sum pushed by rank - 1, in
                  ``segments`` with a flag each; no reduction pass (rounded per hop above W = 2).
  oneshot         small M: one GEMM into the own workspace, a barrier, each rank sums its rows
                  of every partial over NVLink.
"""
from typing import Optional

import torch
import torch.distributed as dist

from flux.ops._checks import FluxInputError  # noqa: F401
from flux.ops._common import deliver, local_gemm, weight_nk_shape
from flux.ops._gemm_op import GEMM_OPS, GemmOp
from flux.runtime import reduce_scatter_dim0, resolve_group

OP = "flux.gemm_rs"
NAME = "gemm_rs"


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


def gemm_rs_ref(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``reduce_scatter(input @ W, dim=0) (+ bias)`` with torch.matmul and torch.distributed, unchecked."""
    return _sequential(input, weight, bias, resolve_group(group, OP), weight_layout, out_dtype)


def _check(sig, input, group) -> None:
    world = dist.get_world_size(group)
    if input.dim() >= 1 and input.shape[0] % world != 0:
        sig.fail(f"input.shape[0] = {input.shape[0]} (M) is not divisible by the group size {world}")


def _grads(needs, grad_out, grad_gathered, input, weight, gathered, group, layout, has_bias, eager):
    """(d input, d weight, d bias) of ``out = reduce_scatter(input @ W) (+ bias)``: d input is an
    AllGather+GEMM (flux.ag_gemm) whose gathered grad_out also serves d weight's local GEMM."""
    n, k = weight_nk_shape(weight, layout)
    grad_bias = grad_out.reshape(-1, n).sum(0) if has_bias and needs[2] else None
    grad_out = grad_out.to(input.dtype).contiguous()
    grad_input = grad_weight = None
    if needs[0] or needs[1]:
        # d input = all_gather(grad_out) @ W: W [N, K] read as [K_in=N, N_out=K] is the other layout.
        grad_input, gathered = GEMM_OPS["ag_gemm"].public(grad_out, weight, group=group,
                                                          weight_layout="kn" if layout == "nk" else "nk",
                                                          return_gathered=True)
        if needs[1]:
            g2d, a2d = gathered.reshape(-1, n), input.reshape(-1, k)
            grad_weight = g2d.t() @ a2d if layout == "nk" else a2d.t() @ g2d
        if not needs[0]:
            grad_input = None
    return grad_input, grad_weight, grad_bias


_RS = GemmOp(NAME, reference=_sequential, gathers=False, grads=_grads, check=_check,
             out_shape=lambda input, n, world: (input.shape[0] // world, *input.shape[1:-1], n),
             rows=lambda local_rows, world: local_rows)
STRATEGIES = _RS.strategies
available_strategies = _RS.available_strategies


def prepare_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                     group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                     out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
                     check: bool = True, **params):
    """A zero-argument callable that enqueues one call of strategy ``name`` (with its
    parameters) on these very tensors and returns the result: the plan is made once, here
    (benchmarks, tests, the autotuner). Collective, like the op."""
    return _RS.prepare_strategy(name, input, weight, bias, group, weight_layout, out_dtype, False, out, check, params)


def run_strategy(name: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 group: Optional[dist.ProcessGroup] = None, weight_layout: str = "nk",
                 out_dtype: Optional[torch.dtype] = None, check: bool = True, **params) -> torch.Tensor:
    """Run one named strategy with its parameters, if any (benchmarks, tests, the autotuner):
    same arguments and result as ``flux.gemm_rs``, bypassing the choice."""
    return prepare_strategy(name, input, weight, bias, group=group, weight_layout=weight_layout,
                            out_dtype=out_dtype, check=check, **params)()


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
    return _RS.public_call(input, weight, bias, group, weight_layout, out_dtype, False, out)

_RS.public = gemm_rs
