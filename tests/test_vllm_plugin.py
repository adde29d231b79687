"""Tests of flux.integrations.vllm, the vLLM plugin (skipped where vLLM is not installed).

In this process: the plugin's switch (FLUX_VLLM), install/uninstall, discovery through vLLM's
own ``vllm.general_plugins`` entry-point loader (an entry point declared as setup.py declares
it, in a temporary dist-info), the CUDA-graph warm-up warning, and the ImportError without vLLM.

In two gloo processes on the CPU (tests/_dist.py), with vLLM's model-parallel groups made by
vLLM's ``init_distributed_environment`` / ``initialize_model_parallel``: small modules that
leave in the compiled graph what vLLM's sequence-parallelism pass leaves
(``torch.ops.vllm.reduce_scatter`` after a GEMM, ``torch.ops.vllm.all_gather`` before one) are
compiled by Inductor with ``FluxTPPass`` as the post-grad pass. Each case checks the graph
before and after the pass (which nodes became flux ops) and the compiled result against the
same module run eagerly, where vLLM's own collectives run on gloo; a RowParallelLinear bias
(rank 0 only) is refused at compile time on every rank. Then the same through vLLM's
``PostGradPassManager`` as ``install()`` configures it. vLLM's SequenceParallelismPass and
AsyncTPPass cannot be built on a CPU-only machine, and its FixFunctionalizationPass cannot run
there (they need vLLM's CUDA extension): stand-ins of those names take their places.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests need vllm installed (see docs/integrations.md)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flux.integrations.vllm as fv  # noqa: E402
from _dist import REPO_ROOT, batches, case  # noqa: E402

BATCH_TIMEOUT_S = float(os.environ.get("FLUX_TEST_VLLM_TIMEOUT_S", "600"))
WORLD = 2
RS, AG = "vllm.reduce_scatter.default", "vllm.all_gather.default"
FLUX_RS, FLUX_AG = "flux.gemm_rs.default", "flux.ag_gemm.default"
MM, ADDMM = "aten.mm.default", "aten.addmm.default"


# --------------------------------------------------------------------------------------
# In this process


@pytest.fixture
def clean_install(monkeypatch):
    fv.uninstall()
    monkeypatch.delenv(fv.ENV, raising=False)
    yield
    fv.uninstall()


def test_register_is_inert_without_env(clean_install):
    assert fv.register() is False
    assert not fv.is_installed()


def test_register_installs_with_env(clean_install, monkeypatch):
    pm_cls = fv._pass_manager_module().PostGradPassManager
    original = pm_cls.configure
    monkeypatch.setenv(fv.ENV, "1")
    assert fv.register() is True
    assert fv.is_installed() and pm_cls.configure is not original
    fv.install()  # idempotent: one wrapper
    assert getattr(pm_cls.configure, "_flux_vllm_original_configure") is original
    fv.uninstall()
    assert pm_cls.configure is original


def test_vllm_loads_the_entry_point(clean_install, monkeypatch, tmp_path):
    """The entry point as setup.py declares it, found and called by vLLM's plugin loader."""
    import vllm.plugins

    dist_info = tmp_path / "flux_vllm_plugin_test-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: flux-vllm-plugin-test\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text("[vllm.general_plugins]\nflux = flux.integrations.vllm:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(fv.ENV, "1")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    found = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    assert found.get("flux") is fv.register
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert fv.is_installed()


def test_configure_without_parallel_groups_adds_nothing(clean_install):
    from vllm.config import DeviceConfig, VllmConfig

    fv.install()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    manager = fv._pass_manager_module().PostGradPassManager()
    manager.configure(cfg)
    assert "FluxTPPass" not in [type(p).__name__ for p in manager.passes]


