"""Megatron-core's tensor-parallel linear layers on flux's overlapped ops.

    FluxColumnParallelLinear     megatron's ColumnParallelLinear; under sequence parallelism its
                                 forward is flux.ag_gemm, its input gradient flux.gemm_rs
    FluxRowParallelLinear        megatron's RowParallelLinear; under sequence parallelism its
                                 forward is flux.gemm_rs, its input gradient flux.ag_gemm
    SequenceParallelTorchNorm    torch LayerNorm / RMSNorm for sequence-parallel layers, its
                                 parameters tagged as megatron's fused norm tags them
    get_gpt_layer_flux_spec(...) megatron-core's local GPT layer spec (same arguments) with
                                 linear_qkv, linear_proj, linear_fc1 and linear_fc2 on the flux layers
    gpt_layer_flux_spec          that spec with the default arguments, a ModuleSpec, for
                                 Megatron-LM's ``--spec flux.integrations.megatron gpt_layer_flux_spec``

The layers keep megatron's constructors, parameters, state dicts, checkpoint sharding and the
``(output, output_bias)`` convention, and honour ``skip_bias_add``, ``gather_output`` /
``runtime_gather_output``, ``tp_group``, frozen weights and
``config.gradient_accumulation_fusion`` (without apex: flux's path accumulates into
``weight.main_grad`` itself). Whatever flux's path does not cover runs the parent's forward,
the reason logged once per layer class and reason on the ``flux`` logger; the list of those
cases, and the megatron-core behaviours this module answers to: docs/integrations.md.

This module imports megatron.core when imported; ``import flux`` does not import it.
"""
import copy
import dataclasses
import functools
import logging
from typing import Optional, Tuple

import torch
import torch.distributed as dist

# The megatron-core releases this module supports (tested: 0.19.2). Older ones differ in the
# spec's structure (0.16's MLP spec makes get_gpt_layer_flux_spec fail) and are refused here.
MEGATRON_CORE_MIN = (0, 19)


def _megatron_core_version() -> str:
    try:
        import megatron.core as _mc
    except ImportError as e:
        raise ImportError("flux.integrations.megatron needs megatron-core >= "
                          f"{'.'.join(map(str, MEGATRON_CORE_MIN))} (pip install 'megatron-core>=0.19'): {e}") from e
    version = getattr(_mc, "__version__", None)
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            version = "0"
    parts = []
    for p in str(version).split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < MEGATRON_CORE_MIN:
        raise ImportError(f"flux.integrations.megatron supports megatron-core >= "
                          f"{'.'.join(map(str, MEGATRON_CORE_MIN))} (tested with 0.19.2); megatron-core {version} is "
                          "installed: pip install 'megatron-core>=0.19'")
    return str(version)


MEGATRON_CORE_VERSION = _megatron_core_version()

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import layers as _mlayers  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

from flux import ag_gemm, gemm_rs  # noqa: E402
from flux.runtime import all_gather_dim0  # noqa: E402

_log = logging.getLogger("flux")
_logged = set()


def _apex_wgrad_available() -> bool:
    """Whether megatron's own backward can accumulate into main_grad (apex's CUDA extension)."""
    return bool(getattr(_mlayers, "_grad_accum_fusion_available", False))


def _log_fallback_once(layer: torch.nn.Module, reason: str) -> None:
    key = (type(layer).__name__, reason)
    if key not in _logged:
        _logged.add(key)
        _log.warning("flux.integrations.megatron: %s runs megatron's own forward: %s", key[0], reason)


def _parent_config(config):
    """The config given to megatron's constructor: without apex, one with
    gradient_accumulation_fusion off (a shallow copy), since that constructor refuses the option
    then although flux's path does not need apex. The layer keeps the caller's config."""
    if config.gradient_accumulation_fusion and not _apex_wgrad_available():
        config = copy.copy(config)
        config.gradient_accumulation_fusion = False
    return config


# --------------------------------------------------------------------------------------
# Weight gradients: returned, or added to weight.main_grad (gradient accumulation fusion)

_wide_mm = {}  # (device type, input dtype, accumulator dtype) -> whether torch.mm takes out_dtype


