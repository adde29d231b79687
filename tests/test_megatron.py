"""flux.integrations.megatron against megatron-core's own layers, in gloo processes on the CPU
(tests/_dist.py), tensor-parallel size 2, sequence parallelism on unless said otherwise.

megatron-core's sequence-parallel code allocates on ``torch.cuda.current_device()`` (its
linear layers' all-gather buffer and reduce-scattered input gradient, the global memory buffer,
the mappings' gathers), and DotProductAttention makes its default causal mask on "cuda"; apart
from that it runs on gloo. The cases therefore point ``torch.cuda.current_device`` at the CPU
while they run (``_on_cpu``) and pass the attention mask explicitly, and compare with the stock
megatron layers themselves, not with a hand-written reference:

- megatron-pair*: FluxColumnParallelLinear -> GELU -> FluxRowParallelLinear against megatron's
  ColumnParallelLinear -> GELU -> RowParallelLinear with the same weights (random biases too),
  float32: the output rows, the input gradient and every parameter gradient, with and without
  skip_bias_add; flux's ops made the calls (2 ag_gemm, 2 gemm_rs), nothing fell back;
- megatron-gather-output: the column layer with gather_output / runtime_gather_output;
- megatron-main-grad: gradient_accumulation_fusion (which megatron's own layers refuse without
  apex, flux's accept): the weight gradients added to fp32 ``main_grad`` over two steps, the
  placeholder gradients and ``grad_added_to_main_grad`` as megatron's DDP expects them (zeros
  under ``zero_out_wgrad``, None without the DDP attribute); where flux's path cannot run, the
  option is refused;
- megatron-frozen: frozen weights (megatron's linear_with_frozen_weight) against flux's path
  (the column bias's gradient, which megatron's frozen path drops, against trainable weights);
- megatron-fallback: sequence parallelism off: megatron's forward, the reason logged once per
  class;
- megatron-layer-*: a GPT TransformerLayer from flux's spec against one from megatron's local
  spec (its torch norms as flux's spec has them: megatron's WrappedTorchNorm refuses sequence
  parallelism), in float32 and bfloat16 (tests/gpu_megatron_worker.py's compare_layers, the
  code the GPU test runs with NCCL).

The whole module is skipped when megatron-core is not installed.
"""
import functools
import json
import logging
import os
import subprocess
import sys
from unittest import mock

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _dist import REPO_ROOT, TESTS_DIR, batches, case  # noqa: E402

H, FFN, ROWS, B = 16, 32, 4, 3  # hidden, FFN width, sequence rows per rank, batch
TIGHT = dict(rtol=1e-6, atol=1e-6)


def _on_cpu():
    """megatron-core's CUDA allocations (torch.cuda.current_device()) made on the CPU."""
    return mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu"))


def mcase(name):
    """A world-2 case run with megatron's parallel state set up and its allocations on the CPU."""

    def deco(fn):
        @functools.wraps(fn)
        def run(rank, world):
            import gpu_megatron_worker

            gpu_megatron_worker.setup_megatron(world)
            with _on_cpu():
                return fn(rank, world)

        return case(name, worlds=(2,))(run)

    return deco


