"""flux.moe_dispatch / moe_combine / flux.nn.MoE at world size 1: the ``local`` strategy
(flux/ops/moe/local.py) against the references and the ``sequential`` strategy, in-process (a
one-rank group). On a GPU: NCCL and flux's kernels (skipped if flux._C lacks them). Without a
GPU: gloo, with CPU stand-ins of the kernels (tests/_moe_local_emulation.py) and the group
treated as a CUDA group (deferred verdicts), so that the strategy's Python path runs; the
graph-capture and SwiGLU-kernel cases need the GPU."""
import os
import sys
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import flux
from flux.ops import moe as moe_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA device")


@pytest.fixture(scope="module")
def group():
    patches, created = [], not dist.is_initialized()
    if created:
        store = dist.FileStore(tempfile.mktemp(prefix="flux-moe-local-"), 1)
        if DEV == "cuda":
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a one-rank process group")
    if DEV == "cpu":
        import _moe_local_emulation

        if not _moe_local_emulation.register():
            pytest.skip("flux._C is built but there is no GPU")
        patches = [mock.patch.object(moe_ops.local, "usable", lambda g, d: None),
                   mock.patch.object(moe_ops.strategies, "cuda_group", lambda g: True)]
        for p in patches:
            p.start()
    why = moe_ops.local.usable(dist.group.WORLD, torch.device(DEV))
    if why is not None:
        pytest.skip(why)
    yield dist.group.WORLD
    for p in patches:
        p.stop()
    if created:  # leave the process as it was for the test files after this one
        moe_ops._LOCAL_PLANS.clear()
        dist.destroy_process_group()


def _routing(t, e, k, gen, empty_slots=True, experts=None):
    """[T, K] int64: k distinct experts per token (from ``experts`` if given), some slots -1."""
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)]) if t else \
        torch.zeros((0, k), dtype=torch.int64)
    if empty_slots and t:
        idx[torch.rand(idx.shape, generator=gen) < 0.1] = -1
    return idx.to(DEV)


def _ints(shape, gen, dtype=torch.bfloat16):
    return torch.randint(-4, 5, shape, generator=gen).to(dtype).to(DEV)


def _weights(t, k, gen):
    return (torch.randint(1, 5, (t, k), generator=gen).float() / 4).to(DEV)  # exact in fp32 sums


# Bounded shapes by the dispatch's kernels (csrc/moe/moe_local.cu): blocks * E <= kFusedCounts (16384)
# takes two launches (count_kernel, bounded_rows_kernel; count blocks of the whole tokens within 256
# pairs, 252 at K = 6), past it the four-kernel path (count, scan, place, scatter_rows).
_FUSED = [(128, 64, 8, 128, 256), (100, 8, 8, 130, 256), (0, 8, 2, 16, 256), (50, 4, 3, 64, 100),
          (300, 16, 6, 300, 256), (200, 8, 5, 200, 100), (200, 100, 8, 200, 64), (300, 1024, 8, 300, 32)]
_FOUR_KERNELS = [(72, 1024, 64, 72, 64), (300, 1024, 48, 300, 32)]  # 18 and 60 count blocks of 1024 experts


