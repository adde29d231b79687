"""flux.ag_scatter_grouped_mm / flux.grouped_mm_gather_rs in gloo processes (world sizes 2 and 4).

Every rank builds the whole problem (all tokens, routing, full expert weights) from seeds and
takes its shard, so each case checks its results against an independent single-process
computation:

- part 1's rows and order (expert-major, then gathered token, then slot) and the routing's
  fields, exact on integer-valued data; part 2's output, exact on integer-valued data with
  power-of-two routing weights; both against the unchecked references too;
- the whole tensor-parallel MoE MLP (part 1 -> SwiGLU or GELU -> part 2) against the unsharded
  MoE MLP built from the full weights in float64, forward and the gradients of x, both weights
  and topk_weights; and the gradients against autograd through the references;
- experts without rows, -1 slots, no valid slot at all, K = 1 and K = 2, skewed routing, both
  weight layouts, int32 ids;
- the chunked (overlapped) strategy, forced on gloo, equal bit for bit to the sequential one;
- bad arguments: the same FluxInputError on every rank, naming the op, then the group still works.
"""
import contextlib
import os

import pytest
import torch

import flux
from flux.ops import moe_tp
from _dist import CASES, batches, case
from _moe_tp_problem import act, full_mlp, problem, shard
from _ref import expect_flux_error

WORLDS = (2, 4)
F64, F32 = torch.float64, torch.float32
STRATS = ("sequential", "chunked")