def test_warns_when_cuda_graphs_have_no_warmup(caplog):
    from types import SimpleNamespace as NS

    cfg = NS(compilation_config=NS(cudagraph_num_of_warmups=0, cudagraph_mode=NS(name="FULL")),
             model_config=NS(enforce_eager=False))
    with caplog.at_level("WARNING", logger="flux"):
        fv._warn_cudagraph_warmups(cfg)
    assert "cudagraph_num_of_warmups" in caplog.text
    caplog.clear()
    for warmups, mode in ((1, "FULL"), (0, "NONE")):
        cfg.compilation_config.cudagraph_num_of_warmups, cfg.compilation_config.cudagraph_mode.name = warmups, mode
        with caplog.at_level("WARNING", logger="flux"):
            fv._warn_cudagraph_warmups(cfg)
        assert caplog.text == ""


def test_import_without_vllm_names_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "try:\n    import flux.integrations.vllm\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "IMPORTERROR" in res.stdout, res.stdout + res.stderr
    assert "needs vLLM" in res.stdout and "install vllm" in res.stdout


# --------------------------------------------------------------------------------------
# Helpers (run inside the workers)

_STATE = {}


def vllm_config(world):
    """A VllmConfig for the CPU with sequence parallelism on, and vLLM's model-parallel groups
    (TP = the whole gloo world), made once per worker."""
    if "config" not in _STATE:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
        cfg.compilation_config.pass_config.enable_sp = True
        with set_current_vllm_config(cfg):
            init_distributed_environment(world_size=world, rank=dist.get_rank(), local_rank=dist.get_rank(),
                                         backend="gloo")
            initialize_model_parallel(tensor_model_parallel_size=world)
        _STATE["config"] = cfg
    return _STATE["config"]


def flux_pass(world):
    if "pass" not in _STATE:
        _STATE["pass"] = fv.FluxTPPass(vllm_config(world))
    return _STATE["pass"]


def tp():
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def reduce_scatter(t):
    g = tp()
    return torch.ops.vllm.reduce_scatter(t, 0, g.world_size, group_name=g.unique_name)


def all_gather(t):
    g = tp()
    return torch.ops.vllm.all_gather(t, 0, g.world_size, group_name=g.unique_name)


def graph_ops(graph):
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


class StopAfterPass(Exception):
    pass


def compile_with(post_pass, model, dynamic_rows=False, stop_after_pass=False):
    """``model`` compiled by Inductor (full graph) with ``post_pass`` as the post-grad pass;
    returns (compiled, record) where record gets the graph's ops before and after the pass
    and the flux nodes' weight layouts. ``stop_after_pass``: the first call raises
    StopAfterPass once the pass has run (nothing is executed)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomGraphPass

    record = {}

    class Recorder(CustomGraphPass):
        def __call__(self, graph):
            record["before"] = graph_ops(graph)
            post_pass(graph)
            record["after"] = graph_ops(graph)
            record["layouts"] = [n.args[4] for n in graph.nodes
                                 if n.op == "call_function" and str(n.target) in (FLUX_RS, FLUX_AG)]
            if stop_after_pass:
                raise StopAfterPass("stopped after the pass")

        def uuid(self):
            return None

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs,
                          config_patches={"post_grad_custom_post_pass": Recorder(), "force_disable_caches": True})

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False if not dynamic_rows else None)
    return compiled, record


def rows(n, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(dtype)


def check_same(compiled, eager, inputs, what, dynamic_rows=False, atol=1e-5, rtol=1e-5):
    """Compiled and eager results agree on ``inputs`` (a list of argument tuples)."""
    diffs = []
    for args in inputs:
        if dynamic_rows:
            for a in args:
                torch._dynamo.mark_dynamic(a, 0)
        got, want = compiled(*args), eager(*args)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
        diffs.append(float((got.float() - want.float()).abs().max()))
    return max(diffs)


def assert_rewritten(record, removed, added):
    before, after = record["before"], record["after"]
    for op, count in removed.items():
        assert before.count(op) == count, f"before the pass: {count} x {op} expected, graph has {before}"
        assert op not in after, f"{op} left after the pass: {after}"
    for op, count in added.items():
        assert after.count(op) == count, f"after the pass: {count} x {op} expected, graph has {after}"


class RowParallel(torch.nn.Module):
    """``reduce_scatter(x @ W^T (+ b))``: vLLM's RowParallelLinear under sequence parallelism,
    the bias only on TP rank 0 as vLLM adds it."""

    def __init__(self, n, k, seed, bias_on_rank0=False, dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(rows(n, k, seed, dtype) * 0.1, requires_grad=False)
        has_bias = bias_on_rank0 and tp().rank_in_group == 0
        self.bias = torch.nn.Parameter(rows(1, n, seed + 1, dtype)[0], requires_grad=False) if has_bias else None

    def forward(self, x):
        return reduce_scatter(F.linear(x, self.weight, self.bias))


class ColumnParallel(torch.nn.Module):
    """``all_gather(x) @ W^T (+ b)``: vLLM's ColumnParallelLinear under sequence parallelism."""

    def __init__(self, n, k, seed, bias=False):
        super().__init__()
        self.weight = torch.nn.Parameter(rows(n, k, seed) * 0.1, requires_grad=False)
        self.bias = torch.nn.Parameter(rows(1, n, seed + 1)[0], requires_grad=False) if bias else None

    def forward(self, x):
        return F.linear(all_gather(x), self.weight, self.bias)