@pytest.mark.parametrize("t,e,k,cap,h", [(64, 8, 2, None, 256), (300, 64, 8, None, 256), (0, 8, 2, None, 256),
                                         (5, 1024, 8, None, 256), (700, 16, 4, None, 100)] + _FUSED + _FOUR_KERNELS)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_round_trip_exact(group, t, e, k, cap, h, idx_dtype):
    # h = 100: rows of 200 bytes, the kernels' element-wise (unvectorised) paths
    gen = torch.Generator().manual_seed(t * 131 + e)
    x, idx, w = _ints((t, h), gen), _routing(t, e, k, gen).to(idx_dtype), _weights(t, k, gen)
    if DEV == "cuda":
        torch.cuda.empty_cache()
        poison = torch.full((max(1, e * (cap or t * k)) * h,), float("nan"), dtype=x.dtype, device=DEV)
        del poison  # the dispatch's outputs may reuse that memory: every row must be written
    recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
    assert handle.strategy == "local"
    ref_recv, ref_counts = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=cap)
    assert torch.equal(counts, ref_counts)
    assert torch.equal(recv, ref_recv)  # zero padding included
    y = recv * 3 - 1
    out = flux.moe_combine(y, handle)
    ref = flux.moe_combine_ref(y, idx, w, e, max_tokens_per_rank=cap)
    assert torch.equal(out, ref)
    # The same through the reference strategy (sequential), row for row.
    a_recv, a_counts, a_handle = moe_ops.run_strategy("sequential", x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
    assert torch.equal(a_recv, recv) and torch.equal(a_counts, counts)
    assert torch.equal(flux.moe_combine(y, a_handle), out)
    if cap is None:
        assert handle.counts_host == ref_counts.tolist()
    else:
        handle.check()


@pytest.mark.parametrize("t,e,k,cap,h", _FUSED + _FOUR_KERNELS)
@pytest.mark.parametrize("zero_pad", [True, False])
@pytest.mark.parametrize("data", ["valid", "bad_id", "duplicate", "host_code"])
def test_bounded_entry_matches_emulation(group, t, e, k, cap, h, zero_pad, data):
    """torch.ops.flux.moe_local_dispatch itself, bounded, on both of its kernel paths, against its
    CPU statement (tests/_moe_local_emulation.py): the layout (pair_row, send_pairs with T * K on
    padding rows), counts and verdict bit for bit, recv's rows exactly (its padding rows too with
    zero_pad); any verdict bit (a bad id, a duplicate, the caller's host_code) leaves every count
    zero and every pair rowless. The outputs are poisoned first (NaN rows freed before the call)."""
    import _moe_local_emulation

    if t == 0 and data in ("bad_id", "duplicate"):
        pytest.skip("no token to make invalid")
    gen = torch.Generator().manual_seed(t * 7 + e + k)
    x, idx = _ints((t, h), gen), _routing(t, e, k, gen, empty_slots=k > 1)
    if data == "bad_id":
        idx[t // 2, k - 1] = e if t % 2 else -2
    elif data == "duplicate":
        idx[t - 1, k - 1] = idx[t - 1, 0] = 1
    host_code = 16 if data == "host_code" else 0
    if DEV == "cuda":
        torch.cuda.empty_cache()
        nbytes = e * cap * h * x.element_size() + (e + 1 + t * k + e * cap) * 8  # recv, the index tensors
        poison = torch.full((nbytes,), 0x7F, dtype=torch.uint8, device=DEV)
        del poison  # every row and index the call returns must be written
    recv, counts, verdict, pair_row, send_pairs, info = torch.ops.flux.moe_local_dispatch(x, idx, e, cap, host_code,
                                                                                           zero_pad)
    ref = _moe_local_emulation.dispatch(x.cpu(), idx.cpu(), e, cap, host_code, zero_pad)
    assert torch.equal(info.cpu(), ref[5]) and torch.equal(counts.cpu(), ref[1]) and torch.equal(verdict.cpu(), ref[2])
    assert (int(verdict[0]) != 0) == (data != "valid")
    assert torch.equal(pair_row.cpu(), ref[3]) and torch.equal(send_pairs.cpu(), ref[4])
    if data != "valid":
        assert not counts.any() and bool((pair_row == -1).all()) and bool((send_pairs == t * k).all())
    assert recv.shape == (e, cap, h)
    if zero_pad:
        assert torch.equal(recv.cpu(), ref[0])
    else:  # the rows up to the counts
        keep = (torch.arange(cap)[None, :] < ref[1][:, None])[..., None]
        assert torch.equal(torch.where(keep, recv.cpu(), 0), ref[0])


@pytest.mark.parametrize("t,e,k,h", [(64, 8, 2, 256), (300, 64, 8, 256), (0, 8, 2, 256), (5, 1024, 8, 256),
                                     (700, 16, 4, 100), (72, 1024, 64, 64)])
@pytest.mark.parametrize("zero_pad", [True, False])
@pytest.mark.parametrize("data", ["valid", "dropped_slots", "bad_id", "duplicate"])
def test_unread_counts_entry_matches_emulation(group, t, e, k, h, zero_pad, data):
    """torch.ops.flux.moe_local_dispatch with capacity -2 (unbounded at the worst case: recv
    [T * K, H] in the same call, nothing for the host to read) against its CPU statement: the
    layout and counts bit for bit, recv's first sum(counts) rows exactly and, with zero_pad, its
    padding rows zero; send_pairs T * K on every padding row. Outputs poisoned first."""
    import _moe_local_emulation

    if t == 0 and data != "valid":
        pytest.skip("no token to make invalid")
    gen = torch.Generator().manual_seed(t * 5 + e + k)
    x, idx = _ints((t, h), gen), _routing(t, e, k, gen, empty_slots=data == "dropped_slots")
    if data == "bad_id":
        idx[t // 2, k - 1] = e
    elif data == "duplicate" and k > 1:
        idx[t - 1, k - 1] = idx[t - 1, 0]
    elif data == "duplicate":
        pytest.skip("K = 1 has no duplicate")
    if DEV == "cuda":
        torch.cuda.empty_cache()
        nbytes = t * k * h * x.element_size() + (e + 1 + 2 * t * k) * 8
        poison = torch.full((nbytes,), 0x7F, dtype=torch.uint8, device=DEV)
        del poison
    recv, counts, verdict, pair_row, send_pairs, info = torch.ops.flux.moe_local_dispatch(x, idx, e, -2, 0, zero_pad)
    ref = _moe_local_emulation.dispatch(x.cpu(), idx.cpu(), e, -2, 0, zero_pad)
    assert torch.equal(info.cpu(), ref[5]) and torch.equal(pair_row.cpu(), ref[3])
    assert torch.equal(send_pairs.cpu(), ref[4])
    assert (int(verdict[0]) != 0) == (data in ("bad_id", "duplicate"))
    assert recv.shape == (t * k, h)
    r = int(counts.sum())
    assert r == (t * k if data == "valid" else int(ref[1].sum()))
    assert torch.equal(recv[:r].cpu(), ref[0][:r])
    if zero_pad:
        assert not recv[r:].any()
    # capacity -3: the same call with the counts and verdict read to the host, recv and send_pairs
    # cut to the counts' sum where the verdict is 0.
    recv, counts, verdict, pair_row, send_pairs, info = torch.ops.flux.moe_local_dispatch(x, idx, e, -3, 0, zero_pad)
    assert info.device.type == "cpu" and torch.equal(info, ref[5]) and torch.equal(pair_row.cpu(), ref[3])
    rows = r if data in ("valid", "dropped_slots") else t * k
    assert recv.shape == (rows, h) and torch.equal(send_pairs.cpu(), ref[4][:rows])
    assert torch.equal(recv[:r].cpu(), ref[0][:r])


@pytest.mark.parametrize("zero_pad", [True, False])
def test_unread_counts_dispatch(group, zero_pad):
    """flux.moe_dispatch(zero_pad=True, read_counts=False) on one rank: recv_x [T * K, H], its first R rows those of
    the default (read) dispatch, counts equal, no host counts, combine and gradients equal to the
    read dispatch's; bad ids deferred to handle.check() (every count zero, combine zeros)."""
    gen = torch.Generator().manual_seed(23)
    t, e, k, h = 150, 16, 4, 128
    x0 = _ints((t, h), gen)
    idx, w0 = _routing(t, e, k, gen), _weights(t, k, gen)
    g = _ints((t, h), gen)
    res = {}
    for read in (True, False):
        x, w = x0.clone().float().requires_grad_(), w0.clone().requires_grad_()
        recv, counts, handle = flux.moe_dispatch(x, idx, w, e, read_counts=read, zero_pad=zero_pad)
        assert handle.strategy == "local"
        out = flux.moe_combine(recv * 3 - 1, handle)
        out.backward(g.float())
        res[read] = (recv.detach(), counts, handle, out.detach(), x.grad, w.grad)
    r = int(res[True][1].sum())
    assert r < t * k  # some slots dropped: padding rows exist
    recv, counts, handle = res[False][:3]
    assert recv.shape == (t * k, h) and handle.counts_host is None and handle.recv_shape == (t * k, h)
    assert torch.equal(counts, res[True][1]) and torch.equal(recv[:r], res[True][0])
    if zero_pad:
        assert not recv[r:].any()
    for a, b in zip(res[False][3:], res[True][3:]):
        assert torch.equal(a, b)
    handle.check()
    bad = idx.clone()
    bad[3, 1] = e
    recv, counts, handle = flux.moe_dispatch(x0, bad, w0, e, zero_pad=True, read_counts=False)  # deferred, as bounded
    assert not counts.any() and not recv.any() and not flux.moe_combine(recv, handle).any()
    with pytest.raises(flux.FluxInputError, match="outside"):
        handle.check()
    # Through the dispatcher op (torch.compile's path): static shapes, the same rows.
    args = (x0, idx, w0, e, moe_ops.group_name(group), None, False, True, False)
    torch.library.opcheck(torch.ops.flux.moe_dispatch, args, test_utils=("test_schema", "test_faketensor"))
    op_recv, op_counts = torch.ops.flux.moe_dispatch(*args)[:2]
    assert op_recv.shape == (t * k, h) and torch.equal(op_counts, res[True][1])
    assert torch.equal(op_recv[:r], res[True][0].to(op_recv.dtype))


def test_fp8_dispatch_exact(group):
    gen = torch.Generator().manual_seed(3)
    t, e, k, h = 200, 16, 4, 512
    x = torch.randn((t, h), generator=gen).to(torch.bfloat16).to(DEV)
    idx, w = _routing(t, e, k, gen), _weights(t, k, gen)
    for cap in (None, 256):
        (q, s), counts, _ = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap, fp8=True)
        (rq, rs), rc = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=cap, fp8=True)
        assert torch.equal(counts, rc)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_empty_experts_and_no_valid_slot(group):
    gen = torch.Generator().manual_seed(5)
    t, e, k, h = 96, 64, 2, 128
    idx = _routing(t, e, k, gen, experts=[3, 17, 40])
    idx[:7] = -1  # tokens without any expert: combine gives zeros
    x, w = _ints((t, h), gen), _weights(t, k, gen)
    for cap in (None, t):
        recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        assert int((counts > 0).sum()) == 3
        ref_recv, _ = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=cap)
        assert torch.equal(recv, ref_recv)
        out = flux.moe_combine(recv.float().to(recv.dtype), handle)
        assert torch.equal(out[:7], torch.zeros_like(out[:7]))
        assert torch.equal(out, flux.moe_combine_ref(recv, idx, w, e, max_tokens_per_rank=cap))