@contextlib.contextmanager
def strategy(name):
    old = os.environ.get(moe_tp.STRATEGY_ENV)
    os.environ[moe_tp.STRATEGY_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(moe_tp.STRATEGY_ENV, None)
        else:
            os.environ[moe_tp.STRATEGY_ENV] = old


def expected_pairs(idx, e):
    """[(expert, gathered token, slot)] of every valid pair, in the expert-major row order."""
    return [(ex, t, k) for ex in range(e) for t, row in enumerate(idx.tolist()) for k, v in enumerate(row) if v == ex]


def tp_mlp(x, idx, tw, w1, w2, layout, gated=True):
    h, routing = flux.ag_scatter_grouped_mm(x, idx, w1, weight_layout=layout)
    return flux.grouped_mm_gather_rs(act(h, gated), w2, routing, tw, weight_layout=layout), routing


def close(a, b, what, tol=1e-12):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------
# Forward: exact rows and routing


def _check_part1(rank, world, p, layout, e):
    x, idx, _, w1, _ = shard(p, rank, world, layout)
    pairs = expected_pairs(p["idx"], e)
    k = p["idx"].shape[1]
    wnk = w1 if layout == "nk" else w1.transpose(1, 2)
    want = torch.stack([p["x"][t] @ wnk[ex].t() for ex, t, _ in pairs]) if pairs else \
        torch.zeros((0, wnk.shape[1]), dtype=F64)
    results = []
    for s in STRATS:
        with strategy(s):
            out, r = flux.ag_scatter_grouped_mm(x, idx, w1, weight_layout=layout)
        assert out.dtype == F64 and out.shape == want.shape, (s, out.shape, want.shape)
        assert torch.equal(out, want), f"{s} {layout}: rows or order"
        assert r.num_rows == len(pairs) and r.gathered_shape == tuple(p["idx"].shape)
        assert r.pairs.tolist() == [t * k + kk for _, t, kk in pairs], f"{s}: pairs"
        counts = [sum(1 for ex, _, _ in pairs if ex == j) for j in range(e)]
        assert r.counts_host == counts and r.counts.tolist() == counts, f"{s}: counts"
        tl = x.shape[0]
        src = [[sum(1 for ex, t, _ in pairs if ex == j and t // tl == q) for j in range(e)] for q in range(world)]
        assert r.source_counts == src, f"{s}: source_counts"
        assert torch.equal(r.topk_idx, p["idx"].to(torch.int64))
        assert r.num_experts == e and r.tokens_per_rank == tl and r.topk == k and r.world == world
        results.append(out)
    ref, r = flux.ag_scatter_grouped_mm_ref(x, idx, w1, weight_layout=layout)
    assert torch.equal(ref, want) and r.counts_host == counts, "ag_scatter_grouped_mm_ref"
    return len(pairs)


@case("moetp-part1", worlds=WORLDS)
def _part1(rank, world):
    rows = []
    p = problem(1, world, 4, 6, 2 * world, 6, 2, integer=True, idx_dtype=torch.int32)
    for layout in ("nk", "kn"):
        rows.append(_check_part1(rank, world, p, layout, 6))
    p = problem(2, world, 3, 5, world, 3, 1, drop=0.0, integer=True)  # K = 1
    rows.append(_check_part1(rank, world, p, "nk", 3))
    p = problem(3, world, 2, 4, world, 16, 2, drop=0.5, integer=True)  # most experts receive nothing
    rows.append(_check_part1(rank, world, p, "nk", 16))
    p = problem(4, world, 5, 4, world, 4, 2, integer=True, skew=2)  # half of the tokens to expert 2
    rows.append(_check_part1(rank, world, p, "kn", 4))
    return rows


def _expected_part2(p, hfull, rank, world):
    """Rank ``rank``'s rows of sum_k tw[t, k] * (hfull[row of (t, k)] @ w2[e]^T) (the full F)."""
    idx, tw, w2 = p["idx"].to(torch.int64), p["tw"], p["w2"]
    t = idx.shape[0]
    y = torch.zeros((t, w2.shape[1]), dtype=F64)
    pairs = expected_pairs(idx, w2.shape[0])
    for row, (e, tok, k) in enumerate(pairs):
        y[tok] += tw[tok, k] * (hfull[row] @ w2[e].t())
    tl = t // world
    return y[rank * tl:(rank + 1) * tl]


@case("moetp-part2", worlds=WORLDS)
def _part2(rank, world):
    for seed, k, e, drop, layout in ((5, 2, 6, 0.25, "nk"), (6, 1, 4, 0.0, "kn"), (7, 2, 12, 0.5, "nk")):
        p = problem(seed, world, 4, 6, 2 * world, e, k, drop=drop, integer=True)
        x, idx, tw, w1, w2 = shard(p, rank, world, layout)
        _, routing = flux.ag_scatter_grouped_mm(x, idx, w1, weight_layout=layout)
        f, fl = p["w2"].shape[2], p["w2"].shape[2] // world
        hfull = torch.randint(-4, 5, (routing.num_rows, f), generator=torch.Generator().manual_seed(seed)).to(F64)
        h = hfull[:, rank * fl:(rank + 1) * fl].contiguous()
        want = _expected_part2(p, hfull, rank, world)
        outs = []
        for s in STRATS:
            with strategy(s):
                out = flux.grouped_mm_gather_rs(h, w2, routing, tw, weight_layout=layout)
            assert out.dtype == F64 and out.shape == want.shape
            assert torch.equal(out, want), f"{s} {layout} K={k}: out"
            outs.append(out)
        ref = flux.grouped_mm_gather_rs_ref(h, w2, routing, tw, weight_layout=layout)
        assert torch.equal(ref, want), "grouped_mm_gather_rs_ref"
    return True


# --------------------------------------------------------------------------------------
# The whole MLP against the unsharded layer, forward and gradients


def _mlp_check(rank, world, p, layout, gated, strat):
    full = {n: (v.clone().requires_grad_() if v.is_floating_point() else v) for n, v in p.items()}
    want = full_mlp(full, gated)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(99), dtype=F64)
    (want * g).sum().backward()
    x, idx, tw, w1, w2 = shard(p, rank, world, layout, gated)
    x, tw, w1, w2 = (t.requires_grad_() for t in (x, tw, w1, w2))
    with strategy(strat):
        out, _ = tp_mlp(x, idx, tw, w1, w2, layout, gated)
        tl = x.shape[0]
        rows = slice(rank * tl, (rank + 1) * tl)
        (out * g[rows]).sum().backward()
    what = f"{strat} {layout} {'swiglu' if gated else 'gelu'}"
    close(out, want[rows].detach(), f"{what}: out")
    close(x.grad, full["x"].grad[rows], f"{what}: d x")
    close(tw.grad, full["tw"].grad[rows], f"{what}: d topk_weights")
    full_shard = dict(p, w13=full["w13"].grad, w2=full["w2"].grad)
    _, _, _, g1, g2 = shard(full_shard, rank, world, layout, gated)
    close(w1.grad, g1, f"{what}: d w1")
    close(w2.grad, g2, f"{what}: d w2")


@case("moetp-mlp-swiglu", worlds=WORLDS)
def _mlp_swiglu(rank, world):
    p = problem(10, world, 4, 8, 3 * world, 6, 2)
    for s in STRATS:
        for layout in ("nk", "kn"):
            _mlp_check(rank, world, p, layout, True, s)
    return True


@case("moetp-mlp-gelu", worlds=WORLDS)
def _mlp_gelu(rank, world):
    for seed, k, e, skew in ((11, 1, 4, None), (12, 2, 8, 5)):  # K = 1; skewed routing with idle experts
        p = problem(seed, world, 3, 6, 2 * world, e, k, skew=skew)
        for s in STRATS:
            _mlp_check(rank, world, p, "kn" if k == 1 else "nk", False, s)
    return True


@case("moetp-grad-ref", worlds=WORLDS)
def _grad_ref(rank, world):
    """Every gradient of the public functions against autograd through the references."""
    p = problem(13, world, 4, 6, 2 * world, 5, 2)
    for s in STRATS:
        for layout in ("nk", "kn"):
            got, ref = [], []
            for fns, dest in (((flux.ag_scatter_grouped_mm, flux.grouped_mm_gather_rs), got),
                              ((flux.ag_scatter_grouped_mm_ref, flux.grouped_mm_gather_rs_ref), ref)):
                x, idx, tw, w1, w2 = shard(p, rank, world, layout)
                x, tw, w1, w2 = (t.requires_grad_() for t in (x, tw, w1, w2))
                with strategy(s):
                    hid, routing = fns[0](x, idx, w1, weight_layout=layout)
                    out = fns[1](act(hid, True), w2, routing, tw, weight_layout=layout)
                    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank), dtype=F64)
                    (out * g).sum().backward()
                dest.extend([out, x.grad, w1.grad, w2.grad, tw.grad])
            for name, a, b in zip(("out", "d x", "d w1", "d w2", "d topk_weights"), got, ref):
                close(a, b, f"{s} {layout}: {name}")
    # Partial gradients: only one input needs one, each alone.
    x, idx, tw, w1, w2 = shard(p, rank, world)
    for which in range(3):
        leaves = [t.clone().requires_grad_(i == which) for i, t in enumerate((x, w1, tw))]
        h, routing = flux.ag_scatter_grouped_mm(leaves[0], idx, leaves[1])
        out = flux.grouped_mm_gather_rs(act(h, True), w2, routing, leaves[2])
        out.sum().backward()
        assert leaves[which].grad is not None and all(t.grad is None for i, t in enumerate(leaves) if i != which)
    return True


# --------------------------------------------------------------------------------------
# Edge cases; the chunked strategy equal to the sequential one


@case("moetp-no-rows", worlds=WORLDS)
def _no_rows(rank, world):
    """Every slot -1 on every rank: P = 0, part 2 gives zeros, every gradient zero; then no token at all."""
    p = problem(20, world, 3, 4, world, 4, 2)
    p["idx"][:] = -1
    for s in STRATS:
        x, idx, tw, w1, w2 = shard(p, rank, world)
        x, tw, w1, w2 = (t.requires_grad_() for t in (x, tw, w1, w2))
        with strategy(s):
            h, routing = flux.ag_scatter_grouped_mm(x, idx, w1)
            assert h.shape == (0, w1.shape[1]) and routing.num_rows == 0 and routing.counts_host == [0] * 4
            out = flux.grouped_mm_gather_rs(act(h, True), w2, routing, tw)
            assert torch.equal(out, torch.zeros_like(x))
            out.sum().backward()
        for t in (x, tw, w1, w2):
            assert t.grad is not None and not t.grad.any(), s
        # No token at all (T_l = 0 on every rank).
        x0, tw0 = x[:0].detach().requires_grad_(), tw[:0].detach().requires_grad_()
        with strategy(s):
            h, routing = flux.ag_scatter_grouped_mm(x0, idx[:0], w1)
            out = flux.grouped_mm_gather_rs(act(h, True), w2, routing, tw0)
            out.sum().backward()
        assert out.shape == (0, x.shape[1]) and routing.num_tokens == 0 and x0.grad.shape == x0.shape
    return True


def _run_both(rank, world, p, layout, gated):
    """(forward outputs and every gradient) under each strategy."""
    res = {}
    for s in STRATS:
        x, idx, tw, w1, w2 = shard(p, rank, world, layout, gated)
        x, tw, w1, w2 = (t.requires_grad_() for t in (x, tw, w1, w2))
        with strategy(s):
            h, routing = flux.ag_scatter_grouped_mm(x, idx, w1, weight_layout=layout)
            h.retain_grad()
            # relu keeps integer data integer (exact in float64 whatever the summation order)
            out = flux.grouped_mm_gather_rs(torch.relu(h) if not gated else act(h, True), w2, routing, tw,
                                            weight_layout=layout)
            g = torch.randint(-3, 4, out.shape, generator=torch.Generator().manual_seed(rank)).to(F64)
            (out * g).sum().backward()
        res[s] = [h, out, h.grad, x.grad, w1.grad, w2.grad, tw.grad]
    return res


@case("moetp-chunked-equal", worlds=WORLDS)
def _chunked_equal(rank, world):
    """The chunked strategy, forced on gloo (where _should_overlap says no), gives the sequential
    strategy's results bit for bit on integer-valued data: forward and every gradient; skewed
    routing, a rank whose tokens have no valid slot, K = 1 and 2."""
    from flux.runtime import resolve_group

    group = resolve_group(None, "test")
    assert not moe_tp._should_overlap(torch.device("cpu"), group, 1 << 20, 1 << 20)
    assert moe_tp._choose_strategy(torch.device("cpu"), group, 4, 4) == ("sequential", None)
    names = ("h", "out", "d h", "d x", "d w1", "d w2", "d topk_weights")
    for seed, k, e, skew, layout in ((30, 2, 6, 1, "nk"), (31, 1, 4, None, "kn"), (32, 2, 8, 0, "kn")):
        p = problem(seed, world, 4, 5, 2 * world, e, k, integer=True, skew=skew)
        if seed == 32:
            p["idx"][4:8] = -1  # rank 1's tokens route nowhere
        res = _run_both(rank, world, p, layout, gated=False)
        for name, a, b in zip(names, res["sequential"], res["chunked"]):
            assert torch.equal(a, b), f"seed {seed}: {name} differs between the strategies"
    return True


# --------------------------------------------------------------------------------------
# Bad arguments: the same FluxInputError on every rank, then the group still works


def _good_call(rank, world):
    p = problem(40, world, 2, 4, world, 4, 2, integer=True)
    x, idx, tw, w1, w2 = shard(p, rank, world, gated=False)
    out, _ = tp_mlp(x, idx, tw, w1, w2, "nk", gated=False)
    assert out.shape == x.shape





def _base(rank, world, e=6):
    return shard(problem(41, world, 4, 4, world, e, 2, integer=True), rank, world, gated=False)


def _bad1(name, change, *fragments):
    """A bad part-1 call: ``change(rank, world, x, idx, w1) -> (x, idx, w1)``."""
    def fn(rank, world):
        x, idx, _, w1, _ = _base(rank, world)
        x, idx, w1 = change(rank, world, x, idx, w1)
        msg = expect_flux_error(lambda: flux.ag_scatter_grouped_mm(x, idx, w1), "flux.ag_scatter_grouped_mm",
                            *fragments)
        _good_call(rank, world)
        return msg

    case(f"moetp-bad-{name}", worlds=WORLDS)(fn)


def _bad2(name, change, *fragments):
    """A bad part-2 call after a good part 1: ``change(rank, world, h, w2, routing, tw)``."""
    def fn(rank, world):
        x, idx, tw, w1, w2 = _base(rank, world)
        h, routing = flux.ag_scatter_grouped_mm(x, idx, w1)
        args = change(rank, world, h, w2, routing, tw)
        msg = expect_flux_error(lambda: flux.grouped_mm_gather_rs(*args), "flux.grouped_mm_gather_rs", *fragments)
        _good_call(rank, world)
        return msg

    case(f"moetp-bad-{name}", worlds=WORLDS)(fn)


def _on(r, rank, bad, good):
    return bad if rank == r else good


_bad1("x-dtype", lambda r, w, x, i, w1: (_on(1, r, x.float(), x), i, _on(1, r, w1.float(), w1)),
      "differ between ranks: x.dtype is float64 on rank 0 but float32 on rank 1")
_bad1("tokens", lambda r, w, x, i, w1: (_on(1, r, x[:3], x), _on(1, r, i[:3], i), w1),
      "differ between ranks: T_l (x.shape[0]) is 4 on rank 0 but 3 on rank 1")
_bad1("experts", lambda r, w, x, i, w1: (x, i, _on(1, r, torch.cat([w1, w1[:1]]), w1)),
      "differ between ranks: E (weight.shape[0]) is 6 on rank 0 but 7 on rank 1")
_bad1("id-too-large", lambda r, w, x, i, w1: (x, _on(1, r, i.index_fill(0, torch.tensor([2]), 6), i), w1),
      "invalid arguments on rank 1: topk_idx[2, 0] = 6 is outside [-1, 6) (2 such entries)")
_bad1("id-negative", lambda r, w, x, i, w1: (x, _on(0, r, i.index_put((torch.tensor([1]), torch.tensor([1])),
                                                                      torch.tensor(-3)), i), w1),
      "invalid arguments on rank 0: topk_idx[1, 1] = -3 is outside [-1, 6)")
_bad1("hidden", lambda r, w, x, i, w1: (x, i, _on(0, r, w1[:, :, :3], w1)),
      "invalid arguments on rank 0:", "x has 4 columns but weight")
_bad1("idx-rows", lambda r, w, x, i, w1: (x, _on(1, r, i[:3], i), w1),
      "invalid arguments on rank 1: topk_idx has 3 rows but x has 4 tokens")
_bad1("idx-float", lambda r, w, x, i, w1: (x, _on(1, r, i.float(), i), w1),
      "invalid arguments on rank 1: topk_idx dtype torch.float32")
_bad2("experts-routing", lambda r, w, h, w2, rt, tw: (h, _on(1, r, torch.cat([w2, w2[:1]]), w2), rt, tw),
      "rank 1: weight has E = 7 experts but the routing has 6")
_bad2("h-dtype", lambda r, w, h, w2, rt, tw: (_on(1, r, h.float(), h), _on(1, r, w2.float(), w2), rt, tw),
      "differ between ranks: h.dtype is float64 on rank 0 but float32 on rank 1")
_bad2("h-rows", lambda r, w, h, w2, rt, tw: (_on(1, r, h[1:], h), w2, rt, tw),
      "invalid arguments on rank 1: h has", "but the routing has P =")
_bad2("weights-shape", lambda r, w, h, w2, rt, tw: (h, w2, rt, _on(0, r, tw[:, :1], tw)),
      "invalid arguments on rank 0: topk_weights has shape (4, 1), expected this rank's [T_l, K] = [4, 2]")
_bad2("routing", lambda r, w, h, w2, rt, tw: (h, w2, _on(1, r, None, rt), tw),
      "invalid arguments on rank 1: routing must be the TpMoeRouting")


@case("moetp-bad-strategy-env", worlds=WORLDS)
def _bad_strategy_env(rank, world):
    x, idx, _, w1, _ = _base(rank, world)
    with strategy("fused" if rank == 0 else "sequential"):
        msg = expect_flux_error(lambda: flux.ag_scatter_grouped_mm(x, idx, w1), "flux.ag_scatter_grouped_mm",
                            "invalid arguments on rank 0: FLUX_STRATEGY_MOE_TP='fused' is not one of")
    _good_call(rank, world)
    return msg


@case("moetp-bad-strategy-decomposed-cpu", worlds=WORLDS)
def _bad_strategy_decomposed_cpu(rank, world):
    """decomposed forced on CPU tensors: the same clear error on every rank, before any transfer;
    ranks giving its former name ``symm`` (rank 0 here) agree with those giving ``decomposed``."""
    x, idx, _, w1, _ = _base(rank, world)
    with strategy(" symm" if rank == 0 else "decomposed"):
        msg = expect_flux_error(lambda: flux.ag_scatter_grouped_mm(x, idx, w1), "flux.ag_scatter_grouped_mm",
                                "FLUX_STRATEGY_MOE_TP=decomposed cannot run here: the tensors are not on a GPU")
    _good_call(rank, world)
    return msg


# --------------------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return batches(__file__, "moetp-", tmp_path_factory, timeout_s=150)


def _names():
    return [n for n in CASES if n.startswith("moetp-")]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in _names() if not n.startswith("moetp-bad-")])
def test_moe_tp(batch, world, name):
    batch(world).assert_ok(name)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in _names() if n.startswith("moetp-bad-")])
def test_bad_arguments(batch, world, name):
    msgs = batch(world).assert_ok(name)
    assert all(m == msgs[0] for m in msgs), "FluxInputError messages differ between ranks:\n" + "\n".join(
        f"rank {r}: {m}" for r, m in enumerate(msgs))
