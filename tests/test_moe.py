"""flux.moe_dispatch / flux.moe_combine in gloo processes (world sizes 2 and 4).

Every rank builds every rank's inputs from seeds, so each case checks its own results against
an independent single-process computation:

- recv_x's content and order (expert-major, then source rank, token, slot), counts and
  counts_host, both variants (bounded: rows past counts zero), and the unchecked references;
- round trips exact on integer-valued data with power-of-two weights: combine(recv_x) equals
  sum_k w[t, k] * x[t]; random routings, experts that receive nothing, a rank with T = 0, all
  tokens to one expert (the bounded buffer exactly full), -1 slots, K = 1 and K = 8, E = 8 and 64;
- gradients of x, topk_weights, the experts' outputs y and the experts' weights against
  autograd through the unsharded computation in float64, eagerly and through the dispatcher ops;
- bad arguments: the same FluxInputError on every rank, then the group still works; the
  bounded variant's deferred verdict (the CUDA path's) run on gloo;
- torch.library.opcheck of flux::moe_dispatch and flux::moe_combine;
- fp8 dispatch: quantize_fp8 / dequantize_fp8 in this process (the format, the round trip within
  fp8's rounding bound, the checks); the received fp8 rows and scales byte for byte equal to
  quantize_fp8 of every rank's tokens, computed here (unbounded, bounded, the deferred verdict's
  path, the reference, the dispatcher ops); the straight-through gradient equal, bitwise, to that
  of an unquantised dispatch of the dequantised tokens; its errors on every rank.
"""
import os

import pytest
import torch
import torch.distributed as dist

import flux
from flux.ops import moe as moe_ops
from _dist import CASES, batches, case
from _ref import expect_flux_error

WORLDS = (2, 4)
F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


# --------------------------------------------------------------------------------------
# Inputs and the independent expectation


