"""GPU cases of the MoE ops: the symmetric-memory strategy (``symm``, flux/ops/moe/symm.py) of
flux.moe_dispatch / moe_combine, and the tensor-parallel MoE ops (``tp_*`` cases), run by
tests/test_moe_symm.py through

    torchrun --nproc_per_node=2 tests/gpu_moe_worker.py

with NCCL, one GPU per rank; or, on a machine with fewer GPUs than ranks, with ranks sharing
the GPUs (gloo, FLUX_GLOO_CUDA=1, as tests/gpu_worker.py does: correctness only). Each rank
prints ``FLUXMOE {"case", "rank", "status", "error"}`` per case and writes the lines to
$FLUX_GPU_RESULTS_DIR/moe.<rank> when that is set.

Every rank builds every rank's inputs from seeds (different token counts per rank, integer-valued
rows, weights that are powers of two, some -1 slots, no expert twice in a row), so the expected
results are computed here without any collective, and exactly:
- dispatch: the received rows, their order (local expert, then sender, then token, then slot)
  and the per-expert counts; bounded: the [E_l, W * cap, H] layout with zero rows past counts;
- combine of f(received rows) (each row plus its expert's id): sum_k w[t, k] (x[t] + g(t, k));
- 20 calls in a row on alternating shapes (workspace and barrier reuse), a rank sending nothing,
  every pair to one expert;
- the bounded variant captured in a CUDA graph and replayed on new routings;
- the bounded variant's verdict (bad ids, duplicates, T > C, a local argument error after a
  checked call): nothing moves and every rank's handle.check() raises naming the rank;
- gradients (x, topk_weights, the experts' y) of dispatch -> expert -> combine through the
  public functions equal to those of the reference sequential strategy (NCCL or gloo), bitwise;
- fp8 dispatch (bf16 tokens whose 128-element blocks span magnitudes): the received fp8 rows and
  scales byte for byte equal to quantize_fp8 of every rank's tokens (quantised here, on this GPU,
  without a collective) in the layout, unbounded and bounded, the same bytes as sequential's, the
  combine of the dequantised rows and the straight-through gradients equal to sequential's;
- flux.nn.MoE with chunks = 2, 3 (communication on a side stream, overlapped with the experts)
  against chunks = 1: output and gradients, repeated steps (buffers reused by the allocator),
  token counts the blocks do not divide and a rank without tokens, unbounded and bounded;
- the tensor-parallel MoE ops (flux.ag_scatter_grouped_mm -> SwiGLU -> flux.grouped_mm_gather_rs)
  in bf16, forward and every gradient, each strategy against the unsharded float64 layer, within
  twice the error of the unfused references in bf16; in fp32 on integer-valued data, part 1 and
  part 2 of each strategy bit for bit equal to the references. Ranks sharing a GPU over gloo run
  ``sequential`` and ``decomposed`` (``chunked`` moves CUDA tensors through NCCL); 30 calls of the
  overlapped strategies on alternating problems with one rank's transfers or reads stalled.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
SHARED = torch.cuda.device_count() < WORLD
if SHARED:  # ranks share GPUs: gloo, and symmetric memory across ranks of one device
    os.environ["FLUX_GLOO_CUDA"] = "1"
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flux  # noqa: E402
from flux.ops.moe import symm as _moe_symm  # noqa: E402
from flux.ops import moe as moe_mod  # noqa: E402

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def inputs(rank, tokens, hidden, k, experts, dtype, dev, seed, skew=False, invalid=0.1):
    """Rank ``rank``'s x [T, H] (integers in [-4, 4]), topk_idx [T, K] (distinct experts per row, a
    fraction ``invalid`` of slots -1) and topk_weights [T, K] (powers of two)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randint(-4, 5, (tokens, hidden), generator=gen).to(dtype)
    if skew:
        idx = torch.zeros(tokens, k, dtype=torch.int64)
        idx[:, :] = torch.arange(k)  # every row: experts 0..K-1
    else:
        idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, k, dtype=torch.int64)
    drop = torch.rand(tokens, k, generator=gen) < invalid
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    w = 2.0 ** torch.randint(-2, 2, (tokens, k), generator=gen).float()
    return x.to(dev), idx.to(dev), w.to(dev)


