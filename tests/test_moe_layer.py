"""flux.ops.grouped_mm and flux.nn.MoE.

grouped_mm and grouped_mm_padded (no communication) run in this process against a per-expert
loop written out here, in float64, both weight layouts, with experts that have no rows; the
torch._grouped_mm path's autograd formulas run on the CPU through torch's own CPU
implementation of that op.

flux.nn.MoE runs in gloo processes (worlds 2 and 4): forward and backward (input gradient and
every parameter's gradient) against an unsharded single-process MoE built from the same full
parameters, in float64, with top-k 1 and 2, unbounded and bounded dispatch, experts (and a whole
rank's experts) that receive no token; and its shard-only initialisation, the same layer at
every group size for a seed. ``chunks`` = 2, 3 and 8 (token blocks, pipelined on CUDA, in order
here) against ``chunks=1``: the same output and gradients, with token counts that the blocks do
not divide, a rank without tokens, blocks of 0 tokens, unbounded and bounded.
"""
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _dist import batches, case
from flux.ops.grouped_mm import _GroupedMMKernel, _offsets, grouped_mm, grouped_mm_impl, grouped_mm_padded

TOL = dict(rtol=1e-10, atol=1e-10)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------
# the router's logits (in process; the 16-bit path on CUDA only)


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_on_the_cpu_are_the_wide_product(dtype):
    from flux.nn.moe import router_logits
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=gen).to(dtype)
    w = torch.randn(5, 64, generator=gen).to(dtype)
    out = router_logits(x, w)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.linear(x.float(), w.float()))
    assert router_logits(x.double(), w).dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_logits_16bit_path_against_float64(dtype):
    """Forward: within the fp32 accumulation bound (or 2x the fp32 product of the converted operands);
    backward: within 2x the error of the 16-bit linear layer's own gradients (torch's autograd of
    F.linear in that dtype), all against float64."""
    from flux.nn.moe import _MIXED_LOGITS_FAILED, router_logits
    gen = torch.Generator(device="cuda").manual_seed(5)
    t, h, e = 1000, 2048, 64
    x = torch.randn(t, h, generator=gen, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(e, h, generator=gen, device="cuda") / h ** 0.5).to(dtype).requires_grad_()
    g = torch.randn(t, e, generator=gen, device="cuda")
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.linear(x64, w64)
    ref.backward(g.double())
    out = router_logits(x, w)
    assert not _MIXED_LOGITS_FAILED, "torch.mm(..., out_dtype=float32) is not available here"
    assert out.dtype == torch.float32
    out.backward(g)
    base = F.linear(x.detach().float(), w.detach().float())
    # fp32 accumulation of H products on tensor cores: within the recursive-summation bound
    # H * 2^-24 * | |x| |w|^T | (far below a 16-bit rounding of the logits, 2^-9 relative)
    bound = h * 2.0 ** -24 * float((x64.detach().abs() @ w64.detach().abs().t()).norm() / ref.detach().norm())
    assert _rel(out, ref) <= max(2 * _rel(base, ref), bound), (_rel(out, ref), _rel(base, ref), bound)
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(xb, wb).backward(g.to(dtype))
    for got, b, r, what in ((x.grad, xb.grad, x64.grad, "x"), (w.grad, wb.grad, w64.grad, "w")):
        assert got.dtype == dtype and torch.isfinite(got).all(), what
        assert _rel(got, r) <= 2 * _rel(b, r), f"d{what}: {_rel(got, r):.3g} against {_rel(b, r):.3g}"


# --------------------------------------------------------------------------------------
# grouped_mm (in process)


def per_expert(x, w, counts, layout):
    """The meaning of grouped_mm, one expert at a time: [R, N]."""
    n = w.shape[1] if layout == "nk" else w.shape[2]
    out = x.new_zeros(x.shape[0], n)
    start = 0
    for e, c in enumerate(counts):
        we = w[e].t() if layout == "nk" else w[e]
        out[start:start + c] = x[start:start + c] @ we
        start += c
    return out


