"""The fused GEMM instantiation table (flux/fused_configs.py), the sources setup.py generates
from it, and, on a GPU, every built instantiation against torch.mm.

GPU cases: every (op, config, dtype) that flux._C was built with, all flags already set (AG: any
rank, every shard "arrived"; RS: a random peer partial folded in), outputs poisoned with NaN,
inputs random; the relative error against an fp32 reference must stay within twice cuBLAS's on
the same data. Instantiations not built are skipped by name; calling one fails naming it.
"""
import glob
import math
import os
import re

import pytest
import torch

from flux import fused_configs as fc
from flux.autotune import kernel_configs as KC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_table_is_consistent():
    for op, configs in fc.CONFIGS.items():
        ids = [c.id for c in configs]
        assert len(ids) == len(set(ids)), op
        for c in configs:
            m, n, k = c.tile
            assert c.schedule in ("cooperative", "pingpong") and c.operands in fc.OPERANDS, c
            if c.operands == "ab":
                assert m in (64, 128, 256) and n % 16 == 0 and 16 <= n <= 256 and k in (64, 128), c
                # Cooperative splits a tile's rows between two consumer warpgroups of 64 rows each.
                assert c.schedule == "pingpong" or m >= 128, c
            else:  # out^T = weight @ a^T: the MMA's 64-row side along the columns, its N side along the rows
                assert m % 8 == 0 and 8 <= m <= 256 and n % (128 if c.schedule == "cooperative" else 64) == 0, c
                assert n <= 256 and k == 64 and not c.scheduler.startswith("streamk") and c.loads == "cutlass", c
                assert "operands swapped" in c.describe(), c
            assert c.cluster in ((1, 1), (2, 1), (1, 2), (2, 2)), c
            assert set(c.default) <= set(fc.DTYPES), c
            # CUTLASS's sm90 stream-K scheduler runs in the cooperative kernel only.
            assert c.scheduler in fc.SCHEDULERS and (not c.scheduler.startswith("streamk") or c.schedule == "cooperative"), c
            assert ("stream-K" in c.describe()) == c.scheduler.startswith("streamk"), c
            assert (f"split-K into {c.splits}" in c.describe()) == (c.scheduler == "splitk") == (c.splits > 1), c
            assert c.applies(256, 1280, 8 * c.splits * 3) and c.applies(256, 1280, 8) == (c.splits == 1), c
            assert c.applies(16384, 53248, 16384) == (c.splits == 1), c  # partials over 1 GiB
    assert fc.config("ag", 0).tile == (128, 256, 64) and fc.config("rs", 99) is None
    # Ids keep their meaning: the fields before `scheduler` unchanged, the old ones persistent.
    assert fc.config("ag", 4) == fc.FusedConfig(4, (128, 128, 64), (1, 1), "cooperative", ())
    assert fc.config("rs", 3).scheduler == "persistent" and fc.config("rs", 8).scheduler == "streamk"