def _config(world, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                tensor_model_parallel_size=world, sequence_parallel=True, use_cpu_initialization=True,
                params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _pair(config, flux, skip_bias_add=False, gather_output=False):
    """(column H -> FFN, row FFN -> H), flux's or megatron's, in a ModuleDict."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    import flux.integrations.megatron as fm

    col_cls, row_cls = ((fm.FluxColumnParallelLinear, fm.FluxRowParallelLinear) if flux
                        else (ColumnParallelLinear, RowParallelLinear))
    init = torch.nn.init.normal_
    return torch.nn.ModuleDict(dict(
        col=col_cls(H, FFN, config=config, init_method=init, bias=True, gather_output=gather_output,
                    skip_bias_add=skip_bias_add),
        row=row_cls(FFN, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                    skip_bias_add=skip_bias_add)))


def _randomize(module, seed=7):
    """Weights N(0, 1/fan_in) and biases N(0, 0.25), alike on every rank (the row bias is
    replicated); megatron zeroes biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            v = torch.randn(tuple(p.shape), generator=gen)
            p.copy_(0.5 * v if name.endswith("bias") else v / FFN ** 0.5)


def _rows(rank, world, *shape, seed):
    """This rank's rows of a [ROWS * world, *shape] tensor drawn alike on every rank."""
    full = torch.randn(ROWS * world, *shape, generator=torch.Generator().manual_seed(seed))
    return full[rank * ROWS:(rank + 1) * ROWS].contiguous()


def _run_pair(pair, x, g):
    """column -> GELU -> row on x, output bias added where skip_bias_add returned it; backward
    with output gradient g. Returns (output, d x)."""
    xi = x.clone().requires_grad_()
    y, b = pair["col"](xi)
    if b is not None:
        y = y + b
    z, b2 = pair["row"](F.gelu(y))
    if b2 is not None:
        z = z + b2
    z.backward(g)
    return z.detach(), xi.grad


def _close(a, b, what, **tol):
    torch.testing.assert_close(a, b, **(tol or TIGHT), msg=lambda m: f"{what}: {m}")


def _stock_and_flux(world, config=None, flux_config=None, **kw):
    stock = _pair(config or _config(world), flux=False, **kw)
    _randomize(stock)
    flux_pair = _pair(flux_config or config or _config(world), flux=True, **kw)
    flux_pair.load_state_dict(stock.state_dict())
    return stock, flux_pair


def _compare_pair(rank, world, skip_bias_add):
    import gpu_megatron_worker

    stock, flux_pair = _stock_and_flux(world, skip_bias_add=skip_bias_add)
    x, g = _rows(rank, world, B, H, seed=1), _rows(rank, world, B, H, seed=2)
    z_ref, dx_ref = _run_pair(stock, x, g)
    with gpu_megatron_worker.counting_flux_calls() as (calls, fallbacks):
        z, dx = _run_pair(flux_pair, x, g)
    assert dict(calls) == {"ag_gemm": 2, "gemm_rs": 2}, dict(calls)
    assert not fallbacks, fallbacks
    assert z.shape == (ROWS, B, H)
    _close(z, z_ref, "output rows")
    _close(dx, dx_ref, "input gradient")
    ref_grads = dict(stock.named_parameters())
    for name, p in flux_pair.named_parameters():
        _close(p.grad, ref_grads[name].grad, f"d {name}")
    return sorted(n for n, _ in flux_pair.named_parameters())


@mcase("megatron-pair")
def _pair_bias_in_op(rank, world):
    return _compare_pair(rank, world, skip_bias_add=False)


@mcase("megatron-pair-skip-bias")
def _pair_skip_bias(rank, world):
    return _compare_pair(rank, world, skip_bias_add=True)


@mcase("megatron-gather-output")
def _gather_output(rank, world):
    """gather_output=True (and runtime_gather_output overriding it both ways): flux's ag_gemm,
    then megatron's all-gather along the last dimension, as megatron's own layer does."""
    stock, flux_pair = _stock_and_flux(world, gather_output=True)
    x = _rows(rank, world, B, H, seed=3)
    for runtime, width in ((None, FFN), (True, FFN), (False, FFN // world)):
        g = torch.randn(ROWS * world, B, width, generator=torch.Generator().manual_seed(4))
        outs = []
        for pair in (stock, flux_pair):
            pair.zero_grad()
            xi = x.clone().requires_grad_()
            y, _ = pair["col"](xi, runtime_gather_output=runtime)
            y.backward(g)
            outs.append((y.detach(), xi.grad, pair["col"].weight.grad.clone(), pair["col"].bias.grad.clone()))
        for what, a, b in zip(("output", "input gradient", "d weight", "d bias"), outs[1], outs[0]):
            _close(a, b, f"runtime_gather_output={runtime}: {what}")
        assert outs[1][0].shape == (ROWS * world, B, width)
    return True


@mcase("megatron-main-grad")
def _main_grad(rank, world):
    from megatron.core.tensor_parallel import layers as mlayers

    acc = _config(world, gradient_accumulation_fusion=True)
    if not mlayers._grad_accum_fusion_available:  # megatron's own layers need apex for it
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            _pair(acc, flux=False)
    stock, flux_pair = _stock_and_flux(world, flux_config=acc)
    col, row = flux_pair["col"], flux_pair["row"]
    assert col.gradient_accumulation_fusion and row.gradient_accumulation_fusion and col.config is acc
    gen = torch.Generator().manual_seed(5)
    base_col = torch.randn(tuple(col.weight.shape), generator=gen)
    base_row = torch.randn(tuple(row.weight.shape), generator=gen)
    col.weight.main_grad = base_col.clone()
    col.weight.grad_added_to_main_grad = False  # as megatron's DDP sets it
    row.weight.main_grad = base_row.clone()  # no DDP attribute: no placeholder gradient
    x, g = _rows(rank, world, B, H, seed=1), _rows(rank, world, B, H, seed=2)

    z_ref, dx_ref = _run_pair(stock, x, g)
    z, dx = _run_pair(flux_pair, x, g)
    _close(z, z_ref, "output rows")
    _close(dx, dx_ref, "input gradient")
    dw_col, dw_row = stock["col"].weight.grad, stock["row"].weight.grad
    _close(col.weight.main_grad, base_col + dw_col, "column main_grad after one step")
    _close(row.weight.main_grad, base_row + dw_row, "row main_grad after one step")
    assert col.weight.grad is not None and col.weight.grad.shape == col.weight.shape
    assert col.weight.grad_added_to_main_grad is True
    assert row.weight.grad is None
    _close(col.bias.grad, stock["col"].bias.grad, "column bias gradient")
    _close(row.bias.grad, stock["row"].bias.grad, "row bias gradient")

    # A second step accumulates; under zero_out_wgrad the placeholder is zeros.
    col.weight.grad, col.weight.grad_added_to_main_grad, col.weight.zero_out_wgrad = None, False, True
    _run_pair(flux_pair, x, g)
    _close(col.weight.main_grad, base_col + 2 * dw_col, "column main_grad after two steps")
    _close(row.weight.main_grad, base_row + 2 * dw_row, "row main_grad after two steps")
    assert torch.count_nonzero(col.weight.grad).item() == 0

    # Where flux's path cannot run the option is refused (megatron's own backward needs apex),
    # at construction when it never can, at the call when the input rules it out.
    if not mlayers._grad_accum_fusion_available:
        with pytest.raises(RuntimeError, match="flux's path cannot run"):
            _pair(_config(world, gradient_accumulation_fusion=True, sequence_parallel=False), flux=True)
        odd = torch.randn(ROWS * world + 1, B, FFN // world)
        with pytest.raises(RuntimeError, match="not divisible by the tensor-parallel size"):
            row(odd)
    return True


@mcase("megatron-frozen")
def _frozen(rank, world):
    """Frozen weights: megatron's linear_with_frozen_weight against flux's path (no weight
    gradient, nothing gathered kept for it). Megatron's frozen column linear returns no gradient
    for a bias inside it (its autograd function drops it); flux's gives the bias its gradient,
    checked against megatron's layers with trainable weights."""
    stock, flux_pair = _stock_and_flux(world)
    x, g = _rows(rank, world, B, H, seed=1), _rows(rank, world, B, H, seed=2)
    _run_pair(stock, x, g)
    bias_grads = {n: p.grad.clone() for n, p in stock.named_parameters() if n.endswith("bias")}
    stock.zero_grad(set_to_none=True)
    for pair in (stock, flux_pair):
        pair["col"].weight.requires_grad_(False)
        pair["row"].weight.requires_grad_(False)
    z_ref, dx_ref = _run_pair(stock, x, g)
    assert stock["col"].bias.grad is None  # megatron's behaviour, above
    z, dx = _run_pair(flux_pair, x, g)
    _close(z, z_ref, "output rows")
    _close(dx, dx_ref, "input gradient")
    assert flux_pair["col"].weight.grad is None and flux_pair["row"].weight.grad is None
    for name, grad in bias_grads.items():
        _close(dict(flux_pair.named_parameters())[name].grad, grad, f"d {name}")
    return True


@mcase("megatron-fallback")
def _fallback(rank, world):
    """sequence_parallel off: the replicated input [s, b, h] on every rank, megatron's own
    forward (all-reduce after the row layer), the reason logged once per class over two steps."""
    import gpu_megatron_worker

    config = _config(world, sequence_parallel=False)
    stock, flux_pair = _stock_and_flux(world, config=config)
    gen = torch.Generator().manual_seed(6)
    x, g = torch.randn(ROWS, B, H, generator=gen), torch.randn(ROWS, B, H, generator=gen)
    z_ref, dx_ref = _run_pair(stock, x, g)
    with gpu_megatron_worker.counting_flux_calls() as (calls, fallbacks):
        for _ in range(2):
            flux_pair.zero_grad()
            z, dx = _run_pair(flux_pair, x, g)
    assert not calls, dict(calls)
    assert len(fallbacks) == 2, fallbacks
    assert any("FluxColumnParallelLinear" in m and "sequence_parallel is off" in m for m in fallbacks), fallbacks
    assert any("FluxRowParallelLinear" in m and "sequence_parallel is off" in m for m in fallbacks), fallbacks
    _close(z, z_ref, "output")
    _close(dx, dx_ref, "input gradient")
    ref_grads = dict(stock.named_parameters())
    for name, p in flux_pair.named_parameters():
        _close(p.grad, ref_grads[name].grad, f"d {name}")
    return fallbacks


@mcase("megatron-layer-fp32")
def _layer_fp32(rank, world):
    import gpu_megatron_worker

    report = gpu_megatron_worker.compare_layers(rank, world, torch.device("cpu"), torch.float32, seq=16, batch=2,
                                                hidden=32, heads=4, ffn=64)
    # Same float32 operations on the CPU: flux's layer computes what megatron's does.
    worst = max(v["max |flux - stock|"] for k, v in report.items() if k != "flux calls")
    assert worst <= 1e-5, report
    return report


@mcase("megatron-layer-bf16")
def _layer_bf16(rank, world):
    """bf16: the GPU test's tolerance rule; the fused layer's fp32 main_grad from bf16 operands
    (a product rounded to bf16 on the CPU, where torch.mm has no out_dtype)."""
    import gpu_megatron_worker

    return gpu_megatron_worker.compare_layers(rank, world, torch.device("cpu"), torch.bfloat16, seq=32, batch=2,
                                              hidden=64, heads=4, ffn=128)


# --------------------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return batches(__file__, "megatron-", tmp_path_factory)


@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_flux_pair_matches_megatron_pair_under_sequence_parallelism(batch, skip_bias_add):
    batch(2).assert_ok("megatron-pair-skip-bias" if skip_bias_add else "megatron-pair")


def test_gather_output_matches_megatron(batch):
    batch(2).assert_ok("megatron-gather-output")


def test_gradient_accumulation_fusion_into_main_grad(batch):
    batch(2).assert_ok("megatron-main-grad")


def test_frozen_weights(batch):
    batch(2).assert_ok("megatron-frozen")


def test_fallback_without_sequence_parallelism_is_megatron_and_logged_once(batch):
    values = batch(2).assert_ok("megatron-fallback")
    assert all(v == values[0] for v in values)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_transformer_layer_from_flux_spec_matches_local_spec(batch, dtype):
    batch(2).assert_ok(f"megatron-layer-{dtype}")


def test_spec_for_megatron_lm():
    """``--spec flux.integrations.megatron gpt_layer_flux_spec``: Megatron-LM imports the
    attribute with megatron's import_module and uses it as the layer spec; the four linears are
    flux's, the rest is the local spec's, and the spec's arguments pass through (RMSNorm and QK
    norms stay sequence-parallel capable)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import flux.integrations.megatron as fm

    spec = import_module(["flux.integrations.megatron", "gpt_layer_flux_spec"])
    assert isinstance(spec, ModuleSpec) and spec.module is TransformerLayer
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.keywords["submodules"]
    assert attn.linear_qkv is fm.FluxColumnParallelLinear and attn.linear_proj is fm.FluxRowParallelLinear
    assert mlp.linear_fc1 is fm.FluxColumnParallelLinear and mlp.linear_fc2 is fm.FluxRowParallelLinear
    local = get_gpt_layer_local_spec()
    assert attn.core_attention is local.submodules.self_attention.submodules.core_attention
    assert spec.submodules.mlp.func == local.submodules.mlp.func
    # megatron's own spec is left as it was
    assert local.submodules.self_attention.submodules.linear_qkv.__name__ == "ColumnParallelLinear"
    rms = fm.get_gpt_layer_flux_spec(qk_layernorm=True, normalization="RMSNorm")
    sub = rms.submodules.self_attention.submodules
    assert sub.linear_qkv is fm.FluxColumnParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for norm in (rms.submodules.input_layernorm, rms.submodules.pre_mlp_layernorm, sub.q_layernorm, sub.k_layernorm):
        assert norm is not WrappedTorchNorm, norm
    # MLA: megatron's MultiLatentAttention accepts only its own classes for the down projections
    # (checked by identity), so they stay megatron's; the up projections and the output are flux's.
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    mla = fm.get_gpt_layer_flux_spec(multi_latent_attention=True).submodules.self_attention.submodules
    for field in ("linear_q_down_proj", "linear_kv_down_proj", "linear_qkv_down_proj"):
        cls = getattr(mla, field, None)
        assert cls is None or cls is ColumnParallelLinear or not issubclass(cls, fm.FluxColumnParallelLinear), \
            (field, cls)
    assert mla.linear_proj is fm.FluxRowParallelLinear


def test_sequence_parallel_torch_norm():
    """RMSNorm or LayerNorm by config.normalization, parameters tagged for megatron's TP sum of
    sequence-parallel gradients; what torch's norms cannot do is refused."""
    import flux.integrations.megatron as fm

    config = _config(2)
    ln = fm.SequenceParallelTorchNorm(config=config, hidden_size=8, eps=1e-6)
    assert isinstance(ln, torch.nn.LayerNorm) and ln.eps == 1e-6
    assert all(p.sequence_parallel is True for p in ln.parameters())
    rms = fm.SequenceParallelTorchNorm(config=_config(2, normalization="RMSNorm"), hidden_size=8, eps=1e-5)
    assert isinstance(rms, torch.nn.RMSNorm) and rms.weight.sequence_parallel is True
    off = fm.SequenceParallelTorchNorm(config=_config(2, sequence_parallel=False), hidden_size=8)
    assert off.weight.sequence_parallel is False
    with pytest.raises(ValueError, match="zero_centered_gamma"):
        fm.SequenceParallelTorchNorm(config=_config(2, layernorm_zero_centered_gamma=True), hidden_size=8)


def test_import_flux_does_not_import_megatron():
    code = ("import sys, flux, flux.integrations, flux.nn; "
            "print('megatron' in sys.modules, 'flux.integrations.megatron' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "False"], out.stdout


# --------------------------------------------------------------------------------------
# GPU part: torchrun of tests/gpu_megatron_worker.py (NCCL, 2 GPUs)

GPU_WORKER = os.path.join(TESTS_DIR, "gpu_megatron_worker.py")
GPU_TIMEOUT_S = float(os.environ.get("FLUX_TEST_GPU_TIMEOUT_S", "540"))


def test_gpu_megatron_layer(tmp_path):
    """A TransformerLayer from flux's spec against one from megatron's local spec on 2 GPUs,
    bf16 and fp16, output and every gradient within twice the stock layer's error against a
    float64 layer plus a floor; flux's path taken, nothing fallen back
    (tests/gpu_megatron_worker.py)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    from _dist import run_torchrun

    rc, output = run_torchrun(GPU_WORKER, ["all"], 2, tmp_path, GPU_TIMEOUT_S, "gpu-megatron-worker.log")
    cases_path = tmp_path / "cases.json"
    if not cases_path.exists():
        pytest.fail(f"the worker did not start its cases (torchrun exit code {rc}):\n{output[-6000:]}", pytrace=False)
    recs = {}
    for rank in range(2):
        path = tmp_path / f"megatron.{rank}"
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                recs[(rec["case"], rec["rank"])] = rec
    problems = []
    for name in json.loads(cases_path.read_text()):
        for rank in range(2):
            rec = recs.get((name, rank))
            if rec is None:
                problems.append(f"case {name!r}: no result from rank {rank}")
            elif rec["status"] != "ok":
                problems.append(f"case {name!r} rank {rank}:\n{rec['error']}")
            else:
                logging.getLogger(__name__).info("%s rank %d: %s", name, rank, rec["value"])
    assert not problems, (f"torchrun exit code {rc}\n" + "\n".join(problems) +
                          f"\n--- output (tail) ---\n{output[-6000:]}")