def test_errors(group):
    gen = torch.Generator().manual_seed(7)
    t, e, k, h = 32, 8, 2, 64
    x, idx, w = _ints((t, h), gen), _routing(t, e, k, gen, empty_slots=False), _weights(t, k, gen)
    bad = idx.clone()
    bad[3, 1] = e
    dup = idx.clone()
    dup[5, 1] = dup[5, 0]
    for wrong, text in ((bad, "outside"), (dup, "twice")):
        with pytest.raises(flux.FluxInputError, match=text):
            flux.moe_dispatch(x, wrong, w, e)
        recv, counts, handle = flux.moe_dispatch(x, wrong, w, e, zero_pad=True, max_tokens_per_rank=t)  # deferred
        assert not counts.any() and not recv.any()
        assert not flux.moe_combine(recv, handle).any()
        with pytest.raises(flux.FluxInputError, match=text):
            handle.check()
    # Over capacity: deferred in the bounded variant (every row zero), raised by check().
    recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=t - 1)
    assert not counts.any() and not recv.any()
    with pytest.raises(flux.FluxInputError, match="exceeds max_tokens_per_rank"):
        handle.check()
    with pytest.raises(flux.FluxInputError, match="flux.moe_dispatch"):
        flux.moe_dispatch(x, idx, w, 7)  # num_experts not matching? (7 experts: ids up to 7 are bad)
    with pytest.raises(flux.FluxInputError, match="must be 2-D"):
        flux.moe_dispatch(x[0], idx, w, e)


