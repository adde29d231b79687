"""flux's CUTLASS grouped GEMMs (csrc/moe/grouped_gemm.cuh; grouped_mm(impl="cutlass")).

CPU: the build table's grouped entries, the rule that picks a configuration per product, and
that the implementation is refused with a reason where it cannot run. GPU (sm 9.0 with the
kernels built; skipped otherwise): every built (configuration, kind) against an fp64 reference
within 2x torch._grouped_mm's own error on the same inputs (bf16 output), on uneven groups with
experts that have no rows (leading, inner, last), outputs over memory poisoned with NaN; an
expert without rows gets a zero weight gradient; grouped_mm(impl="cutlass") and "auto" forward,
dx and dW against the loop of torch.mm (test_grouped_mm_triton.compare); CUDA-graph capture.
"""
import pytest
import torch

import flux.fused_configs as fc
from flux.ops import grouped_mm as G

COUNTS = [0, 130, 1, 0, 257, 64, 7, 0]  # uneven, a leading, inner and last expert without rows


def test_table_selects_grouped_kernels():
    default = fc.select_grouped("default")
    assert set(default) == {(c.id, k) for c in fc.GROUPED for k in c.default}
    assert {k for _, k in default} == set(fc.GROUPED_KINDS)  # every kind has a default kernel
    assert len(fc.select_grouped("all")) == len(fc.GROUPED) * len(fc.GROUPED_KINDS)
    assert fc.select_grouped("minimal") == [] and fc.select("gmm:1") == []
    assert fc.select_grouped("minimal,gmm:1:kn") == [(1, "kn")]
    assert fc.select_grouped("gmm:1") == [(1, k) for k in fc.GROUPED_KINDS]
    for bad in ("gmm:9", "gmm:0:tn", "gmm:x", "gmm:0:nk:1"):
        with pytest.raises(ValueError, match="grouped GEMM"):
            fc.select_grouped(bad)
        with pytest.raises(ValueError, match="grouped GEMM"):
            fc.select(bad)  # the build's fused selection checks the same term
    assert len({fc.grouped_kernel_name(c, k) for c, k in fc.select_grouped("all")}) == len(fc.select_grouped("all"))


def test_rule():
    built = frozenset(fc.select_grouped("default"))
    assert G.cutlass_config("nk", 128, built=built) == 0
    assert G.cutlass_config("kn", G.ROWS_MAX, built=built) == 0
    assert G.cutlass_config("nk", 4096, built=built) is None  # torch's kernel there
    assert G.cutlass_config("nk", 4096, forced=True, built=built) == 0
    assert G.cutlass_config("wgrad", 128, built=built) == 3
    assert G.cutlass_config("wgrad", G.ROWS_MAX, built=built) == 2
    assert G.cutlass_config("wgrad", 4096, built=built) is None  # torch's kernel there too
    assert G.cutlass_config("wgrad", 4096, forced=True, built=built) == 2
    assert G.cutlass_config("wgrad", 1024, built=frozenset({(3, "wgrad")})) == 3  # the one built
    assert G.cutlass_config("nk", 128, built=frozenset({(2, "wgrad")})) is None  # none of the kind
    assert G.cutlass_config("nk", 128, built=frozenset()) is None


def test_refused_on_cpu():
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    use, why = G.grouped_mm_impl(x, w, impl="cutlass")
    assert use == "loop" and "cpu" in why
    with pytest.raises(ValueError, match=r"flux.grouped_mm: impl='cutlass'"):
        G.grouped_mm(x, w, [2, 3], impl="cutlass")
    assert G.grouped_mm_impl(x, w)[0] == "loop"  # auto on CPU: the loop


def _gpu_why_not():
    if not torch.cuda.is_available():
        return "no GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "flux's grouped kernels are built for sm 9.0"
    if not G.grouped_built():
        return "flux._C holds no grouped GEMM"
    return ""


gpu = pytest.mark.skipif(bool(_gpu_why_not()), reason=_gpu_why_not() or "runs")


def _problem(kind, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows, e = sum(COUNTS), len(COUNTS)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(rows, k, generator=gen).bfloat16().cuda()
    if kind == "wgrad":  # a [R, M] (dy), b [R, N] (x)
        b = torch.randn(rows, n, generator=gen).bfloat16().cuda()
    else:
        b = (torch.randn(e, n, k, generator=gen) / k ** 0.5).bfloat16()
        b = (b if kind == "nk" else b.transpose(1, 2).contiguous()).cuda()
    return a, b, offs


def _reference(kind, a, b, offs):
    """fp64 per expert, and torch._grouped_mm's result on the same bf16 inputs."""
    ends = [0] + offs.tolist()
    outs = []
    for e in range(len(ends) - 1):
        ae, s = a[ends[e]:ends[e + 1]].double(), slice(ends[e], ends[e + 1])
        if kind == "wgrad":
            outs.append(ae.t() @ b[s].double())
        else:
            outs.append(ae @ (b[e].double().t() if kind == "nk" else b[e].double()))
    ref = torch.stack(outs) if kind == "wgrad" else torch.cat(outs)
    if kind == "wgrad":
        torch_out = torch._grouped_mm(a.t(), b, offs=offs)
    else:
        torch_out = torch._grouped_mm(a, b.transpose(1, 2) if kind == "nk" else b, offs=offs)
    return ref, torch_out


def _rel(got, ref):
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).abs().max() / ref.abs().max()).item()