def test_select_and_parse():
    default = fc.select("default")
    assert ("ag", 0, "bf16") in default and ("rs", 3, "bf16_fp32") in default and ("ag", 2, "fp16_fp32") in default and len(default) == 79
    assert ("rs", 0, "bf16") in default and ("rs", 0, "bf16_fp32") not in default
    # Every default configuration in bf16 and fp16; fp32 output: RS 3 (bf16 inputs) and, in both input
    # dtypes, AG 0 and 2, AG's split-K configurations and the tiles of their GEMMs (AG 9, 25, 29); no
    # stream-K one.
    bf16 = {(op, i) for op, i, d in default if d == "bf16"}
    assert {(op, i) for op, i, d in default if d == "fp16"} == bf16
    fp32 = {(op, i) for op, i, d in default if d not in ("bf16", "fp16")}
    assert fp32 == {("ag", i) for i in (0, 2, 9, 25, 29, 32, 33, 34, 35, 36, 37, 41, 42)} | {("rs", 3)}
    assert {(op, i) for op, i, d in default if d == "fp16_fp32"} >= {("ag", 0), ("ag", 2)}
    assert ("rs", 3, "fp16_fp32") not in default
    # Those beyond AG 0, 2 and RS 3 add no CUTLASS GEMM: each is a split-K GEMM of the build (AG's split GEMM
    # is the persistent kernel of its tile with fp32 output, setup.py _SPLIT_CXX).
    split = {(fc.config("ag", i).tile, fc.config("ag", i).cluster, fc.config("ag", i).schedule, d)
             for op, i, d in default if op == "ag" and fc.config(op, i).scheduler == "splitk" and d in fc.H}
    for op, i, d in default:
        c = fc.config(op, i)
        if d in fc.O and (op, i) not in {("ag", 0), ("ag", 2), ("rs", 3)}:
            assert op == "ag" and (c.scheduler == "splitk" or
                                   (c.tile, c.cluster, c.schedule, fc.DTYPE_IO[d][0]) in split), (op, i, d)
    assert not [(op, i, d) for op, i, d in default if fc.config(op, i).scheduler == "streamk"]
    assert fc.select("streamk") == [("ag", i, "bf16") for i in range(12, 19)] + [("rs", i, "bf16") for i in range(8, 13)]
    assert fc.select("splitk") == ([("ag", i, "bf16") for i in [*range(32, 43), *range(53, 59), 104, 105, 115, 116]]
                                  + [("rs", i, "bf16") for i in [*range(13, 19), *range(23, 27), 47, 48]])
    # Swapped operands: a launcher of their own (the same tile as the layer's order is another kernel).
    assert fc.kernel_name("ag", 115, "bf16") == fc.kernel_name("ag", 116, "bf16_fp32") == "ag_split_32x128x64_1x1_coop_sw_bf16"
    for bad in (fc.FusedConfig(999, (32, 96, 64), (1, 1), "cooperative", (), operands="swapped"),  # 96 columns
                fc.FusedConfig(999, (36, 128, 64), (1, 1), "cooperative", (), operands="swapped"),  # rows % 8
                fc.FusedConfig(999, (32, 128, 64), (1, 1), "cooperative", (), "streamk", operands="swapped"),
                fc.FusedConfig(999, (32, 128, 64), (1, 1), "cooperative", (), operands="ba")):
        with pytest.raises(ValueError, match="operands"):
            fc.CONFIGS["ag"] += (bad,)
            try:
                fc._check_schedulers()
            finally:
                fc.CONFIGS["ag"] = fc.CONFIGS["ag"][:-1]
    # A tile in both orders (AG 0 and 113): two configurations, told apart in cached choices.
    assert fc.config("ag", 0)[1:4] == fc.config("ag", 113)[1:4] and fc.config("ag", 113).operands == "swapped"
    assert KC.KernelConfig.of("ag", fc.config("ag", 113), (("bf16", "bf16"),)).desc == "128x256x64/2x1/coop/sw"
    assert KC.KernelConfig.of("ag", fc.config("ag", 115), (("bf16", "bf16"),)).desc == "32x128x64/1x1/coop/k2/sw"
    # Split-K configurations of one tile share a launcher (one unit per tile and input dtype).
    assert fc.kernel_name("ag", 32, "bf16") == fc.kernel_name("ag", 34, "bf16_fp32") == "ag_split_128x64x64_1x1_pp_bf16"
    assert fc.kernel_name("ag", 33, "fp16") == "ag_split_128x64x64_1x1_pp_fp16"
    with pytest.raises(ValueError, match="splits"):
        fc.CONFIGS["ag"] += (fc.FusedConfig(999, (128, 64, 64), (1, 1), "pingpong", (), "persistent", 2),)
        try:
            fc._check_schedulers()
        finally:
            fc.CONFIGS["ag"] = fc.CONFIGS["ag"][:-1]
    with pytest.raises(ValueError, match="differ only in their loads"):
        fc.CONFIGS["ag"] += (fc.FusedConfig(999, (64, 96, 64), (2, 1), "pingpong", (), loads="cutlass"),)
        try:
            fc._check_schedulers()
        finally:
            fc.CONFIGS["ag"] = fc.CONFIGS["ag"][:-1]
    # The source loaded ahead (an epilogue's buffers, not a new tile): RS only, not under split-K (its
    # reduction adds the source), and no twin of a configuration differing only in it (cached choices
    # name tile, cluster, schedule and scheduler).
    for op, bad in (("ag", fc.FusedConfig(999, (128, 128, 64), (1, 1), "cooperative", (), source="ahead")),
                    ("rs", fc.FusedConfig(999, (128, 128, 64), (1, 1), "cooperative", (), "splitk", 2,
                                          source="ahead")),
                    ("rs", fc.FusedConfig(999, (128, 96, 64), (1, 1), "cooperative", (), source="early")),
                    ("rs", fc.FusedConfig(999, (128, 256, 64), (2, 1), "cooperative", ()))):
        with pytest.raises(ValueError, match="source"):
            fc.CONFIGS[op] += (bad,)
            try:
                fc._check_schedulers()
            finally:
                fc.CONFIGS[op] = fc.CONFIGS[op][:-1]
    assert fc.config("rs", 0).source == "ahead" and "source loaded ahead" in fc.config("rs", 0).describe()
    assert KC.KernelConfig.of("rs", fc.config("rs", 0), (("bf16", "bf16"),)).desc == "128x256x64/2x1/coop"
    assert len(fc.select("all")) == sum(len(v) for v in fc.CONFIGS.values()) * len(fc.DTYPES)
    assert fc.select("minimal") == [("ag", 0, "bf16"), ("rs", 0, "bf16")]
    assert fc.select("ag:2") == [("ag", 2, d) for d in fc.DTYPES]
    assert set(fc.select("minimal,rs:*:fp16")) == {("ag", 0, "bf16"), ("rs", 0, "bf16")} | {
        ("rs", c.id, "fp16") for c in fc.CONFIGS["rs"]}
    for bad in ("ag:999", "xx:0", "ag:0:fp8", "ag:0:bf16:1"):
        with pytest.raises(ValueError, match="FLUX_KERNELS"):
            fc.select(bad)
    text = " ".join(f"{op}:{i}:{d}" for op, i, d in default)
    assert fc.parse_built(text) == frozenset(default)
    assert fc.parse_built("") == frozenset()


def _setup_scope(tmp_path):
    """setup.py's functions (its module body up to the build), with ROOT a scratch root holding the table."""
    src = open(os.path.join(ROOT, "setup.py")).read().split("ext_modules, cmdclass, _ = _cuda_extension()")[0]
    scope = {"__file__": os.path.join(ROOT, "setup.py"), "__name__": "flux_setup_under_test"}
    exec(compile(src, "setup.py", "exec"), scope)
    scope["ROOT"] = str(tmp_path)
    os.makedirs(tmp_path / "flux")
    with open(os.path.join(ROOT, "flux", "fused_configs.py")) as f:
        (tmp_path / "flux" / "fused_configs.py").write_text(f.read())
    return scope


def test_setup_generates_swapped_operands(tmp_path, monkeypatch):
    """A configuration with swapped operands is generated as CUTLASS's transposed problem: its tile and
    cluster as (columns, rows), the Swapped flag on the persistent and the split-K GEMM (AG's split GEMM
    the fp32-output kernel of its tile, in one unit), and the extended MMA shapes by the rows (CUTLASS's N)."""
    scope = _setup_scope(tmp_path)
    monkeypatch.setenv("FLUX_KERNELS", "ag:113:bf16,ag:115:bf16,ag:110:bf16_fp32,rs:42:bf16,rs:47:fp16")
    monkeypatch.setenv("FLUX_UNIT_KERNELS", "8")
    names = sorted(os.path.basename(s) for s in scope["_generate_fused_sources"](True))
    assert names == ["ag_fused_0.cu", "fused_dispatch.cpp", "rs_fused_0.cu"]
    gen = tmp_path / "build" / "flux_generated"
    ag, rs = (gen / "ag_fused_0.cu").read_text(), (gen / "rs_fused_0.cu").read_text()
    assert ("launch_ag_fused<AgGemm<kBf16, cute::Shape<cute::_256, cute::_128, cute::_64>,\n"
            "      cute::Shape<cute::_1, cute::_2, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative, "
            "cutlass::epilogue::TmaWarpSpecializedCooperative, /*StreamK=*/0, /*Swapped=*/true>>(a);") in ag
    assert "launch_ag_split<AgSplitGemm<kBf16, cute::Shape<cute::_128, cute::_32, cute::_64>" in ag
    assert "/*Swapped=*/true>>(a, splits, dtype);" in ag and "operands swapped" in ag
    assert "launch_rs_fused<RsFoldGemm<kBf16, cute::Shape<cute::_128, cute::_32, cute::_64>" in rs
    assert "launch_rs_split<RsSplitGemm<kFp16, cute::Shape<cute::_128, cute::_32, cute::_64>" in rs
    assert rs.count("/*Swapped=*/true>>") == 2 and "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" not in ag + rs
    dispatch = (gen / "fused_dispatch.cpp").read_text()
    assert f"case {115 * 4}: ag_split_32x128x64_1x1_coop_sw_bf16(a, 2, 0); return true;" in dispatch
    assert f"case {110 * 4 + 2}: ag_fused_c110_bf16_fp32(a); return true;" in dispatch