@pytest.mark.parametrize("cap", [None, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [128, 100])
def test_gradients_match_sequential(group, cap, dtype, h, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    t, e, k = 48, 16, 4
    x0 = torch.randn((t, h), generator=gen).to(dtype).to(DEV)
    idx = _routing(t, e, k, gen)
    w0 = torch.rand((t, k), generator=gen).to(DEV)
    scale = torch.randn((h,), generator=gen).to(dtype).to(DEV)
    g = torch.randn((t, h), generator=gen).to(dtype).to(DEV)
    results = {}
    for name in ("local", "sequential"):
        monkeypatch.setenv(moe_ops.STRATEGY_ENV, name)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        assert handle.strategy == name
        out = flux.moe_combine(torch.tanh(recv * scale), handle)
        out.backward(g)
        results[name] = (out.detach(), x.grad, w.grad)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(results["local"], results["sequential"]):
        torch.testing.assert_close(a, b, **tol)


@gpu_only
@pytest.mark.parametrize("zero_pad", [True, False])
def test_bounded_graph_capture(group, zero_pad):
    gen = torch.Generator().manual_seed(13)
    t, e, k, h, cap = 128, 64, 8, 512, 128
    x, idx, w = _ints((t, h), gen), _routing(t, e, k, gen), _weights(t, k, gen)
    flux.moe_dispatch(x, idx, w, e, max_tokens_per_rank=cap, zero_pad=zero_pad)  # warm-up: checks remembered
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            recv, counts, handle = flux.moe_dispatch(x, idx, w, e, max_tokens_per_rank=cap, zero_pad=zero_pad)
            flux.moe_combine(recv, handle)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, counts, handle = flux.moe_dispatch(x, idx, w, e, max_tokens_per_rank=cap, zero_pad=zero_pad)
        out = flux.moe_combine(recv, handle)
    for step in range(3):  # new inputs each replay
        x.copy_(_ints((t, h), gen))
        idx.copy_(_routing(t, e, k, gen))
        w.copy_(_weights(t, k, gen))
        graph.replay()
        torch.cuda.synchronize()
        ref_recv, ref_counts = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=cap)
        assert torch.equal(counts, ref_counts)
        for ex in range(e):
            n = int(ref_counts[ex])
            assert torch.equal(recv[ex, :n], ref_recv[ex, :n])
            if zero_pad:
                assert not recv[ex, n:].any()
        assert torch.equal(out, flux.moe_combine_ref(ref_recv, idx, w, e, max_tokens_per_rank=cap))


@gpu_only
def test_unread_counts_graph_capture(group):
    """The unbounded dispatch without the count read (read_counts=False) and its combine replay from
    a CUDA graph: nothing on the host per call."""
    gen = torch.Generator().manual_seed(29)
    t, e, k, h = 128, 64, 8, 512
    x, idx, w = _ints((t, h), gen), _routing(t, e, k, gen), _weights(t, k, gen)
    flux.moe_dispatch(x, idx, w, e, zero_pad=True, read_counts=False)  # warm-up: checks remembered
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, read_counts=False)
            flux.moe_combine(recv, handle)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, read_counts=False)
        out = flux.moe_combine(recv, handle)
    for _ in range(3):
        x.copy_(_ints((t, h), gen))
        idx.copy_(_routing(t, e, k, gen))
        w.copy_(_weights(t, k, gen))
        graph.replay()
        torch.cuda.synchronize()
        ref_recv, ref_counts = flux.moe_dispatch_ref(x, idx, w, e)
        r = ref_recv.shape[0]
        assert torch.equal(counts, ref_counts) and torch.equal(recv[:r], ref_recv) and not recv[r:].any()
        assert torch.equal(out, flux.moe_combine_ref(ref_recv, idx, w, e))


