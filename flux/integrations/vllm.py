"""A vLLM plugin that fuses vLLM's sequence-parallel GEMMs and collectives into flux's ops.

vLLM's sequence-parallelism pass turns the ``all_reduce`` after a row-parallel GEMM into
``reduce_scatter -> RMSNorm -> all_gather``, leaving in the compiled (post-grad) graph::

    r = vllm.reduce_scatter(mm(x, B), dim=0, W, tp)      after o_proj / down_proj
    y = mm(vllm.all_gather(h, dim=0, W, tp), B)           before qkv_proj / gate_up_proj

``FluxTPPass`` (a vLLM pattern-matcher pass, built as vLLM's own ``AsyncTPPass`` is) replaces
them with ``flux.gemm_rs(x, weight, None, group, "nk", None)`` and ``flux.ag_gemm(h, weight,
bias, group, "nk", None, False)[0]``, ``group`` being vLLM's tensor-parallel device group.

The plugin is inert unless ``FLUX_VLLM=1`` is set in the environment of the vLLM processes
(vLLM loads every installed general plugin in every process)::

    FLUX_VLLM=1 vllm serve MODEL --tensor-parallel-size 4 -O '{"pass_config": {"enable_sp": true}}'

``register()`` (the ``vllm.general_plugins`` entry point) then adds a ``FluxTPPass`` to every
post-grad pass manager vLLM configures; ``install()`` / ``uninstall()`` do the same from Python
in one process. A bias before the reduce-scatter (vLLM adds it on TP rank 0 only) cannot be
fused: the ranks compare, at compile time, the collectives their graphs will call and raise
alike where they differ. Where the pass goes, what it leaves alone, the CUDA-graph warm-up it
needs and the vLLM versions it was written against: docs/integrations.md.
Importing this module needs vLLM installed; ``import flux`` never imports it.
"""
import functools
import hashlib
import importlib
import importlib.util
import logging
import sys
import zlib
from typing import Any, Callable, List, Optional, Tuple

import torch


def _vllm_missing() -> bool:
    if "vllm" in sys.modules:
        return sys.modules["vllm"] is None
    return importlib.util.find_spec("vllm") is None


if _vllm_missing():
    raise ImportError(
        "flux.integrations.vllm needs vLLM, which is not installed: install vllm (this plugin is "
        "written against vllm 0.31.0 with torch 2.13) to use flux's vLLM pass")

# FluxTPPass is a module attribute too, made at first access (it subclasses a vLLM class).
__all__ = ["ENV", "add_to_pass_manager", "install", "is_installed", "register", "uninstall"]

ENV = "FLUX_VLLM"
"""Environment variable that turns the plugin on: ``1`` (also ``true``, ``yes``, ``on``)."""

_log = logging.getLogger("flux")
_PASS_NAME = "FluxTPPass"
_WRAPPED = "_flux_vllm_original_configure"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _env_enabled() -> bool:
    from flux import envs

    return envs.VLLM.get()


def _import_first(*names: str):
    """The first of the modules ``names`` that imports (vLLM moved its compilation modules
    between releases)."""
    error = None
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise  # a module that exists failed inside: not a layout question
            error = e
    raise ImportError(f"flux.integrations.vllm: none of {list(names)} is in the installed vLLM") from error


def _pass_manager_module():
    return _import_first("vllm.compilation.passes.pass_manager", "vllm.compilation.pass_manager")


# --------------------------------------------------------------------------------------
# Patterns


def _flux_weight(b: torch.Tensor) -> Tuple[torch.Tensor, str]:
    """flux's (weight, weight_layout) for the GEMM's [K, N] operand ``b``: its [N, K] transpose
    when that is contiguous (the usual ``permute`` of an nn.Linear weight), else ``b`` itself."""
    if b.t().is_contiguous():
        return b.t(), "nk"
    return b, "kn"


def _value(node: Any) -> Any:
    return node.meta.get("val") if hasattr(node, "meta") else node


def _static(n: Any) -> Optional[int]:
    """``n`` where it is a plain int; None for a symbolic size (reading its value would
    specialise the compiled graph to it)."""
    return n if isinstance(n, int) else None