def test_setup_generates_units_of_instantiations(tmp_path, monkeypatch):
    """setup.py's generator, run against a scratch root: every instantiation defined in exactly one
    unit of at most FLUX_UNIT_KERNELS, units of one op's header (the grouped GEMMs apart) and of one
    MMA-shape setting, a dispatch case per instantiation, and the built list naming exactly them."""
    scope = _setup_scope(tmp_path)
    monkeypatch.setenv("FLUX_KERNELS", "minimal,ag:7:fp16_fp32,ag:28:bf16,rs:8:bf16,rs:12:bf16,gmm:0:kn,"
                       "ag:33:bf16,ag:34:bf16_fp32,rs:15:fp16,ag:9:bf16_fp32")
    monkeypatch.setenv("FLUX_UNIT_KERNELS", "2")
    sources = scope["_generate_fused_sources"](True)
    gen = tmp_path / "build" / "flux_generated"
    names = sorted(os.path.basename(s) for s in sources)
    # AG: 3 GEMMs in 2 units (AG 9 with fp32 output is AG 33's and 34's split GEMM), the 224-wide tile in its
    # own; RS: 4 in 2; the grouped GEMM.
    assert names == ["ag_fused_0.cu", "ag_fused_1.cu", "ag_fused_x_0.cu", "fused_dispatch.cpp", "gmm_0.cu",
                     "rs_fused_0.cu", "rs_fused_1.cu"]
    units = {n: (gen / n).read_text() for n in names if n.endswith(".cu")}
    defined = {}

    def gemm(launch):  # the CUTLASS GEMM a launcher instantiates: AG's split GEMM is AgGemm with fp32 output
        m = re.search(r"AgSplitGemm<k(\w+?), ", launch)
        return launch[launch.index("<") + 1:].replace(m[0], f"AgGemm<k{m[1]}Fp32, ") if m else launch[launch.index("<") + 1:]
    for n, text in units.items():
        fns = re.findall(r"^void (\w+)\(", text, re.M)
        gemms = {gemm(launch) for launch in re.findall(r"^  (\w+<.*?)\(a", text, re.M | re.S)}
        assert 1 <= len(gemms) <= 2 and len(fns) >= len(gemms) and text.count("#include") == 1, n
        for fn in fns:
            assert fn not in defined, fn
            defined[fn] = n
    assert defined["ag_fused_c9_bf16_fp32"] == defined["ag_split_128x64x64_1x1_pp_bf16"]  # one GEMM, one unit
    assert sorted(defined) == sorted(["ag_fused_c0_bf16", "ag_fused_c7_fp16_fp32", "ag_fused_c9_bf16_fp32", "ag_fused_c28_bf16",
                                      "ag_split_128x64x64_1x1_pp_bf16", "rs_fused_c0_bf16", "rs_fused_c8_bf16",
                                      "rs_fused_c12_bf16", "rs_split_64x128x64_1x1_pp_fp16", "gmm_c0_kn"])
    for fn, n in defined.items():
        assert n.startswith("gmm_" if fn.startswith("gmm") else fn[:2] + "_fused_"), (fn, n)
        assert ("FLUX_AG_FUSED_IMPL" in units[n]) == n.startswith("ag_")
        assert ("FLUX_RS_FUSED_IMPL" in units[n]) == n.startswith("rs_")
    # CUTLASS's extended MMA shapes only in the units whose tile widths need them (224 here).
    ext = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"
    assert [n for n, text in units.items() if ext in text] == ["ag_fused_x_0.cu"] == [defined["ag_fused_c28_bf16"]]
    unit = lambda fn: units[defined[fn]].split(f"void {fn}(")[1].split("\n}")[0]  # noqa: E731
    dispatch = (gen / "fused_dispatch.cpp").read_text()
    assert "case 0: ag_fused_c0_bf16(a); return true;" in dispatch
    assert f"case {7 * 4 + 3}: ag_fused_c7_fp16_fp32(a); return true;" in dispatch
    assert f"case {8 * 4}: rs_fused_c8_bf16(a); return true;" in dispatch
    assert '"ag:0:bf16 ag:7:fp16_fp32 ag:9:bf16_fp32 ag:28:bf16 ag:33:bf16 ag:34:bf16_fp32 rs:0:bf16 rs:8:bf16 rs:12:bf16 ' \
        'rs:15:fp16"' in dispatch
    # Split-K: one instantiation per tile and input dtype (its fp32-output GEMM), the slice count and
    # the output dtype variant passed by each configuration's case.
    assert f"case {33 * 4}: ag_split_128x64x64_1x1_pp_bf16(a, 4, 0); return true;" in dispatch
    assert f"case {34 * 4 + 2}: ag_split_128x64x64_1x1_pp_bf16(a, 8, 2); return true;" in dispatch
    assert f"case {15 * 4 + 1}: rs_split_64x128x64_1x1_pp_fp16(a, 2, 1); return true;" in dispatch
    text = unit("ag_split_128x64x64_1x1_pp_bf16")
    assert "launch_ag_split<AgSplitGemm<kBf16, cute::Shape<cute::_128, cute::_64, cute::_64>" in text
    assert text.startswith("const AgFusedArgs& a, int splits, int dtype)") and "(a, splits, dtype);" in text
    text = unit("rs_split_64x128x64_1x1_pp_fp16")
    assert "launch_rs_split<RsSplitGemm<kFp16, cute::Shape<cute::_64, cute::_128, cute::_64>" in text
    assert "case 1: gmm_c0_kn(a); return true;" in dispatch and '"gmm:0:kn"' in dispatch
    text = unit("ag_fused_c7_fp16_fp32")
    assert "kFp16Fp32" in text and "cute::_64, cute::_128, cute::_64" in text and "Pingpong" in text
    assert "StreamK" not in text  # persistent instantiations keep their text
    assert "stream-K;" in units[defined["rs_fused_c8_bf16"]]  # each instantiation's comment heads its unit
    text = unit("rs_fused_c8_bf16")
    assert "KernelTmaWarpSpecializedCooperative" in text and "/*StreamK=*/1>>(a);" in text
    assert "/*StreamK=*/2>>(a);" in unit("rs_fused_c12_bf16")
    text = unit("gmm_c0_kn")
    assert "cute::_64, cute::_256, cute::_64" in text and "/*Pingpong=*/true, 1>>" in text
    assert "FLUX_GROUPED_IMPL" in units[defined["gmm_c0_kn"]]
    # One per unit as the setting's floor; anything but a positive count is refused.
    monkeypatch.setenv("FLUX_UNIT_KERNELS", "1")
    assert len(scope["_generate_fused_sources"](True)) == 1 + len(defined) - 1  # the dispatch; AG 9 with AG 33, 34
    for bad in ("0", "x", "-1"):
        monkeypatch.setenv("FLUX_UNIT_KERNELS", bad)
        with pytest.raises(RuntimeError, match="FLUX_UNIT_KERNELS"):
            scope["_generate_fused_sources"](True)
    monkeypatch.delenv("FLUX_UNIT_KERNELS")
    # The host sources, and the CUDA sources beside the GEMMs, each as two units that include each file once.
    os.makedirs(tmp_path / "csrc")
    for ext, make, suffix in (("cpp", "_host_units", ".cpp"), ("cu", "_device_units", ".cu")):
        files = sorted(os.path.relpath(f, ROOT)
                       for f in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True))
        for f in files:
            os.makedirs(os.path.dirname(tmp_path / f), exist_ok=True)
            (tmp_path / f).write_text(open(os.path.join(ROOT, f)).read())
        units = scope[make](files)
        included = [line.split('"')[1] for u in units for line in (tmp_path / u).read_text().splitlines()
                    if line.startswith("#include")]
        assert len(units) == 2 and all(u.endswith(suffix) for u in units), units
        assert sorted(included) == sorted(os.path.relpath(f, "csrc") for f in files)
    # Without an sm_90a target nothing is instantiated, and stale units are removed.
    assert [os.path.basename(s) for s in scope["_generate_fused_sources"](False)] == ["fused_dispatch.cpp"]
    assert os.listdir(tmp_path / "build" / "flux_generated") == ["fused_dispatch.cpp"]