class RowParallelKN(torch.nn.Module):
    """A GEMM whose [K, N] operand is a contiguous tensor: flux's weight_layout 'kn'."""

    def __init__(self, k, n, seed):
        super().__init__()
        self.b = torch.nn.Parameter(rows(k, n, seed) * 0.1, requires_grad=False)

    def forward(self, x):
        return reduce_scatter(torch.mm(x, self.b))


class SharedGather(torch.nn.Module):
    """The gathered tensor is read by the GEMM and by something else: left as it is."""

    def __init__(self, n, k, seed):
        super().__init__()
        self.weight = torch.nn.Parameter(rows(n, k, seed) * 0.1, requires_grad=False)

    def forward(self, x):
        g = all_gather(x)
        return F.linear(g, self.weight) + g.sum(-1, keepdim=True)


class SequenceParallelBlock(torch.nn.Module):
    """What vLLM's sequence-parallelism pass makes of a decoder layer's tail: the attention
    output's o_proj reduce-scattered, RMSNorm on this rank's rows, the MLP's input all-gathered
    into gate_up_proj, SiLU-and-mul, down_proj reduce-scattered, the residual added."""

    def __init__(self, hidden, head_dim_local, inter_local, seed):
        super().__init__()
        self.o_proj = torch.nn.Parameter(rows(hidden, head_dim_local, seed) * 0.1, requires_grad=False)
        self.norm = torch.nn.Parameter(1 + 0.1 * rows(1, hidden, seed + 1)[0], requires_grad=False)
        self.gate_up = torch.nn.Parameter(rows(2 * inter_local, hidden, seed + 2) * 0.1, requires_grad=False)
        self.down = torch.nn.Parameter(rows(hidden, inter_local, seed + 3) * 0.1, requires_grad=False)
        self.inter = inter_local

    def forward(self, attn_out):
        h = reduce_scatter(F.linear(attn_out, self.o_proj))
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        gate_up = F.linear(all_gather(normed), self.gate_up)
        act = F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
        return reduce_scatter(F.linear(act, self.down)) + h


def _summary(record, diff):
    return {"before": record["before"], "after": record["after"], "layouts": record.get("layouts"), "diff": diff}


# --------------------------------------------------------------------------------------
# Cases (each runs in both worker processes)


@case("vllm-mm-reduce_scatter", worlds=(WORLD,))
def case_mm_rs(rank, world):
    p = flux_pass(world)
    model = RowParallel(24, 16, seed=10 + rank)
    compiled, record = compile_with(p, model)
    diff = check_same(compiled, model, [(rows(8, 16, 100 + rank),)], "mm->reduce_scatter")
    assert_rewritten(record, {RS: 1, MM: 1}, {FLUX_RS: 1})
    assert p.matched_count == 1 and record["layouts"] == ["nk"]
    return _summary(record, diff)