def _weights(e, n, k, layout, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (e, n, k) if layout == "nk" else (e, k, n)
    return torch.randn(shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("counts", [[3, 0, 4, 0, 2], [0, 0, 5, 0, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
def test_grouped_mm_matches_a_per_expert_loop(layout, counts):
    e, n, k = len(counts), 6, 5
    torch.manual_seed(1)
    x = torch.randn(sum(counts), k, dtype=torch.float64, requires_grad=True)
    w = _weights(e, n, k, layout).requires_grad_()
    g = torch.randn(sum(counts), n, dtype=torch.float64)
    ref = per_expert(x, w, counts, layout)
    (ref * g).sum().backward()
    ref_dx, ref_dw = x.grad.clone(), w.grad.clone()
    cum = torch.tensor(counts).cumsum(0)
    for kwargs in (dict(counts=torch.tensor(counts)), dict(counts=counts), dict(counts=cum, cumulative=True),
                   dict(counts=torch.tensor(counts), counts_host=counts), dict(counts=cum.int(), cumulative=True),
                   dict(counts=cum.tolist(), cumulative=True)):
        x.grad = w.grad = None
        y = grouped_mm(x, w, weight_layout=layout, **kwargs)
        assert y.shape == (sum(counts), n)
        torch.testing.assert_close(y, ref, **TOL)
        (y * g).sum().backward()
        torch.testing.assert_close(x.grad, ref_dx, **TOL)
        assert w.grad is not None, "w is not connected to the graph"
        torch.testing.assert_close(w.grad, ref_dw, **TOL)
        for i, c in enumerate(counts):
            if c == 0:
                assert not w.grad[i].any(), f"expert {i} has no rows but a weight gradient"


def test_grouped_mm_refuses_bad_arguments():
    x, w = torch.randn(5, 4), torch.randn(3, 6, 4)
    with pytest.raises(ValueError, match="sum to 4"):
        grouped_mm(x, w, [1, 1, 2])
    with pytest.raises(ValueError, match="3 experts"):
        grouped_mm(x, w, [1, 4])
    with pytest.raises(ValueError, match="K=4"):
        grouped_mm(x, w, [1, 2, 2], weight_layout="kn")
    with pytest.raises(ValueError, match="cannot run here"):
        grouped_mm(x, w, [1, 2, 2], impl="kernel")
    assert grouped_mm_impl(x, w) == ("loop", "cpu tensors")
    assert grouped_mm(x, w, [1, 2, 2], impl="loop").shape == (5, 6)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_grouped_mm_padded_matches_a_per_expert_loop_and_ignores_rows_past_the_counts(layout):
    e, cap, n, k = 4, 5, 6, 3
    counts = [2, 0, 5, 1]
    torch.manual_seed(2)
    x = torch.randn(e, cap, k, dtype=torch.float64)
    for i, c in enumerate(counts):
        x[i, c:] = float("nan")  # whatever lies past the counts must not show anywhere
    x.requires_grad_()
    w = _weights(e, n, k, layout).requires_grad_()
    g = torch.randn(e, cap, n, dtype=torch.float64)
    # skip_padding on the CPU: the masked product (flux's slab kernels are GPU-only), which its
    # contract (rows past the counts undefined) allows.
    for cnt, skip in ((torch.tensor(counts), False), (counts, False), (torch.tensor(counts), True)):
        x.grad = w.grad = None
        y = grouped_mm_padded(x, w, cnt, weight_layout=layout, skip_padding=skip)
        assert y.shape == (e, cap, n)
        (y * g).sum().backward()
        xs = torch.cat([x.detach()[i, :c] for i, c in enumerate(counts)])
        ref = per_expert(xs, w.detach(), counts, layout)
        ref_x = xs.clone().requires_grad_()
        ref_w = w.detach().clone().requires_grad_()
        gs = torch.cat([g[i, :c] for i, c in enumerate(counts)])
        (per_expert(ref_x, ref_w, counts, layout) * gs).sum().backward()
        start = 0
        for i, c in enumerate(counts):
            torch.testing.assert_close(y[i, :c], ref[start:start + c], **TOL)
            assert not y[i, c:].any(), "output rows past the count are not zero"
            torch.testing.assert_close(x.grad[i, :c], ref_x.grad[start:start + c], **TOL)
            assert not x.grad[i, c:].any()
            start += c
        torch.testing.assert_close(w.grad, ref_w.grad, **TOL)
    # Without counts every row counts: a plain batched product.
    xf = torch.randn(e, cap, k, dtype=torch.float64)
    wt = w.detach().transpose(1, 2) if layout == "nk" else w.detach()
    torch.testing.assert_close(grouped_mm_padded(xf, w.detach(), weight_layout=layout), xf @ wt, **TOL)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_the_grouped_mm_kernel_path_gradients(layout):
    """The autograd function around torch._grouped_mm (taken on CUDA), here through torch's CPU
    implementation of the op (float32): forward, dx and dW (2-D x 2-D grouped) against the loop,
    with empty experts, and a zero-stride output gradient (what ``sum()`` sends)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    counts = [3, 0, 4, 0, 9]
    e, n, k = len(counts), 8, 16
    torch.manual_seed(3)
    x = torch.randn(sum(counts), k, requires_grad=True)
    w = _weights(e, n, k, layout, dtype=torch.float32).requires_grad_()
    offs = _offsets(torch.tensor(counts), False, x.device, e, "test")
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 3, 7, 7, 16]
    assert _offsets([3, 3, 7, 7, 16], True, x.device, e, "test").tolist() == offs.tolist()
    assert _offsets(counts, False, x.device, e, "test").tolist() == offs.tolist()
    y = _GroupedMMKernel.apply(x, w, offs, layout)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = per_expert(x, w, counts, layout)
    (ref * g).sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, w.grad, rtol=1e-5, atol=1e-5)
    assert not dw[1].any() and not dw[3].any()
    x.grad = w.grad = None
    _GroupedMMKernel.apply(x, w, offs, layout).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


# --------------------------------------------------------------------------------------
# flux.nn.MoE (gloo processes)


def ref_moe(x, router, w13, w2, top_k, renormalize):
    """The unsharded layer: every expert in this process, one expert at a time."""
    probs = F.linear(x, router).softmax(-1)
    weights, idx = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    f = w2.shape[2]
    for e in range(router.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[e].t()
        y = (F.silu(h[:, :f]) * h[:, f:]) @ w2[e].t()
        out = out.index_add(0, tok, weights[tok, slot].unsqueeze(-1) * y)
    return out, idx


def _moe_vs_reference(rank, world, top_k, renormalize, bounded, dead, dispatcher=None):
    """One comparison: tokens per rank 5 + rank (uneven), 3 experts per rank, the router's
    column 0 pushing the experts in ``dead`` out of every token's top k (x[:, 0] > 3)."""
    import flux.nn as fnn

    h, f, e = 8, 6, 3 * world
    tokens = [5 + r for r in range(world)]
    full = fnn.MoE.full_weights(h, f, e, seed=11)
    router = full["router"].double()
    router[dead, 0] = -20.0
    w13, w2 = full["w13"].double(), full["w2"].double()
    gen = torch.Generator().manual_seed(5)  # the same tokens on every rank: all ranks' tokens
    x_all = torch.randn(sum(tokens), h, generator=gen, dtype=torch.float64)
    x_all[:, 0] = 3.0 + x_all[:, 0].abs()
    g_all = torch.randn(sum(tokens), h, generator=gen, dtype=torch.float64)
    lo = sum(tokens[:rank])
    mine = slice(lo, lo + tokens[rank])

    params = [t.clone().requires_grad_() for t in (router, w13, w2)]
    xr = x_all.clone().requires_grad_()
    ref, idx = ref_moe(xr, *params, top_k, renormalize)
    (ref * g_all).sum().backward()
    used = set(idx.flatten().tolist())
    assert used.isdisjoint(dead) and len(used) >= top_k, f"routing did not exercise the case: {sorted(used)}"

    cap = max(tokens) + 1 if bounded else None
    moe = fnn.MoE(h, f, e, top_k, seed=3, dtype=torch.float64, max_tokens_per_rank=cap,
                  renormalize=renormalize, dispatcher=dispatcher).load_full_(router, w13, w2)
    x = x_all[mine].clone().view(tokens[rank], 1, h).requires_grad_()  # a [..., H] input
    y = moe(x)
    assert y.shape == x.shape
    (y * g_all[mine].view_as(y)).sum().backward()

    what = f"top_k={top_k} renormalize={renormalize} bounded={bounded} dead={dead}"

    def close(a, b, name):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {name}: {m}")

    el = e // world
    close(y.view(-1, h), ref.detach()[mine], "output")
    close(x.grad.view(-1, h), xr.grad[mine], "input gradient")
    close(moe.w13.grad, params[1].grad[rank * el:(rank + 1) * el], "w13 gradient")
    close(moe.w2.grad, params[2].grad[rank * el:(rank + 1) * el], "w2 gradient")
    dr = moe.router.weight.grad.clone()
    dist.all_reduce(dr)  # each rank holds its own tokens' share
    close(dr, params[0].grad, "router gradient (summed over ranks)")
    if top_k == 1 and renormalize:
        # The weight is w / w = 1: no router gradient (up to rounding in the quotient's derivative).
        assert params[0].grad.abs().max() < 1e-12, "top-1 renormalised weights are 1: no router gradient expected"
    else:
        assert params[0].grad.abs().sum() > 0
    return sorted(used)


def _cases_for(world):
    last = list(range(3 * (world - 1), 3 * world))  # every expert of the last rank
    return [(1, True, False, [1]), (1, False, False, [1, 3 * world - 1]), (2, True, False, [1, 3 * world - 1]),
            (2, True, False, last), (2, False, True, [1, 3 * world - 1]), (1, True, True, last)]


@case("moelayer-forward-backward", worlds=(2, 4))
def _forward_backward(rank, world):
    return [_moe_vs_reference(rank, world, *c) for c in _cases_for(world)]


@case("moelayer-a2a-baseline", worlds=(2, 4))
def _a2a_baseline(rank, world):
    """The same comparisons with bench/bench_moe.py's all-to-all dispatcher in place of flux's: the
    layer's own arithmetic, and the baseline that the benchmark measures flux against."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from bench_moe import AllToAllDispatcher

    return [_moe_vs_reference(rank, world, *c, dispatcher=AllToAllDispatcher()) for c in _cases_for(world)]


@case("moelayer-init-shard-only", worlds=(2, 4))
def _init_shard_only(rank, world):
    """For one seed, the world group, groups of two and groups of one hold slices of the same full
    layer (MoE.full_weights); each rank allocates only its experts; nn.Linear's bounds."""
    import flux.nn as fnn

    h, f, e, seed = 8, 4, 8, 1234
    full = fnn.MoE.full_weights(h, f, e, seed)
    assert float(full["w13"].abs().max()) <= 1 / math.sqrt(h) and float(full["w2"].abs().max()) <= 1 / math.sqrt(f)
    assert float(full["w13"].std()) > 0.5 / math.sqrt(3 * h)
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    singles = [dist.new_group([r]) for r in range(world)]
    groups = [(None, world, rank), (pairs[rank // 2], 2, rank % 2), (singles[rank], 1, 0)]
    for group, size, r in groups:
        moe = fnn.MoE(h, f, e, 2, group=group, seed=seed)
        el = e // size
        assert moe.w13.shape == (el, 2 * f, h) and moe.w2.shape == (el, h, f), (size, moe.w13.shape)
        assert moe.first_expert == r * el
        assert torch.equal(moe.router.weight.data, full["router"]), f"router differs at group size {size}"
        assert torch.equal(moe.w13.data, full["w13"][r * el:(r + 1) * el]), f"w13 differs at group size {size}"
        assert torch.equal(moe.w2.data, full["w2"][r * el:(r + 1) * el]), f"w2 differs at group size {size}"
    # No seed: the group's first rank draws it; ranks seeded differently build one layer.
    torch.manual_seed(100 + rank)
    a = fnn.MoE(h, f, e, 2)
    routers = [torch.empty_like(a.router.weight.data) for _ in range(world)]
    dist.all_gather(routers, a.router.weight.data)
    assert all(torch.equal(t, routers[0]) for t in routers), "ranks built different routers"
    w13s = [torch.empty_like(a.w13.data) for _ in range(world)]
    dist.all_gather(w13s, a.w13.data)
    assert not torch.equal(w13s[0], w13s[1]), "two ranks hold the same experts"
    assert "MoE" in fnn.__all__ and f"{e // world} per rank" in repr(a)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunks must be a positive int"):
            fnn.MoE(h, f, e, 2, seed=1, chunks=bad)
    with pytest.raises(ValueError, match="not divisible by the group size"):
        fnn.MoE(h, f, e + 1, 2, seed=1)
    return True


@case("moelayer-chunks", worlds=(2, 4))
def _chunks(rank, world):
    """chunks = 2, 3, 8 against chunks = 1 (float64): output, input gradient and every parameter's
    gradient. Tokens per rank 7, 0, 5, 4 (7 and 5 not divisible by 2 or 3; rank 1 has none; 8
    blocks leave blocks of 0 tokens on every rank); unbounded and bounded (C = 8: blocks of at most
    ceil(8 / c) tokens)."""
    import flux.nn as fnn

    h, f, e, k = 8, 6, 3 * world, 2
    tokens = [7, 0, 5, 4][:world]
    gen = torch.Generator().manual_seed(21)
    x_all = torch.randn(sum(tokens), h, generator=gen, dtype=torch.float64)
    g_all = torch.randn(sum(tokens), h, generator=gen, dtype=torch.float64)
    lo = sum(tokens[:rank])
    mine = slice(lo, lo + tokens[rank])
    seen = []
    for cap in (None, 8):
        results = {}
        for c in (1, 2, 3, 8):
            moe = fnn.MoE(h, f, e, k, seed=4, dtype=torch.float64, max_tokens_per_rank=cap, chunks=c)
            assert moe.chunks == c and f"chunks={c}" in repr(moe)
            x = x_all[mine].clone().requires_grad_()
            y = moe(x)
            (y * g_all[mine]).sum().backward()
            results[c] = [y.detach(), x.grad, moe.router.weight.grad, moe.w13.grad, moe.w2.grad]
            seen.append(c)
        for c in (2, 3, 8):
            for name, a, b in zip(("output", "input gradient", "router gradient", "w13 gradient", "w2 gradient"),
                                  results[c], results[1]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"chunks={c} C={cap}: {name}: {m}")
        assert results[1][3].abs().sum() > 0, "no expert of this rank got a gradient: the case routes too little"
    return seen


@case("moelayer-bounded-deferred-error", worlds=(2,))
def _bounded_deferred_error(rank, world):
    """The bounded dispatch's verdict without a host read (what CUDA groups do), run on gloo: a rank
    over max_tokens_per_rank makes every rank's layer raise the same FluxInputError (the layer
    reads the verdict), not return zeros; with chunks too."""
    from unittest import mock

    import flux
    import flux.nn as fnn
    from flux.ops import moe as moe_ops

    h, f, e = 8, 6, 2 * world
    msgs = []
    with mock.patch.object(moe_ops.strategies, "cuda_group", lambda g: True):
        for c in (1, 2):
            moe = fnn.MoE(h, f, e, 2, seed=5, dtype=torch.float64, max_tokens_per_rank=4, chunks=c)
            x = torch.randn(9 if rank == 1 else 4, h, dtype=torch.float64)
            try:
                moe(x)
            except flux.FluxInputError as err:
                msgs.append(str(err))
            else:
                raise AssertionError(f"chunks={c}: no error although rank 1 has 9 tokens, max_tokens_per_rank 4")
    assert all("rank 1: x.shape[0] (T) exceeds max_tokens_per_rank" in m for m in msgs), msgs
    return msgs


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return batches(__file__, "moelayer-", tmp_path_factory)


def test_bounded_layer_raises_a_deferred_error_on_every_rank(batch):
    msgs = batch(2).assert_ok("moelayer-bounded-deferred-error")
    assert msgs[0] == msgs[1], msgs


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_matches_the_unsharded_layer(batch, world):
    batch(world).assert_ok("moelayer-forward-backward")


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_on_the_all_to_all_baseline_matches_the_unsharded_layer(batch, world):
    batch(world).assert_ok("moelayer-a2a-baseline")


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_chunks_match_one_chunk(batch, world):
    batch(world).assert_ok("moelayer-chunks")


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_draws_only_its_experts_the_same_at_any_group_size(batch, world):
    batch(world).assert_ok("moelayer-init-shard-only")


def test_bounded_layer_skips_padding_only_on_sparse_slabs(monkeypatch):
    """MoE.skip_padding: flux's masked grouped kernels where they run (stood in for here) and at
    most half the slab rows can carry data (T * top_k <= E * C / 2); never where they do not run."""
    from types import SimpleNamespace

    import flux.nn.moe as moe_mod

    def layer(e, k):  # what skip_padding reads of the layer (a real one needs a process group)
        return SimpleNamespace(num_experts=e, top_k=k, w13=torch.empty(e, 16, 16), w2=torch.empty(e, 16, 8))

    x = torch.randn(128, 16)
    assert not moe_mod.MoE.skip_padding(layer(64, 8), x, 128)  # the CPU: no masked kernels
    monkeypatch.setattr(moe_mod, "slab_kernels_ready", lambda *a, **k: True)
    assert moe_mod.MoE.skip_padding(layer(64, 8), x, 128)  # 128 * 8 rows over 64 * 128
    assert moe_mod.MoE.skip_padding(layer(64, 8), x[:64], 16)  # exactly half
    assert not moe_mod.MoE.skip_padding(layer(64, 8), x[:64], 15)
    assert not moe_mod.MoE.skip_padding(layer(8, 8), x, 128)  # 8 experts, top-8: every slab row has data