def make_inputs(seed, rank, tokens, h, k, e, dtype=F64, drop=0.25, idx_dtype=torch.int64):
    """Rank ``rank``'s (x, topk_idx, topk_weights): integer-valued x in [-8, 8], k distinct
    experts per token with a fraction ``drop`` of the slots -1, weights in {1/4, 1/2, 1, 2}."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randint(-8, 9, (tokens, h), generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]) if tokens else \
        torch.empty((0, k), dtype=torch.int64)
    idx[torch.rand((tokens, k), generator=g) < drop] = -1
    w = 2.0 ** torch.randint(-2, 2, (tokens, k), generator=g).to(F64)
    return x, idx.to(idx_dtype), w.to(F32 if dtype != F64 else F64)


def all_inputs(seed, world, sizes, h, k, e, **kw):
    return [make_inputs(seed, r, sizes[r], h, k, e, **kw) for r in range(world)]


def expected_rows(values, idxs, rank, world, e):
    """Per local expert of ``rank``: the list of rows ``values[s][t]`` (or ``values[s][t][k]`` when
    ``values[s]`` is per pair) of every pair routed to it, by source, token, slot."""
    el = e // world
    out = [[] for _ in range(el)]
    for le in range(el):
        gid = rank * el + le
        for s in range(world):
            for t, row in enumerate(idxs[s].tolist()):
                for k, ex in enumerate(row):
                    if ex == gid:
                        v = values[s][t]
                        out[le].append(v[k] if v.dim() == 2 else v)
    return out


def expected_recv(values, idxs, rank, world, e, h, dtype, cap=None):
    rows = expected_rows(values, idxs, rank, world, e)
    blocks = [torch.stack(r).to(dtype) if r else torch.zeros((0, h), dtype=dtype) for r in rows]
    counts = [b.shape[0] for b in blocks]
    if cap is None:
        return torch.cat(blocks), counts
    padded = [torch.cat([b, torch.zeros((world * cap - b.shape[0], h), dtype=dtype)]) for b in blocks]
    return torch.stack(padded), counts


def expected_round_trip(x, idx, w):
    """combine(dispatch(x)) with y = recv_x: sum over valid k of w[t, k] * x[t]."""
    wv = torch.where(idx >= 0, w.to(F64), torch.zeros((), dtype=F64))
    return (wv.sum(1, keepdim=True) * x.to(F64)).to(x.dtype)


def check_layout(seed, rank, world, sizes, h, k, e, dtype, caps=(None,), drop=0.25):
    inputs = all_inputs(seed, world, sizes, h, k, e, dtype=dtype, drop=drop)
    x, idx, w = inputs[rank]
    xs, idxs = [i[0] for i in inputs], [i[1] for i in inputs]
    el = e // world
    for cap in caps:
        recv_x, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        want, want_counts = expected_recv(xs, idxs, rank, world, e, h, dtype, cap)
        what = f"E={e} K={k} T={sizes} {dtype} C={cap}"
        assert recv_x.dtype == dtype and counts.dtype == torch.int64, what
        assert tuple(recv_x.shape) == tuple(want.shape), f"{what}: recv_x {tuple(recv_x.shape)} != {tuple(want.shape)}"
        assert torch.equal(recv_x, want), f"{what}: recv_x content or order"
        assert counts.tolist() == want_counts and counts.shape == (el,), what
        assert handle.counts_host == (want_counts if cap is None else None), what
        out = flux.moe_combine(recv_x, handle)
        assert out.dtype == dtype and torch.equal(out, expected_round_trip(x, idx, w)), f"{what}: round trip"
        ref_x, ref_counts = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=cap)
        assert torch.equal(ref_x, want) and ref_counts.tolist() == want_counts, f"{what}: moe_dispatch_ref"
        ref_out = flux.moe_combine_ref(recv_x, idx, w, e, max_tokens_per_rank=cap)
        assert torch.equal(ref_out, out), f"{what}: moe_combine_ref"
        if cap is not None:  # zero_pad=False: the same rows up to the counts (past them undefined)
            nx, ncounts, nhandle = flux.moe_dispatch(x, idx, w, e, max_tokens_per_rank=cap, zero_pad=False)
            assert ncounts.tolist() == want_counts, f"{what} zero_pad=False: counts"
            for le, c in enumerate(want_counts):
                assert torch.equal(nx[le, :c], want[le, :c]), f"{what} zero_pad=False: expert {le}"
            keep = (torch.arange(nx.shape[1])[None, :] < ncounts[:, None])[..., None]
            nout = flux.moe_combine(torch.where(keep, nx, torch.zeros((), dtype=dtype)), nhandle)
            assert torch.equal(nout, out), f"{what} zero_pad=False: round trip"
    return sum(want_counts)


# --------------------------------------------------------------------------------------
# Layout and round trips


@case("moe-layout", worlds=WORLDS)
def _layout(rank, world):
    rows = []
    sizes = [5, 0, 7, 3][:world]  # rank 1 has no token
    rows.append(check_layout(1, rank, world, sizes, 6, 1, 8, F32, caps=(None, 7, 10)))
    rows.append(check_layout(2, rank, world, [6, 4, 1, 5][:world], 4, 8, 8, F64, caps=(None, 6)))
    rows.append(check_layout(3, rank, world, [9, 0, 12, 2][:world], 8, 8, 64, BF16, caps=(None, 12)))
    # E = 64, few tokens, K = 2: most experts receive nothing.
    rows.append(check_layout(4, rank, world, [3, 2, 1, 2][:world], 5, 2, 64, F32,
                             caps=(None, 3), drop=0.0))
    return rows


@case("moe-one-expert", worlds=WORLDS)
def _one_expert(rank, world):
    """Every token of every rank to one expert (the last rank's last), slot 1 -1 or another
    expert: the bounded buffer of that expert exactly full (T = C on every rank)."""
    e, h, c = 4 * world, 3, 5
    xs = [torch.arange(c * h, dtype=F32).reshape(c, h) + 100 * s for s in range(world)]
    idxs = [torch.tensor([[e - 1, -1 if t % 2 else t % (e - 1)] for t in range(c)]) for s in range(world)]
    ws = [torch.full((c, 2), 0.5) for _ in range(world)]
    for cap in (None, c):
        recv_x, counts, handle = flux.moe_dispatch(xs[rank], idxs[rank], ws[rank], e, zero_pad=True, max_tokens_per_rank=cap)
        want, want_counts = expected_recv(xs, idxs, rank, world, e, h, F32, cap)
        assert torch.equal(recv_x, want) and counts.tolist() == want_counts
        if rank == world - 1:
            assert want_counts[-1] == world * c
        out = flux.moe_combine(recv_x, handle)
        assert torch.equal(out, expected_round_trip(xs[rank], idxs[rank], ws[rank]))
    return True


@case("moe-no-slot", worlds=WORLDS)
def _no_slot(rank, world):
    """Every slot -1 on every rank: nothing moves, combine gives zeros; and a bounded call with
    T = 0 on every rank."""
    e, h = 2 * world, 4
    x = torch.randn(3, h)
    idx = torch.full((3, 2), -1, dtype=torch.int32)
    w = torch.ones(3, 2)
    recv_x, counts, handle = flux.moe_dispatch(x, idx, w, e)
    assert recv_x.shape == (0, h) and counts.tolist() == [0, 0] and handle.counts_host == [0, 0]
    assert torch.equal(flux.moe_combine(recv_x, handle), torch.zeros(3, h))
    recv_x, counts, handle = flux.moe_dispatch(x[:0], idx[:0], w[:0], e, zero_pad=True, max_tokens_per_rank=2)
    assert torch.equal(recv_x, torch.zeros(2, 2 * world, h)) and counts.tolist() == [0, 0]
    assert flux.moe_combine(recv_x, handle).shape == (0, h)
    return True


@case("moe-dtypes", worlds=WORLDS)
def _dtypes(rank, world):
    """y in another float dtype than recv_x: out in y's dtype; fp16 x; int32 topk_idx; the
    accumulation in fp32 of bf16 rows (the sum of 8 slots of 1 + 2^-7 each is exact in fp32, not in bf16)."""
    e, h, k = 8, 4, 8
    inputs = all_inputs(5, world, [4] * world, h, k, e, dtype=torch.float16, idx_dtype=torch.int32)
    x, idx, w = inputs[rank]
    recv_x, counts, handle = flux.moe_dispatch(x, idx, w, e)
    out = flux.moe_combine(recv_x.to(F32) * 3, handle)
    assert out.dtype == F32 and torch.equal(out, expected_round_trip(x, idx, w).to(F32) * 3)
    idx_full = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(rank * 10 + t))
                            for t in range(2)])
    x = torch.ones(2, h, dtype=BF16)
    recv_x, _, handle = flux.moe_dispatch(x, idx_full, torch.ones(2, k), e)
    y = torch.full_like(recv_x, 1 + 2 ** -7)  # representable in bf16; 8 * it is, and bf16 partial sums are not
    out = flux.moe_combine(y, handle)
    assert out.dtype == BF16 and torch.equal(out, torch.full((2, h), 8 * (1 + 2 ** -7), dtype=BF16)), out
    return True


# --------------------------------------------------------------------------------------
# Gradients


class _ThroughOps(torch.overrides.TorchFunctionMode):
    """A pass-through torch-function mode: flux's public functions take the dispatcher path
    (torch.ops.flux.moe_*) under it, with the registered autograd formulas."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _grad_check(rank, world, cap, through_ops):
    e, h, k, seed = 4 * world, 5, 3, 7 + (cap or 0)
    sizes = [4, 0, 3, 4][:world] if cap is None else [cap, 2, cap, 1][:world]
    inputs = all_inputs(seed, world, sizes, h, k, e, dtype=F64, drop=0.2)
    gen = torch.Generator().manual_seed(seed)
    experts = torch.randn((e, h, h), generator=gen, dtype=F64)  # one linear map per expert
    g_out = [torch.randn((sizes[s], h), generator=gen, dtype=F64) for s in range(world)]
    # The unsharded computation.
    xs = [i[0].clone().requires_grad_() for i in inputs]
    ws = [i[2].clone().requires_grad_() for i in inputs]
    ex = experts.clone().requires_grad_()
    loss, outs = 0, []
    for s in range(world):
        idx = inputs[s][1]
        out = torch.zeros((sizes[s], h), dtype=F64)
        for t in range(sizes[s]):
            for kk in range(k):
                if idx[t, kk] >= 0:
                    out[t] = out[t] + ws[s][t, kk] * (xs[s][t] @ ex[idx[t, kk]])
        outs.append(out)
        loss = loss + (out * g_out[s]).sum()
    loss.backward()
    # The sharded computation.
    el = e // world
    x = inputs[rank][0].clone().requires_grad_()
    w = inputs[rank][2].clone().requires_grad_()
    mine = experts[rank * el:(rank + 1) * el].clone().requires_grad_()
    mode = _ThroughOps() if through_ops else None
    if mode is not None:
        mode.__enter__()
    try:
        recv_x, counts, handle = flux.moe_dispatch(x, inputs[rank][1], w, e, zero_pad=True, max_tokens_per_rank=cap)
        if cap is None:
            y = torch.cat([blk @ mine[i] for i, blk in enumerate(recv_x.split(handle.counts_host))])
        else:
            y = torch.bmm(recv_x, mine)
        y.retain_grad()
        out = flux.moe_combine(y, handle)
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    (out * g_out[rank]).sum().backward()

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what} (C={cap}): {m}")

    def ref_grad(t):  # None for a rank without tokens
        return torch.zeros_like(t) if t.grad is None else t.grad

    close(out, outs[rank].detach(), "out")
    close(x.grad, ref_grad(xs[rank]), "d x")
    close(w.grad, ref_grad(ws[rank]), "d topk_weights")
    close(mine.grad, ex.grad[rank * el:(rank + 1) * el], "d expert weights")
    # d y[row of (s, t, k)] = w_s[t, k] * g_s[t]
    per_pair = [inputs[s][2][:, :, None] * g_out[s][:, None, :] for s in range(world)]
    want, _ = expected_recv(per_pair, [i[1] for i in inputs], rank, world, e, h, F64, cap)
    close(y.grad, want, "d y")