def test_layer_matches_sequential(group, monkeypatch):
    torch.manual_seed(0)
    t, h, f, e, k = 64, 256, 128, 8, 2
    x0 = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    results = {}
    for name in ("local", "sequential"):
        monkeypatch.setenv(moe_ops.STRATEGY_ENV, name)
        for cap in (None, t):
            layer = flux.nn.MoE(h, f, e, k, seed=1, dtype=torch.bfloat16, device=DEV, max_tokens_per_rank=cap)
            x = x0.clone().requires_grad_()
            out = layer(x)
            out.backward(g)
            results[(name, cap)] = [out, x.grad, layer.router.weight.grad, layer.w13.grad, layer.w2.grad]
    for cap in (None, t):
        for a, b in zip(results[("local", cap)], results[("sequential", cap)]):
            torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def test_layer_reads_counts_only_for_other_routers(group):
    """flux.nn.MoE dispatches without the count read where its own router chose the ids (valid by
    construction), with it where a subclass routes (its ids could be invalid: the read raises)."""
    from flux.nn.moe import FluxDispatcher

    seen = []

    class Recording(FluxDispatcher):
        @staticmethod
        def dispatch(*args, **kw):
            seen.append(kw.get("read_counts", True))
            return FluxDispatcher.dispatch(*args, **kw)

    class OwnRouter(flux.nn.MoE):
        def route(self, x):
            idx, w = super().route(x)
            idx[0, 0] = self.num_experts  # invalid
            return idx, w

    x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    flux.nn.MoE(64, 32, 4, 2, seed=1, dtype=torch.bfloat16, device=DEV, dispatcher=Recording())(x)
    assert seen == [False]
    with pytest.raises(flux.FluxInputError, match="outside"):
        OwnRouter(64, 32, 4, 2, seed=1, dtype=torch.bfloat16, device=DEV, dispatcher=Recording())(x)
    assert seen == [False, True]