@gpu
@pytest.mark.parametrize("cid,kind", fc.select_grouped("all"))
@pytest.mark.parametrize("k,n", [(256, 384), (1024, 136)])
def test_kernel_against_reference(cid, kind, k, n):
    if (cid, kind) not in G.grouped_built():
        pytest.skip(f"gmm:{cid}:{kind} not built (FLUX_KERNELS)")
    a, b, offs = _problem(kind, k, n)
    ref, torch_out = _reference(kind, a, b, offs)
    base = _rel(torch_out, ref)
    # The op allocates its output: poison the allocator's blocks of that size with NaN first.
    torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    got = torch.ops.flux.grouped_mm_cutlass(a, b, offs, fc.GROUPED_KINDS.index(kind), cid)
    torch.cuda.synchronize()
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    err = _rel(got, ref)
    assert err <= 2 * base + 1e-3, f"gmm:{cid}:{kind} K={k} N={n}: error {err:.3g}, torch's {base:.3g}"
    if kind == "wgrad":
        for e, c in enumerate(COUNTS):
            if c == 0:
                assert torch.equal(got[e], torch.zeros_like(got[e])), f"expert {e} has no rows: dW not zero"


@gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("impl", ["cutlass", "auto"])
def test_grouped_mm_forward_and_gradients(layout, impl):
    from test_grouped_mm_triton import compare
    assert G.grouped_mm_impl(torch.empty(8, 64, dtype=torch.bfloat16, device="cuda"),
                             torch.empty(2, 64, 64, dtype=torch.bfloat16, device="cuda"), layout, impl)[0] == "cutlass"
    compare("cuda", torch.bfloat16, layout, COUNTS, 256, 384, impls=(impl,), slack=2.0)
    compare("cuda", torch.bfloat16, layout, [300, 0, 2100], 128, 256, impls=(impl,), slack=2.0)  # > ROWS_MAX


@gpu
def test_graph_capture():
    a, b, offs = _problem("nk", 256, 384)
    G.grouped_mm(a, b, offs, cumulative=True, impl="cutlass")  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.grouped_mm(a, b, offs, cumulative=True, impl="cutlass")
    a.copy_(torch.randn_like(a, dtype=torch.float32).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    ref, torch_out = _reference("nk", a, b, offs)
    assert _rel(out, ref) <= 2 * _rel(torch_out, ref) + 1e-3


SLAB_COUNTS = [0, 37, 64, 1, 0, 64, 13, 50]  # C = 64: empty, partial and full slabs


@gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_slab_layout_skips_padding(layout):
    """grouped_mm_padded(skip_padding=True) on flux's kernels (slab mode): the counted rows of the
    output, d x and d w against fp64 per expert within 2x the error of torch's bf16 product on the
    same rows, with NaN in every row past the counts (never read) and the outputs over memory
    poisoned with NaN (the counted rows must all be written); an expert without rows gets d w = 0."""
    e, c, k, n = len(SLAB_COUNTS), 64, 256, 136
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(e, c, k, generator=gen).bfloat16()
    for i, cnt in enumerate(SLAB_COUNTS):
        x[i, cnt:] = float("nan")
    w = (torch.randn(e, n, k, generator=gen) / k ** 0.5).bfloat16()
    if layout == "kn":
        w = w.transpose(1, 2).contiguous()
    g = torch.randn(e, c, n, generator=gen).bfloat16()
    x, w, g = x.cuda().requires_grad_(), w.cuda().requires_grad_(), g.cuda()
    counts = torch.tensor(SLAB_COUNTS, device="cuda")
    assert G.slab_kernels_ready(x, w, layout)
    for shape in ((e, c, n), (e, c, k), tuple(w.shape)):  # the output, d x, d w: poisoned blocks
        torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    y = G.grouped_mm_padded(x, w, counts, weight_layout=layout, skip_padding=True)
    y.backward(g)
    torch.cuda.synchronize()
    assert y.shape == (e, c, n)
    wt = lambda i, t: t[i].t() if layout == "nk" else t[i]  # noqa: E731
    for i, cnt in enumerate(SLAB_COUNTS):
        xi, gi = x.detach()[i, :cnt], g[i, :cnt]
        ref = xi.double() @ wt(i, w.detach().double())
        ref_dx = gi.double() @ wt(i, w.detach().double()).t()
        ref_dw = gi.double().t() @ xi.double() if layout == "nk" else xi.double().t() @ gi.double()
        if cnt == 0:
            assert torch.equal(w.grad[i], torch.zeros_like(w.grad[i])), f"expert {i} has no rows: d w not zero"
            continue
        for got, want, base in ((y[i, :cnt], ref, xi @ wt(i, w.detach())),
                                (x.grad[i, :cnt], ref_dx, gi @ wt(i, w.detach()).t()),
                                (w.grad[i], ref_dw, gi.t() @ xi if layout == "nk" else xi.t() @ gi)):
            err, tol = _rel(got, want), _rel(base, want)
            assert err <= 2 * tol + 1e-3, f"{layout} expert {i} ({cnt} rows): error {err:.3g}, torch's {tol:.3g}"
