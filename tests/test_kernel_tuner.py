"""The fused kernels' configuration choice without a GPU: the model grid's shapes, the
configuration table adapter, the analytic default's rules, the kernel cache (round trip,
precedence, shipped files, entries from a benchmark JSON) and the benchmark's exit without a GPU."""
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from flux import fused_configs as FC
from flux.autotune import cache as cache_mod
from flux.autotune import kernel_configs as KC
from flux.autotune import kernels as K
from flux.autotune.model_grid import model_grid, parse_shapes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUX_CACHE_DIR", str(tmp_path / "user"))
    K.reset()
    yield
    K.reset()


def _bench_module():
    path = os.path.join(REPO, "bench", "bench_fused_gemm.py")
    spec = importlib.util.spec_from_file_location("bench_fused_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the grid ------------------------------------------------------------------------------
def test_model_grid_shapes():
    g = model_grid()
    keys = {(r["op"], r["m"], r["n"], r["k"]) for r in g}
    assert len(keys) == len(g)  # listed once
    for op in ("ag", "rs"):  # 3 models x 3 TP x 4 M x 2 layers per op
        assert sum(len(r["layers"]) for r in g if r["op"] == op) == 72
    assert ("ag", 256, 3072, 4096) in keys          # 8B QKV, TP 2: (32 + 16) * 128 / 2, K = hidden
    assert ("ag", 16384, 7168, 8192) in keys        # 70B FC1, TP 8: 2 * 28672 / 8
    assert ("ag", 4096, 2 * 53248 // 4, 16384) in keys  # 405B FC1, TP 4
    assert ("ag", 1024, (128 + 16) * 128 // 8, 16384) in keys  # 405B QKV, TP 8
    assert ("rs", 32, 4096, 512) in keys            # 8B O-proj, TP 8, M = 256: 32 rows of the block
    assert ("rs", 4096, 16384, 53248 // 4) in keys  # 405B FC2, TP 4, M = 16384
    assert ("rs", 8192, 8192, 28672 // 2) in keys   # 70B FC2, TP 2, M = 16384
    rec = next(r for r in g if (r["op"], r["m"], r["n"], r["k"]) == ("rs", 32, 4096, 512))
    assert rec["layers"] == ["llama3-8b tp8 oproj M=256"]
    assert all(r["m"] in (256, 1024, 4096, 16384) for r in g if r["op"] == "ag")


def test_bench_grid_and_shapes_match_the_builder():
    bench = _bench_module()
    assert bench.problems(bench.parse_args(["--grid", "models"])) == model_grid()
    sub = bench.problems(bench.parse_args(["--op", "rs", "--grid", "models", "--tp", "8", "--m", "256"]))
    assert {(r["m"], r["n"], r["k"]) for r in sub} == {(32, 4096, 512), (32, 4096, 1792), (32, 8192, 1024),
                                                       (32, 8192, 3584), (32, 16384, 2048), (32, 16384, 6656)}
    assert parse_shapes("ag", "128x8192x14336") == [{"op": "ag", "m": 128, "n": 14336, "k": 8192,
                                                       "layers": ["custom 128x8192x14336"]}]
    with pytest.raises(ValueError):
        parse_shapes("ag", "128x8192")


def test_bench_without_gpu_says_so_in_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_fused_gemm.py"), "--quick"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert proc.stdout.strip().count("\n") == 0 and "needs a CUDA GPU" in proc.stdout


def test_bench_top_from_ranks_as_the_tuner(monkeypatch):
    """--top-from: per shape of the earlier run, its variants of least score (the tuner's rule) among
    the configurations selected now, least first; a file of another GPU model or dtype is refused."""
    def missing():
        raise RuntimeError("no flux._C")

    monkeypatch.setattr(torch.ops.flux, "fused_kernels_built", missing, raising=False)
    K.reset()
    bench = _bench_module()
    path = os.path.join(REPO, "bench", "results", "fused_gemm-h100-ag-16384-all-01db301.json")
    doc = json.load(open(path))
    recs = bench.top_records(path, doc["device"], "bf16", "bf16")
    assert len(recs) == len(doc["results"]) == 18
    _, entries = K.entries_from_bench(doc)
    for (op, m, n, k), r in recs.items():
        cfgs = [c for c in K.kernel_configs(op) if c.applies(m, n, k)]  # the default build without flux._C
        top = bench.top_labels(r, cfgs, 3)
        _, scores = K.bench_scores(r, {c.id: c for c in cfgs})
        assert len(top) == 3 and all(lab in r["variants"] for lab in top)
        assert [scores[x] for x in top] == sorted(scores.values())[:3]
        entry = entries[K.entry_key(op, m, n, k, "bf16")]
        assert entry["choice"] in (top[0], entry["default"])  # the least, or the analytic default within MARGIN
        assert bench.top_labels(r, [c for c in cfgs if c.id != K.parse_label(top[0])[0]], 1) != top[:1]
    with pytest.raises(ValueError, match="this run bf16 -> fp32"):
        bench.top_records(path, doc["device"], "bf16", "fp32")
    with pytest.raises(ValueError, match="NVIDIA H200"):
        bench.top_records(path, "NVIDIA H200", "bf16", "bf16")
    args = bench.parse_args(["--op", "ag", "--shapes", "16384x8192x1280", "--top-from", path, "--top", "2"])
    assert args.top_from == path and args.top == 2
    # Only the shapes the earlier run holds are re-timed: the grid's AG shapes, of which it holds 16384 rows.
    grid = bench.problems(bench.parse_args(["--op", "ag", "--grid", "models"]))
    kept, left = bench.top_shapes(grid, recs)
    assert len(grid) == 72 and left == 54 and len(kept) == 18
    assert {(r["op"], r["m"], r["n"], r["k"]) for r in kept} == set(recs)
    with pytest.raises(SystemExit):
        bench.parse_args(["--top", "0"])


# ---- the configuration table adapter ----------------------------------------------------------
def test_configs_of_the_default_build_without_flux_c(monkeypatch):
    """Without flux._C's list, the configurations are the table's default build."""
    def missing():
        raise RuntimeError("no flux._C")

    monkeypatch.setattr(torch.ops.flux, "fused_kernels_built", missing, raising=False)
    K.reset()
    ag, rs = K.kernel_configs("ag"), K.kernel_configs("gemm_rs")
    want = {op: [c.id for c in FC.CONFIGS[op] if c.default] for op in FC.OPS}
    assert [c.id for c in ag] == want["ag"] and [c.id for c in rs] == want["rs"]
    assert "default build" in K.config_source("ag")
    c2 = next(c for c in ag if c.id == 2)
    assert c2.schedule == "pingpong" and (c2.tile_m, c2.tile_n, c2.cluster_m) == (128, 128, 2)
    fp32 = [9, 25, 29, 32, 33, 34, 35, 36, 37, 41, 42]  # split-K and their GEMMs' tiles: no GEMM of their own
    in16 = [i for i in want["ag"] if "bf16" in FC.config("ag", i).default]
    assert [c.id for c in K.kernel_configs("ag", torch.float16)] == [c.id for c in K.kernel_configs("ag", "bf16")] == in16
    assert [c.id for c in K.kernel_configs("ag", "bf16", torch.float32)] == [0, 2, *fp32]
    assert [c.id for c in K.kernel_configs("ag", torch.float16, torch.float32)] == [0, 2, *fp32]
    assert [c.id for c in K.kernel_configs("rs", "bf16", "fp32")] == [3] and not K.kernel_configs("rs", "fp16", "fp32")


def test_built_filter(monkeypatch):
    monkeypatch.setattr(torch.ops.flux, "fused_kernels_built", lambda: "rs:0:bf16 rs:2:fp16_fp32 ag:11:fp16",
                        raising=False)
    K.reset()
    assert [c.id for c in K.kernel_configs("rs")] == [0, 2] and [c.id for c in K.kernel_configs("ag")] == [11]
    assert [c.id for c in K.kernel_configs("rs", "fp16", "fp32")] == [2]
    assert K.kernel_configs("ag", "bf16") == [] and K.config_source("ag") == "torch.ops.flux.fused_kernels_built()"
    assert K.kernel_configs("ag", "fp16")[0].desc == "64x128x128/1x1/pp"


# ---- the analytic default ------------------------------------------------------------------
def _cfg(i, tm, tn, cm=1, cn=1, sched="cooperative"):
    return KC.KernelConfig("ag", i, tm, tn, 64, cm, cn, sched)


def test_analytic_default_is_valid_for_every_grid_shape():
    """The analytic default's swizzle bands divide the problem's tiles; the served choice (on a
    GPU with shipped choices, a tuned one) is a variant the tuner would time."""
    configs = {op: {c.id: c for c in K.kernel_configs(op, "bf16")} for op in ("ag", "rs")}
    for r in model_grid():
        cfg, raster, swz = K.served_default(r["op"], r["m"], r["n"], r["k"], "bf16", None, 132)
        c = configs[r["op"]][cfg]
        assert raster == 1 and swz in (1, 2, 4, 8)
        # a band never pads tiles (a partial last tile, e.g. 4096 columns in 176-wide tiles, is a tile)
        assert swz == 1 or -(-r["m"] // c.tile_m) % (c.cluster_m * swz) == 0, r
        assert swz == 1 or -(-r["n"] // c.tile_n) % (c.cluster_n * swz) == 0, r
        assert K.label(cfg, raster, swz) in K.variants(r["op"], r["m"], [c], (1, 2, 4, 8), n=r["n"]), r
        cfg, raster, swz = K.choose_config(r["op"], r["m"], r["n"], r["k"], torch.bfloat16)
        c = configs[r["op"]][cfg]
        assert K.label(cfg, raster, swz) in K.variants(r["op"], r["m"], [c], (1, 2, 4, 8), n=r["n"]), r


def test_rule_whole_waves():
    """A tile count one past a whole wave of 132 SMs costs a second wave."""
    c = _cfg(0, 128, 256)
    one = K.predict_s(c, "ag", 128 * 12, 256 * 11, 8192)        # 132 tiles
    two = K.predict_s(c, "ag", 128 * 12, 256 * 11 + 8, 8192)    # 144 tiles
    assert two / one > 1.8
    # Between two configurations, the one whose tiles fill whole waves wins.
    a, b = _cfg(0, 128, 256), _cfg(1, 256, 128)
    m, n = 128 * 11, 256 * 12  # a: 11 x 12 = 132 tiles (1 wave); b: 6 x 24 = 144 (2 waves, padded rows)
    assert K.analytic_config("ag", m, n, 8192, configs=[b, a])[0] == 0


def test_rule_cluster_padding_small_m():
    """With one M tile a 2x1 cluster pads a second, idle M tile into every cluster: 1x2 wins."""
    c21, c12 = _cfg(0, 128, 256, 2, 1), _cfg(1, 128, 256, 1, 2)
    assert K.analytic_config("ag", 128, 256 * 132, 4096, configs=[c21, c12])[0] == 1
    # Many M tiles: no padding, the tie goes to the table's first.
    assert K.analytic_config("ag", 8192, 8192, 8192, configs=[c21, c12])[0] == 0


def test_rule_64x64_tiles_by_cluster():
    """64x64 ping-pong tiles (RS 27 / 28): a 2x1 cluster (the weight multicast) over two or more tile
    rows, 1x2 over one (fitted to bench/results/fused_gemm-h200-rs-64x64.json)."""
    c12, c21 = _cfg(27, 64, 64, 1, 2, "pingpong"), _cfg(28, 64, 64, 2, 1, "pingpong")
    wide = _cfg(5, 64, 128, 1, 1, "pingpong")
    assert K.analytic_config("rs", 128, 4096, 7168, configs=[wide, c12, c21])[0] == 28   # 2 x 64 tiles
    assert K.analytic_config("rs", 64, 4096, 3584, configs=[wide, c12, c21])[0] == 27    # 1 x 64 tiles
    assert K._tile_eff(c21, 2) > K._tile_eff(c21, 1) == K._tile_eff(c12, 2)


def test_rule_swapped_operands_where_rows_fit_two_tiles():
    """Swapped operands (the rows on the MMA's narrow side) are modelled where M fits two of their tile rows,
    with a band of all of them (the tiles sharing a weight tile side by side): RS at 8-32 rows per rank takes
    the 32x64 swapped tile over the 64-row ones; at 33-64 rows (M's bucket 64) it too where the 64-row tiles
    fill under half the SMs (N = 4096), else a 64-row tile (as measured on an H100, docs/performance.md
    §9.9); from 65 rows the model leaves them to the tuner, and where nothing else is built it still picks them."""
    c12 = dataclasses.replace(_cfg(27, 64, 64, 1, 2, "pingpong"), op="rs")
    c21 = dataclasses.replace(_cfg(28, 64, 64, 2, 1, "pingpong"), op="rs")
    wide = dataclasses.replace(_cfg(5, 64, 128, 1, 1, "pingpong"), op="rs")
    sw = dataclasses.replace(_cfg(46, 32, 64, 1, 1, "pingpong"), op="rs", operands="swapped")
    cfgs = [wide, c12, c21, sw]
    for m in (8, 16, 24, 32):
        assert K.analytic_config("rs", m, 8192, 3584, configs=cfgs) == (46, 1, 1), m
        assert K.served_default("rs", m, 8192, 3584, "bf16", None, 132, cfgs) == (46, 1, 1), m
    for m, k in ((64, 3584), (64, 1024), (40, 3584)):
        assert K.served_default("rs", m, 4096, k, "bf16", None, 132, cfgs) == (46, 1, 2), (m, k)
    for k in (2048, 7168):
        assert K.analytic_config("rs", 64, 8192, k, configs=cfgs)[0] == 27, k
    assert K.analytic_config("rs", 128, 4096, 2048, configs=cfgs)[0] == 28
    assert K.analytic_config("rs", 256, 8192, 3584, configs=[sw])[0] == 46  # nothing else built


def test_rule_pingpong_for_shallow_k():
    """Shallow K (rs O-proj at TP 8): the epilogue (store + the peer's partial) rivals the
    mainloop, and ping-pong hides it behind the other warpgroup's mainloop; deep K: wide tiles."""
    coop, pp = _cfg(0, 128, 256, 2, 1), _cfg(1, 128, 128, 2, 1, "pingpong")
    assert K.analytic_config("rs", 2048, 8192, 1024, configs=[coop, pp])[0] == 1
    assert K.analytic_config("ag", 8192, 8192, 8192, configs=[coop, pp])[0] == 0


def test_rule_swizzle():
    """RS: the widest band that pads nothing, where the operands exceed L2; AG: the band of least
    modelled time among those that pad nothing: a weight over L2 is read once per band of M tiles
    (bands that one wave runs together share a read), and its HBM traffic lowers the clock."""
    c = _cfg(0, 128, 256, 2, 1)
    assert K.analytic_config("rs", 256, 4096, 4096, configs=[c])[2] == 1  # fits in L2: no band
    assert K.analytic_config("rs", 16384, 14336, 8192, configs=[c])[2] == 8
    assert K.analytic_config("rs", 768, 53248, 16384, configs=[c])[2] == 1  # 6 M tiles: no band divides
    assert K.analytic_config("rs", 8192, 5120, 8192, configs=[c])[2] == 4  # 20 N tiles: bands of 8 would pad to 24
    assert K.analytic_config("ag", 256, 4096, 4096, configs=[c])[2] == 1  # one wave
    assert K.analytic_config("ag", 16384, 14336, 8192, configs=[c])[2] in (4, 8)  # a 235 MB weight, 128 M tiles
    assert K.analytic_config("ag", 8192, 5120, 8192, configs=[c])[2] == 1  # saves under 2%: a near-tie
    assert K.analytic_config("ag", 16384, 14336, 512, configs=[c])[2] == 1  # the weight (15 MB) fits in L2
    # The weight's HBM reads: once per band, but once for all bands that run in one wave.
    _, one = K._traffic(c, "ag", 16384, 14336, 8192, 2, 2, 132, 8)
    _, many = K._traffic(c, "ag", 16384, 14336, 8192, 2, 2, 132, 1)
    assert many - one == 14336 * 8192 * 2 * (64 - 8)
    assert K._traffic(c, "ag", 1024, 4096, 8192, 2, 2, 132, 1)[1] == (1024 + 4096) * 8192 * 2 + 1024 * 4096 * 2
    # Padding to bands costs what it adds (20 -> 24 N tiles, 10 -> 12 waves) where the weight fits in L2.
    assert K.predict_s(c, "ag", 8192, 5120, 2048, 8) / K.predict_s(c, "ag", 8192, 5120, 2048, 1) == pytest.approx(
        1.2, rel=0.02)


def test_rule_stream_k_for_few_tiles_and_deep_k():
    """The stream-K configuration where the persistent choice fills under 0.8 of a wave and K is
    deep (1024x1280x8192: 80 tiles of 128x128 on 132 SMs, 128 K tiles); the persistent one with
    shallow K, with a wave nearly full, and with many tiles. A "streamk" configuration splits only
    where CUTLASS's heuristic does (the last wave under half full), "streamk-all" always."""
    pp, coop = _cfg(2, 128, 128, 2, 1, "pingpong"), _cfg(0, 128, 256, 2, 1)
    sk = KC.KernelConfig("ag", 16, 128, 128, 64, 1, 1, "cooperative", scheduler="streamk-all")
    cfgs = [coop, pp, sk]
    for op in ("ag", "rs"):
        assert K.analytic_config(op, 1024, 1280, 8192, configs=cfgs)[0] == 16
        assert K.analytic_config(op, 256, 2560, 16384, configs=cfgs)[0] == 16
        assert K.analytic_config(op, 1024, 1280, 1024, configs=cfgs)[0] != 16  # 16 K tiles
        assert K.analytic_config(op, 1408, 1280, 8192, configs=cfgs)[0] != 16  # 110 tiles: 0.83 wave
        assert K.analytic_config(op, 8192, 8192, 8192, configs=cfgs)[0] != 16
    heur = KC.KernelConfig("ag", 12, 128, 128, 64, 1, 1, "cooperative", scheduler="streamk")
    assert K.predict_stream_k_s(heur, "ag", 1024, 1280, 8192) == K.predict_s(heur, "ag", 1024, 1280, 8192)
    assert K.analytic_config("ag", 1024, 1280, 8192, configs=[coop, pp, heur])[0] != 12  # 80 tiles: no split
    assert K.analytic_config("ag", 256, 2560, 16384, configs=[coop, pp, heur])[0] == 12  # 40 tiles: split
    # Only stream-K built: it serves every shape (CUTLASS runs whole tiles where many).
    assert K.analytic_config("ag", 8192, 8192, 8192, configs=[sk])[0] == 16
    assert K._should_use_stream_k(pp, 1024, 1280, 8192, 1, 132)
    assert not K._should_use_stream_k(pp, 1024, 1280, 1984, 1, 132)  # 31 K tiles
    # The model: split K beats one wave of whole tiles on few tiles, equals predict_s on many.
    # (the split's own cost: STREAM_K_FIXED_S per launch; both bounded by the L2 reads of the 1x1
    # cluster's tiles, K.L2_SM_BW, which the split does not reduce)
    split = lambda m, n, k: K.predict_stream_k_s(sk, "ag", m, n, k) - K.STREAM_K_FIXED_S  # noqa: E731
    assert split(1024, 1280, 8192) < 0.8 * K.predict_s(sk, "ag", 1024, 1280, 8192)
    assert split(256, 1280, 8192) < 0.4 * K.predict_s(sk, "ag", 256, 1280, 8192)
    assert K.predict_stream_k_s(sk, "ag", 8192, 8192, 8192) == K.predict_s(sk, "ag", 8192, 8192, 8192)


def test_stream_k_configs_in_the_default_build():
    """The default build holds AG's split-K configurations 32-37, 41 and 42 (bf16), no stream-K
    configuration and no split-K one of RS's; for a narrow AG layer at 256 rows (20 tiles of 128x128) the analytic
    default picks split-K (128x96 tiles, K in 4 slices: 128 units on 132 SMs), and whole-K tiles where K
    does not cut into such slices; split-K not at 1024 rows (80 tiles, where CUTLASS's heuristic keeps
    whole tiles). Labels name the scheduler (stream-K, stream-K always, split-K and its slices)."""
    built = K._allowed("default", "bf16", "bf16")  # the default build's, whatever this process loaded
    ag, rs = built["ag"], built["rs"]
    ag_c, rs_c = list(ag.values()), list(rs.values())
    assert not [i for i, c in ag.items() if c.stream_k] and not [i for i, c in rs.items() if c.stream_k]
    assert KC.KernelConfig.of("ag", FC.config("ag", 14), ()).desc == "128x128x64/2x1/coop/sk"
    assert ag[0].desc.count("/") == 2
    assert KC.KernelConfig("ag", 16, 128, 128, 64, 1, 1, "cooperative", scheduler="streamk-all").desc == \
        "128x128x64/1x1/coop/ska"
    assert 8 not in ag and 12 not in ag  # 64x256 ping-pong left the default build for it
    assert [i for i, c in ag.items() if c.splits > 1] == [32, 33, 34, 35, 36, 37, 41, 42]
    assert ag[36].desc == "128x96x64/2x1/coop/k4" and not ag[36].stream_k
    assert K.analytic_config("ag", 1024, 1280, 8192, configs=ag_c)[0] not in (32, 33, 34, 35, 36, 37, 41, 42)
    assert K.analytic_config("ag", 256, 1280, 8192, configs=ag_c)[0] == 36
    assert ag[K.analytic_config("ag", 256, 1280, 8200, configs=ag_c)[0]].splits == 1  # 8200 = 8 * 1025: no split-K applies
    assert not rs[K.analytic_config("rs", 128, 4096, 7168, configs=rs_c)[0]].stream_k
    with pytest.raises(ValueError, match="stream-K is cooperative only"):
        KC.KernelConfig("ag", 99, 128, 128, 64, 1, 1, "pingpong", scheduler="streamk")


def test_no_config_for_dtype_is_an_error():
    with pytest.raises(ValueError, match="no configuration built"):
        K.choose_config("rs", 1024, 4096, 4096, torch.float16, torch.float32)  # none in the default build


# ---- the cache ------------------------------------------------------------------------------
def _entry(choice, desc):
    return {"choice": choice, "config": desc, "default": "c0/r1/s1", "loop_ms": {choice: 1.0}, "graph_ms": {}}


def test_cache_round_trip_and_precedence(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "SHIPPED_DIR", str(tmp_path / "shipped"))
    key, _ = K.gpu_key()  # the key choose_config reads: this machine's GPU, or the CPU's without one
    descs = {c.id: c.desc for c in K.kernel_configs("ag")}
    desc28 = descs[28]
    assert K.choose_config("ag", 4096, 14336, 8192) == K.analytic_config("ag", 4096, 14336, 8192)
    # shipped file (another flux version: shipped files are read regardless)
    shipped = K.KernelCache(key, str(tmp_path / "shipped"))
    shipped.put(K.entry_key("ag", 4096, 14336, 8192, "bf16"), _entry("c28/r1/s4", desc28))
    shipped.put(K.entry_key("ag", 1024, 14336, 8192, "bf16"), _entry("c28/r1/s1", "999x1x1/1x1/coop"))  # stale
    path = shipped.save()
    assert os.path.basename(path).startswith("kernels-")
    data = json.load(open(path))
    data["flux"] = "0.0.0-other"
    json.dump(data, open(path, "w"))
    K.reset()
    assert K.choose_config("ag", 4096, 14336, 8192) == (28, 1, 4)
    assert K.choose_config("ag", 3000, 14336, 8192) == (28, 1, 4)  # same M bucket (4096)
    assert K.choose_config("ag", 1024, 14336, 8192) == K.analytic_config("ag", 1024, 14336, 8192)  # stale ignored
    # the user's file wins over the shipped one, and survives a reload
    user = K.kernel_cache(key)
    user.put(K.entry_key("ag", 4096, 14336, 8192, "bf16"), _entry("c2/r1/s8", descs[2]))
    user.save()
    K.reset()
    assert K.choose_config("ag", 4096, 14336, 8192) == (2, 1, 8)
    # fp16 in / fp32 out, no entry of their own: the bf16 choice where its configuration is built for them
    # (AG 2 is for both, AG 28 for fp16 only: with fp32 output the analytic choice among AG 0 and 2); an
    # entry of their own wins.
    for dt, odt in ((torch.float16, None), (torch.bfloat16, torch.float32)):
        assert K.choose_config("ag", 4096, 14336, 8192, dt, odt) == (2, 1, 8)
    for m in (1024, 8192):  # 1024: stale bf16 entry; 8192: none
        assert K.choose_config("ag", m, 14336, 8192, torch.float16) == \
            K.analytic_config("ag", m, 14336, 8192, torch.float16)
    user.put(K.entry_key("ag", 4096, 14336, 8192, "bf16"), _entry("c28/r1/s4", desc28))
    user.save()
    K.reset()
    for dt, odt in ((torch.float16, None), (torch.bfloat16, torch.float32)):  # by the build's list
        built = [c.id for c in K.kernel_configs("ag", dt, odt)]
        want = (28, 1, 4) if 28 in built else K.analytic_config("ag", 4096, 14336, 8192, dt, odt)
        assert K.choose_config("ag", 4096, 14336, 8192, dt, odt) == want and want[0] in built
    if not torch.cuda.is_available():  # the default build's lists: AG 28 in fp16, not with fp32 output
        assert 28 in [c.id for c in K.kernel_configs("ag", torch.float16)]
        assert 28 not in [c.id for c in K.kernel_configs("ag", torch.bfloat16, torch.float32)]
    user.put(K.entry_key("ag", 4096, 14336, 8192, "bf16", "fp32"), _entry("c0/r1/s2", descs[0]))
    user.save()
    K.reset()
    assert K.choose_config("ag", 4096, 14336, 8192, torch.bfloat16, torch.float32) == (0, 1, 2)
    # fp16 -> fp32 takes bf16 -> fp32's entry before bf16 -> bf16's, where built for it (by default AG 0, 2
    # are; where not, the analytic choice); fp16 -> fp16 still bf16's; an entry of its own wins.
    fp16_fp32 = [c.id for c in K.kernel_configs("ag", torch.float16, torch.float32)]
    assert K.choose_config("ag", 4096, 14336, 8192, torch.float16, torch.float32) == (
        (0, 1, 2) if 0 in fp16_fp32 else K.analytic_config("ag", 4096, 14336, 8192, torch.float16, torch.float32))
    user.put(K.entry_key("ag", 4096, 14336, 8192, "bf16"), _entry("c2/r1/s2", descs[2]))
    user.put(K.entry_key("ag", 4096, 14336, 8192, "bf16", "fp32"), _entry("c29/r1/s4", descs[29]))
    user.save()
    K.reset()
    assert 29 in fp16_fp32  # the default build (the GEMM of AG's split-K tiles 128x96)
    assert K.choose_config("ag", 4096, 14336, 8192, torch.float16, torch.float32) == (29, 1, 4)
    assert K.choose_config("ag", 4096, 14336, 8192, torch.float16) == (2, 1, 2)
    user.put(K.entry_key("ag", 4096, 14336, 8192, "fp16", "fp32"), _entry("c9/r1/s1", descs[9]))
    user.save()
    K.reset()
    assert K.choose_config("ag", 4096, 14336, 8192, torch.float16, torch.float32) == (9, 1, 1)


def test_entries_from_bench_and_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "SHIPPED_DIR", str(tmp_path / "shipped"))
    descs = {c.id: c.desc for op in ("rs",) for c in map(lambda c: KC.KernelConfig(
        "rs", c.id, *c.tile, *c.cluster, c.schedule), FC.CONFIGS[op])}

    def var(cfg, swz, loop, graph, ok=True):
        return {"config": cfg, "raster": 1, "swizzle": swz, "tile": descs[cfg], "ok": ok,
                "ms": {"loop": loop, "graph": graph, "spin": loop}}
    cub = {"ms": {"loop": 1.0, "graph": 0.5}}
    doc = {"device": "NVIDIA H200", "sm_count": 132, "dtype": "bf16", "out_dtype": "bf16", "results": [
        {"op": "rs", "m": 2048, "n": 8192, "k": 4096, "cublas": cub,
         "variants": {"c3/r1/s1": var(3, 1, 1.00, 1.00), "c6/r1/s1": var(6, 1, 0.995, 0.995),
                      "c5/r1/s1": var(5, 1, 0.5, 0.25, ok=False),  # wrong: never chosen
                      "c31/r1/s1": var(31, 1, 0.5, 0.25)}},         # not in the default build
        {"op": "rs", "m": 4096, "n": 8192, "k": 4096, "cublas": cub,
         # c6 is faster in the loop, c3 at its worse ratio (graph): the worse ratio decides
         "variants": {"c3/r1/s1": var(3, 1, 1.0, 0.6), "c6/r1/s8": var(6, 8, 0.8, 0.7)}}]}
    key, entries = K.entries_from_bench(doc)
    assert key == "kernels|NVIDIA H200|sm132"
    e = entries["rs|bf16|bf16|m2048|n8192|k4096"]
    assert e["choice"] in ("c3/r1/s1", "c6/r1/s1") and "c31/r1/s1" not in e["loop_ms"]
    if e["default"] in ("c3/r1/s1", "c6/r1/s1"):
        assert e["choice"] == e["default"]  # within the margin of the analytic default
    assert entries["rs|bf16|bf16|m4096|n8192|k4096"]["choice"] == "c3/r1/s1"
    _, wider = K.entries_from_bench(doc, "default,rs:31:bf16")  # a build that holds config 31
    assert wider["rs|bf16|bf16|m2048|n8192|k4096"]["choice"] == "c31/r1/s1"
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(doc))
    assert K.main(["--from-bench", str(src), "--ship"]) == 0
    files = os.listdir(tmp_path / "shipped")
    assert files == [K.file_name(key)]
    got = K.KernelCache(key)
    assert got.get("rs|bf16|bf16|m4096|n8192|k4096")["choice"] == "c3/r1/s1"
    assert K.cached_choice(got, "rs", 4096, 8192, 4096, "bf16", "bf16") == (3, 1, 1)


def test_entries_from_bench_band_above_8_is_a_sample_of_8():
    """CUTLASS's scheduler runs a band above 8 tiles as 8: such a variant is one more sample of the
    8-tile one (averaged in), never a choice of its own."""
    c0 = FC.config("ag", 0)
    desc = KC.KernelConfig("ag", 0, *c0.tile, *c0.cluster, c0.schedule).desc

    def var(swz, ms):
        return {"config": 0, "raster": 1, "swizzle": swz, "tile": desc, "ok": True,
                "ms": {"loop": ms, "graph": ms, "spin": ms}}
    doc = {"device": "NVIDIA H200", "sm_count": 132, "dtype": "bf16", "out_dtype": "bf16", "results": [
        {"op": "ag", "m": 16384, "n": 28672, "k": 8192, "cublas": {"ms": {"loop": 10.0, "graph": 10.0}},
         "variants": {"c0/r1/s1": var(1, 11.0), "c0/r1/s8": var(8, 10.6), "c0/r1/s16": var(16, 9.0)}}]}
    _, entries = K.entries_from_bench(doc)
    (e,) = entries.values()
    assert set(e["loop_ms"]) == {"c0/r1/s1", "c0/r1/s8"} and e["loop_ms"]["c0/r1/s8"] == pytest.approx(9.8)
    assert e["choice"] == "c0/r1/s8" and e["vs_cublas"] == pytest.approx(0.98)


def test_entries_from_bench_pools_runs(tmp_path, monkeypatch):
    """Runs of one build pooled: per shape the variants timed in the most runs, each by the geometric
    mean of its scores over them (a variant only the first run timed is no candidate); one run pooled
    with itself chooses as it alone; runs of another GPU model or dtype are refused."""
    monkeypatch.setattr(cache_mod, "SHIPPED_DIR", str(tmp_path / "shipped"))
    desc = {i: KC.KernelConfig("ag", i, *FC.config("ag", i).tile, *FC.config("ag", i).cluster,
                               FC.config("ag", i).schedule).desc for i in (0, 72, 73)}

    def var(cfg, swz, ms):
        return {"config": cfg, "raster": 1, "swizzle": swz, "tile": desc[cfg], "ok": True,
                "ms": {"loop": ms, "graph": ms, "spin": ms}}

    def run(cub, variants):
        return {"device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "dtype": "bf16", "out_dtype": "bf16",
                "results": [{"op": "ag", "m": 16384, "n": 28672, "k": 8192,
                             "cublas": {"ms": {"loop": cub, "graph": cub}},
                             "variants": {f"c{c}/r1/s{w}": var(c, w, ms) for c, w, ms in variants}}]}
    # The first run: c73/s4 least (0.96), then c0/s8 (0.98), c72/s1 (0.99); c0/s1 1.20.
    first = run(10.0, [(73, 4, 9.6), (0, 8, 9.8), (72, 1, 9.9), (0, 1, 12.0)])
    # The second look, on a machine 10% slower (its cuBLAS too): c73/s4 1.06, c0/s8 1.00, c72/s1 0.995
    # (alone, its choice); pooled, c0/s8 is least.
    second = run(11.0, [(73, 4, 11.66), (0, 8, 11.0), (72, 1, 10.945)])
    _, alone = K.entries_from_bench(first)
    (a,) = alone.values()
    assert a["choice"] in ("c73/r1/s4", a["default"]) and "runs" not in a
    _, same = K.entries_from_bench([first, first])
    assert [e["choice"] for e in same.values()] == [a["choice"]]
    _, pooled = K.entries_from_bench([first, second])
    (e,) = pooled.values()
    g = {"c73/r1/s4": (0.96 * 1.06) ** 0.5, "c0/r1/s8": (0.98 * 1.00) ** 0.5, "c72/r1/s1": (0.99 * 0.995) ** 0.5}
    best = min(g, key=g.get)
    assert best == "c0/r1/s8" and e["runs"] == 2 and "c0/r1/s1" in e["loop_ms"]
    assert e["default"] not in g  # the analytic default (c0/r1/s4) was not timed: the least is the choice
    assert e["choice"] == best and e["vs_cublas"] == pytest.approx(g[best], rel=1e-3)
    assert e["loop_ms"]["c0/r1/s8"] == pytest.approx((9.8 + 11.0) / 2)
    other = dict(second, out_dtype="fp32")
    with pytest.raises(ValueError, match="share GPU model and dtypes"):
        K.entries_from_bench([first, other])
    for i, d in enumerate((first, second)):
        (tmp_path / f"run{i}.json").write_text(json.dumps(d))
    assert K.main(["--from-bench", str(tmp_path / "run0.json"), str(tmp_path / "run1.json"), "--ship"]) == 0
    key = "kernels|NVIDIA H100 80GB HBM3|sm132"
    assert K.KernelCache(key).get("ag|bf16|bf16|m16384|n28672|k8192")["choice"] == e["choice"]


# The bench JSONs the shipped H200 choices were chosen from, in order (a later file wins a shape):
# the whole grid, the AG tile widths, the split-K tiles at 256 / 1024 rows, the default build
# (split-K included) over the AG grid, cuBLAS's tiles at 256 / 1024 rows, bands of 2 and 4 M tiles
# (AG, RS), RS's 64x64 tiles, the ping-pong tiles wider than 128 columns (AG, RS), bands of up to 8
# M tiles on the large 16384-row AG shapes, RS's 64x128 2x1 tile at 32-512 rows per rank; then,
# timed with each variant warmed up (its own clock), AG at 4096 / 16384 rows and RS at 16384; then bands of 2 on
# AG at 16384 rows, RS's wide tiles, and AG at 256 rows: AG 60, 75, the served and the analytic choices (beside AG
# 107 and 108, which the default build lacks).
SHIPPED_FROM = ("fused_gemm-h200-models.json", "fused_gemm-h200-ag.json",
                "fused_gemm-h200-ag-splitk.json", "fused_gemm-h200-ag-grid-splitk.json",
                "fused_gemm-h200-ag-tiles.json", "fused_gemm-h200-ag-swizzle.json", "fused_gemm-h200-rs-swizzle.json",
                "fused_gemm-h200-rs-64x64.json", "fused_gemm-h200-ag-pingpong.json", "fused_gemm-h200-rs-pingpong.json",
                "fused_gemm-h200-ag-bands16k.json", "fused_gemm-h200-rs-64x128.json",
                "fused_gemm-h200-ag-warm.json", "fused_gemm-h200-rs-warm.json",
                "fused_gemm-h200-ag-band2-ca8892f.json", "fused_gemm-h200-rs-wide.json",
                "fused_gemm-h200-ag-107-108-7550bdd.json")


# The bench JSONs the shipped H100 choices were chosen from: AG at 256 / 1024 rows, 14 of the 18 AG
# shapes of 4096 rows and 71 of the 72 RS shapes, every configuration of the default build; then the
# other four AG shapes of 4096 rows and the last RS one, and AG at 16384 rows (the configurations and
# bands that serve them on the H200, and the analytic default's); then RS from 512 rows per rank again
# (RS 0, 3 and 6, bands 1-8) with RS 0's SourceAhead epilogue; then AG at 256, 1024 and 4096 rows, the served and
# the analytic choices beside AG's stream-K tiles and, at 256 and 1024 rows, AG 31. Then AG with fp32 output
# from bf16 (entries of their own dtype key): at 256 to 4096 rows, then 16384, every configuration built for
# it; then at 4096 rows AG 0, 2 and 25 with bands of 2-8 beside the choices from the file before. Last, one
# pooled group: AG at every M against every configuration of the default build (bands 1-8; at 16384 rows 1, 4
# and 8) and second looks at each of those runs' three least (--top-from; those runs timed the grid's other
# shapes in full until cut off).
SHIPPED_FROM_H100 = ("fused_gemm-h100-ag-small.json", "fused_gemm-h100-ag-4096.json", "fused_gemm-h100-rs.json",
                     "fused_gemm-h100-ag-4096-405b.json", "fused_gemm-h100-rs-2048x6656.json",
                     "fused_gemm-h100-ag-16384.json", "fused_gemm-h100-rs-retune.json",
                     "fused_gemm-h100-ag-streamk.json", "fused_gemm-h100-ag-streamk-4096.json",
                     "fused_gemm-h100-ag-fp32out-small-46b4b8f.json", "fused_gemm-h100-ag-fp32out-4096-46b4b8f.json",
                     "fused_gemm-h100-ag-fp32out-16384-649234c.json", "fused_gemm-h100-ag-fp32out-4096-bands-649234c.json",
                     # AG bf16, the whole grid: runs of one build pooled per shape (entries_from_bench).
                     ("fused_gemm-h100-ag-16384-all-01db301.json", "fused_gemm-h100-ag-small-all-94b6098.json",
                      "fused_gemm-h100-ag-4096-all-94b6098.json", "fused_gemm-h100-ag-4096-405b-all-94b6098.json",
                      "fused_gemm-h100-ag-16384-top3-94b6098.json", "fused_gemm-h100-ag-small-all-top3-94b6098.json",
                      "fused_gemm-h100-ag-4096-all-top3-94b6098.json",
                      "fused_gemm-h100-ag-4096-405b-all-top3-94b6098.json"),
                     # RS bf16 at 4096 and 16384 rows over every configuration, and its second look, pooled.
                     ("fused_gemm-h100-rs-all-31fa2ed.json", "fused_gemm-h100-rs-all-top3-31fa2ed.json"),
                     # RS bf16 at 256 and 1024 rows over every configuration, and their second looks, pooled.
                     ("fused_gemm-h100-rs-256-all-d29c9e3.json", "fused_gemm-h100-rs-256-all-d29c9e3-top3.json",
                      "fused_gemm-h100-rs-1024-all-d29c9e3.json", "fused_gemm-h100-rs-1024-all-d29c9e3-top3.json"),
                     # RS at 32-128 rows per rank: the swapped-operand tiles beside the served choice (RS 46 built).
                     "fused_gemm-h100-rs-swapped-small-7e57d9e.json",
                     # RS at 256 and 1024 rows, every configuration of the default build (RS 46 in it, bands 1
                     # and 2), and its second look, pooled.
                     ("fused_gemm-h100-rs-256-1024-all-998236c.json", "fused_gemm-h100-rs-256-1024-all-998236c-top3.json"))


@pytest.mark.parametrize("gpu,files,whole", [("H200", SHIPPED_FROM, True), ("H100", SHIPPED_FROM_H100, True)])
def test_shipped_choices_are_served_and_built(monkeypatch, gpu, files, whole):
    """On the GPU a shipped file was made for, every model-grid shape it holds gets its tuned choice,
    made from the bench JSONs listed (a later file or pooled group wins a shape) among the default build's
    configurations, and that configuration is built; a shape it does not hold gets the analytic
    default. Both files hold the whole grid."""
    entries = {}
    for group in files:  # a file, or a tuple of runs of one build pooled per shape
        docs = []
        for name in (group,) if isinstance(group, str) else group:
            bench = os.path.join(REPO, "bench", "results", name)
            if not os.path.exists(bench):
                pytest.skip(f"no {gpu} bench JSON {name}")
            docs.append(json.load(open(bench)))
        key, got = K.entries_from_bench(docs)
        entries.update(got)
    assert gpu in key
    monkeypatch.setattr(K, "gpu_key", lambda device=None: (key, 132))
    shipped = K.KernelCache(key).shipped
    assert shipped, f"no shipped kernel file for the {gpu}"
    assert set(shipped) == set(entries)
    for r in model_grid():
        ek = K.entry_key(r["op"], r["m"], r["n"], r["k"], "bf16")
        got = K.choose_config(r["op"], r["m"], r["n"], r["k"], torch.bfloat16)
        assert got[0] in {c.id for c in K.kernel_configs(r["op"], "bf16")}, ek
        if ek in shipped:
            assert K.label(*got) == shipped[ek]["choice"] == entries[ek]["choice"], ek
        else:
            assert not whole, ek
            cfgs = [c for c in K.kernel_configs(r["op"], "bf16") if c.applies(r["m"], r["n"], r["k"])]
            assert got == K.served_default(r["op"], r["m"], r["n"], r["k"], "bf16", None, 132, cfgs), ek
    # Entries of other dtypes (fp32 output): served to such calls, and built for them.
    for ek, e in shipped.items():
        op, dt, out, mb, n, k = ek.split("|")
        if (dt, out) == ("bf16", "bf16"):
            continue
        got = K.choose_config(op, int(mb[1:]), int(n[1:]), int(k[1:]), dt, out)
        assert K.label(*got) == e["choice"] == entries[ek]["choice"], ek
        assert got[0] in {c.id for c in K.kernel_configs(op, dt, out)}, ek


def test_shipped_kernel_files_load_and_name_built_configs():
    """Every shipped kernel file (none until measured) loads for its key, and every choice
    names a configuration built today with the tile it was measured with."""
    for name in os.listdir(cache_mod.SHIPPED_DIR):
        if not name.startswith("kernels-"):
            continue
        data = json.load(open(os.path.join(cache_mod.SHIPPED_DIR, name)))
        assert name == K.file_name(data["topology"])
        cache = K.KernelCache(data["topology"])
        assert len(cache.shipped) == len(data["entries"]) > 0
        for ek, e in cache.shipped.items():
            op, dt, out = ek.split("|")[:3]
            descs = {c.id: c.desc for c in K.kernel_configs(op, dt, out)}
            assert descs.get(K.parse_label(e["choice"])[0]) == e["config"], ek


# ---- the benchmark's and the tuner's logic, kernels and CUDA timing faked on the CPU ----------
WRONG = {"ag": 2, "rs": 5}  # the fakes' faulty configuration of each op (built by default)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.ops.flux's fused kernels as their meaning (ag config 2 computes a wrong result, rs config 5 none),
    CUDA events and graphs as wall-clock calls: the code paths of a GPU run, no timings."""
    import time

    from flux.autotune import kernel_timing as KT

    ag_worlds = []  # the world of every AG launch

    def ag(out, a, w, bias, flags, rank, world, rows, timeout, err, raster, swizzle, config):
        assert rank == 0 and world * rows == a.shape[0] and bool((flags[:world] != 0).all())
        ag_worlds.append(world)
        out.copy_(a.float() @ w.float().t() * (1.5 if config == WRONG["ag"] else 1.0))

    def rs(out, a, w, bias, src, flags, seg_rows, rank, peer, timeout, err, raster, swizzle, config):
        if config != WRONG["rs"]:  # writes nothing
            out.copy_(a.float() @ w.float().t() + src.float())

    def events_ms(run, spin=False, cycles=0):
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(torch.ops.flux, "ag_gemm_fused_", ag, raising=False)
    monkeypatch.setattr(torch.ops.flux, "gemm_rs_fused_", rs, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(KT, "_events_ms", events_ms)
    monkeypatch.setattr(KT, "capture", lambda loop, calls=1: types.SimpleNamespace(replay=loop))
    monkeypatch.setattr(KT, "L2_BYTES", 1 << 20)  # the small shapes below rotate input sets
    return ag_worlds


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_bench_shape_on_fakes(fake_gpu, op):
    bench = _bench_module()
    args = bench.parse_args(["--op", op, "--shapes", "256x256x512", "--quick"])
    rec = bench.problems(args)[0]
    r = bench.bench_shape(rec, args, torch.bfloat16, torch.bfloat16, 132, torch.device("cpu"))
    assert r["input_sets"] >= 2
    assert set(r["cublas"]["ms"]) == {"loop", "graph", "spin"} and r["cublas"]["rel_err"] < 1e-2
    assert ("cublas_add" in r) == ("cublas_beta1" in r) == (op == "rs")
    if op == "rs":  # in place, checked from the partial: the sum's error, cuBLAS-sized
        assert r["cublas_beta1"]["rel_err"] < 1e-2 and r["cublas_beta1"]["ms"]["loop"] > 0
    labels = set(r["variants"])
    assert r["own"]["label"] in labels and r["served"] in labels
    wrong = {lab for lab, v in r["variants"].items() if not v["ok"]}
    assert wrong == {lab for lab in labels if lab.startswith(f"c{WRONG[op]}/")} != set()
    assert all(("error" in r["variants"][lab]) == (op == "rs") for lab in wrong)  # rs: output left NaN
    assert all(v["ms"]["loop"] is None for lab, v in r["variants"].items() if lab in wrong)
    assert all(r["best"][t]["label"] not in wrong for t in ("loop", "graph", "spin"))
    summ = bench.summarize([r])
    assert summ[op]["graph"]["shapes"] == 1 and summ[op]["loop"]["geomean_best_over_cublas"] > 0
    bench.print_table([r], summ)
    key, entries = K.entries_from_bench({"device": "x", "sm_count": 132, "dtype": "bf16", "out_dtype": "bf16",
                                         "results": [r]})
    assert list(entries) == [K.entry_key(op, 256, 512, 256, "bf16")]


def test_bench_pdl_both_on_fakes(fake_gpu, monkeypatch):
    """--pdl 0,1: every variant twice, the switch set by each copy's first launcher, the PDL-off
    copies labelled and summarised apart, and never a tuned choice."""
    seen = []
    monkeypatch.setattr(torch.ops.flux, "set_fused_pdl", seen.append, raising=False)
    bench = _bench_module()
    args = bench.parse_args(["--op", "ag", "--shapes", "256x256x512", "--quick", "--pdl", "0,1"])
    assert args.pdl_list == [1, 0]
    rec = bench.problems(args)[0]
    r = bench.bench_shape(rec, args, torch.bfloat16, torch.bfloat16, 132, torch.device("cpu"))
    plain = {lab for lab in r["variants"] if "/pdl" not in lab}
    assert {lab + "/pdl0" for lab in plain} == set(r["variants"]) - plain
    assert all(r["variants"][lab]["pdl"] == (0 if "/pdl0" in lab else 1) for lab in r["variants"])
    assert set(seen) == {True, False} and seen[-1] is True  # the process default restored
    assert r["by_pdl"]["0"]["own"]["label"] == r["own"]["label"] + "/pdl0"
    summ = bench.summarize([r])
    assert "geomean_best_over_cublas_pdl0" in summ["ag"]["graph"]
    bench.print_table([r], summ)
    _, entries = K.entries_from_bench({"device": "x", "sm_count": 132, "dtype": "bf16", "out_dtype": "bf16",
                                       "results": [r]})
    assert all("/pdl" not in e["choice"] and not any("/pdl" in lab for lab in e["loop_ms"])
               for e in entries.values())
    with pytest.raises(SystemExit):
        bench.parse_args(["--pdl", "2"])


def test_bench_ag_worlds_on_fakes(fake_gpu):
    """--ag-world 2,1,8: every AG variant also launched as 1 and 8 ranks' shards, labelled apart, the
    primary world's copies alone in own / best and never a tuned choice."""
    bench = _bench_module()
    args = bench.parse_args(["--op", "ag", "--shapes", "256x256x512", "--quick", "--ag-world", "2,1,8"])
    assert args.worlds == [2, 1, 8]
    r = bench.bench_shape(bench.problems(args)[0], args, torch.bfloat16, torch.bfloat16, 132, torch.device("cpu"))
    plain = {lab for lab in r["variants"] if "/w" not in lab}
    assert {lab + s for lab in plain for s in ("/w1", "/w8")} == set(r["variants"]) - plain
    assert all(r["variants"][lab]["ag_world"] == (1 if lab.endswith("/w1") else 8 if lab.endswith("/w8") else 2)
               for lab in r["variants"])
    assert set(fake_gpu) == {1, 2, 8}
    assert "/w" not in r["own"]["label"] and all("/w" not in (b["label"] or "") for b in r["best"].values())
    _, entries = K.entries_from_bench({"device": "x", "sm_count": 132, "dtype": "bf16", "out_dtype": "bf16",
                                       "results": [r]})
    assert all("/w" not in e["choice"] and not any("/w" in lab for lab in e["loop_ms"]) for e in entries.values())
    for bad in ("0", "65", "x"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--ag-world", bad])
    for bad in ("16", "3", "1,x"):  # CUTLASS runs a band above 8 as 8
        with pytest.raises(SystemExit):
            bench.parse_args(["--swizzles", bad])


def test_tune_on_fakes(fake_gpu, monkeypatch):
    from flux.autotune import kernel_timing as KT

    cache = K.KernelCache("kernels|cpu|sm132")
    e = K.tune("ag", 256, 512, 256, torch.bfloat16, device=torch.device("cpu"), quick=True, cache=cache)
    assert not any(lab.startswith("c2/") for lab in e["loop_ms"])  # the wrong configuration is never timed
    assert e["choice"] in e["loop_ms"] and cache.get(K.entry_key("ag", 256, 512, 256, "bf16")) == e
    # rounds: a floor on the planned rounds (3 with quick), never fewer; each tuning times twice (the second look)
    seen, timed = [], KT.time_calls
    monkeypatch.setattr(KT, "time_calls", lambda fns, calls, rounds, *a, **kw: seen.append((rounds, sorted(fns))) or
                        timed(fns, calls, rounds, *a, **kw))
    for floor in (7, 1):
        K.tune("rs", 256, 512, 256, torch.bfloat16, device=torch.device("cpu"), quick=True, cache=cache, rounds=floor)
    assert [r for r, _ in seen] == [7, 7, 3, 3]
    assert len(seen[0][1]) > K.LOOK + 1 and set(seen[1][1]) < set(seen[0][1])


class _FakeProblem:
    """kernel_timing.KernelProblem without a GPU: each variant "runs" as its label, always correct."""
    def __init__(self, *a):
        pass

    def fused(self, *lab):
        return K.label(*lab)

    def cublas(self):
        return "cublas"

    def rel_err(self, f):
        return 0.0


def _fake_problems(monkeypatch, time_calls):
    """The tuner on _FakeProblem, timed by ``time_calls(fns, calls, rounds, timings, warm=0)``."""
    from flux.autotune import kernel_timing as KT

    monkeypatch.setattr(KT, "KernelProblem", _FakeProblem)
    monkeypatch.setattr(KT, "tolerance", lambda prob: 1.0)
    monkeypatch.setattr(KT, "estimate_ms", lambda f: 1.0)
    monkeypatch.setattr(KT, "time_calls", time_calls)


def test_tune_second_look(monkeypatch):
    """The tuner's rule is the bench files' (entry_from_records: the worse ratio to cuBLAS, timed beside
    it), with a second look: the LOOK variants of least score and the analytic default are timed again
    with cuBLAS, each then scored by the geometric mean of its two scores, and the choice is among them:
    a variant fast in the first timing alone loses to one fast in both."""
    cfgs = [c for c in K.kernel_configs("ag", "bf16") if c.applies(4096, 8192, 4096)]
    labs = [K.label(c.id, 1, 1) for c in cfgs][:6]
    default = K.label(*K.served_default("ag", 4096, 8192, 4096, "bf16", "bf16", 132, cfgs))
    first = {lab: 1.0 + 0.01 * i for i, lab in enumerate(labs)}
    first[labs[0]] = 0.90  # fast in the first timing alone
    first[default] = 1.2
    second = {labs[0]: 1.10, labs[1]: 0.96}

    calls = []

    def time_calls(fns, calls_, rounds, timings, warm=0):
        calls.append(sorted(lab for lab in fns if lab != "cublas"))
        src = first if len(fns) == len(first) + 1 else second
        # cuBLAS 2 ms in the loop, 1 ms in the graph: a variant's ratio to it is src in both timings
        return {lab: {"loop": 2.0, "graph": 1.0} if lab == "cublas" else
                {"loop": 2 * src.get(lab, 1.0), "graph": src.get(lab, 1.0)} for lab in fns}
    monkeypatch.setattr(K, "variants", lambda op, m, cfgs, n=None: list(first))
    _fake_problems(monkeypatch, time_calls)
    cache = K.KernelCache("kernels|cpu|sm132")
    e = K.tune("ag", 4096, 8192, 4096, torch.bfloat16, device=torch.device("cpu"), cache=cache)
    want = sorted(labs[:K.LOOK] + ([default] if default not in labs[:K.LOOK] else []))
    assert calls[1] == want and e["runs"] == 2
    assert e["loop_ms"][labs[0]] == pytest.approx(2 * (0.90 + 1.10) / 2)
    assert e["choice"] == labs[1]  # (1.01 * 0.96) ** 0.5 = 0.985 against labs[0]'s 0.995
    assert e["vs_cublas"] == pytest.approx((1.01 * 0.96) ** 0.5, abs=1e-4)
    one = K.tune("ag", 4096, 8192, 4096, torch.bfloat16, device=torch.device("cpu"), cache=cache, look=0)
    assert one["choice"] == labs[0] and "runs" not in one and len(calls) == 3


def test_tune_weighs_the_served_default(monkeypatch):
    """The tuner weighs its choice against the analytic default that choose_config serves uncached: at the
    bucket of M (every M of the bucket gets the entry), as entries_from_bench does, not at M itself."""
    m, n, k = 300, 4096, 1024  # bucket 512: the analytic default differs between 300 rows and 512
    at_m = K.label(*K.analytic_config("ag", m, n, k, "bf16", "bf16", 132))
    served = K.label(*K.served_default("ag", m, n, k, "bf16", "bf16", 132))
    assert at_m != served

    _fake_problems(monkeypatch, lambda fns, *a, **kw: {lab: {"loop": 1.0, "graph": 1.0} for lab in fns})
    e = K.tune("ag", m, n, k, torch.bfloat16, device=torch.device("cpu"), cache=K.KernelCache("kernels|cpu|sm132"))
    assert e["default"] == served and e["choice"] == served  # all equal: the default stands
    assert e["default"] == K.label(*K.choose_config("ag", m, n, k, torch.bfloat16))


def test_bench_rounds_on_fakes(fake_gpu):
    """--rounds N: at least N rounds per shape, recorded in the JSON; fewer keep the planned count."""
    bench = _bench_module()
    for floor, want in ((6, 6), (2, 3)):
        args = bench.parse_args(["--op", "ag", "--shapes", "256x256x512", "--quick", "--rounds", str(floor)])
        r = bench.bench_shape(bench.problems(args)[0], args, torch.bfloat16, torch.bfloat16, 132, torch.device("cpu"))
        assert r["rounds"] == want


def test_plan_sampling_sample_ms():
    """Samples of ~2 ms (at most 64 calls) by default, of ~20 ms where a call takes 0.5 ms or more (but
    quick); --sample-ms asks for longer ones, uncapped."""
    from flux.autotune.kernel_timing import plan_sampling

    assert plan_sampling(0.4) == (5, 5)
    assert plan_sampling(0.7) == (29, 3)
    assert plan_sampling(0.7, quick=True) == (2, 3)
    assert plan_sampling(12.0) == (2, 3)
    assert plan_sampling(0.01) == (64, 5)
    assert plan_sampling(0.7, sample_ms=20.0) == (29, 3)
    assert plan_sampling(0.01, sample_ms=20.0) == (2000, 3)
    assert plan_sampling(0.7, sample_ms=20.0, min_rounds=5) == (29, 5)


# ---- on a GPU: the real kernels -------------------------------------------------------------
def _fused_on_gpu() -> bool:
    from flux.runtime.extension import cuda_kernels_available

    return cuda_kernels_available() and bool(torch.ops.flux.ag_gemm_fused_supported())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and flux._C with the sm_90a fused kernels")
@pytest.mark.parametrize("op,shape", [("ag", "1024x4096x3072"), ("ag", "256x8192x1280"), ("rs", "512x1792x4096"),
                                      ("rs", "32x512x4096")])
def test_gpu_every_config_correct_and_tuned(op, shape, tmp_path):
    if not _fused_on_gpu():
        pytest.skip("flux._C without the sm_90a fused kernels")
    bench = _bench_module()
    args = bench.parse_args(["--op", op, "--shapes", shape, "--quick", "--swizzles", "1,2,8"])
    r = bench.bench_shape(bench.problems(args)[0], args, torch.bfloat16, torch.bfloat16,
                          torch.cuda.get_device_properties(0).multi_processor_count)
    bad = {lab: (v["rel_err"], v.get("error")) for lab, v in r["variants"].items() if not v["ok"]}
    assert not bad, bad
    assert all(v["ms"]["loop"] and v["ms"]["graph"] for v in r["variants"].values())
    m, k, n = map(int, shape.split("x"))
    cache = K.KernelCache(K.gpu_key()[0], str(tmp_path))
    e = K.tune(op, m, n, k, torch.bfloat16, quick=True, cache=cache)
    assert K.cached_choice(cache, op, m, n, k, "bf16", "bf16") == K.parse_label(e["choice"])


def test_fused_scoreboard(tmp_path):
    """bench/fused_scoreboard.py: the targets' counts for a two-file set (the later file winning a
    shared shape), each choice, and the shipped choice timed for every grid shape of the H200 files."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import fused_scoreboard as S

    def doc(results):
        return {"device": "GPU X", "sm_count": 132, "dtype": "bf16", "out_dtype": "bf16", "results": results}

    def res(op, m, ms, served, base=1.0, add=None, beta1=None):
        r = {"op": op, "m": m, "n": 64, "k": 64, "served": served, "cublas": {"ms": {"loop": base, "graph": base}},
             "variants": {lab: {"ok": True, "config": 0, "tile": "t", "ms": {"loop": v, "graph": v}} for lab, v in ms.items()}}
        if add is not None:
            r["cublas_add"] = {"ms": {"loop": add, "graph": add}}
        if beta1 is not None:
            r["cublas_beta1"] = {"ms": {"loop": beta1, "graph": beta1}}
        return r
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc([res("ag", 1024, {"c0/r1/s1": 1.5}, "c0/r1/s1"),
                                 res("ag", 256, {"c0/r1/s1": 1.04}, "c0/r1/s1")])))
    b.write_text(json.dumps(doc([res("ag", 1024, {"c0/r1/s1": 1.01, "c2/r1/s1": 0.9}, "c0/r1/s1"),
                                 res("rs", 2048, {"c3/r1/s1": 1.03}, "c3/r1/s1", add=1.2, beta1=1.1)])))
    s = S.scoreboard([str(a), str(b)], "served")
    t = s["timings"]["loop"]
    assert s["shapes"] == 3 and not s["untimed"]
    assert t["ag_within_2pct_from_1024"]["missed"] == 0  # b's 1.01 replaced a's 1.5
    assert t["ag_within_5pct_at_256"] == {"shapes": 1, "missed": 0, "which": []}
    assert abs(t["ag_geomean"] - math.sqrt(1.01 * 1.04)) < 1e-9
    assert t["rs_faster_than_mm_add_from_128"]["missed"] == 0  # 1.03 < 1.2
    assert t["rs_within_2pct_of_mm_from_1024"]["missed"] == 1  # 1.03 > 1.02
    assert "1.030" in t["rs_within_2pct_of_mm_from_1024"]["which"][0]
    # cuBLAS adding into its output: 1.1 x mm, the choice 1.03 / 1.1 x it
    b1, vb1 = t["rs_beta1_over_mm_from_1024"], t["rs_within_2pct_of_beta1_from_1024"]
    assert b1["missed"] == 1 and abs(b1["geomean"] - 1.1) < 1e-9
    assert vb1["missed"] == 0 and abs(vb1["geomean"] - 1.03 / 1.1) < 1e-9
    assert "beta = 1" in S.text(s)
    # Pooled, the files are repeats: the shared AG shape's ratio is the geometric mean of both files'.
    p = S.scoreboard([str(a), str(b)], "served", pool=True)
    pt = p["timings"]["graph"]
    assert p["pool"] and "pooled" in S.text(p)
    assert pt["ag_within_2pct_from_1024"]["which"] == [f"1024x64x64 {math.sqrt(1.5 * 1.01):.3f}"]
    assert abs(pt["ag_geomean"] - math.sqrt(math.sqrt(1.5 * 1.01) * 1.04)) < 1e-9
    assert pt["rs_within_2pct_of_mm_from_1024"] == t["rs_within_2pct_of_mm_from_1024"]  # one file: as unpooled
    # The spread between repeats: the one shape both files timed, 1.5 against 1.01.
    assert pt["spread"] == {"shapes": 1, "median": pytest.approx(1.5 / 1.01), "max": pytest.approx(1.5 / 1.01)}
    assert "moved by a median 1.485x" in S.text(p) and "spread" not in t
    # A label the later file did not time is read from the latest file that did, as its ratio to that
    # file's cuBLAS (c9 only in c.json: 1.2 / 2.0), and a label no file timed leaves the shape untimed.
    c, d = tmp_path / "c.json", tmp_path / "d.json"
    c.write_text(json.dumps(doc([res("ag", 1024, {"c0/r1/s1": 1.0, "c9/r1/s1": 1.2}, "c0/r1/s1", base=2.0)])))
    d.write_text(json.dumps(doc([res("ag", 1024, {"c0/r1/s1": 0.5}, "c9/r1/s1"),
                                 res("ag", 256, {"c0/r1/s1": 0.5}, "c7/r1/s1")])))
    s2 = S.scoreboard([str(c), str(d)], "served")
    assert s2["untimed"] == ["ag 256x64x64"]
    assert abs(s2["timings"]["graph"]["ag_geomean"] - 0.6) < 1e-9
    files = [os.path.join(REPO, "bench", "results", n) for n in SHIPPED_FROM]
    if all(os.path.exists(f) for f in files):
        shipped = S.scoreboard(files, "shipped")
        assert shipped["shapes"] == 144 and not shipped["untimed"], shipped["untimed"][:5]
        # The analytic default over every recorded H200 shape (the grid file too), against the
        # tuned choice: the geometric mean within 1%, 8 or fewer shapes over 5% (docs/tuning.md); one RS
        # shape of 512 rows per rank gets RS 37, and two AG shapes of 1024 rows (N = 13312, 26624; K = 16384)
        # AG 31 with bands of 4, and RS 46 (swapped operands) on the six RS shapes of 32 rows per rank and the two
        # of 64 rows on 4096 columns, which no file timed there (docs/performance.md, "Not yet measured"), the
        # rest timed.
        grid = os.path.join(REPO, "bench", "results", "fused_gemm-h200-grid-bf16.json")
        if os.path.exists(grid):
            analytic = S.scoreboard([grid] + files, "analytic")
            untimed = analytic["untimed"]
            swapped = [u for u in untimed if u.startswith(("rs 32x", "rs 64x4096x"))]
            assert analytic["shapes"] == 144 and len(swapped) == 8 and len(untimed) - 8 <= 3, untimed
            for t in S.TIMINGS:
                vt = analytic["timings"][t]["vs_tuned"]
                assert vt["shapes"] == 144 - len(analytic["untimed"]) and vt["geomean"] < 1.01, (t, vt)
                assert vt["over_5pct"] <= 8 and len(vt["which"]) == vt["over_5pct"], (t, vt)
    # No tuned choice on the two-file set (its tiles name no built configuration): no ratio to it.
    assert s["timings"]["loop"]["vs_tuned"] == {"shapes": 0, "geomean": None, "over_5pct": 0, "max": None,
                                                   "which": []}
    # The configuration fastest alone (spin timing) among the default build's, and a choice put over it.
    ag = next(c for c in K._allowed("default", "bf16", "bf16")["ag"].values() if c.applies(1024, 64, 64))
    lab0, lab1 = K.label(ag.id, 1, 1), K.label(ag.id, 1, 2)
    e = tmp_path / "e.json"
    r = res("ag", 1024, {}, lab0)
    r["cublas"]["ms"]["spin"] = 2.0
    r["variants"] = {lab: {"ok": True, "config": ag.id, "raster": 1, "swizzle": sw, "tile": ag.desc,
                           "ms": {"loop": lp, "graph": lp, "spin": sp}}
                     for lab, sw, lp, sp in ((lab0, 1, 1.0, 2.4), (lab1, 2, 1.1, 2.2))}
    r["variants"]["c999/r1/s1"] = {"ok": True, "config": 999, "raster": 1, "swizzle": 1, "tile": "t",
                                   "ms": {"loop": 0.5, "graph": 0.5, "spin": 0.5}}  # not built: not a choice
    e.write_text(json.dumps(doc([r])))
    alone = S.scoreboard([str(e)], "alone", ("loop", "spin"), "served")
    assert alone["timings"]["spin"]["ag_geomean"] == 1.1 and alone["timings"]["loop"]["ag_geomean"] == 1.1
    served = S.scoreboard([str(e)], "served", ("spin",), "alone")["timings"]["spin"]["vs_alone"]
    assert abs(served["geomean"] - 2.4 / 2.2) < 1e-9 and served["over_5pct"] == 1


def test_time_calls_rotates_and_warms(monkeypatch):
    """Each round starts one variant further; ``warm`` untimed calls precede a variant's samples
    in every round (the clock its own power draw sets); warm_calls only from 0.5 ms a call."""
    from flux.autotune import kernel_timing as KT

    log = []
    monkeypatch.setattr(KT, "_events_ms", lambda run, spin=False, cycles=0: (log.append("sample"), run(), 1.0)[2])
    monkeypatch.setattr(KT, "capture", lambda loop, calls=1: types.SimpleNamespace(replay=loop))
    variants = {lab: [lambda lab=lab: log.append(lab)] for lab in "abc"}
    t = KT.time_calls(variants, calls=2, rounds=3, timings=("loop",), settle=False, warm=4)
    assert set(t) == set("abc") and all(v["loop"] == 0.5 for v in t.values())
    timed = log[3 + 0:]  # after each variant's first call
    firsts, i = [], 0
    while i < len(timed):  # per variant and round: 4 warm calls, then a sample of 2 calls
        assert timed[i:i + 4] == [timed[i]] * 4 and timed[i + 4:i + 7] == ["sample", timed[i], timed[i]], timed[i:i + 7]
        firsts.append(timed[i])
        i += 7
    assert firsts == list("abc" "bca" "cab")
    assert KT.warm_calls(0.2) == 0 and KT.warm_calls(10.0) == 6 and KT.warm_calls(0.5) == 120


def test_time_calls_lead_spin(monkeypatch):
    """lead=True: the loop and graph samples start behind a GPU spin of LEAD_CYCLES (the first call's
    launch untimed); the spin sample keeps its own; without lead, loop and graph have none."""
    from flux.autotune import kernel_timing as KT

    seen = []
    monkeypatch.setattr(KT, "_events_ms", lambda run, spin=False, cycles=KT.SPIN_CYCLES: (
        seen.append((spin, cycles if spin else None)), run(), 1.0)[2])
    monkeypatch.setattr(KT, "capture", lambda loop, calls=1: types.SimpleNamespace(replay=loop))
    fns = {"a": [lambda: None]}
    KT.time_calls(fns, calls=1, rounds=1, timings=("loop", "graph", "spin"), lead=True)
    assert seen == [(True, KT.LEAD_CYCLES), (True, KT.LEAD_CYCLES), (True, KT.SPIN_CYCLES)]
    seen.clear()
    KT.time_calls(fns, calls=1, rounds=1, timings=("loop", "graph", "spin"))
    assert seen == [(False, None), (False, None), (True, KT.SPIN_CYCLES)]