# --------------------------------------------------------------------------- GPU


def _gpu_built():
    if not torch.cuda.is_available():
        return None
    try:
        from flux.runtime.extension import cuda_kernels_available

        if not cuda_kernels_available() or not torch.ops.flux.ag_gemm_fused_supported():
            return None
        if torch.cuda.get_device_capability() != (9, 0):
            return None
    except (ImportError, AttributeError, RuntimeError):
        return None
    return fc.built()


_BUILT = _gpu_built()
gpu = pytest.mark.skipif(_BUILT is None, reason="needs flux._C with the sm_90a fused kernels and an H100/H200")
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (M, K, N): whole tiles; ragged M, N (partial tiles on every side) and K not a multiple of 64;
# rows of one shard thinner than a tile (tiles spanning two shards in AG, two segments in RS);
# few tiles and deep K (20 to 40 tiles on 132 SMs: stream-K configurations split K, and their
# partial accumulators are reduced before the one epilogue that adds the bias and RS's source).
_SHAPES = ((512, 512, 512), (328, 392, 1288), (96, 256, 2312), (256, 8192, 1280))


def _case(op, cid, dtype):
    if (op, cid, dtype) not in _BUILT:
        pytest.skip(f"{op}:{cid}:{dtype} not built (FLUX_KERNELS)")
    torch.manual_seed(1000 * cid + fc.DTYPES.index(dtype))
    din, dout = (_TORCH_DTYPE[x] for x in fc.DTYPE_IO[dtype])
    return din, dout