def test_opcheck_and_compile_path(group):
    gen = torch.Generator().manual_seed(17)
    t, e, k, h = 40, 8, 2, 128
    x, idx, w = _ints((t, h), gen), _routing(t, e, k, gen), _weights(t, k, gen)
    args = (x, idx, w, e, moe_ops.group_name(group), 64, False, True)  # fp8 False, zero_pad True
    torch.library.opcheck(torch.ops.flux.moe_dispatch, args, test_utils=("test_schema", "test_faketensor"))
    recv, counts, send_pairs, recv_dest, meta, verdict = torch.ops.flux.moe_dispatch(*args)
    ref_recv, _ = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=64)
    assert torch.equal(recv, ref_recv)
    out, returned = torch.ops.flux.moe_combine(recv, w, send_pairs, recv_dest, meta, moe_ops.group_name(group), e, 64)
    assert torch.equal(out, flux.moe_combine_ref(recv, idx, w, e, max_tokens_per_rank=64))


@pytest.mark.parametrize("cap", [None, 48])
def test_strided_inputs_and_weight_dtypes(group, cap):
    """x, topk_idx, topk_weights and y as strided views, the weights in bf16 and fp64: the kernels'
    entries make them contiguous and fp32 themselves (no copy in Python); the same rows and sums
    as the reference, exactly (the weights' values are exact in every dtype used)."""
    gen = torch.Generator().manual_seed(29)
    t, e, k, h = 40, 8, 2, 128
    x = _ints((t, 2 * h), gen)[:, ::2]
    idx = _routing(t, e, k, gen).t().contiguous().t()
    for w_dtype in (torch.bfloat16, torch.float64):
        w = _weights(t, k, gen).to(w_dtype).t().contiguous().t()
        assert not (x.is_contiguous() or idx.is_contiguous() or w.is_contiguous())
        recv, counts, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=cap)
        ref_recv, ref_counts = flux.moe_dispatch_ref(x, idx, w, e, max_tokens_per_rank=cap)
        assert torch.equal(recv, ref_recv) and torch.equal(counts, ref_counts)
        y = (torch.cat([recv, recv], dim=-1) * 2)[..., ::2]  # strided, in recv_x's layout
        assert not y.is_contiguous()
        out = flux.moe_combine(y, handle)
        assert torch.equal(out, flux.moe_combine_ref(y.contiguous(), idx, w, e, max_tokens_per_rank=cap))


def _flux_frames(fn):
    """(fn's result, the Python frames of flux's own code that the call enters)."""
    root = os.path.dirname(os.path.abspath(flux.__file__))
    frames = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            frames.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, frames


# Python frames of flux's code in a repeat bounded call at world size 1 (the hot path: the public
# function, resolve_group, call_mode, _dispatch_impl, the plan key and its live read of
# FLUX_STRATEGY_MOE, _run_local, dispatch_local; combine: the public function, its local check,
# call_mode, _combine_impl, kernel_dtype, LocalStrategy.combine). A first call runs dozens more
# (the signature, the checks, the choice).
_HOT_FRAMES = {"dispatch": 8, "combine": 6}