@case("vllm-mm-reduce_scatter-bf16", worlds=(WORLD,))
def case_mm_rs_bf16(rank, world):
    model = RowParallel(24, 16, seed=10 + rank, dtype=torch.bfloat16)
    compiled, record = compile_with(flux_pass(world), model)
    diff = check_same(compiled, model, [(rows(8, 16, 100 + rank, torch.bfloat16),)], "bf16", atol=2e-2, rtol=2e-2)
    assert_rewritten(record, {RS: 1, MM: 1}, {FLUX_RS: 1})
    return _summary(record, diff)


@case("vllm-rank0-bias-refused", worlds=(WORLD,))
def case_rank0_bias(rank, world):
    """vLLM's RowParallelLinear bias is in rank 0's graph only: every rank's compilation stops
    with the reason (the ranks compare what their graphs would call before any runs). Compiled,
    not run."""
    model = RowParallel(24, 16, seed=10 + rank, bias_on_rank0=True)
    compiled, record = compile_with(flux_pass(world), model, stop_after_pass=True)
    try:
        compiled(rows(8, 16, 100 + rank))
    except Exception as e:  # noqa: BLE001  (inspected below)
        error = str(e)
    else:
        raise AssertionError("compilation went on to run the graph")
    assert "with a bias" in error and "rank(s) [0]" in error and fv.ENV in error, error
    assert "after" not in record
    return {"error": error.splitlines()[0][:300]}


@case("vllm-all_gather-mm", worlds=(WORLD,))
def case_ag_mm(rank, world):
    model = ColumnParallel(12, 16, seed=20 + rank)
    compiled, record = compile_with(flux_pass(world), model)
    diff = check_same(compiled, model, [(rows(4, 16, 200 + rank),)], "all_gather->mm")
    assert_rewritten(record, {AG: 1, MM: 1}, {FLUX_AG: 1})
    assert record["layouts"] == ["nk"]
    return _summary(record, diff)


@case("vllm-all_gather-addmm", worlds=(WORLD,))
def case_ag_addmm(rank, world):
    model = ColumnParallel(12, 16, seed=20 + rank, bias=True)
    compiled, record = compile_with(flux_pass(world), model)
    diff = check_same(compiled, model, [(rows(4, 16, 200 + rank),)], "all_gather->addmm")
    assert_rewritten(record, {AG: 1, ADDMM: 1}, {FLUX_AG: 1})
    return _summary(record, diff)


@case("vllm-kn-layout", worlds=(WORLD,))
def case_kn(rank, world):
    model = RowParallelKN(16, 24, seed=30 + rank)
    compiled, record = compile_with(flux_pass(world), model)
    diff = check_same(compiled, model, [(rows(8, 16, 300 + rank),)], "kn layout")
    assert_rewritten(record, {RS: 1, MM: 1}, {FLUX_RS: 1})
    assert record["layouts"] == ["kn"]
    return _summary(record, diff)


@case("vllm-shared-gather-untouched", worlds=(WORLD,))
def case_shared(rank, world):
    p = flux_pass(world)
    model = SharedGather(12, 16, seed=40 + rank)
    compiled, record = compile_with(p, model)
    diff = check_same(compiled, model, [(rows(4, 16, 400 + rank),)], "shared gather")
    assert record["after"] == record["before"] and AG in record["after"]
    assert p.matched_count == 0
    return _summary(record, diff)


@case("vllm-sequence-parallel-block-dynamic", worlds=(WORLD,))
def case_block(rank, world):
    p = flux_pass(world)
    model = SequenceParallelBlock(hidden=32, head_dim_local=16, inter_local=24, seed=50 + rank)
    compiled, record = compile_with(p, model, dynamic_rows=True)
    inputs = [(rows(t, 16, 500 + rank + t),) for t in (8, 12, 20)]
    diff = check_same(compiled, model, inputs, "sequence-parallel block", dynamic_rows=True)
    assert_rewritten(record, {RS: 2, AG: 1, MM: 3}, {FLUX_RS: 2, FLUX_AG: 1})
    assert p.matched_count == 3
    return _summary(record, diff)