def _wide_mm_supported(device: torch.device, dtype: torch.dtype, acc: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=acc)`` runs for ``dtype`` operands on this device type
    (a transposed operand, as in the weight gradient): recent PyTorch has it on CUDA for
    bf16/fp16 -> fp32, a GEMM whose product reaches main_grad without a rounding to 16 bits."""
    key = (device.type, dtype, acc)
    if key not in _wide_mm:
        try:
            a = torch.ones(3, 2, dtype=dtype, device=device)
            b = torch.ones(3, 4, dtype=dtype, device=device)
            ok = torch.mm(a.t(), b, out_dtype=acc).dtype == acc
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _wide_mm[key] = ok
    return _wide_mm[key]


def _accumulate(main_grad: torch.Tensor, g2d: torch.Tensor, a2d: torch.Tensor) -> None:
    """main_grad += g2d^T @ a2d (main_grad [N, K], g2d [M, N], a2d [M, K]).

    Same dtypes: one in-place addmm. An fp32 main_grad from bf16/fp16 operands: the product in
    fp32 (torch.mm with out_dtype, where PyTorch has it), then added, as apex's
    wgrad_gemm_accum_fp32 accumulates; elsewhere the product in the operands' dtype (fp32
    accumulation inside the GEMM, one rounding), as megatron's unfused path adds a 16-bit .grad
    to main_grad."""
    if main_grad.dtype == g2d.dtype:
        main_grad.addmm_(g2d.t(), a2d)
    elif _wide_mm_supported(g2d.device, g2d.dtype, main_grad.dtype):
        main_grad.add_(torch.mm(g2d.t(), a2d, out_dtype=main_grad.dtype))
    else:
        main_grad.add_(g2d.t() @ a2d)


def _weight_grad(ctx, weight: torch.Tensor, g2d: torch.Tensor, a2d: torch.Tensor) -> Optional[torch.Tensor]:
    """d weight = g2d^T @ a2d, [N, K] like the weight: returned, or, when the forward found
    gradient accumulation fusion on and a ``weight.main_grad``, added to that main_grad and
    megatron's placeholder returned. Megatron's DDP adds ``.grad`` into main_grad in a hook
    unless ``weight.grad_added_to_main_grad`` is set; where that attribute exists (DDP made
    it), a placeholder of the weight's shape is returned (zeros when ``weight.zero_out_wgrad``,
    else uninitialised) and the attribute set, so that the hook runs, on the backward thread,
    and adds nothing; without it, None."""
    if not ctx.needs_input_grad[1]:
        return None
    main_grad = ctx.main_grad
    if main_grad is None:
        return g2d.t() @ a2d
    _accumulate(main_grad, g2d, a2d)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    placeholder = make(weight.shape, dtype=weight.dtype, device=weight.device)
    weight.grad_added_to_main_grad = True
    return placeholder


def _main_grad_of(weight: torch.Tensor, accumulate: bool, needs_weight_grad: bool) -> Optional[torch.Tensor]:
    # Taken at forward time and kept on ctx, as megatron does: a layer may be applied more than
    # once per step (shared output layers), and main_grad may be re-pointed between steps.
    if accumulate and needs_weight_grad:
        return getattr(weight, "main_grad", None)
    return None


class _FluxColumnLinear(torch.autograd.Function):
    """``out = all_gather(input, dim 0) @ weight^T (+ bias)``, megatron's sequence-parallel
    column linear, on flux's ops. input ``[s/W, b, K]`` (any shape ``[M_local, ..., K]``),
    weight ``[N/W, K]``, bias ``[N/W]`` or None, out ``[s, b, N/W]``.

    Forward: ``flux.ag_gemm(input, weight, bias, return_gathered=True)``. Backward: d input
    ``= flux.gemm_rs(grad_out, weight, weight_layout="kn")`` (the GEMM and the
    reduce-scatter that megatron overlaps by stream order only, fused), d weight
    ``= grad_out^T @ gathered`` (returned, or added to ``weight.main_grad``), d bias the
    column sums of grad_out.

    The gathered input ``[s, b, K]`` is what the forward saves for d weight, in place of the
    ``[s/W, b, K]`` shard that megatron saves, so that backward needs no second all-gather:
    megatron re-gathers the input in backward, beside its unfused d input GEMM; in flux's backward
    the d input op is itself a GEMM fused with a reduce-scatter, and a re-gather would run
    un-overlapped before or after it, or contend with it for the links. The price is memory: the
    gathered activation is held from forward to backward, W times the shard megatron keeps per
    layer (megatron holds the same gathered tensor too, but transiently, in its global buffer,
    during the forward GEMM and again during backward). A frozen weight saves nothing.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, group, accumulate):
        needs_w = bool(ctx.needs_input_grad[1])
        if needs_w:
            out, gathered = ag_gemm(input, weight, bias, group=group, return_gathered=True)
        else:
            out, gathered = ag_gemm(input, weight, bias, group=group), None
        ctx.save_for_backward(weight, gathered)
        ctx.group, ctx.has_bias = group, bias is not None
        # Kept on ctx, not saved: the same layer may run several times before its backwards.
        ctx.main_grad = _main_grad_of(weight, accumulate, needs_w)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, gathered = ctx.saved_tensors
        n, k = weight.shape
        grad_out = grad_out.to(weight.dtype).contiguous()
        grad_input = grad_bias = None
        if ctx.needs_input_grad[0]:
            # W [N/W, K] read as [K_in = N/W, N_out = K]: the "kn" layout computes grad_out @ W.
            grad_input = gemm_rs(grad_out, weight, group=ctx.group, weight_layout="kn")
        g2d = grad_out.reshape(-1, n)
        grad_weight = _weight_grad(ctx, weight, g2d, gathered.reshape(-1, k)) if gathered is not None else None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g2d.sum(0)
        return grad_input, grad_weight, grad_bias, None, None