@pytest.mark.parametrize("grad", [False, True])
def test_repeat_calls_take_the_hot_path(group, grad):
    """After a problem's first call, bounded calls like it (T up to C, new data each call) run no
    check on the host and no Python per step (a bounded number of flux frames), and give the
    reference's rows, counts, combine and gradients exactly."""
    gen = torch.Generator().manual_seed(19)
    e, k, h, cap = 16, 4, 128, 64

    def inputs(t):
        x, idx, w = _ints((t, h), gen), _routing(t, e, k, gen), _weights(t, k, gen)
        if grad:
            x.requires_grad_()
            w.requires_grad_()
        return x, idx, w

    flux.moe_dispatch(*inputs(cap), e, zero_pad=True, max_tokens_per_rank=cap)  # the first call: checked, planned
    checked = mock.patch.object(moe_ops.strategies, "_signature",
                                side_effect=AssertionError("a repeat call took the checked path"))
    for t in (cap, 40, 1, cap):
        x, idx, w = inputs(t)
        with checked:
            (recv, counts, handle), frames = _flux_frames(lambda: flux.moe_dispatch(x, idx, w, e,
                                                                                    zero_pad=True, max_tokens_per_rank=cap))
            out, cframes = _flux_frames(lambda: flux.moe_combine(recv, handle))
        extra = ("forward",) if grad else ()  # the autograd.Function's forward
        assert len(frames) <= _HOT_FRAMES["dispatch"] + len(extra), frames
        assert len(cframes) <= _HOT_FRAMES["combine"] + len(extra), cframes
        handle.check()
        ref_recv, ref_counts = flux.moe_dispatch_ref(x.detach(), idx, w.detach(), e, max_tokens_per_rank=cap)
        assert torch.equal(recv, ref_recv) and torch.equal(counts, ref_counts)
        assert torch.equal(out, flux.moe_combine_ref(recv.detach(), idx, w.detach(), e, max_tokens_per_rank=cap))
        if grad:  # out[t] = sum over valid k of w[t, k] * x[t]: its gradients, exact with these values
            g = _ints((t, h), gen)
            out.backward(g)
            valid = (idx >= 0).float()
            assert torch.equal(x.grad, (g.float() * (w.detach() * valid).sum(1, keepdim=True)).to(x.dtype))
            assert torch.equal(w.grad, (g.float() * x.detach().float()).sum(1, keepdim=True) * valid)