def expected_dispatch(all_inputs, rank, world, experts):
    """Rows rank ``rank`` receives, in order, and its per-local-expert counts."""
    el = experts // world
    rows, counts = [], []
    for e in range(rank * el, (rank + 1) * el):
        n = 0
        for s in range(world):
            x, idx, _ = all_inputs[s]
            for t in range(idx.shape[0]):
                for j in range(idx.shape[1]):
                    if int(idx[t, j]) == e:
                        rows.append(x[t])
                        n += 1
        counts.append(n)
    hidden = all_inputs[0][0].shape[1]
    dtype = all_inputs[0][0].dtype
    return (torch.stack(rows) if rows else torch.zeros(0, hidden, dtype=dtype)), counts


def expert_of_rows(counts, rank, world, experts):
    el = experts // world
    return torch.cat([torch.full((n,), rank * el + e, dtype=torch.float32) for e, n in enumerate(counts)]) \
        if counts else torch.zeros(0)


def run_once(rank, world, dev, group, tokens_of, hidden, k, experts, dtype, seed, cap=None, skew=False,
             zero_pad=True):
    """One dispatch and combine through ``symm``, exact against the expected rows and sums.
    zero_pad=False (bounded): recv_x's memory is first poisoned with NaN (a freed block of its
    size, which the caching allocator hands back), so rows the dispatch leaves unwritten stay NaN,
    and the combine must still be exact: it never reads a row past the counts."""
    all_inputs = [inputs(s, tokens_of(s), hidden, k, experts, dtype, "cpu", seed, skew) for s in range(world)]
    x, idx, w = (t.to(dev) for t in all_inputs[rank])
    want_rows, want_counts = expected_dispatch(all_inputs, rank, world, experts)
    if not zero_pad:
        torch.full((experts // world, world * cap, hidden), float("nan"), dtype=dtype, device=dev)
    recv, counts, handle = moe_mod.run_strategy("symm", x, idx, w, experts, group=group, max_tokens_per_rank=cap,
                                                zero_pad=zero_pad)
    assert handle.strategy == "symm"
    counts_host = handle.counts_host
    assert counts.tolist() == want_counts, f"counts {counts.tolist()} != {want_counts}"
    el = experts // world
    if cap is None:
        assert counts_host == want_counts
        assert torch.equal(recv.cpu(), want_rows), "received rows differ"
        y = recv.float() + expert_of_rows(want_counts, rank, world, experts).to(dev)[:, None]
    else:
        assert counts_host is None and recv.shape == (el, world * cap, hidden)
        start = 0
        for e, n in enumerate(want_counts):
            assert torch.equal(recv[e, :n].cpu(), want_rows[start:start + n]), f"expert {e}: rows differ"
            if zero_pad:
                assert not recv[e, n:].any(), f"expert {e}: rows past the count are not zero"
            else:  # not written: still the poison
                assert bool(recv[e, n:].isnan().all()), f"expert {e}: rows past the count were written"
            start += n
        y = recv.float() + (rank * el + torch.arange(el, device=dev, dtype=torch.float32))[:, None, None]
    out = flux.moe_combine(y.to(dtype), handle)
    xf, idxc, wc = x.float().cpu(), idx.cpu(), w.cpu()
    want = torch.zeros(x.shape[0], hidden)
    for t in range(x.shape[0]):
        for j in range(k):
            if int(idxc[t, j]) >= 0:
                want[t] += wc[t, j] * (xf[t] + float(idxc[t, j]))
    assert torch.equal(out.float().cpu(), want.to(dtype).float()), \
        f"combine differs: max {float((out.float().cpu() - want).abs().max())}"


@case
def dispatch_combine_fp32(rank, world, dev, group):
    for k, experts in ((1, 8), (2, 8), (8, 64)):
        run_once(rank, world, dev, group, lambda s: 37 + 11 * s, 256, k, experts, torch.float32, seed=k)


@case
def dispatch_combine_bf16_bounded(rank, world, dev, group):
    run_once(rank, world, dev, group, lambda s: 64 - 9 * s, 7168, 8, 64, torch.bfloat16, seed=3, cap=64)
    run_once(rank, world, dev, group, lambda s: 128, 4096, 2, 8, torch.bfloat16, seed=4, cap=128)
    # Without the zeros (most of recv_x at 64 experts, top-8); the rows past the counts are NaN.
    run_once(rank, world, dev, group, lambda s: 64 - 9 * s, 7168, 8, 64, torch.bfloat16, seed=3, cap=64,
             zero_pad=False)


@case
def rank_sends_nothing_and_one_expert(rank, world, dev, group):
    run_once(rank, world, dev, group, lambda s: 0 if s == 1 else 50, 512, 2, 8, torch.bfloat16, seed=5)
    run_once(rank, world, dev, group, lambda s: 40, 512, 4, 8, torch.float32, seed=6, skew=True)
    run_once(rank, world, dev, group, lambda s: 0 if s == 0 else 30, 512, 2, 8, torch.float32, seed=7, cap=32)


@case
def repeat20_alternating(rank, world, dev, group):
    for i in range(20):
        cap = 48 if i % 3 == 2 else None
        hidden = 1024 if i % 2 else 2048
        run_once(rank, world, dev, group, lambda s: 20 + (i * 7 + s * 5) % 25, hidden, 2, 16, torch.bfloat16,
                 seed=100 + i, cap=cap)


@case
def bounded_graph_replay(rank, world, dev, group):
    tokens, hidden, k, experts, cap = 32, 1024, 4, 16, 32
    x, idx, w = inputs(rank, tokens, hidden, k, experts, torch.bfloat16, dev, seed=50)
    static = [x.clone(), idx.clone(), w.clone()]

    def step():
        recv, _, handle = flux.moe_dispatch(static[0], static[1], static[2], experts, group=group,
                                            max_tokens_per_rank=cap)
        return recv, flux.moe_combine(recv, handle)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_g, out_g = step()
    for rep in range(3):
        all_inputs = [inputs(s, tokens, hidden, k, experts, torch.bfloat16, "cpu", seed=60 + rep) for s in range(world)]
        for t, v in zip(static, all_inputs[rank]):
            t.copy_(v.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        want_rows, want_counts = expected_dispatch(all_inputs, rank, world, experts)
        start = 0
        for e, n in enumerate(want_counts):
            assert torch.equal(recv_g[e, :n].cpu(), want_rows[start:start + n]), f"replay {rep}: expert {e}"
            start += n
        xf, idxc, wc = (t.cpu() for t in all_inputs[rank])
        want = torch.zeros(tokens, hidden)
        for t in range(tokens):
            for j in range(k):
                if int(idxc[t, j]) >= 0:
                    want[t] += wc[t, j] * xf[t].float()
        assert torch.equal(out_g.float().cpu(), want.to(torch.bfloat16).float()), f"replay {rep}: combine"


@case
def bounded_errors_on_every_rank(rank, world, dev, group):
    """The bounded dispatch's verdict, exchanged with the rows: a bad id on rank 1, a duplicate on
    rank 0, T > C on the last rank, then (after a checked call) a local argument error on rank 1
    whose peers skip the store exchange: nothing moves (recv_x, counts, combine zero on every
    rank), every rank's handle.check() raises naming the rank, and the next call is right."""
    import contextlib
    from unittest import mock

    from flux.ops import _checks

    experts, hidden, k, cap = 4 * world, 256, 2, 8
    x, idx, w = inputs(rank, cap, hidden, k, experts, torch.bfloat16, dev, seed=80)
    want = {"id": "rank 1: topk_idx holds an expert id outside",
            "duplicate": "rank 0: a row of topk_idx lists an expert twice",
            "capacity": f"rank {world - 1}: x.shape[0] (T) exceeds max_tokens_per_rank"}
    for bad, text in want.items():
        xb, ib = x, idx.clone()
        if rank == 1 and bad == "id":
            ib[0, 1] = experts + 3
        if rank == 0 and bad == "duplicate":
            ib[2] = torch.tensor([0, 0], device=dev)
        if rank == world - 1 and bad == "capacity":
            xb, ib = torch.cat([x, x[:1]]), torch.cat([ib, ib[:1]])
        wb = torch.ones(xb.shape[0], k, device=dev)
        recv, counts, handle = flux.moe_dispatch(xb, ib, wb, experts, group=group, zero_pad=True, max_tokens_per_rank=cap)
        assert handle.strategy == "symm"
        assert not recv.any() and not counts.any(), f"{bad}: rows moved although a rank's data was invalid"
        assert not flux.moe_combine(recv + 1, handle).any(), f"{bad}: combine after an invalid dispatch"
        try:
            handle.check()
        except flux.FluxInputError as e:
            assert text in str(e), f"{bad}: {e}"
        else:
            raise AssertionError(f"{bad}: handle.check() did not raise")
    header = mock.patch.object(_checks, "_carries_header", lambda g: False) if SHARED else contextlib.nullcontext()
    with header, mock.patch.object(moe_mod.strategies, "cuda_group", lambda g: True):
        _checks.reset_cache()
        flux.moe_dispatch(x, idx, w, experts, group=group, zero_pad=True, max_tokens_per_rank=cap)[2].check()
        wb = torch.ones(x.shape[0], k + 1, device=dev) if rank == 1 else w
        recv, counts, handle = flux.moe_dispatch(x, idx, wb, experts, group=group, zero_pad=True, max_tokens_per_rank=cap)
        assert not recv.any() and not counts.any(), "rows moved although rank 1's arguments were invalid"
        try:
            handle.check()
        except flux.FluxInputError as e:
            assert "rank 1: its arguments are invalid" in str(e), str(e)
        else:
            raise AssertionError("a local error on rank 1: handle.check() did not raise")
        _checks.reset_cache()
    run_once(rank, world, dev, group, lambda s: cap, hidden, k, experts, torch.bfloat16, seed=81, cap=cap)


@case
def gradients_match_sequential(rank, world, dev, group):
    experts, hidden, k = 16, 512, 4
    for cap in (None, 48):
        # T differs between ranks and stays within C = 48 at any world size
        x0, idx, w0 = inputs(rank, 40 + 3 * (rank % 3), hidden, k, experts, torch.float32, dev, seed=70)
        x0 = x0 + 0.25 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(rank)).to(dev)
        scale = torch.linspace(0.5, 1.5, hidden, device=dev)
        g = torch.randn(x0.shape, generator=torch.Generator().manual_seed(10 + rank)).to(dev)
        grads = {}
        for name in ("sequential", "symm"):
            moe_mod.strategies._choose_strategy = (lambda n: lambda *a: n)(name)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            recv, _, handle = flux.moe_dispatch(x, idx, w, experts, group=group, zero_pad=True, max_tokens_per_rank=cap)
            assert handle.strategy == name
            out = flux.moe_combine(recv * scale, handle)
            out.backward(g)
            grads[name] = (out.detach(), x.grad, w.grad)
        moe_mod.strategies._choose_strategy = _CHOOSE
        assert grads["symm"][1] is not None and grads["symm"][1].abs().sum() > 0, f"cap={cap}: no gradient for x"
        for what, a, b in zip(("out", "d x", "d topk_weights"), grads["symm"], grads["sequential"]):
            assert torch.equal(a, b), f"cap={cap}: {what} differs from sequential by {float((a - b).abs().max())}"


_CHOOSE = moe_mod.strategies._choose_strategy


def fp8_inputs(rank, tokens, hidden, k, experts, dev, seed):
    """inputs(), x made bf16 with non-integer values and a power-of-two magnitude per 128-element
    block (2^-8 .. 2^5), so the quantisation rounds and the scales differ between blocks."""
    x, idx, w = inputs(rank, tokens, hidden, k, experts, torch.float32, "cpu", seed)
    gen = torch.Generator().manual_seed(seed * 1000 + rank + 500)
    mag = 2.0 ** torch.randint(-8, 6, (tokens, hidden // 128, 1), generator=gen).float()
    x = (x + torch.rand(x.shape, generator=gen)).view(tokens, hidden // 128, 128) * mag
    return x.view(tokens, hidden).to(torch.bfloat16).to(dev), idx.to(dev), w.to(dev)


def packed_bytes(q, scales):
    """A row's fp8 bytes, then its scales' bytes: ``[..., H + 4 H / 128]`` uint8."""
    return torch.cat([q.view(torch.uint8), scales.view(torch.uint8)], -1)


@case
def fp8_dispatch_layout(rank, world, dev, group):
    shapes = ((lambda s: 37 + 11 * s, 7168, 8, 64, None), (lambda s: 64 - 9 * s, 7168, 8, 64, 64),
              (lambda s: 0 if s == 1 else 20, 128, 2, 8, None), (lambda s: 30, 256, 4, 8, 32))
    for tokens_of, hidden, k, experts, cap in shapes:
        all_inputs = [fp8_inputs(s, tokens_of(s), hidden, k, experts, dev, seed=80 + k) for s in range(world)]
        x, idx, w = all_inputs[rank]
        # What every rank sends, quantised here: rows of packed bytes, routed on the host.
        sent = [(packed_bytes(*moe_mod.quantize_fp8(t[0])).cpu(), t[1].cpu(), None) for t in all_inputs]
        want_rows, want_counts = expected_dispatch(sent, rank, world, experts)
        el = experts // world
        got = {}
        for name in ("symm", "sequential"):
            (q, scales), counts, handle = moe_mod.run_strategy(name, x, idx, w, experts, group=group,
                                                               max_tokens_per_rank=cap, fp8=True, zero_pad=True)
            what = f"{name} H={hidden} K={k} C={cap}"
            assert handle.strategy == name and handle.fp8, what
            assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32, what
            assert counts.tolist() == want_counts, f"{what}: counts {counts.tolist()} != {want_counts}"
            rows = packed_bytes(q, scales).cpu()
            if cap is None:
                assert torch.equal(rows, want_rows), f"{what}: received fp8 rows or scales differ"
                y = moe_mod.dequantize_fp8(q, scales) * (1 + torch.repeat_interleave(
                    torch.arange(el, device=dev), counts)[:, None]).to(torch.bfloat16)
            else:
                assert q.shape == (el, world * cap, hidden) and scales.shape == (el, world * cap, hidden // 128)
                start = 0
                for e, n in enumerate(want_counts):
                    assert torch.equal(rows[e, :n], want_rows[start:start + n]), f"{what}: expert {e}: rows differ"
                    assert not rows[e, n:].any(), f"{what}: expert {e}: rows past the count are not zero"
                    start += n
                y = moe_mod.dequantize_fp8(q, scales) * (1 + torch.arange(el, device=dev)[:, None, None]).to(
                    torch.bfloat16)
            got[name] = (rows, flux.moe_combine(y, handle))
        assert torch.equal(got["symm"][0], got["sequential"][0]), f"H={hidden} C={cap}: symm and sequential differ"
        assert torch.equal(got["symm"][1], got["sequential"][1]), f"H={hidden} C={cap}: combine differs"


@case
def fp8_gradients_match_sequential(rank, world, dev, group):
    experts, hidden, k = 16, 512, 4
    for cap in (None, 48):
        # T differs between ranks and stays within C = 48 at any world size
        x0, idx, w0 = fp8_inputs(rank, 40 + 3 * (rank % 3), hidden, k, experts, dev, seed=90)
        scale = torch.linspace(0.5, 1.5, hidden, device=dev, dtype=torch.bfloat16)
        g = torch.randn(x0.shape, generator=torch.Generator().manual_seed(20 + rank)).to(dev, torch.bfloat16)
        grads = {}
        for name in ("sequential", "symm"):
            moe_mod.strategies._choose_strategy = (lambda n: lambda *a: n)(name)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            recv, _, handle = flux.moe_dispatch(x, idx, w, experts, group=group, zero_pad=True, max_tokens_per_rank=cap, fp8=True)
            assert handle.strategy == name and handle.fp8
            out = flux.moe_combine(moe_mod.dequantize_fp8(*recv) * scale, handle)
            out.backward(g)
            grads[name] = (out.detach(), x.grad, w.grad)
        moe_mod.strategies._choose_strategy = _CHOOSE
        assert grads["symm"][1] is not None and grads["symm"][1].abs().sum() > 0, f"cap={cap}: no gradient for x"
        for what, a, b in zip(("out", "d x", "d topk_weights"), grads["symm"], grads["sequential"]):
            assert torch.equal(a, b), f"cap={cap}: {what} differs from sequential by {float((a - b).abs().max())}"


def rel_err(a, b):
    """max |a - b| relative to max |b| (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


@case
def moe_layer_chunks(rank, world, dev, group):
    import flux.nn as fnn

    hidden, ffn, experts, k = 1024, 512, 16, 4
    for dtype, cap, tol in ((torch.float32, None, 1e-5), (torch.float32, 96, 1e-5), (torch.bfloat16, 96, 2e-2)):
        tokens = [90, 0][rank % 2] if cap is None else [96, 37][rank % 2]
        ref = None
        for c in (1, 2, 3):
            moe = fnn.MoE(hidden, ffn, experts, k, group=group, seed=9, dtype=dtype, device=dev,
                          max_tokens_per_rank=cap, chunks=c)
            for step in range(3):  # the same data each step (a buffer reused too early would show)
                gen = torch.Generator().manual_seed(100 + rank)
                x = torch.randn(tokens, hidden, generator=gen).to(dev, dtype).requires_grad_()
                g = torch.randn(tokens, hidden, generator=gen).to(dev, dtype)
                moe.zero_grad()
                y = moe(x)
                y.backward(g)
                got = [y.detach().float(), x.grad.float(), moe.w13.grad.float(), moe.w2.grad.float(),
                       moe.router.weight.grad.float()]
                if step == 0:
                    first = got
                for name, a, b in zip(("out", "d x", "d w13", "d w2", "d router"), got, first):
                    err = rel_err(a, b)
                    assert err <= tol, f"{dtype} C={cap} chunks={c} step {step}: {name} changed by {err:.3g} (of max)"
            if ref is None:
                ref = first
                continue
            for name, a, b in zip(("out", "d x", "d w13", "d w2", "d router"), first, ref):
                err = rel_err(a, b)
                assert err <= tol, f"{dtype} C={cap} chunks={c}: {name} differs from chunks=1 by {err:.3g} (of max)"


# --------------------------------------------------------------------------------------
# The tensor-parallel MoE ops (flux.ag_scatter_grouped_mm / flux.grouped_mm_gather_rs): every
# rank builds the whole problem from seeds (tests/_moe_tp_problem.py) and takes its shard.


def tp_strategies(group):
    """The TP MoE strategies this group can run on CUDA tensors: 'chunked' needs NCCL (its
    point-to-point transfers), so ranks sharing a GPU over gloo run 'sequential' and 'decomposed'."""
    from flux.ops import moe_tp

    return [n for n in moe_tp.STRATEGIES if n != "chunked" or not moe_tp._is_gloo(group)]


def tp_forced(name):
    from flux.ops import moe_tp

    os.environ[moe_tp.STRATEGY_ENV] = name


def tp_unforce():
    from flux.ops import moe_tp

    os.environ.pop(moe_tp.STRATEGY_ENV, None)


def tp_mlp_run(fns, p, rank, world, layout, dtype, dev, g):
    """(out, d x, d w1, d w2, d topk_weights) of part 1 -> SwiGLU -> part 2 through ``fns`` (the
    public functions or the references), on this rank's shard in ``dtype``."""
    from _moe_tp_problem import act, shard

    x, idx, tw, w1, w2 = shard(p, rank, world, layout)
    x, w1, w2 = (t.to(dev, dtype).requires_grad_() for t in (x, w1, w2))
    tw = tw.to(dev, torch.float32).requires_grad_()
    hid, routing = fns[0](x, idx.to(dev), w1, weight_layout=layout)
    out = fns[1](act(hid, True), w2, routing, tw, weight_layout=layout)
    out.backward(g.to(dev, dtype))
    return [out.detach(), x.grad, w1.grad, w2.grad, tw.grad]


@case
def tp_moe_mlp_bf16(rank, world, dev, group):
    """The TP MoE MLP in bf16 (torch._grouped_mm on sm90), forward and every gradient, against
    the unsharded float64 layer; the tolerance is derived from the unfused references run in
    bf16 on the same data: flux's error at most twice theirs (plus 1e-3 of the maximum)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _moe_tp_problem import full_mlp, problem, shard

    refs = (flux.ag_scatter_grouped_mm_ref, flux.grouped_mm_gather_rs_ref)
    public = (flux.ag_scatter_grouped_mm, flux.grouped_mm_gather_rs)
    # (seed, tokens per rank, H, F, E, K, skew, layout): 16-aligned sizes; skewed routing leaves experts idle
    for seed, tl, h, f, e, k, skew, layout in ((40, 256, 512, 256 * world, 8, 2, None, "nk"),
                                               (41, 192, 256, 128 * world, 4, 1, 2, "kn")):
        p = problem(seed, world, tl, h, f, e, k, skew=skew)
        full = {n: (v.to(dev).clone().requires_grad_() if v.is_floating_point() else v.to(dev)) for n, v in p.items()}
        want = full_mlp(full, True)
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        (want * g.to(dev)).sum().backward()
        rows = slice(rank * tl, (rank + 1) * tl)
        grads_full = dict(p, w13=full["w13"].grad.cpu(), w2=full["w2"].grad.cpu())
        _, _, _, g1, g2 = shard(grads_full, rank, world, layout)
        exact = [want[rows].detach(), full["x"].grad[rows], g1.to(dev), g2.to(dev), full["tw"].grad[rows]]
        base = tp_mlp_run(refs, p, rank, world, layout, torch.bfloat16, dev, g[rows])
        base_err = [rel_err(a.double(), b) for a, b in zip(base, exact)]
        for strat in tp_strategies(group):
            tp_forced(strat)
            try:
                got = tp_mlp_run(public, p, rank, world, layout, torch.bfloat16, dev, g[rows])
            finally:
                tp_unforce()
            for name, a, b, be in zip(("out", "d x", "d w1", "d w2", "d topk_weights"), got, exact, base_err):
                assert a.dtype == (torch.float32 if name == "d topk_weights" else torch.bfloat16), (name, a.dtype)
                err = rel_err(a.double(), b)
                assert err <= 2 * be + 1e-3, (f"E={e} K={k} {layout} {strat}: {name} error {err:.3g} of max, "
                                              f"the bf16 references' {be:.3g}")


@case
def tp_moe_exact_fp32(rank, world, dev, group):
    """Integer-valued data in fp32 on the GPU (products and sums exact): part 1's rows and part 2's
    output of every strategy equal, bit for bit, to the unfused references, over 5 calls on
    alternating shapes; and the routing the same on every rank."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _moe_tp_problem import problem, shard

    for call in range(5):
        seed, tl, e, k = (50, 64, 8, 2) if call % 2 == 0 else (51, 40, 6, 3)
        p = problem(seed, world, tl, 64, 32 * world, e, k, integer=True)
        x, idx, tw, w1, w2 = (t.to(dev) for t in shard(p, rank, world, "nk", gated=False))
        x, tw, w1, w2 = (t.to(torch.float32) for t in (x, tw, w1, w2))
        want1, r_ref = flux.ag_scatter_grouped_mm_ref(x, idx, w1)
        hid = torch.randint(-4, 5, (r_ref.num_rows, w2.shape[2]), generator=torch.Generator().manual_seed(seed))
        hid = hid.to(dev, torch.float32)
        want2 = flux.grouped_mm_gather_rs_ref(hid, w2, r_ref, tw)
        for strat in tp_strategies(group):
            tp_forced(strat)
            try:
                got1, r = flux.ag_scatter_grouped_mm(x, idx, w1)
                got2 = flux.grouped_mm_gather_rs(hid, w2, r, tw)
            finally:
                tp_unforce()
            assert r.counts_host == r_ref.counts_host and torch.equal(r.pairs, r_ref.pairs), f"call {call} {strat}"
            assert torch.equal(got1, want1), f"call {call} {strat}: part 1 differs by {float((got1 - want1).abs().max())}"
            assert torch.equal(got2, want2), f"call {call} {strat}: part 2 differs by {float((got2 - want2).abs().max())}"
        # every rank holds the same gathered routing
        sig = torch.tensor([float(r_ref.pairs.sum()), float(r_ref.num_rows)], dtype=torch.float64, device=dev)
        mine = sig.clone()
        dist.all_reduce(sig, op=dist.ReduceOp.MAX)
        assert torch.equal(sig, mine), f"call {call}: the ranks' routings differ"


@case
def tp_moe_delayed(rank, world, dev, group):
    """The overlapped strategies (chunked, decomposed: where they run) over 30 calls of part 1 then part
    2 on two alternating integer-valued fp32 problems of one shape, with stalls (a GPU spin of ~1
    ms): before every third call one rank's runtime communication stream (decomposed's transfers: the
    peers' waits must really wait), before every fifth another rank's current stream (its reads of
    the workspace come late: the next call must not overwrite them). Every output bitwise equal to
    the references'. A read before its wait, or an overwrite before the reader is done, shows as a
    row of the other problem."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _moe_tp_problem import problem, shard
    import flux.testing

    probs = []
    for seed in (60, 61):
        p = problem(seed, world, 48, 64, 32 * world, 8, 2, integer=True)
        x, idx, tw, w1, w2 = (t.to(dev) for t in shard(p, rank, world, "nk", gated=False))
        x, tw, w1, w2 = (t.to(torch.float32) for t in (x, tw, w1, w2))
        want1, r_ref = flux.ag_scatter_grouped_mm_ref(x, idx, w1)
        gen = torch.Generator().manual_seed(seed)
        hid = torch.randint(-4, 5, (r_ref.num_rows, w2.shape[2]), generator=gen).to(dev, torch.float32)
        probs.append((x, idx, tw, w1, w2, hid, want1, flux.grouped_mm_gather_rs_ref(hid, w2, r_ref, tw)))
    spin = 2_000_000  # cycles, ~1 ms
    for strat in [n for n in tp_strategies(group) if n != "sequential"]:
        tp_forced(strat)
        try:
            for call in range(-1, 30):  # call -1: every rank makes the runtime and its workspace
                x, idx, tw, w1, w2, hid, want1, want2 = probs[call % 2]
                if call >= 0 and call % 3 == 0 and rank == call % world and strat == "decomposed":
                    comm = flux.testing.comm_stream(group)
                    comm.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(comm):
                        torch.cuda._sleep(spin)
                if call >= 0 and call % 5 == 0 and rank == (call + 1) % world:
                    torch.cuda._sleep(spin)
                got1, r = flux.ag_scatter_grouped_mm(x, idx, w1)
                got2 = flux.grouped_mm_gather_rs(hid, w2, r, tw)
                assert torch.equal(got1, want1), f"{strat} call {call}: part 1 differs"
                assert torch.equal(got2, want2), f"{strat} call {call}: part 2 differs"
        finally:
            tp_unforce()


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo" if SHARED else "nccl", device_id=None if SHARED else dev)
    group = dist.group.WORLD
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    names = list(CASES) if which == "all" else which.split(",")
    out_dir = os.environ.get("FLUX_GPU_RESULTS_DIR")
    lines = []
    why = _moe_symm.usable(group, dev)
    from flux.ops import moe_tp

    moe_tp_why = moe_tp.decomposed_usable(dev, group)
    # The automatic choice: symm for bounded calls where it can run, the all-to-all for unbounded ones.
    assert why is not None or moe_mod._choose_strategy(torch.empty(1, device=dev), group, True) == "symm"
    assert moe_mod._choose_strategy(torch.empty(1, device=dev), group, False) == "sequential"
    for name in names:
        rec = {"case": name, "rank": rank, "status": "ok", "error": None}
        # The tp_ cases need the TP ops' decomposed strategy (moe_tp.decomposed_usable), the others MoE's symm.
        skip = moe_tp_why if name.startswith("tp_") else why
        if skip is not None:
            rec.update(status="skip", error=skip)
        else:
            try:
                CASES[name](rank, world, dev, group)
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                rec.update(status="fail", error=traceback.format_exc()[-3000:])
        line = "FLUXMOE " + json.dumps(rec)
        print(line, flush=True)
        lines.append(line)
    if out_dir:
        with open(os.path.join(out_dir, f"moe.{rank}"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