@case("moe-grad", worlds=WORLDS)
def _grad(rank, world):
    for cap in (None, 4):
        _grad_check(rank, world, cap, through_ops=False)
    return True


@case("moe-grad-ops", worlds=WORLDS)
def _grad_ops(rank, world):
    for cap in (None, 4):
        _grad_check(rank, world, cap, through_ops=True)
    return True


# --------------------------------------------------------------------------------------
# fp8 dispatch


def fp8_tokens(seed, rank, tokens, h, dtype):
    """Tokens whose 128-element blocks span magnitudes (2^-12 .. 2^8), one all-zero block per
    token (a clamped amax) when H allows, and tiny values that become fp8 subnormals."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    nb = h // 128
    mag = 2.0 ** torch.randint(-12, 9, (tokens, nb, 1), generator=g).to(F64)
    x = torch.randn((tokens, nb, 128), generator=g, dtype=F64) * mag
    x[:, :, :4] *= 2.0 ** -14  # fp8 subnormals after scaling (|x / scale| < 2^-6)
    if nb > 1 and tokens:
        x[:, torch.randint(0, nb, (1,), generator=g)] = 0
    return x.reshape(tokens, h).to(dtype)


def test_quantize_fp8_format_and_round_trip():
    for dtype in (BF16, torch.float16, F32):
        x = fp8_tokens(1, 0, 33, 512, dtype)
        q, scales = moe_ops.quantize_fp8(x)
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
        assert scales.dtype == F32 and scales.shape == (33, 4)
        amax = x.float().view(33, 4, 128).abs().amax(-1)
        assert torch.equal(scales, amax.clamp(min=1e-4) / 448), dtype
        qf = q.float().view(33, 4, 128)
        big = amax >= 1e-4
        assert torch.equal(qf.abs().amax(-1)[big], torch.full_like(amax[big], 448.0)), "block max is not +-448"
        assert (qf.abs().amax(-1)[~big] < 448).all() and not qf[amax == 0].any()
        assert (amax == 0).any(), "no all-zero block: the test data does not exercise the clamp"
        back = moe_ops.dequantize_fp8(q, scales, F32)
        assert back.dtype == F32 and back.shape == x.shape
        # fp8 e4m3: 3 mantissa bits (relative error <= 2^-4) for |x / scale| >= 2^-6, subnormal
        # spacing 2^-9 below (error <= 2^-10 scale); a little slack for fp32's own rounding.
        xs = x.float().view(33, 4, 128)
        err = (back.view(33, 4, 128) - xs).abs()
        bound = torch.maximum(xs.abs() * 2.0 ** -4, scales[..., None] * 2.0 ** -10) * (1 + 2.0 ** -20)
        assert (err <= bound).all(), f"{dtype}: round trip error {float((err / bound).max())} of the bound"
        assert (err > 0).any(), "no rounding at all: the test data does not exercise fp8"
        assert moe_ops.dequantize_fp8(q, scales).dtype == BF16
        # Leading dimensions pass through (the bounded layout).
        q3, s3 = moe_ops.quantize_fp8(x.view(3, 11, 512))
        assert torch.equal(q3.view(33, 512).view(torch.uint8), q.view(torch.uint8)) and torch.equal(s3.view(33, 4),
                                                                                                    scales)
    with pytest.raises(flux.FluxInputError, match="not a multiple of 128"):
        moe_ops.quantize_fp8(torch.ones(2, 100))
    with pytest.raises(flux.FluxInputError, match="scales must have shape"):
        moe_ops.dequantize_fp8(q, scales[:, :3])
    with pytest.raises(flux.FluxInputError, match="float8_e4m3fn"):
        moe_ops.dequantize_fp8(q.float(), scales)


def _packed_rows(x):
    """Rows of quantize_fp8(x) as ``[T, H + 4 H / 128]`` bytes (fp8 bytes, then the scales')."""
    q, s = moe_ops.quantize_fp8(x)
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], 1)


