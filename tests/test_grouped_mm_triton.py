"""grouped_mm(..., impl="triton"), the contiguous-grouped Triton prototype (flux/ops/_triton_gmm.py),
and impl="hybrid" (torch._grouped_mm with the Triton weight gradient), against the loop of
torch.mm: forward, dx and dW, both weight layouts, an expert without rows.

CPU: Triton's interpreter (TRITON_INTERPRET=1), which has to be set before triton is imported,
so those checks run in a subprocess (this file run as a script). The interpreter's tl.dot is
wrong for bf16 operands, which the kernels handle by casting tiles to fp32 there, and its
fp32 -> bf16 cast truncates (twice the round-to-nearest error); fp32 and bf16 are checked.
Where the interpreter fails a probe kernel (some Triton and NumPy versions), those checks skip
with its error. GPU: the same comparison on CUDA (bf16, fp16, fp32), bf16 also through the
kernel and hybrid, skipped without a GPU. Tolerances: 4 x the same-precision loop's error against an fp64 reference.
"""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| relative to max |ref| (NaN anywhere in a counts as infinite)."""
    a = a.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() if ref.numel() else 0.0


def _ref(x, w, counts, layout, dy):
    """fp64 forward, dx and dW of the grouped product (per expert, plain autograd)."""
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    outs, s = [], 0
    for e, c in enumerate(counts):
        outs.append(xr[s:s + c] @ (wr[e].t() if layout == "nk" else wr[e]))
        s += c
    y = torch.cat(outs)
    y.backward(dy.double())
    return y.detach(), xr.grad, wr.grad


def _run(impl, x, w, counts, layout, dy):
    from flux.ops.grouped_mm import grouped_mm
    xi = x.detach().clone().requires_grad_()
    wi = w.detach().clone().requires_grad_()
    offs = torch.tensor(counts, device=x.device)  # a device tensor: no host copy of the counts
    y = grouped_mm(xi, wi, offs if impl != "loop" else counts, weight_layout=layout, impl=impl)
    y.backward(dy)
    return y.detach(), xi.grad, wi.grad


def compare(device, dtype, layout, counts, k, n, impls=("triton",), slack=4.0, seed=0):
    """Each impl's forward, dx and dW within ``slack`` x the loop's error (same dtype) of the
    fp64 reference, and an empty expert's dW exactly zero. Returns the errors."""
    gen = torch.Generator().manual_seed(seed)
    rows, experts = sum(counts), len(counts)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = torch.randn(experts, n, k, generator=gen) / k ** 0.5
    w = (w if layout == "nk" else w.transpose(1, 2).contiguous()).to(device, dtype)
    dy = torch.randn(rows, n, generator=gen).to(device, dtype)
    ref = _ref(x, w, counts, layout, dy)
    base = [_err(got, r) for got, r in zip(_run("loop", x, w, counts, layout, dy), ref)]
    floor = {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype, 1e-3)
    errors = {"loop": base}
    for impl in impls:
        got = _run(impl, x, w, counts, layout, dy)
        errs = [_err(g, r) for g, r in zip(got, ref)]
        for what, e, b in zip(("forward", "dx", "dW"), errs, base):
            assert e <= slack * b + floor, f"{impl} {dtype} {layout} {what}: error {e:.3g}, loop's {b:.3g}"
        for expert, c in enumerate(counts):
            if c == 0:
                assert torch.equal(got[2][expert], torch.zeros_like(got[2][expert])), f"{impl}: empty expert's dW"
        errors[impl] = errs
    return errors


def poisoned(device, dtype, layout):
    """The kernels write every output element: outputs filled with NaN before the call."""
    from flux.ops import _triton_gmm as tg
    counts = [17, 0, 40, 3, 0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), 32, generator=gen).to(device, dtype)
    w = torch.randn(len(counts), 48, 32, generator=gen).to(device, dtype)
    if layout == "kn":  # a non-contiguous "kn" view: the kernels read strides
        w = w.transpose(1, 2)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    cfg = tg._FWD_CPU if device == "cpu" else tg._FWD_GPU
    plan = tg.tile_plan(offs, x.shape[0], cfg[0])
    se, sn, sk = tg._strides(w, layout)
    out = torch.full((x.shape[0], 48), float("nan"), dtype=dtype, device=device)
    tg._tiles_mm(x, w, plan, se, sk, sn, 48, cfg, out=out)
    assert torch.isfinite(out).all()
    dw = torch.full(w.shape, float("nan"), dtype=dtype, device=device)
    tg._wgrad(out, x, offs, w.shape, layout, dw=dw)
    assert torch.isfinite(dw).all()
    assert (dw[1] == 0).all() and (dw[4] == 0).all()