class _FluxRowLinear(torch.autograd.Function):
    """``out = reduce_scatter(input @ weight^T, dim 0) (+ bias)``, megatron's
    sequence-parallel row linear, on flux's ops. input ``[s, b, K/W]`` (any shape
    ``[M, ..., K/W]``, M divisible by W), weight ``[N, K/W]``, bias ``[N]`` (replicated, added
    once after the reduction) or None, out ``[s/W, b, N]``.

    Forward: ``flux.gemm_rs(input, weight, bias)``. Backward: d input and the gathered
    grad_out ``[s, b, N]`` from one ``flux.ag_gemm(grad_out, weight, weight_layout="kn",
    return_gathered=True)``, d weight ``= gathered^T @ input`` (returned, or added to
    ``weight.main_grad``), d bias the column sums of this rank's grad_out rows (the rows'
    share: megatron tags the bias ``sequence_parallel`` and sums it over the TP group)."""

    @staticmethod
    def forward(ctx, input, weight, bias, group, accumulate):
        needs_w = bool(ctx.needs_input_grad[1])
        ctx.save_for_backward(input if needs_w else None, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.main_grad = _main_grad_of(weight, accumulate, needs_w)
        return gemm_rs(input, weight, bias, group=group)

    @staticmethod
    def backward(ctx, grad_out):
        input, weight = ctx.saved_tensors
        n, k = weight.shape
        grad_out = grad_out.to(weight.dtype).contiguous()
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # d input = all_gather(grad_out) @ W, W [N, K/W] read as [K_in = N, N_out = K/W].
            grad_input, gathered = ag_gemm(grad_out, weight, group=ctx.group, weight_layout="kn",
                                           return_gathered=True)
        elif ctx.needs_input_grad[1]:
            gathered = all_gather_dim0(grad_out, ctx.group)
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_grad(ctx, weight, gathered.reshape(-1, n), input.reshape(-1, k))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, n).sum(0)
        return grad_input, grad_weight, grad_bias, None, None


# --------------------------------------------------------------------------------------
# The layers