def _check_fp8_recv(recv, counts, want_bytes, want_counts, h, what):
    q, s = recv
    assert q.dtype == torch.float8_e4m3fn and s.dtype == F32, what
    assert q.shape[:-1] == s.shape[:-1] and q.shape[-1] == h and s.shape[-1] == h // 128, what
    got = torch.cat([q.view(torch.uint8), s.view(torch.uint8)], -1)
    assert got.shape == want_bytes.shape, f"{what}: {tuple(got.shape)} != {tuple(want_bytes.shape)}"
    assert torch.equal(got, want_bytes), f"{what}: fp8 rows or scales differ from quantize_fp8 of the tokens"
    assert counts.tolist() == want_counts, what


@case("moe-fp8-layout", worlds=WORLDS)
def _fp8_layout(rank, world):
    """The received fp8 rows and scales are quantize_fp8 of every rank's tokens, computed here,
    byte for byte, in the dispatch's layout: unbounded, bounded (zeros past the counts), the
    deferred verdict's path, the reference, the dispatcher ops; combine of the dequantised rows."""
    group = dist.group.WORLD
    for h, k, e, dtype, sizes, cap in ((256, 2, 2 * world, BF16, [5, 0, 7, 3], 8), (128, 4, 8, F32, [4, 6, 1, 2], 6),
                                       (384, 1, 4 * world, torch.float16, [3, 3, 0, 5], 5)):
        sizes = sizes[:world]
        _, idxs, ws = zip(*all_inputs(50 + h, world, sizes, 4, k, e))
        xs = [fp8_tokens(h, s, sizes[s], h, dtype) for s in range(world)]
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        packed = [_packed_rows(t) for t in xs]
        for c in (None, cap):
            what = f"H={h} K={k} E={e} {dtype} C={c}"
            want, want_counts = expected_recv(packed, idxs, rank, world, e, packed[0].shape[1], torch.uint8, c)
            recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=c, fp8=True)
            _check_fp8_recv(recv, counts, want, want_counts, h, what)
            assert handle.fp8 and "fp8" in repr(handle) and handle.recv_shape == tuple(recv[0].shape), what
            ref_recv, ref_counts = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=c, fp8=True)
            _check_fp8_recv(ref_recv, ref_counts, want, want_counts, h, what + " (moe_dispatch_ref)")
            # Combine stays in the experts' dtype: here the dequantised rows, back to their tokens.
            y = moe_ops.dequantize_fp8(*recv, dtype=F32)
            out = flux.moe_combine(y, handle)
            deq = moe_ops.dequantize_fp8(*moe_ops.quantize_fp8(x), dtype=F64)
            torch.testing.assert_close(out.to(F64), expected_round_trip(deq, idx, w.to(F64)), rtol=1e-6, atol=0)
            with _ThroughOps(), torch.no_grad():
                recv2, counts2, handle2 = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=c, fp8=True)
            _check_fp8_recv(recv2, counts2, want, want_counts, h, what + " (dispatcher op)")
            assert handle2.fp8 and handle2.recv_shape == handle.recv_shape, what
            if c is not None:  # the bounded variant's verdict without a host read (CUDA groups' path)
                raw, counts3, handle3 = moe_ops._dispatch_impl(x, idx, w, e, group, c, defer_verdict=True, fp8=True)
                handle3.check()
                _check_fp8_recv(moe_ops._unpack_fp8(raw, h), counts3, want, want_counts, h, what + " (deferred)")
    return True