def _interpreter_why_not() -> str:
    """Why this Triton's interpreter cannot run the kernels ("" where it can): a probe kernel
    with a program id as a loop bound (Triton 3.6 under NumPy 2.4 raises there, 3.8 does not)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(out_ptr, n):
        for i in range(tl.program_id(0), n, 2):
            tl.store(out_ptr + i, i)

    out = torch.zeros(4, dtype=torch.int32)
    try:
        probe[(2,)](out, 4)
    except Exception as e:  # the interpreter's own error type differs across versions
        return f"Triton {triton.__version__}'s interpreter fails a probe kernel ({type(e).__name__}: {e})"
    return "" if out.tolist() == [0, 1, 2, 3] else f"Triton {triton.__version__}'s interpreter: wrong probe result"


def _interpreted_checks():
    """Run under TRITON_INTERPRET=1 (the subprocess of test_triton_interpreted)."""
    why = _interpreter_why_not()
    if why:
        print(f"skip: {why}")
        return
    from flux.ops.grouped_mm import grouped_mm_impl
    counts = [29, 0, 9, 62]  # R = 100, uneven, one expert without rows
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("nk", "kn"):
            errs = compare("cpu", dtype, layout, counts, 32, 48)
            print(dtype, layout, {k: [f"{e:.2g}" for e in v] for k, v in errs.items()})
            poisoned("cpu", dtype, layout)
    compare("cpu", torch.float32, "nk", [0, 0, 5], 16, 16)  # leading empty experts, one short tile
    compare("cpu", torch.float32, "kn", [0, 0], 16, 16)  # no rows at all: dW zero, empty output
    x, w = torch.randn(4, 16), torch.randn(2, 16, 16)
    assert grouped_mm_impl(x, w) == ("triton", ""), grouped_mm_impl(x, w)  # FLUX_GROUPED_MM=triton
    # Offsets past R or decreasing (unchecked: a check would synchronise) stay inside x, out and dW.
    from flux.ops._triton_gmm import grouped_mm_triton
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(3, 24, 16, requires_grad=True)
    for offs in ([8, 100, 150], [12, 5, 20]):
        y = grouped_mm_triton(x, w, torch.tensor(offs, dtype=torch.int32))
        y.sum().backward()
        assert y.shape == (20, 24) and x.grad.shape == x.shape and w.grad.shape == w.shape
        assert torch.allclose(y[:8], x[:8] @ w[0].t(), atol=1e-5), offs  # the rows before the bad offset
        x.grad = w.grad = None
    # wgrad alone (impl="hybrid"'s weight gradient): the loop's dW, bad offsets clamped likewise
    from flux.ops._triton_gmm import wgrad
    counts = [7, 0, 13]
    x, dy = torch.randn(20, 16), torch.randn(20, 24)
    ref = torch.stack([dy[s:s + c].t() @ x[s:s + c] for s, c in zip((0, 7, 7), counts)])
    for layout, shape in (("nk", (3, 24, 16)), ("kn", (3, 16, 24))):
        got = wgrad(dy, x, torch.tensor([7, 7, 20], dtype=torch.int32), shape, layout)
        want = ref if layout == "nk" else ref.transpose(1, 2)
        assert got.shape == shape and torch.allclose(got, want, atol=1e-4) and (got[1] == 0).all(), layout
    got = wgrad(dy, x, torch.tensor([7, 3, 99], dtype=torch.int32), (3, 24, 16))  # -> [7, 7, 20]
    assert torch.allclose(got, ref, atol=1e-4)
    print("ok")


def test_tile_plan():
    """Every row in exactly one tile, each tile inside one expert's rows, at most block_m rows;
    unused tiles empty; the length the static bound (no interpreter needed)."""
    pytest.importorskip("triton")
    from flux.ops._triton_gmm import tile_plan
    gen = torch.Generator().manual_seed(2)
    for counts in ([29, 0, 9, 62], [0, 0, 0], [], [16, 16], [1] * 7, torch.randint(0, 40, (11,), generator=gen).tolist()):
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        rows, bm = sum(counts), 16
        start, end, expert = tile_plan(offs, rows, bm)
        assert start.shape[0] == -(-rows // bm) + len(counts)
        hits = torch.zeros(rows, dtype=torch.int64)
        bounds = [0] + offs.tolist()
        for s, e, x in zip(start.tolist(), end.tolist(), expert.tolist()):
            assert 0 <= e - s <= bm
            if s < e:
                assert bounds[x] <= s and e <= bounds[x + 1], (counts, s, e, x)
                hits[s:e] += 1
        assert (hits == 1).all(), counts


def test_triton_interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "FLUX_GROUPED_MM": "triton", "PYTHONPATH": ROOT,
           "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=300)
    last = r.stdout.strip().splitlines()[-1:] or [""]
    if r.returncode == 0 and last[0].startswith("skip: "):
        pytest.skip(last[0][len("skip: "):])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]


def test_triton_refused_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from flux.ops.grouped_mm import grouped_mm, grouped_mm_impl
    x, w = torch.randn(5, 8), torch.randn(2, 4, 8)
    assert grouped_mm_impl(x, w, impl="triton")[0] == "loop"
    with pytest.raises(ValueError, match="impl='triton'"):
        grouped_mm(x, w, [2, 3], impl="triton")
    monkeypatch.setenv("FLUX_GROUPED_MM", "triton")  # asked through the environment: falls back
    assert torch.equal(grouped_mm(x, w, [2, 3]), grouped_mm(x, w, [2, 3], impl="loop"))
    assert grouped_mm_impl(x, w, impl="hybrid")[0] == "loop"
    with pytest.raises(ValueError, match="impl='hybrid'"):
        grouped_mm(x, w, [2, 3], impl="hybrid")
    monkeypatch.setenv("FLUX_GROUPED_MM", "hybrid")  # asked through the environment: falls back
    assert grouped_mm_impl(x, w)[0] == "loop"
    assert grouped_mm(x, w, [2, 3]).shape == (5, 4)
    monkeypatch.setenv("FLUX_GROUPED_MM", "cutlass")  # asked through the environment: falls back
    assert grouped_mm(x, w, [2, 3]).shape == (5, 4)
    monkeypatch.setenv("FLUX_GROUPED_MM", "cuBLAS")
    with pytest.raises(ValueError, match="FLUX_GROUPED_MM"):
        grouped_mm(x, w, [2, 3])


def test_bench_imports_without_gpu():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_grouped_mm.py"), "--help"],
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--experts" in r.stdout, r.stderr[-2000:]


def _gpu_ok():
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("experts", [8, 64])
def test_triton_gpu(layout, experts):
    from flux.ops.grouped_mm import grouped_mm_impl
    gen = torch.Generator().manual_seed(experts)
    counts = torch.randint(0, 300, (experts,), generator=gen)
    counts[1] = 0
    counts[-1] = 0
    counts = counts.tolist()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, 384, 256, device="cuda", dtype=torch.bfloat16)
    impls = ("triton",) + (("kernel", "hybrid") if grouped_mm_impl(x, w, layout)[0] == "kernel" else ())
    errs = compare("cuda", torch.bfloat16, layout, counts, 256, 384, impls=impls)
    print(errs)
    compare("cuda", torch.float16, layout, counts, 256, 384)
    compare("cuda", torch.float32, layout, counts, 256, 384)  # two pipeline stages (shared memory)
    for dtype in (torch.bfloat16, torch.float16):
        poisoned("cuda", dtype, layout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_kernel_empty_experts_zero_on_poisoned_memory(layout):
    """The kernel path with the counts on the device only (no host list: the backward cannot name
    the empty experts): their weight gradient is exactly zero although the block the caching
    allocator hands dW was filled with NaN (torch writes the zeros on 9.x, a mask elsewhere).
    dW is 7.3 MB, in the allocator's large pool, where a freed block of its exact size is reused;
    the other tensors here are small-pool ones."""
    from flux.ops.grouped_mm import grouped_mm, grouped_mm_impl
    counts = [0, 40, 0, 24, 0, 8, 0]
    n, k = 512, 1024
    x = torch.randn(sum(counts), k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    shape = (len(counts), n, k) if layout == "nk" else (len(counts), k, n)
    w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if grouped_mm_impl(x, w, layout, impl="kernel")[0] != "kernel":
        pytest.skip("torch._grouped_mm does not run here")
    offs = torch.tensor(counts, device="cuda")
    y = grouped_mm(x, w, offs, weight_layout=layout, impl="kernel")
    dy = torch.randn_like(y)
    poison = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison  # its block, NaN-filled, is the one dW gets
    y.backward(dy)
    s = 0
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e])), f"expert {e}"
        else:
            xe, de = x[s:s + c].detach().float(), dy[s:s + c].float()
            want = de.t() @ xe if layout == "nk" else xe.t() @ de
            assert torch.allclose(w.grad[e].float(), want, rtol=2e-2, atol=2e-1), f"expert {e}"
        s += c


@pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU and triton")
def test_every_tuned_wgrad_configuration():
    """Each weight-gradient configuration the autotuner may pick, run alone on NaN-filled dW:
    every element written, the loop's dW within bf16 tolerance, zeros for experts without rows."""
    from flux.ops import _triton_gmm as tg
    counts = [0, 300, 5, 0, 131, 64]
    gen = torch.Generator().manual_seed(4)
    n, k = 384, 320
    x = torch.randn(sum(counts), k, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(sum(counts), n, generator=gen).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    starts = [0] + offs.tolist()[:-1]
    want = torch.stack([dy[a:a + c].float().t() @ x[a:a + c].float() for a, c in zip(starts, counts)])
    for m, p, q, warps, stages in tg._WGRAD_TUNE:
        dw = torch.full((len(counts), n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        grid = (len(counts), -(-n // p), -(-k // q))
        tg._wgrad_kernel[grid](dy, x, dw, offs, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                               dw.stride(0), dw.stride(1), dw.stride(2), 64, BLOCK_M=m, BLOCK_P=p, BLOCK_Q=q,
                               PRECISION="tf32", UPCAST=False, num_warps=warps, num_stages=stages)
        assert torch.isfinite(dw).all(), (m, p, q)
        assert torch.allclose(dw.float(), want, rtol=2e-2, atol=0.25), (m, p, q, (dw.float() - want).abs().max())
        assert (dw[0] == 0).all() and (dw[3] == 0).all(), (m, p, q)


if __name__ == "__main__":
    _interpreted_checks()