def test_host_cost_ratio(group):
    """The host cost of flux's Python around the kernels in a repeat bounded call, as a ratio to
    a plain ATen sequence of the same size timed in the same process (four allocations and two
    views, through the dispatcher; the C++ entry itself makes two allocations and five views): the
    kernels' entries are replaced by functions that return their outputs, computed once, so that
    only the Python layers are timed. Minimum over interleaved rounds of 200 calls each; bounds
    with a margin over what the hot path takes (dispatch ~0.9, combine ~0.3 of the sequence; a
    call that slices, reshapes or converts in Python, or asks the group's backend before the plan
    lookup, takes about 1.7 and 1.0)."""
    import time

    gen = torch.Generator().manual_seed(23)
    t, e, k, h = 64, 8, 4, 128
    x, idx, w = _ints((t, h), gen), _routing(t, e, k, gen), _weights(t, k, gen)
    recv, _, handle = flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=t)
    outs = torch.ops.flux.moe_local_dispatch(x, idx, e, t, 0, True)
    cout = torch.ops.flux.moe_local_combine(recv, w, handle.recv_dest, k)
    a = torch.empty(16)

    def aten_sequence():
        torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0), a.narrow(0, 0, 8), a.narrow(0, 8, 1)

    calls = {"aten": aten_sequence, "dispatch": lambda: flux.moe_dispatch(x, idx, w, e, zero_pad=True, max_tokens_per_rank=t),
             "combine": lambda: flux.moe_combine(recv, handle)}
    best = dict.fromkeys(calls, float("inf"))
    with mock.patch.object(torch.ops.flux, "moe_local_dispatch", lambda *args: outs), \
            mock.patch.object(torch.ops.flux, "moe_local_combine", lambda *args: cout):
        for _ in range(30):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    ratio = {name: round(v / best["aten"], 2) for name, v in best.items()}
    assert ratio["dispatch"] <= 1.4 and ratio["combine"] <= 0.7, (
        f"host time of a repeat call over the plain ATen sequence's: {ratio} "
        f"(us per call: { {n: round(v / 200 * 1e6, 1) for n, v in best.items()} })")


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("f", [256, 6])  # vectorised and element-wise paths
def test_swiglu_kernel(dtype, f):
    from flux.nn.moe import _has_swiglu_kernel, swiglu

    if not _has_swiglu_kernel():
        pytest.skip("flux._C without moe_swiglu")
    torch.manual_seed(0)
    h = (torch.randn(37, 2 * f, device=DEV) * 3).to(dtype).requires_grad_()
    g = torch.randn(37, f, device=DEV).to(dtype)
    a = swiglu(h)
    a.backward(g)
    h32 = h.detach().float().requires_grad_()
    gate, up = h32.chunk(2, dim=-1)
    a32 = torch.nn.functional.silu(gate) * up
    a32.backward(g.float())
    # The kernel rounds once from fp32; the tolerance: a few units of the dtype's last place.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(a.float(), a32, **tol)
    torch.testing.assert_close(h.grad.float(), h32.grad, **tol)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_kernel_slabs(dtype):
    """swiglu(h [E, C, 2F], counts): the counted rows of each slab as without counts, forward and
    backward, with NaN in every other row (never read) and over the outputs' memory (the counted
    rows must all be written)."""
    from flux.nn.moe import _has_swiglu_kernel, swiglu

    if not _has_swiglu_kernel():
        pytest.skip("flux._C without moe_swiglu")
    torch.manual_seed(1)
    e, c, f = 5, 12, 256
    cnt = [0, 12, 3, 7, 1]
    h = (torch.randn(e, c, 2 * f, device=DEV) * 3).to(dtype)
    g = torch.randn(e, c, f, device=DEV).to(dtype)
    for i, n in enumerate(cnt):
        h[i, n:] = float("nan")
        g[i, n:] = float("nan")
    h.requires_grad_()
    counts = torch.tensor(cnt, device=DEV)
    for shape in ((e, c, f), (e, c, 2 * f)):
        torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    a = swiglu(h, counts)
    a.backward(g)
    for i, n in enumerate(cnt):
        hi = h.detach()[i, :n].clone().requires_grad_()
        ai = swiglu(hi)
        ai.backward(g[i, :n])
        assert torch.equal(a[i, :n], ai.detach()) and torch.equal(h.grad[i, :n], hi.grad), f"slab {i}"


@gpu_only
def test_bounded_layer_skips_padding(group):
    """flux.nn.MoE bounded on flux's masked grouped kernels: the dispatch leaves the padding
    unwritten (zero_pad=False) and the output and every gradient match the same layer computing
    every slab row over the dispatch's zeros; the forward replays from a CUDA graph."""
    from flux.nn.moe import FluxDispatcher

    seen = []

    class Recording(FluxDispatcher):
        @staticmethod
        def dispatch(*args, **kw):
            seen.append(kw.get("zero_pad", True))
            return FluxDispatcher.dispatch(*args, **kw)

    torch.manual_seed(2)
    t, h, f, e, k = 64, 256, 128, 8, 2
    layer = flux.nn.MoE(h, f, e, k, seed=1, dtype=torch.bfloat16, device=DEV, max_tokens_per_rank=t,
                        dispatcher=Recording())
    x0 = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    if not layer.skip_padding(x0, t):
        pytest.skip("flux's masked grouped kernels do not run here")
    g = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    results = {}
    for name in ("masked", "padded"):
        if name == "padded":
            layer.skip_padding = lambda x, cap: False
        x = x0.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        out = layer(x)
        out.backward(g)
        results[name] = [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
    del layer.skip_padding
    assert seen == [False, True]
    for a, b in zip(results["masked"], results["padded"]):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
    with torch.no_grad():
        xs = x0.clone()
        layer(xs)  # warm-up: the dispatch's checks remembered
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(xs)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = layer(xs)
        xs.copy_(torch.randn(t, h, device=DEV, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), layer(xs).float(), atol=0, rtol=0)