class _FluxLinearMixin:
    """What the two layers share: the constructor's handling of gradient accumulation fusion,
    the run-time checks common to both, and the fallback."""

    def _take_config(self, config) -> None:
        # The parent constructor saw a copy with the option off when apex is missing (see
        # _parent_config); the layer works from the caller's config.
        self.config = config
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if self.gradient_accumulation_fusion and not _apex_wgrad_available() and self._static_reason() is not None:
            raise RuntimeError(
                f"{type(self).__name__} was built with gradient_accumulation_fusion, but flux's path cannot run "
                f"for it ({self._static_reason()}) and megatron's own needs apex's fused_weight_gradient_mlp_cuda, "
                "which is not installed: install apex with --cpp_ext --cuda_ext or turn the option off")

    def _common_reason(self, input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        static = self._static_reason()
        if static is not None:
            return static
        offload = getattr(self.config, "_cpu_offloading_context", None)
        if offload is not None and getattr(offload, "inside_context", False):
            return "CPU activation offloading is active"
        if input_.dim() < 2:
            return "the input has fewer than 2 dimensions"
        if input_.dtype != weight.dtype:
            return f"input dtype {input_.dtype} differs from the weight's {weight.dtype}"
        if bias is not None and bias.dtype != weight.dtype:
            return f"bias dtype {bias.dtype} differs from the weight's {weight.dtype}"
        if input_.device != weight.device:
            return "the input and the weight are on different devices"
        if torch.is_autocast_enabled(input_.device.type):
            return "autocast is enabled"
        if self.gradient_accumulation_fusion and hasattr(weight, "__fsdp_param__"):
            return "a Megatron-FSDP parameter under gradient accumulation fusion"
        return None

    def _fall_back(self, reason: str, weight: Optional[torch.Tensor]) -> None:
        if (self.gradient_accumulation_fusion and not _apex_wgrad_available() and weight is not None
                and weight.requires_grad):
            raise RuntimeError(
                f"{type(self).__name__}: this call would run megatron's own forward ({reason}), whose backward "
                "needs apex's fused_weight_gradient_mlp_cuda under gradient_accumulation_fusion, which is not "
                "installed")
        _log_fallback_once(self, reason)


class FluxColumnParallelLinear(_FluxLinearMixin, ColumnParallelLinear):
    """megatron.core's ColumnParallelLinear (same constructor, parameters and
    ``forward(input_, weight=None, runtime_gather_output=None) -> (output, output_bias)``),
    whose sequence-parallel forward is ``flux.ag_gemm``.

    Under ``config.sequence_parallel``: input ``[s/W, b, in]``, output ``[s, b, out/W]``
    (``[s, b, out]`` with ``gather_output`` or ``runtime_gather_output=True``: megatron's
    all-gather along the last dimension after flux's op), weight ``[out/W, in]``, bias
    ``[out/W]`` added in the op unless ``skip_bias_add`` (then returned as ``output_bias``).
    A ``weight`` given to forward (``skip_weight_param_allocation``, tied output layers) is
    used the same way. Everything else runs ColumnParallelLinear.forward (module docstring).
    """

    def __init__(self, input_size, output_size, *, config, init_method, **kwargs):
        super().__init__(input_size, output_size, config=_parent_config(config), init_method=init_method, **kwargs)
        self._take_config(config)

    def _static_reason(self) -> Optional[str]:
        if not self.sequence_parallel:  # megatron turns it off at a TP size of 1
            return "sequence_parallel is off (flux fuses the sequence-parallel all-gather)"
        if self.explicit_expert_comm:
            return "an expert layer with explicit expert communication"
        if getattr(self, "gtp_remat_size", 1) > 1:
            return "GTP weight rematerialisation"
        if self.config.defer_embedding_wgrad_compute:
            return "deferred embedding wgrad compute"
        return None

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        w = self.weight if weight is None else weight
        bias = self.bias if not self.skip_bias_add else None
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        reason = "no weight (skip_weight_param_allocation) was given" if w is None else \
            self._common_reason(input_, w, bias)
        if (reason is None and gather_output and getattr(self, "use_inference_optimized_all_gather", False)
                and not self.training):
            reason = "gather_output with the inference-optimized all-gather"
        if reason is not None:
            self._fall_back(reason, w)
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if weight is not None and tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, "
                               f"not {(self.output_size_per_partition, self.input_size)} as expected")
        output = _FluxColumnLinear.apply(input_.contiguous(), w, bias, self.tp_group,
                                         bool(self.gradient_accumulation_fusion))
        if gather_output:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class FluxRowParallelLinear(_FluxLinearMixin, RowParallelLinear):
    """megatron.core's RowParallelLinear (same constructor, parameters and
    ``forward(input_) -> (output, output_bias)``), whose sequence-parallel forward is
    ``flux.gemm_rs``.

    Under ``config.sequence_parallel``: input ``[s, b, in/W]``, output ``[s/W, b, out]``, weight
    ``[out, in/W]``, bias ``[out]`` (replicated) added once after the reduce-scatter, in the op,
    unless ``skip_bias_add`` (then returned as ``output_bias``). Everything else runs
    RowParallelLinear.forward (module docstring).
    """

    def __init__(self, input_size, output_size, *, config, init_method, **kwargs):
        super().__init__(input_size, output_size, config=_parent_config(config), init_method=init_method, **kwargs)
        self._take_config(config)

    def _static_reason(self) -> Optional[str]:
        if not self.sequence_parallel:
            return "sequence_parallel is off (flux fuses the sequence-parallel reduce-scatter)"
        if dist.get_world_size(self.tp_group) <= 1:
            return "the tensor-parallel size is 1"
        if self.explicit_expert_comm:
            return "an expert layer with explicit expert communication"
        if getattr(self, "gtp_remat_size", 1) > 1:
            return "GTP weight rematerialisation"
        return None

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        bias = self.bias if not self.skip_bias_add else None
        reason = self._common_reason(input_, self.weight, bias)
        if reason is None and input_.shape[0] % dist.get_world_size(self.tp_group):
            reason = "the input's first dimension is not divisible by the tensor-parallel size"
        if reason is not None:
            self._fall_back(reason, self.weight)
            return super().forward(input_)
        output = _FluxRowLinear.apply(input_.contiguous(), self.weight, bias, self.tp_group,
                                      bool(self.gradient_accumulation_fusion))
        return output, (self.bias if self.skip_bias_add else None)