class _StandIn:
    """Takes the place of a vLLM pass that cannot be built without vLLM's CUDA extension."""

    def __init__(self, config):
        pass

    def __call__(self, graph):
        pass

    def uuid(self):
        return type(self).__name__

    def is_applicable_for_range(self, compile_range):
        return True


@case("vllm-pass-manager", worlds=(WORLD,))
def case_manager(rank, world):
    """install(), then vLLM's own PostGradPassManager configured and run as vLLM runs it."""
    from vllm.compilation.passes.inductor_pass import InductorPass, pass_context
    from vllm.config.utils import Range

    cfg = vllm_config(world)
    pm_mod = fv._pass_manager_module()
    stand_ins = {name: type(name, (_StandIn, InductorPass), {}) for name in ("SequenceParallelismPass", "AsyncTPPass")}
    saved = {name: getattr(pm_mod, name, None) for name in stand_ins}
    pass_config = cfg.compilation_config.pass_config
    fv.install()
    try:
        for name, cls in stand_ins.items():
            setattr(pm_mod, name, cls)
        pass_config.fuse_gemm_comms = True
        with_async = pm_mod.PostGradPassManager()
        with_async.configure(cfg)
        pass_config.fuse_gemm_comms = False
        without_async = pm_mod.PostGradPassManager()
        without_async.configure(cfg)
        pass_config.enable_sp = False
        sp_off = pm_mod.PostGradPassManager()
        sp_off.configure(cfg)
    finally:
        pass_config.enable_sp, pass_config.fuse_gemm_comms = True, False
        for name, value in saved.items():
            if value is None:
                delattr(pm_mod, name)
            else:
                setattr(pm_mod, name, value)
        fv.uninstall()
    names = [type(p).__name__ for p in with_async.passes]
    assert names == ["NoOpEliminationPass", "SequenceParallelismPass", "FluxTPPass", "AsyncTPPass"], names
    names = [type(p).__name__ for p in without_async.passes]
    assert names == ["NoOpEliminationPass", "SequenceParallelismPass", "FluxTPPass"], names
    assert "FluxTPPass" not in [type(p).__name__ for p in sp_off.passes]
    assert fv.add_to_pass_manager(without_async, cfg) is None  # one flux pass per manager

    # vLLM's manager (its no-op elimination, cleanup, IR lowering and clone elimination passes
    # included) as the post-grad pass of a compilation, under the pass context vLLM's backend
    # sets. Its last pass, FixFunctionalizationPass, reads vLLM's CUDA extension ops on every
    # call: a stand-in takes its place here.
    without_async.fix_functionalization = stand_ins["SequenceParallelismPass"](cfg)
    model = SequenceParallelBlock(hidden=32, head_dim_local=16, inter_local=24, seed=70 + rank)
    compiled, record = compile_with(without_async, model, dynamic_rows=True)
    inputs = [(rows(t, 16, 700 + rank + t),) for t in (8, 16)]
    with pass_context(Range(start=1, end=1 << 16)):
        diff = check_same(compiled, model, inputs, "through PostGradPassManager", dynamic_rows=True)
    assert_rewritten(record, {RS: 2, AG: 1, MM: 3}, {FLUX_RS: 2, FLUX_AG: 1})
    return _summary(record, diff)


# --------------------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def vllm_batch(tmp_path_factory):
    return batches(__file__, "vllm-", tmp_path_factory, timeout_s=BATCH_TIMEOUT_S)(WORLD)


@pytest.mark.parametrize("name", [
    "vllm-mm-reduce_scatter",
    "vllm-mm-reduce_scatter-bf16",
    "vllm-rank0-bias-refused",
    "vllm-all_gather-mm",
    "vllm-all_gather-addmm",
    "vllm-kn-layout",
    "vllm-shared-gather-untouched",
    "vllm-sequence-parallel-block-dynamic",
    "vllm-pass-manager",
])
def test_flux_tp_pass(vllm_batch, name):
    values = vllm_batch.assert_ok(name)
    assert len(values) == WORLD