def _depth(op, cid, k):
    """K of a test shape for configuration cid: split-K takes the next multiple of 8 * splits
    (392 -> 400, 416, 448: slices that end in a partial K tile)."""
    step = 8 * fc.config(op, cid).splits
    return -(-k // step) * step


def _cublas(a, w, dout):
    """cuBLAS on the same data: the inputs' dtype, or fp32 output from the same inputs."""
    if dout == a.dtype:
        return torch.mm(a, w.t())
    try:
        return torch.mm(a, w.t(), out_dtype=dout)
    except (TypeError, RuntimeError):  # a torch without mm's out_dtype: fp32 operands, exact products
        return torch.mm(a.to(dout), w.to(dout).t())


def _check(out, ref32, baseline, what, k):
    """Relative error within twice cuBLAS's on the same data. An fp32 output is also allowed the
    rounding of one fp32 accumulation over K (about sqrt(K) * 2^-24 relative), twice over: cuBLAS
    may split K, which shortens its sums, where a kernel that does not runs one K-long sum."""
    assert torch.isfinite(out).all(), f"{what}: NaN/inf left in the output (tiles not written)"
    norm = ref32.norm()
    err = ((out.double() - ref32.double()).norm() / norm).item()
    base = ((baseline.double() - ref32.double()).norm() / norm).item()
    accumulation = 2 * math.sqrt(k) * 2.0**-24 if out.dtype == torch.float32 else 0.0
    assert err <= 2 * base + accumulation + 1e-6, f"{what}: relative error {err:.3g}, cuBLAS's {base:.3g}"


@gpu
@pytest.mark.parametrize("op,cid,dtype", [t for t in fc.select("all") if t[0] == "ag"])
def test_gpu_ag_fused(op, cid, dtype):
    din, dout = _case(op, cid, dtype)
    dev = torch.device("cuda")
    world = 2
    for i, (m, k, n) in enumerate(_SHAPES):
        m, k = m // world * world, _depth(op, cid, k)
        a = torch.randn(m, k, device=dev, dtype=din)
        w = torch.randn(n, k, device=dev, dtype=din) / k ** 0.5
        bias = torch.randn(n, device=dev, dtype=dout) if i in (1, 3) else None
        flags = torch.ones(world, device=dev, dtype=torch.int32)
        ref32 = a.float() @ w.float().t() + (bias.float() if bias is not None else 0)
        baseline = _cublas(a, w, dout) + (bias if bias is not None else 0)
        for rank, raster, swizzle in ((1, 1, 8), (1, 1, 4), (1, 1, 2), (0, 2, 1)):
            out = torch.full((m, n), float("nan"), device=dev, dtype=dout)
            torch.ops.flux.ag_gemm_fused_(out, a, w, bias, flags, rank, world, m // world, 10000, 0, raster,
                                          swizzle, cid)
            torch.cuda.synchronize()
            _check(out, ref32, baseline, f"ag:{cid}:{dtype} {m}x{k}x{n} rank {rank} raster {raster} swizzle {swizzle}", k)


@gpu
@pytest.mark.parametrize("op,cid,dtype", [t for t in fc.select("all") if t[0] == "rs"])
def test_gpu_rs_fused(op, cid, dtype):
    din, dout = _case(op, cid, dtype)
    dev = torch.device("cuda")
    for i, (m, k, n) in enumerate(_SHAPES):
        k = _depth(op, cid, k)
        a = torch.randn(m, k, device=dev, dtype=din)
        w = torch.randn(n, k, device=dev, dtype=din) / k ** 0.5
        src = torch.randn(m, n, device=dev, dtype=dout)  # the peer's partial, in the output dtype
        bias = torch.randn(n, device=dev, dtype=dout) if i in (1, 3) else None
        seg_rows = 40  # thinner than every tile: tiles wait for two or more segments
        flags = torch.ones(-(-m // seg_rows), device=dev, dtype=torch.int32)
        ref32 = a.float() @ w.float().t() + src.float() + (bias.float() if bias is not None else 0)
        baseline = _cublas(a, w, dout) + src + (bias if bias is not None else 0)
        for swizzle in (1, 4, 8):
            out = torch.full((m, n), float("nan"), device=dev, dtype=dout)
            torch.ops.flux.gemm_rs_fused_(out, a, w, bias, src, flags, seg_rows, 0, 1, 10000, 0, 1, swizzle, cid)
            torch.cuda.synchronize()
            _check(out, ref32, baseline, f"rs:{cid}:{dtype} {m}x{k}x{n} swizzle {swizzle}", k)


def _op_or_skip(name):
    """torch.ops.flux.<name>, or a skip where this flux._C predates it."""
    try:
        return getattr(torch.ops.flux, name)
    except (AttributeError, RuntimeError):
        pytest.skip(f"flux._C has no {name}")


@gpu
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gpu_pdl_chain_matches_serial_launches(op):
    """Programmatic dependent launch: a chain of fused GEMMs, each reading the previous one's
    output as its A (and RS its source), launched back to back, gives bitwise the result of the
    same chain without PDL (each kernel must wait for the previous one's stores)."""
    built = sorted(t for t in _BUILT if t[0] == op and t[2] == "bf16")
    if not built:
        pytest.skip(f"no {op} bf16 instantiation built")
    set_pdl = _op_or_skip("set_fused_pdl")
    dev = torch.device("cuda")
    torch.manual_seed(7)
    m, k = 1024, 1024
    x0 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(k, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(3)]
    src = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 0.1
    flags = torch.ones(max(2, m // 64), device=dev, dtype=torch.int32)

    def chain(cid, pdl):
        set_pdl(pdl)
        x, source = x0.clone(), src
        outs = []
        for _ in range(8):
            for w in ws:
                out = torch.full((m, k), float("nan"), device=dev, dtype=torch.bfloat16)
                if op == "ag":
                    torch.ops.flux.ag_gemm_fused_(out, x, w, None, flags, 0, 2, m // 2, 10000, 0, 1, 1, cid)
                else:  # the source is the previous output too: read in the epilogue
                    torch.ops.flux.gemm_rs_fused_(out, x, w, None, source, flags, 64, 0, 1, 10000, 0, 1, 1, cid)
                outs.append(out)
                x = source = out
        torch.cuda.synchronize()
        return outs

    stream_k = [t for t in built if fc.config(op, t[1]).scheduler == "streamk"]
    split_k = [t for t in built if fc.config(op, t[1]).scheduler == "splitk"]
    try:
        # A stream-K and a split-K one too: their reductions are deterministic, and split-K's
        # reduction pass is itself launched as a dependent of its GEMM.
        for _, cid, _ in built[:2] + stream_k[:1] + split_k[:1]:
            serial, overlapped = chain(cid, False), chain(cid, True)
            for i, (a, b) in enumerate(zip(serial, overlapped)):
                assert torch.isfinite(a).all(), f"{op}:{cid} step {i}: NaN without PDL"
                assert torch.equal(a, b), f"{op}:{cid} step {i}: PDL launch differs from serial launches"
    finally:
        set_pdl(True)


def _ag_problem(seed, m=1024, n=1280, k=512):
    """(device, (m, n, k), a, w, flags) of a bf16 AG problem of two ranks' rows, every flag set."""
    dev = torch.device("cuda")
    torch.manual_seed(seed)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    return dev, (m, n, k), a, w, torch.ones(2, device=dev, dtype=torch.int32)


@gpu
def test_gpu_ag_trace_accounts_for_every_tile():
    """The diagnostic per-CTA trace (torch.ops.flux.set_fused_trace): every CTA that ran records
    its SM and times in order (built, released, ended), their producers loaded each tile once, the
    result is unchanged, and with the trace off again nothing more is written."""
    built = sorted(t for t in _BUILT if t[0] == "ag" and t[2] == "bf16" and fc.config("ag", t[1]).splits == 1)
    if not built:
        pytest.skip("no AG bf16 instantiation without split-K built")
    set_trace = _op_or_skip("set_fused_trace")
    dev, (m, n, k), a, w, flags = _ag_problem(11)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for _, cid, _ in built[:1] + [t for t in built if fc.config("ag", t[1]).scheduler == "streamk"][:1]:
        cfg = fc.config("ag", cid)
        ref = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        torch.ops.flux.ag_gemm_fused_(ref, a, w, None, flags, 0, 2, m // 2, 10000, 0, 1, 1, cid)
        buf = torch.zeros(4096, 8, dtype=torch.int64, device=dev)
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        try:
            set_trace(buf.data_ptr())
            torch.ops.flux.ag_gemm_fused_(out, a, w, None, flags, 0, 2, m // 2, 10000, 0, 1, 1, cid)
        finally:
            set_trace(0)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), f"ag:{cid}: traced launch changed the result"
        t = buf.cpu()
        again = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        torch.ops.flux.ag_gemm_fused_(again, a, w, None, flags, 0, 2, m // 2, 10000, 0, 1, 1, cid)
        torch.cuda.synchronize()
        assert torch.equal(again, ref) and torch.equal(buf.cpu(), t), f"ag:{cid}: written with the trace off"
        ran = t[t[:, 1] != 0]
        assert len(ran) > 0 and (t[len(ran):] == 0).all(), f"ag:{cid}: CTAs recorded past the grid"
        assert ((ran[:, 0] >= 0) & (ran[:, 0] < sms)).all(), f"ag:{cid}: SM ids out of range"
        worked = ran[ran[:, 6] > 0]
        assert (worked[:, 2] >= worked[:, 1]).all() and (worked[:, 3] >= worked[:, 2]).all(), f"ag:{cid}: times"
        tiles = math.ceil(m / cfg.tile[0]) * math.ceil(n / cfg.tile[1])
        if cfg.scheduler == "persistent":  # stream-K hands a tile out to each CTA that shares its K loop
            assert int(ran[:, 6].sum()) == tiles, f"ag:{cid}: producers loaded {int(ran[:, 6].sum())} of {tiles} tiles"
            firsts = {(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in worked[:, 7]}
            assert len(firsts) == len(worked), f"ag:{cid}: two CTAs started on one tile"
        else:
            assert int(ran[:, 6].sum()) >= tiles, f"ag:{cid}"


def _permuted(tile, perm, cluster, rows, cols):
    """The tile (m, n) served in place of ``tile`` under the cluster-tile permutation ``perm``
    (csrc/ag_gemm/ag_tile_scheduler.hpp AgTileScheduler::permute)."""
    (m, n), (cm, cn) = tile, cluster
    if m // cm >= rows or n // cn >= cols:
        return tile
    c = perm[(m // cm) * cols + n // cn]
    return (c // cols * cm + m % cm, c % cols * cn + n % cn)


@gpu
def test_gpu_ag_order_permutes_cluster_tiles():
    """The diagnostic cluster-tile permutation (torch.ops.flux.set_fused_order): each CTA's first
    tile is the permuted one of the same launch without it, on rank 0 and on rank 1 (whose M order
    is rotated), the result is bitwise the same, a table of another size changes nothing, and
    clearing it restores the order."""
    # (Swapped operands leave the diagnostic order and deal off: csrc/ag_gemm/ag_tile_scheduler.hpp.)
    built = sorted(t for t in _BUILT if t[0] == "ag" and t[2] == "bf16" and fc.config("ag", t[1]).splits == 1
                   and fc.config("ag", t[1]).scheduler == "persistent" and fc.config("ag", t[1]).operands == "ab")
    if not built:
        pytest.skip("no persistent AG bf16 instantiation built")
    set_trace, set_order = _op_or_skip("set_fused_trace"), _op_or_skip("set_fused_order")
    with pytest.raises(RuntimeError, match="set_fused_order"):
        set_order(0, 5)
    dev, (m, n, k), a, w, flags = _ag_problem(13)
    # A 2x1 cluster and a 1x1 one where built, ping-pong and cooperative.
    picks = {}
    for t in built:
        c = fc.config("ag", t[1])
        picks.setdefault((c.cluster, c.schedule), t)
    for _, cid, _ in list(picks.values())[:3]:
        cfg = fc.config("ag", cid)
        rows = math.ceil(math.ceil(m / cfg.tile[0]) / cfg.cluster[0])
        cols = math.ceil(math.ceil(n / cfg.tile[1]) / cfg.cluster[1])
        perm = torch.randperm(rows * cols, generator=torch.Generator().manual_seed(cid))
        table = torch.cat([perm, torch.argsort(perm)]).to(torch.int32).to(dev)

        def run(rank, order_count):
            out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            buf = torch.zeros(4096, 8, dtype=torch.int64, device=dev)
            try:
                set_trace(buf.data_ptr())
                if order_count:
                    set_order(table.data_ptr(), order_count)
                torch.ops.flux.ag_gemm_fused_(out, a, w, None, flags, rank, 2, m // 2, 10000, 0, 1, 1, cid)
            finally:
                set_order(0, 0)
                set_trace(0)
            torch.cuda.synchronize()
            t = buf.cpu()
            ran = t[t[:, 1] != 0]
            return out, [(int(v) >> 32, int(v) & 0xFFFFFFFF) if int(c) > 0 else None
                         for v, c in zip(ran[:, 7], ran[:, 6])]

        plains = {}
        for rank in (0, 1):
            ref, plain = plains[rank] = run(rank, 0)
            assert torch.isfinite(ref).all(), f"ag:{cid} rank {rank}: NaN left"
            out, permuted = run(rank, rows * cols)
            assert torch.equal(out, ref), f"ag:{cid} rank {rank}: the permuted order changed the result"
            assert len(permuted) == len(plain) and any(p is not None for p in plain), f"ag:{cid}"
            want = [None if p is None else _permuted(p, perm.tolist(), cfg.cluster, rows, cols) for p in plain]
            assert permuted == want, f"ag:{cid} rank {rank}: first tiles are not the permuted ones"
            assert want != plain, f"ag:{cid}: the permutation moved no first tile"
            other, unchanged = run(rank, rows * cols + 1)
            assert torch.equal(other, ref) and unchanged == plain, f"ag:{cid} rank {rank}: a mismatched table applied"
        again, restored = run(0, 0)
        assert torch.equal(again, plains[0][0]) and restored == plains[0][1], f"ag:{cid}: order not cleared"


@gpu
def test_gpu_ag_deal_by_gpc_claims_each_cluster_tile_once():
    """The diagnostic deal by GPC (torch.ops.flux.set_fused_deal): on one wave of 2-CTA clusters (2x1 and
    1x2 where built), on rank 0 and rank 1, the result is bitwise that of the static order launch after
    launch and in CUDA-graph replay; every slot is claimed once per launch (the claims' epoch moves on
    on the device, once a launch, and the groups' counters account for every cluster); the CTAs start on
    distinct tiles, most clusters on a slot of their GPC's run (on a wave of nearly every SM and on one
    of about half); a launch of several waves keeps the static order and the epoch."""
    from flux.autotune import placement

    built = sorted(t for t in _BUILT if t[0] == "ag" and t[2] == "bf16" and fc.config("ag", t[1]).splits == 1
                   and fc.config("ag", t[1]).operands == "ab"
                   and fc.config("ag", t[1]).scheduler == "persistent"
                   and sorted(fc.config("ag", t[1]).cluster) == [1, 2])
    if not built:
        pytest.skip("no persistent AG bf16 instantiation with a 2-CTA cluster built")
    set_trace, set_deal = _op_or_skip("set_fused_trace"), _op_or_skip("set_fused_deal")
    with pytest.raises(RuntimeError, match="set_fused_deal"):
        set_deal(0, 0, 5)
    places, state, sms = placement.deal_buffers()
    per_sm, groups = places.tolist()[:sms], places.tolist()[sms:]
    picks = {}
    for t in built:
        picks.setdefault(fc.config("ag", t[1]).cluster, t)
    epoch = 0
    # A wave of nearly every SM, and one of about half (the runs scaled, some clusters misfits).
    for (_, cid, _), mt in [(p, mt) for p in picks.values() for mt in (8, 4)]:
        cfg = fc.config("ag", cid)
        dev, (m, n, k), a, w, flags = _ag_problem(17, m=mt * cfg.tile[0], n=16 * cfg.tile[1], k=512)
        rows, cols = math.ceil(mt / cfg.cluster[0]), math.ceil(16 / cfg.cluster[1])
        if 2 * rows * cols > torch.cuda.get_device_properties(dev).multi_processor_count:
            continue

        def run(rank, deal, rows_m=m):
            out = torch.full((rows_m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            buf = torch.zeros(4096, 8, dtype=torch.int64, device=dev)
            x = a if rows_m == m else torch.randn(rows_m, k, device=dev, dtype=torch.bfloat16)
            try:
                set_trace(buf.data_ptr())
                if deal:
                    set_deal(places.data_ptr(), state.data_ptr(), sms)
                torch.ops.flux.ag_gemm_fused_(out, x, w, None, flags, rank, 2, rows_m // 2, 10000, 0, 1, 1, cid)
            finally:
                set_deal(0, 0, 0)
                set_trace(0)
            torch.cuda.synchronize()
            return out, buf.cpu(), x

        for rank in (0, 1):
            ref, _, _ = run(rank, False)
            assert torch.isfinite(ref).all(), f"ag:{cid}: NaN left"
            for _ in range(2):
                out, t, _ = run(rank, True)
                epoch += 1
                assert torch.equal(out, ref), f"ag:{cid} rank {rank}: the deal changed the result"
                st = state.cpu()
                assert int(st[0]) == epoch and int(st[1]) == 0, f"ag:{cid}: epoch {int(st[0])}, want {epoch}"
                # Each group's claims (bottom + top counts, its launch's tag on top) cover its run's
                # slots (AgTileScheduler::run_of); the runs' good claims are one per cluster.
                words = st.view(torch.int64).tolist()
                total, good = groups[-1] & 0xFFFF, 0
                for g, word in enumerate(groups):
                    base, end = word & 0xFFFF, (word & 0xFFFF) + (word >> 16)
                    if rows * cols <= total:
                        base, end = base * rows * cols // total, end * rows * cols // total
                    fit, c = max(min(end, rows * cols) - base, 0), words[1 + g]
                    claims = (c & 0xFFFF) + ((c >> 16) & 0xFFFF) if c >> 32 == epoch else 0
                    good += min(claims, fit)
                assert good == rows * cols, f"ag:{cid}: {good} slots claimed of {rows * cols}"
                ran = t[t[:, 6] > 0]
                assert len(ran) == 2 * rows * cols and int(ran[:, 6].sum()) == len(ran), f"ag:{cid}"
                firsts = [(int(v) >> 32, int(v) & 0xFFFFFFFF) for v in ran[:, 7]]
                assert len(set(firsts)) == len(firsts), f"ag:{cid}: two CTAs started on one tile"
                # Where a cluster took a slot of its GPC's run: the slot (read along N for 2x1, along M
                # for 1x2) lies in the run of the group of the SM its CTAs run on.
                on_run = 0
                for sm, (tm, tn) in zip(ran[:, 0].tolist(), firsts):
                    c = (tm // cfg.cluster[0]) * cols + tn // cfg.cluster[1]
                    slot = c if cfg.cluster[0] == 2 else (c % cols) * rows + c // cols
                    here = per_sm[sm]  # the SM's group's run, scaled as the kernel does
                    base, end = here >> 16, (here >> 16) + ((here >> 6) & 1023)
                    if rows * cols <= total:
                        base, end = base * rows * cols // total, end * rows * cols // total
                    on_run += here >= 0 and base <= slot < end
                assert on_run >= len(firsts) // 2, f"ag:{cid}: {on_run} of {len(firsts)} CTAs on their run"
        # Graph replay: the epoch moves on on the device.
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        ref, _, _ = run(0, False)
        s = torch.cuda.Stream()
        try:
            set_deal(places.data_ptr(), state.data_ptr(), sms)
            torch.ops.flux.ag_gemm_fused_(out, a, w, None, flags, 0, 2, m // 2, 10000, 0, 1, 1, cid)  # warm-up
            epoch += 1
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    torch.ops.flux.ag_gemm_fused_(out, a, w, None, flags, 0, 2, m // 2, 10000, 0, 1, 1, cid)
        finally:
            set_deal(0, 0, 0)
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            epoch += 1
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and int(state[0]) == epoch, f"ag:{cid}: graph replay"
        # Several waves: the static order, the epoch untouched.
        big = 4 * m
        ref_big, _, x = run(0, False, rows_m=big)
        out = torch.full((big, n), float("nan"), device=dev, dtype=torch.bfloat16)
        try:
            set_deal(places.data_ptr(), state.data_ptr(), sms)
            torch.ops.flux.ag_gemm_fused_(out, x, w, None, flags, 0, 2, big // 2, 10000, 0, 1, 1, cid)
        finally:
            set_deal(0, 0, 0)
        torch.cuda.synchronize()
        assert torch.equal(out, ref_big) and int(state[0]) == epoch, f"ag:{cid}: a launch of several waves dealt"


_UNBUILT_CHILD = r"""
import sys, torch
import flux  # noqa: F401  (loads flux._C)
op, cid, dtype, din, dout = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
din, dout = getattr(torch, din), getattr(torch, dout)
dev = torch.device("cuda")
a = torch.randn(128, 64, device=dev, dtype=din)
w = torch.randn(64, 64, device=dev, dtype=din)
out = torch.empty(128, 64, device=dev, dtype=dout)
flags = torch.ones(2, device=dev, dtype=torch.int32)
src = torch.randn(128, 64, device=dev, dtype=dout)


def call(weight, config):
    if op == "ag":
        torch.ops.flux.ag_gemm_fused_(out, a, weight, None, flags, 0, 2, 64, 10000, 0, 1, 1, config)
    else:
        torch.ops.flux.gemm_rs_fused_(out, a, weight, None, src, flags, 64, 0, 1, 10000, 0, 1, 1, config)


for what, weight in (("shape", w[:, :32].contiguous()), ("unbuilt", w)):  # a plain check first
    print("calling", what, flush=True)
    try:
        call(weight, cid)
        print("NO ERROR", what, flush=True)
    except RuntimeError as e:
        print("RAISED", what, str(e).splitlines()[0], flush=True)
"""


@gpu
def test_gpu_unbuilt_instantiation_fails_by_name():
    """Calling an instantiation that is not built raises, naming op, configuration and dtype. In a
    child process, after a plain shape check of the same op: a crash is reported with the step
    it happened in instead of taking the test session down."""
    import subprocess
    import sys

    missing = [t for t in fc.select("all") if t not in _BUILT]
    if not missing:
        pytest.skip("every instantiation is built (FLUX_KERNELS=all)")
    op, cid, dtype = missing[0]
    din, dout = (str(_TORCH_DTYPE[x]).split(".")[1] for x in fc.DTYPE_IO[dtype])
    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _UNBUILT_CHILD, op, str(cid), dtype, din, dout],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    log = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, f"child died (rc {res.returncode}) calling {op}:{cid}:{dtype}:\n{log}"
    name = "ag_gemm_fused_" if op == "ag" else "gemm_rs_fused_"
    assert f"RAISED shape flux.{name}" in res.stdout, log
    assert f"RAISED unbuilt flux.{name}: configuration {cid} for {dtype} is not built" in res.stdout, log


_MISSING_CHILD = r"""
import sys, torch
import flux  # noqa: F401  (loads flux._C)
op, cid, missing = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = torch.device("cuda")
m, k, n = 256, 8192, 1280
a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
src = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
try:  # a launch after the trapping kernel (split-K's reduction) may report the trap already
    if op == "ag":  # rank 0 of 2: rank 1's rows never arrive
        flags = torch.tensor([1, 1 - missing], device=dev, dtype=torch.int32)
        torch.ops.flux.ag_gemm_fused_(out, a, w, None, flags, 0, 2, m // 2, 300, 0, 1, 1, cid)
    else:  # the last of 4 segments of the peer's partial never arrives
        flags = torch.tensor([1, 1, 1, 1 - missing], device=dev, dtype=torch.int32)
        torch.ops.flux.gemm_rs_fused_(out, a, w, None, src, flags, m // 4, 0, 1, 300, 0, 1, 1, cid)
    torch.cuda.synchronize()
    print("COMPLETED", flush=True)
except RuntimeError as e:
    print("TRAPPED", str(e).splitlines()[0], flush=True)
"""


@gpu
@pytest.mark.parametrize("kind", ["streamk", "splitk", "swapped"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gpu_waits_for_missing_rows(op, kind):
    """A stream-K kernel whose problem splits K (few tiles, deep K), a split-K configuration
    (AG: its GEMM's tiles wait; RS: its reduction pass waits for the source), or a persistent one with
    swapped operands (A's rows, and the source's, along CUTLASS's N tiles), with one shard (AG) or
    one segment of the source (RS) never announced does not complete: its wait expires and traps
    (nothing read rows that had not arrived); with every flag set the same call completes.
    In child processes, whose CUDA context the trap ends."""
    import subprocess
    import sys

    def of_kind(c):
        return c.operands == "swapped" and c.scheduler == "persistent" if kind == "swapped" else c.scheduler == kind
    built = sorted(t for t in _BUILT if t[0] == op and t[2] == "bf16" and of_kind(fc.config(op, t[1])))
    if not built:
        pytest.skip(f"no {op} {kind} bf16 instantiation built")
    for missing, expect in ((0, "COMPLETED"), (1, "TRAPPED")):
        res = subprocess.run([sys.executable, "-c", _MISSING_CHILD, op, str(built[0][1]), str(missing)],
                             capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
        assert expect in res.stdout, f"{op}:{built[0][1]} missing={missing}:\n{res.stdout}{res.stderr[-3000:]}"


@gpu
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gpu_split_k_rejects_a_depth_it_cannot_slice(op):
    """A split-K configuration given K that its slices cannot cut into 16-byte rows raises before
    any launch, naming the op and the multiple K needs."""
    built = sorted(t for t in _BUILT if t[0] == op and t[2] == "bf16" and fc.config(op, t[1]).scheduler == "splitk")
    if not built:
        pytest.skip(f"no {op} split-K bf16 instantiation built (FLUX_KERNELS=splitk builds them)")
    cid = built[0][1]
    splits = fc.config(op, cid).splits
    dev = torch.device("cuda")
    m, k, n = 256, 8 * splits * 5 + 8, 256
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    flags = torch.ones(4, device=dev, dtype=torch.int32)
    name = "ag_gemm_fused_" if op == "ag" else "gemm_rs_fused_"
    with pytest.raises(RuntimeError, match=f"{name}.*split-K into {splits} slices needs K a multiple of {8 * splits}"):
        if op == "ag":
            torch.ops.flux.ag_gemm_fused_(out, a, w, None, flags, 0, 2, m // 2, 10000, 0, 1, 1, cid)
        else:
            src = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            torch.ops.flux.gemm_rs_fused_(out, a, w, None, src, flags, m // 4, 0, 1, 10000, 0, 1, 1, cid)