@case("moe-fp8-grad", worlds=WORLDS)
def _fp8_grad(rank, world):
    """The straight-through gradient: dispatch with fp8 -> dequantize_fp8 -> experts -> combine
    gives, bitwise, the output and the gradients (x's, the weights', the experts') of an
    unquantised dispatch of z = dequantize_fp8(quantize_fp8(x)), x's gradient equal to z's.
    dequantize_fp8 is called twice on the same rows (their gradients sum)."""
    e, h, k = 2 * world, 256, 3
    for cap, sizes in ((None, [4, 0, 3, 5]), (5, [5, 2, 5, 1])):
        sizes = sizes[:world]
        _, idxs, ws = zip(*all_inputs(70, world, sizes, 4, k, e))
        x0 = fp8_tokens(71, rank, sizes[rank], h, F32)
        idx = idxs[rank]
        gen = torch.Generator().manual_seed(72)
        a = torch.randn((e // world, 1, h), generator=gen)  # per local expert: a diagonal linear map
        b = torch.randn((e // world, 1, h), generator=gen)
        g = torch.randn((sizes[rank], h), generator=torch.Generator().manual_seed(73 + rank))
        results = []
        for fp8 in (True, False):
            x = (x0 if fp8 else moe_ops.dequantize_fp8(*moe_ops.quantize_fp8(x0), dtype=F32)).clone()
            x.requires_grad_()
            w = ws[rank].clone().requires_grad_()
            ea, eb = a.clone().requires_grad_(), b.clone().requires_grad_()
            recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap, fp8=fp8)
            if fp8:
                assert not recv[0].requires_grad and recv[1].requires_grad
                r1, r2 = moe_ops.dequantize_fp8(*recv, dtype=F32), moe_ops.dequantize_fp8(*recv, dtype=F32)
            else:
                r1 = r2 = recv
            if cap is None:
                ids = torch.repeat_interleave(torch.arange(e // world), counts)
                y = r1 * ea[ids, 0] + r2 * eb[ids, 0]
            else:
                y = r1 * ea + r2 * eb
            out = flux.moe_combine(y, handle)
            (out * g).sum().backward()
            results.append((out.detach(), x.grad, w.grad, ea.grad, eb.grad))
        for name, p, q in zip(("out", "d x", "d topk_weights", "d a", "d b"), *results):
            assert torch.equal(p, q), f"C={cap}: {name} of the fp8 dispatch differs from the unquantised one's"
        assert results[0][1].abs().sum() > 0 or sizes[rank] == 0
    # recv_scales used other than through dequantize_fp8: x gets a zero gradient (and every rank
    # still runs the dispatch's backward collective).
    x = fp8_tokens(74, rank, 3, 128, F32).requires_grad_()
    idx, w = all_inputs(75, world, [3] * world, 4, 2, e)[rank][1:]
    recv, _, _ = flux.moe_dispatch(x, idx, w, e, fp8=True)
    (recv[1] * 2).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    # Through the dispatcher ops an fp8 dispatch has no gradient: refused, on every rank alike.
    with _ThroughOps():
        _expect_error(lambda: flux.moe_dispatch(x, idx, w, e, fp8=True), "not differentiable through the dispatcher")
    return True

# --------------------------------------------------------------------------------------
# Bad arguments: the same FluxInputError on every rank, then the group still works


def _good_call(rank, world):
    check_layout(11, rank, world, [3] * world, 4, 2, 2 * world, F32, caps=(None, 3))


def _expect_error(fn, *fragments, op="flux.moe_dispatch"):
    return expect_flux_error(fn, op, *fragments)


def _bad_case(name, build, *fragments):
    def fn(rank, world):
        args = build(rank, world)  # (x, idx, w, e, cap), then optionally moe_dispatch's other keywords
        x, idx, w, e, cap = args[:5]
        kw = args[5] if len(args) > 5 else {}
        msg = _expect_error(lambda: flux.moe_dispatch(x, idx, w, e, max_tokens_per_rank=cap, **kw), *fragments)
        _good_call(rank, world)
        return msg  # compared across ranks by test_bad_arguments

    case(f"moe-bad-{name}", worlds=WORLDS)(fn)


def _base(rank, world, t=4, k=2, e=None, h=4, cap=None):
    e = e or 2 * world
    x, idx, w = make_inputs(20, rank, t, h, k, e, dtype=F32)
    return x, idx, w, e, cap


def _bad_id(bounded, value=None):
    def build(rank, world):
        x, idx, w, e, _ = _base(rank, world)
        if rank == 1:
            idx[2, 0] = e if value is None else value
        return x, idx, w, e, 4 if bounded else None
    return build


def _duplicate(rank, world):
    x, idx, w, e, _ = _base(rank, world)
    if rank == 0:
        idx[1] = torch.tensor([1, 1])
    return x, idx, w, e, None


def _not_divisible(rank, world):
    x, idx, w, e, _ = _base(rank, world, e=2 * world + 1)
    return x, idx.clamp(max=2 * world), w, 2 * world + 1, None


def _experts_differ(rank, world):
    x, idx, w, e, _ = _base(rank, world)
    return x, idx, w, e * (2 if rank == 1 else 1), None


def _hidden_differs(rank, world):
    x, idx, w, e, _ = _base(rank, world, h=5 if rank == 1 else 4)
    return x, idx, w, e, None


def _over_capacity(rank, world):
    return _base(rank, world, t=5 if rank == 1 else 4, cap=4)


def _capacity_differs(rank, world):
    return _base(rank, world, cap=4 if rank == 1 else 6)


def _float_idx(rank, world):
    x, idx, w, e, _ = _base(rank, world)
    return x, idx.float() if rank == 1 else idx, w, e, None


def _rows_differ(rank, world):
    x, idx, w, e, _ = _base(rank, world)
    return x, idx[:3] if rank == 1 else idx, w[:3] if rank == 1 else w, e, None


def _fp8_hidden(rank, world):
    x, idx, w, e, _ = _base(rank, world, h=192)
    return x, idx, w, e, 4, {"fp8": True}


def _fp8_dtype(rank, world):
    x, idx, w, e, _ = _base(rank, world, h=128)
    return x.double(), idx, w, e, None, {"fp8": True}


def _fp8_differs(rank, world):
    x, idx, w, e, _ = _base(rank, world, h=128)
    return x, idx, w, e, None, {"fp8": rank != 1}


def _x_not_a_tensor(rank, world):
    x, idx, w, e, _ = _base(rank, world)
    return (None if rank == 1 else x), idx, w, e, None


_bad_case("x-not-a-tensor", _x_not_a_tensor, "invalid arguments on rank 1:", "x must be a tensor, got NoneType")
_bad_case("id-on-one-rank", _bad_id(False), "invalid arguments on rank 1:", "topk_idx[2, 0] =", "outside [-1,")
_bad_case("negative-id-bounded", _bad_id(True, -2), "invalid arguments on rank 1:", "topk_idx[2, 0] = -2")
_bad_case("duplicate", _duplicate, "invalid arguments on rank 0:", "lists expert 1 twice")
_bad_case("not-divisible", _not_divisible, "rank 0:", "rank 1:", "not divisible by the group size")
_bad_case("experts-differ", _experts_differ, "differ between ranks: num_experts", "rank 1")
_bad_case("hidden-differs", _hidden_differs, "differ between ranks: H (x.shape[-1]) is 4 on rank 0 but 5 on rank 1")
_bad_case("over-capacity", _over_capacity, "invalid arguments on rank 1:", "T = 5", "max_tokens_per_rank = 4")
_bad_case("capacity-differs", _capacity_differs, "differ between ranks: max_tokens_per_rank", "rank 1")
_bad_case("float-idx", _float_idx, "invalid arguments on rank 1:", "topk_idx dtype torch.float32")
_bad_case("rows-differ", _rows_differ, "invalid arguments on rank 1:", "topk_idx has 3 rows but x has 4")
_bad_case("fp8-hidden", _fp8_hidden, "rank 0: fp8=True needs H (x.shape[-1]) a positive multiple of 128",
          "rank 1: fp8=True needs H", "got 192")
_bad_case("fp8-dtype", _fp8_dtype, "rank 0: fp8=True quantises bf16, fp16 or fp32 x, got torch.float64")
_bad_case("fp8-differs", _fp8_differs, "differ between ranks: fp8 is 1 on rank 0 but 0 on rank 1")


@case("moe-bad-combine", worlds=WORLDS)
def _bad_combine(rank, world):
    """combine's input is checked locally, before any communication; the handle still works."""
    x, idx, w, e, _ = _base(rank, world)
    for cap in (None, 4):
        recv_x, _, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        bad = torch.zeros(recv_x.shape[0] + 1, *recv_x.shape[1:])
        _expect_error(lambda: flux.moe_combine(bad, handle), "y has shape", "recv_x had", op="flux.moe_combine")
        _expect_error(lambda: flux.moe_combine(recv_x.long(), handle), "must be floating", op="flux.moe_combine")
        _expect_error(lambda: flux.moe_combine(recv_x, None), "MoeHandle", op="flux.moe_combine")
        assert torch.equal(flux.moe_combine(recv_x, handle), expected_round_trip(x, idx, w))
    return True


@case("moe-deferred", worlds=WORLDS)
def _deferred(rank, world):
    """The bounded variant's verdict without a host read (the CUDA groups' path), run on gloo:
    valid calls give the same results; a bad id on rank 1 moves nothing (recv_x, counts and
    combine zero on every rank) and handle.check() raises the same error on every rank."""
    e, h, k, cap = 2 * world, 4, 2, 4
    x, idx, w = make_inputs(30, rank, cap, h, k, e, dtype=F32)
    ref_x, ref_counts, _ = moe_ops.run_strategy("sequential", x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
    group = dist.group.WORLD
    recv_x, counts, handle = moe_ops._dispatch_impl(x, idx, w, e, group, cap, defer_verdict=True)
    handle.check()
    assert torch.equal(recv_x, ref_x) and torch.equal(counts, ref_counts)
    assert torch.equal(flux.moe_combine(recv_x, handle), expected_round_trip(x, idx, w))
    msgs = []
    for bad in ("id", "duplicate", "capacity"):
        xb, ib = x, idx.clone()
        if rank == 1 and bad == "id":
            ib[0, 1] = e + 3
        if rank == 0 and bad == "duplicate":
            ib[2] = torch.tensor([0, 0])
        if rank == world - 1 and bad == "capacity":
            xb, ib = torch.cat([x, x[:1]]), torch.cat([ib, ib[:1]])
        wb = torch.ones(xb.shape[0], k)
        recv_x, counts, handle = moe_ops._dispatch_impl(xb, ib, wb, e, group, cap, defer_verdict=True)
        assert not recv_x.any() and not counts.any(), f"{bad}: rows moved although a rank's data was invalid"
        assert not flux.moe_combine(recv_x + 1, handle).any(), f"{bad}: combine after an invalid dispatch"
        msgs.append(_expect_error(handle.check))
    assert "rank 1: topk_idx holds an expert id outside" in msgs[0], msgs[0]
    assert "rank 0: a row of topk_idx lists an expert twice" in msgs[1], msgs[1]
    assert f"rank {world - 1}: x.shape[0] (T) exceeds max_tokens_per_rank" in msgs[2], msgs[2]
    _good_call(rank, world)
    return msgs


@case("moe-forced-strategy", worlds=WORLDS)
def _forced_strategy(rank, world):
    """FLUX_STRATEGY_MOE: sequential runs; symm, which needs a GPU group, raises on every rank;
    an unknown name raises."""
    from unittest import mock

    x, idx, w = make_inputs(32, rank, 3, 4, 2, 2 * world, dtype=F32)
    with mock.patch.dict(os.environ, {"FLUX_STRATEGY_MOE": "sequential"}):
        assert flux.moe_dispatch(x, idx, w, 2 * world)[2].strategy == "sequential"
    with mock.patch.dict(os.environ, {"FLUX_STRATEGY_MOE": "symm"}):
        a = _expect_error(lambda: flux.moe_dispatch(x, idx, w, 2 * world), "FLUX_STRATEGY_MOE=symm, but it cannot run")
    with mock.patch.dict(os.environ, {"FLUX_STRATEGY_MOE": "nccl"}):
        b = _expect_error(lambda: flux.moe_dispatch(x, idx, w, 2 * world), "is not a strategy")
    _good_call(rank, world)
    return [a, b]


@case("moe-former-strategy-names", worlds=WORLDS)
def _former_names(rank, world):
    """``all_to_all``, the former name of ``sequential``, is accepted wherever a name is given
    (run_strategy, FLUX_STRATEGY_MOE, with blanks) and read as it: the same rows, counts and
    combine, a handle reporting ``sequential``, and ranks giving either name agree (the checked
    signature holds the normalised name)."""
    from unittest import mock

    e, h, k = 2 * world, 4, 2
    for cap in (None, 4):
        x, idx, w = make_inputs(33, rank, 4, h, k, e, dtype=F32)
        ref_x, ref_counts, ref_handle = moe_ops.run_strategy("sequential", x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        got_x, got_counts, handle = moe_ops.run_strategy("all_to_all", x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        assert handle.strategy == ref_handle.strategy == "sequential", handle
        assert torch.equal(got_x, ref_x) and torch.equal(got_counts, ref_counts)
        assert torch.equal(flux.moe_combine(got_x, handle), flux.moe_combine(ref_x, ref_handle))
        forced = " all_to_all " if rank % 2 == 0 else "sequential"  # the ranks differ in the name only
        with mock.patch.dict(os.environ, {"FLUX_STRATEGY_MOE": forced}):
            env_x, env_counts, env_handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        assert env_handle.strategy == "sequential", env_handle
        assert torch.equal(env_x, ref_x) and torch.equal(env_counts, ref_counts)
    _good_call(rank, world)
    return True


@case("moe-deferred-local-error", worlds=WORLDS)
def _deferred_local_error(rank, world):
    """The bounded variant on a CUDA group that plans (no per-call header; simulated on gloo): after a call
    whose signature was checked, rank 1's next call has a local error (topk_weights of the wrong
    shape) with the same signature fields. Its peers skip the store exchange, so rank 1 must not
    wait there: its error travels in the device verdict, every rank's handle.check() raises the
    same error naming rank 1, and the next call works."""
    from unittest import mock

    from flux.ops import _checks

    e, h, k, cap = 2 * world, 4, 2, 4
    x, idx, w = make_inputs(31, rank, cap, h, k, e, dtype=F32)
    with mock.patch.object(_checks, "_carries_header", lambda g: False), \
            mock.patch.object(_checks, "_header_every_call", lambda g, no_symm: False), \
            mock.patch.object(moe_ops.strategies, "cuda_group", lambda g: True):
        _checks.reset_cache()
        recv_x, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)  # checked, remembered
        handle.check()
        wb = torch.ones(x.shape[0], k + 1) if rank == 1 else w
        recv_x, counts, handle = flux.moe_dispatch(x, idx, wb, e, zero_pad=True, max_tokens_per_rank=cap)
        assert not recv_x.any() and not counts.any(), "rows moved although rank 1's arguments were invalid"
        assert not flux.moe_combine(recv_x + 1, handle).any()
        msg = _expect_error(handle.check, "rank 1: its arguments are invalid")
        recv_x, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        handle.check()
        ref_x, ref_counts, _ = moe_ops.run_strategy("sequential", x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        assert torch.equal(recv_x, ref_x) and torch.equal(counts, ref_counts)
        _checks.reset_cache()
    return msg


# --------------------------------------------------------------------------------------
# opcheck
#
# Every opcheck sub-test calls the op the same number of times with the same shapes on every
# rank, so the collectives inside match up across ranks.


@case("moe-opcheck", worlds=WORLDS)
def _opcheck(rank, world):
    from flux.runtime import group_name

    gname = group_name(dist.group.WORLD)
    e, h, k = 2 * world, 4, 2
    x, idx, w = make_inputs(40, rank, 3 + rank, h, k, e, dtype=F32)
    for cap in (None, 3 + world):
        args = (x.clone().requires_grad_(), idx, w.clone().requires_grad_(), e, gname, cap)
        torch.library.opcheck(torch.ops.flux.moe_dispatch.default, args)
        recv_x, _, send_pairs, recv_dest, meta, _ = torch.ops.flux.moe_dispatch(x, idx, w, e, gname, cap)
        y = (recv_x * 2).requires_grad_()
        torch.library.opcheck(torch.ops.flux.moe_combine.default,
                              (y, w.clone().requires_grad_(), send_pairs, recv_dest, meta, gname, e, cap))
        # fp8: the op returns the packed byte rows (no gradient flows through them)
        xq = make_inputs(41, rank, 3 + rank, 128, k, e, dtype=BF16)[0]
        torch.library.opcheck(torch.ops.flux.moe_dispatch.default, (xq, idx, w.clone().requires_grad_(), e, gname,
                                                                    cap, True))
        # zero_pad=False (rows past the counts undefined; on the CPU they are still zeros)
        torch.library.opcheck(torch.ops.flux.moe_dispatch.default, args + (False, False))
    return True


# --------------------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return batches(__file__, "moe-", tmp_path_factory, timeout_s=150)


def _names():
    return [n for n, c in CASES.items() if n.startswith("moe-")]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in _names() if not n.startswith("moe-bad-")])
def test_moe(batch, world, name):
    batch(world).assert_ok(name)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in _names() if n.startswith("moe-bad-") and n != "moe-bad-combine"])
def test_bad_arguments(batch, world, name):
    msgs = batch(world).assert_ok(name)
    assert all(m == msgs[0] for m in msgs), "FluxInputError messages differ between ranks:\n" + "\n".join(
        f"rank {r}: {m}" for r, m in enumerate(msgs))


@pytest.mark.parametrize("world", WORLDS)
def test_deferred_local_error_raises_on_every_rank(batch, world):
    msgs = batch(world).assert_ok("moe-deferred-local-error")
    assert all(m == msgs[0] for m in msgs), msgs


@pytest.mark.parametrize("world", WORLDS)
def test_bad_combine_input(batch, world):
    batch(world).assert_ok("moe-bad-combine")


def test_deferred_messages_agree(batch):
    msgs = batch(2).assert_ok("moe-deferred")
    assert all(m == msgs[0] for m in msgs), msgs