# --------------------------------------------------------------------------------------
# Norm and layer spec


class SequenceParallelTorchNorm:
    """``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (by ``config.normalization``) for a
    layer that may run under sequence parallelism: megatron-core's WrappedTorchNorm, the local
    spec's norm without apex, refuses ``sequence_parallel``, since under it each rank normalises
    only its rows and the norm's gradients must be summed over the TP group. This builder tags
    the weight (and bias) with ``sequence_parallel = config.sequence_parallel``, as megatron's
    FusedLayerNorm does, which megatron's finalize_model_grads reads to do that sum. Same call
    as WrappedTorchNorm (``config, hidden_size, eps``) and same parameters (``weight``,
    ``bias``); returns the torch module (created in the default dtype, on the CPU, as
    WrappedTorchNorm's)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        for option in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, option, False):
                raise ValueError(f"SequenceParallelTorchNorm: config.{option} is not supported by torch's norms")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"SequenceParallelTorchNorm: normalization {config.normalization!r} is not supported "
                             "(LayerNorm, RMSNorm)")
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


_FLUX_CLASSES = {
    ColumnParallelLinear: FluxColumnParallelLinear,
    RowParallelLinear: FluxRowParallelLinear,
    WrappedTorchNorm: SequenceParallelTorchNorm,
}


# Spec fields whose class megatron checks by identity (MultiLatentAttention accepts only the
# classes it lists for its down projections): kept as megatron's own.
_KEEP_FIELDS = frozenset({"linear_q_down_proj", "linear_kv_down_proj", "linear_qkv_down_proj"})


def _swap_classes(obj, table):
    """``obj`` (a spec tree) with each class that is a key of ``table`` replaced by its value,
    through ModuleSpecs, submodule dataclasses, functools.partial builders (the MLP's, in
    megatron-core 0.19) and lists, tuples and dicts, except in the fields of ``_KEEP_FIELDS``.
    Everything else is kept as is."""
    if isinstance(obj, type):
        return table.get(obj, obj)
    if isinstance(obj, functools.partial):
        return functools.partial(_swap_classes(obj.func, table), *_swap_classes(obj.args, table),
                                 **_swap_classes(obj.keywords, table))
    if dataclasses.is_dataclass(obj):
        changes = {f.name: _swap_classes(getattr(obj, f.name), table) for f in dataclasses.fields(obj)
                   if f.init and f.name not in _KEEP_FIELDS}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap_classes(x, table) for x in obj)
    if isinstance(obj, dict):
        return {k: _swap_classes(v, table) for k, v in obj.items()}
    return obj


def get_gpt_layer_flux_spec(*args, **kwargs) -> ModuleSpec:
    """megatron-core's ``get_gpt_layer_local_spec(*args, **kwargs)`` (a GPT TransformerLayer of
    megatron-core's own modules: no Transformer Engine, unfused DotProductAttention) with
    megatron's ColumnParallelLinear and RowParallelLinear replaced by the flux layers wherever
    the spec uses them (linear_qkv, linear_proj, linear_fc1, linear_fc2; the MLA up projections
    and the MoE experts' linears too, where the experts fall back to megatron's forward; MLA's
    down projections stay megatron's, whose classes MultiLatentAttention checks by identity), and
    WrappedTorchNorm (present without apex) by SequenceParallelTorchNorm. The layers use flux's
    ops when the TransformerConfig has ``sequence_parallel=True`` and a TP size above 1."""
    return _swap_classes(get_gpt_layer_local_spec(*args, **kwargs), _FLUX_CLASSES)


# For Megatron-LM's ``--spec flux.integrations.megatron gpt_layer_flux_spec``: gpt_builders.py
# takes the attribute itself (megatron.core.transformer.spec_utils.import_module) as the
# transformer layer spec, so it is the ModuleSpec, not a function returning one.
gpt_layer_flux_spec = get_gpt_layer_flux_spec()

__all__ = [
    "FluxColumnParallelLinear",
    "FluxRowParallelLinear",
    "SequenceParallelTorchNorm",
    "get_gpt_layer_flux_spec",
    "gpt_layer_flux_spec",
]