def _operands_ok(match, world: int, scatter: bool) -> bool:
    """Whether flux takes the matched GEMM: 2-D operands of one supported dtype, the [K, N]
    operand contiguous in one of the two layouts, a 1-D bias of N, rows divisible by the
    group for a reduce-scatter. Ranks see the same graph, so they decide alike."""
    x, b = _value(match.kwargs.get("x")), _value(match.kwargs.get("w"))
    bias = _value(match.kwargs["bias"]) if "bias" in match.kwargs else None
    if not isinstance(x, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if x.dim() != 2 or b.dim() != 2 or x.dtype not in _DTYPES or b.dtype != x.dtype:
        return False
    if not (b.t().is_contiguous() or b.is_contiguous()):
        return False
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.dtype != x.dtype:
            return False
        if _static(bias.shape[0]) != _static(b.shape[1]):
            return False
    if scatter:
        rows = _static(x.shape[0])
        if rows is not None and rows % world:
            return False
    return True


def _register_patterns(pm_pass, world: int, vllm_group: str, group_name: str, dtype: torch.dtype,
                       device) -> List[str]:
    """Register the three rewrites with ``pm_pass`` (call under vLLM's fake mode); returns their
    names. ``vllm_group`` is vLLM's name of the TP group (its collectives' argument),
    ``group_name`` the torch process group's name (flux's)."""
    import torch._inductor.pattern_matcher as pm

    aten, vllm_ops = torch.ops.aten, torch.ops.vllm

    def reduce_scatter(t):
        return vllm_ops.reduce_scatter.default(t, dim=0, world_size=world, group_name=vllm_group)

    def all_gather(t):
        return vllm_ops.all_gather.default(t, dim=0, world_size=world, group_name=vllm_group)

    def gemm_rs(x, w):
        weight, layout = _flux_weight(w)
        return torch.ops.flux.gemm_rs.default(x.contiguous(), weight, None, group_name, layout, None)

    def ag_gemm(x, w, bias):
        weight, layout = _flux_weight(w)
        out, _ = torch.ops.flux.ag_gemm.default(x.contiguous(), weight, bias, group_name, layout, None, False)
        return out

    def mm_rs(x, w):
        return reduce_scatter(aten.mm.default(x, w))

    def mm_rs_flux(x, w):
        return gemm_rs(x, w)

    def ag_mm(x, w):
        return aten.mm.default(all_gather(x), w)

    def ag_mm_flux(x, w):
        return ag_gemm(x, w, None)

    def ag_addmm(bias, x, w):
        return aten.addmm.default(bias, all_gather(x), w)

    def ag_addmm_flux(bias, x, w):
        return ag_gemm(x, w, bias.contiguous())

    def check(scatter: bool) -> Callable:
        return lambda match: _operands_ok(match, world, scatter)

    m, k, n = 4 * world, 8, 16

    def empty(*shape):
        return torch.empty(*shape, dtype=dtype, device=device)

    rows = empty(m, k)            # the GEMM's rows before a reduce-scatter
    shard = empty(m // world, k)  # one rank's rows before an all-gather
    b_op, bias = empty(k, n), empty(n)
    entries = [
        ("mm->reduce_scatter", mm_rs, mm_rs_flux, [rows, b_op], True),
        ("all_gather->mm", ag_mm, ag_mm_flux, [shard, b_op], False),
        ("all_gather->addmm", ag_addmm, ag_addmm_flux, [bias, shard, b_op], False),
    ]
    for _, pattern, replacement, inputs, scatter in entries:
        pm.register_replacement(pattern, replacement, inputs, pm.fwd_only, pm_pass, extra_check=check(scatter))
    return [e[0] for e in entries]


def _bias_before_scatter(graph: torch.fx.Graph, vllm_group: str) -> Optional[str]:
    """A description of the first GEMM with a bias (addmm, or an add after mm) that feeds a
    reduce-scatter on the TP group, or None."""
    scatter, addmm = torch.ops.vllm.reduce_scatter.default, torch.ops.aten.addmm.default
    add, mm = torch.ops.aten.add.Tensor, torch.ops.aten.mm.default
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not scatter:
            continue
        src = node.args[0] if node.args else node.kwargs.get("tensor")
        group = node.args[3] if len(node.args) > 3 else node.kwargs.get("group_name")
        if group != vllm_group or getattr(src, "op", None) != "call_function":
            continue
        if src.target is addmm or (src.target is add and any(getattr(a, "target", None) is mm for a in src.args)):
            return f"{src.name} -> {node.name} on vLLM group {group!r}"
    return None


def _collective_sequence(graph: torch.fx.Graph, vllm_group: str) -> str:
    """The graph's TP collectives in order, vLLM's and flux's (what the ranks must agree on)."""
    vllm_ops = {torch.ops.vllm.reduce_scatter.default: "reduce_scatter", torch.ops.vllm.all_gather.default: "all_gather"}
    flux_ops = {torch.ops.flux.gemm_rs.default: "flux.gemm_rs", torch.ops.flux.ag_gemm.default: "flux.ag_gemm"}
    seq = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in vllm_ops:
            group = node.args[3] if len(node.args) > 3 else node.kwargs.get("group_name")
            if group == vllm_group:
                seq.append(vllm_ops[node.target])
        elif node.target in flux_ops:
            seq.append(flux_ops[node.target])
    return ",".join(seq)


def _agree_across_ranks(code: int, cpu_group) -> list:
    """Every TP rank's ``code`` (an int64), through vLLM's TP CPU group: the ranks compile the same
    sequence of graphs, so each rank's pass makes this call at the same point."""
    import torch.distributed as dist

    mine = torch.tensor([code], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(cpu_group))]
    dist.all_gather(every, mine, group=cpu_group)
    return [int(t.item()) for t in every]


_REFUSED = -1  # a rank's code when its graph has a GEMM with a bias before a reduce-scatter


def _check_agreement(codes: list, bias: Optional[str]) -> None:
    """Raise, on every rank alike, when some rank refused its graph or the ranks' rewritten graphs
    would make different collective calls (which would hang them)."""
    if _REFUSED in codes:
        where = f" ({bias})" if bias else ""
        raise RuntimeError(
            f"flux.integrations.vllm: TP rank(s) {[r for r, c in enumerate(codes) if c == _REFUSED]} reduce-scatter a "
            f"GEMM with a bias{where}. vLLM adds a RowParallelLinear bias on tensor-parallel rank 0 only, so that "
            f"rank's GEMM cannot become flux.gemm_rs while its peers' would, and the ranks would wait on different "
            f"collectives. flux's vLLM pass does not support this model: unset {ENV}.")
    if len(set(codes)) > 1:
        raise RuntimeError(
            f"flux.integrations.vllm: the TP ranks' graphs would make different collective calls after flux's "
            f"rewrite (hashes per rank {codes}); refusing rather than hanging. Unset {ENV} for this model.")


# --------------------------------------------------------------------------------------
# The pass (a vLLM class, defined at first use)


@functools.lru_cache(maxsize=None)
def _pass_class():
    base_mod = _import_first("vllm.compilation.passes.vllm_inductor_pass", "vllm.compilation.vllm_inductor_pass")
    ind_mod = _import_first("vllm.compilation.passes.inductor_pass", "vllm.compilation.inductor_pass")
    VllmInductorPass = base_mod.VllmInductorPass
    base = getattr(base_mod, "VllmPatternMatcherPass", VllmInductorPass)
    timed = getattr(VllmInductorPass, "time_and_log", lambda fn: fn)
    fake_mode = getattr(ind_mod, "enable_fake_mode", lambda fn: fn)

    class FluxTPPass(base):
        """vLLM post-grad pass: ``mm -> vllm.reduce_scatter`` into ``flux.gemm_rs`` and
        ``vllm.all_gather -> mm`` into ``flux.ag_gemm`` on vLLM's tensor-parallel group (see
        the module's documentation). Needs vLLM's model-parallel groups to exist; the count of
        rewrites of the last call is ``matched_count``."""

        @fake_mode
        def __init__(self, config) -> None:
            super().__init__(config)
            from torch._inductor.pattern_matcher import PatternMatcherPass
            from vllm.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
            self.pass_name = _PASS_NAME
            self.world_size = tp.world_size
            self.vllm_group_name = tp.unique_name
            self.group_name = tp.device_group.group_name
            self.cpu_group = tp.cpu_group
            self.matched_count = 0
            self.pm_pass = PatternMatcherPass(pass_name=self.pass_name)
            device = getattr(self, "device", None) or "cpu"
            dtype = getattr(self, "model_dtype", None)
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
            self.pattern_names = _register_patterns(self.pm_pass, self.world_size, self.vllm_group_name,
                                                    self.group_name, dtype, device)
            if hasattr(self, "dump_patterns"):
                self.dump_patterns(config, self.pm_pass)

        @timed
        def __call__(self, graph: torch.fx.Graph) -> None:
            # Rewrite, then make sure every TP rank's graph calls the same collectives in the same
            # order (vLLM's graphs may differ between ranks: a row-parallel bias on rank 0 only),
            # raising on every rank at compile time instead of hanging at run time.
            bias = _bias_before_scatter(graph, self.vllm_group_name)
            self.matched_count = 0 if bias else self.pm_pass.apply(graph)
            seq = _collective_sequence(graph, self.vllm_group_name)
            code = _REFUSED if bias else zlib.crc32(seq.encode())
            _check_agreement(_agree_across_ranks(code, self.cpu_group), bias)
            table = getattr(base, "match_table", None)
            if table is not None:
                table[self.pass_name] += self.matched_count
            _log.debug("flux: %s rewrote %d GEMM+collective patterns", self.pass_name, self.matched_count)

        def uuid(self) -> str:
            # Inductor's cache key: this module's code and the group the patterns name.
            h = hashlib.sha256()
            with open(__file__, "rb") as f:
                h.update(f.read())
            h.update(repr((self.world_size, self.vllm_group_name, self.group_name)).encode())
            return h.hexdigest()

    FluxTPPass.__module__ = __name__
    FluxTPPass.__qualname__ = "FluxTPPass"
    return FluxTPPass


def __getattr__(name: str):
    if name == "FluxTPPass":
        return _pass_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------
# Installation into vLLM's pass manager


def _sequence_parallel_off(pass_config) -> bool:
    """True where this vLLM's PassConfig has a sequence-parallelism switch and it is off."""
    for field in ("enable_sp", "enable_sequence_parallelism"):
        if hasattr(pass_config, field):
            return not getattr(pass_config, field)
    return False


def _warn_cudagraph_warmups(config) -> None:
    cc = getattr(config, "compilation_config", None)
    if cc is None or getattr(cc, "cudagraph_num_of_warmups", 1) >= 1:
        return
    mode = getattr(cc, "cudagraph_mode", None)
    enforce_eager = getattr(getattr(config, "model_config", None), "enforce_eager", False)
    if enforce_eager or mode is None or str(getattr(mode, "name", mode)).upper() == "NONE":
        return
    _log.warning("flux: CUDA graphs are on with compilation_config.cudagraph_num_of_warmups=0; flux plans "
                 "each problem at its first call, which cannot be inside a capture: set "
                 "cudagraph_num_of_warmups=1 (or --enforce-eager)")


def add_to_pass_manager(manager, config):
    """Add a ``FluxTPPass`` for ``config`` to vLLM's configured post-grad pass ``manager``:
    before ``AsyncTPPass`` if it is there, else after ``SequenceParallelismPass``, else after
    ``NoOpEliminationPass`` (or first). Returns the pass, or None where it does not apply (no
    model-parallel groups yet, a TP size of 1, sequence parallelism off) or is already there."""
    from vllm.distributed import parallel_state

    passes = manager.passes
    if any(type(p).__name__ == _PASS_NAME for p in passes):
        return None
    if not parallel_state.model_parallel_is_initialized():
        _log.debug("flux: vLLM's model-parallel groups do not exist; no FluxTPPass")
        return None
    if parallel_state.get_tp_group().world_size < 2:
        return None
    pass_config = getattr(getattr(config, "compilation_config", None), "pass_config", None)
    if pass_config is not None and _sequence_parallel_off(pass_config):
        _log.info("flux: %s=1 but vLLM's sequence parallelism is off (pass_config.enable_sp): the graphs "
                  "have no reduce-scatter or all-gather for flux to fuse", ENV)
        return None
    flux_pass = _pass_class()(config)
    names = [type(p).__name__ for p in passes]
    if "AsyncTPPass" in names:
        at = names.index("AsyncTPPass")
    elif "SequenceParallelismPass" in names:
        at = len(names) - names[::-1].index("SequenceParallelismPass")
    elif names and names[0] == "NoOpEliminationPass":
        at = 1
    else:
        at = 0
    passes.insert(at, flux_pass)
    _log.info("flux: FluxTPPass added to vLLM's post-grad passes (TP size %d, group %s)", flux_pass.world_size,
              flux_pass.vllm_group_name)
    _warn_cudagraph_warmups(config)
    return flux_pass


def is_installed() -> bool:
    """Whether vLLM's PostGradPassManager.configure currently adds the flux pass."""
    cls = _pass_manager_module().PostGradPassManager
    return hasattr(cls.configure, _WRAPPED)


def install() -> None:
    """Make every vLLM post-grad pass manager configured in this process add a ``FluxTPPass``
    (``add_to_pass_manager``). Idempotent; ``uninstall()`` undoes it."""
    cls = _pass_manager_module().PostGradPassManager
    if hasattr(cls.configure, _WRAPPED):
        return
    original = cls.configure

    @functools.wraps(original)
    def configure(self, config, *args, **kwargs):
        result = original(self, config, *args, **kwargs)
        add_to_pass_manager(self, config)
        return result

    setattr(configure, _WRAPPED, original)
    cls.configure = configure


def uninstall() -> None:
    """Undo ``install()``: pass managers configured afterwards get no flux pass."""
    cls = _pass_manager_module().PostGradPassManager
    original = getattr(cls.configure, _WRAPPED, None)
    if original is not None:
        cls.configure = original


def register() -> bool:
    """The ``vllm.general_plugins`` entry point, called by vLLM in each of its processes:
    ``install()`` when ``FLUX_VLLM=1``, nothing otherwise. Returns whether it installed."""
    if not _env_enabled():
        _log.debug("flux: vLLM plugin loaded but %s is not 1: vLLM's compilation is left as it is", ENV)
        return False
    install()
    return True
