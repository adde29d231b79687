"""flux.autotune on the CPU: candidates and pruning, M bucketing, the cache file (round
trip, versioning, shipped defaults), the order of precedence of the choice, and, in gloo
processes, that ranks which measure different times still make the same choice."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from flux import autotune
from flux.autotune import cache as cache_mod, space
from flux.autotune.space import Candidate, Problem, candidates, m_bucket, why_invalid
from flux.autotune.topology import Topology
from _dist import batches, case

BF16 = torch.bfloat16


def big(op, **kw):
    args = dict(op=op, m=8192, n=14336, k=8192, dtype=BF16, world=2)
    args.update(kw)
    return Problem(**args)


def test_candidate_label_round_trip():
    for c in (Candidate("sequential"), Candidate.of("decomposed", chunks=2), Candidate.of("fused", config=1, swizzle=8)):
        assert Candidate.parse(c.label) == c
    assert Candidate.of("x", b=2, a=1).label == "x(a=1,b=2)"


def test_pruning():
    labels = lambda p: [c.label for c in candidates(p)]  # noqa: E731
    assert labels(big("ag_gemm")) == ["sequential", "decomposed", "decomposed(first8=4)", "decomposed(first8=6)",
                                      "decomposed(first8=7)", "oneshot", "fused"]
    # One fused candidate: its kernel configuration is the kernel tuner's (flux.autotune.kernels).
    assert labels(big("gemm_rs")) == ["sequential", "oneshot", "decomposed(chunks=1)", "decomposed(chunks=2)",
                                      "decomposed_p2p(chunks=1)", "fused"]
    assert "fused" in labels(big("gemm_rs", world=4))  # a ring at any world size
    assert "first8" not in " ".join(labels(big("ag_gemm", world=4)))  # two ranks' rows only
    assert "first8" not in " ".join(labels(big("ag_gemm", m=1024)))  # 512 rows per rank
    assert "fused" not in " ".join(labels(big("gemm_rs", world=1)))
    assert "fused" in labels(big("gemm_rs", dtype=torch.float16))  # built by default (flux/fused_configs.py)
    assert "fused" not in " ".join(labels(big("gemm_rs", n=14330)))
    assert why_invalid(Candidate.of("fused", config=99), big("gemm_rs")) == "no fused configuration 99"
    assert "not built" in why_invalid(Candidate.of("fused", config=1), big("gemm_rs"))  # not in the default build
    assert why_invalid(Candidate.of("fused", segments=0), big("gemm_rs")) == "segments must be positive"
    # Bands of 8 tiles: RS counts this rank's rows (M / world), AG all M rows.
    rs_band = Candidate.of("fused", config=6, segments=8, swizzle=8)  # 128-row tiles, clusters of 2 along M
    assert why_invalid(rs_band, big("gemm_rs", m=4096)) is None  # 2048 rows: 16 tiles of 128
    assert why_invalid(rs_band, big("gemm_rs", m=2048)) == "bands of M tiles larger than the problem pad the grid"
    assert why_invalid(Candidate.of("fused", config=1, segments=8, swizzle=8), big("gemm_rs", m=4096)) is not None
    assert why_invalid(Candidate.of("fused", config=0, swizzle=8), big("ag_gemm", m=2048)) is None
    # Configurations with one CTA per cluster along M: bands of 8 tiles of 128 rows.
    assert why_invalid(Candidate.of("fused", config=3, segments=8, swizzle=8), big("gemm_rs", m=2048)) is None
    assert why_invalid(Candidate.of("fused", config=3, segments=8, swizzle=8), big("gemm_rs", m=1024)) is not None
    assert why_invalid(Candidate.of("fused", config=32, swizzle=8), big("ag_gemm", m=1024)) is None
    assert why_invalid(Candidate.of("fused", config=32, swizzle=8), big("ag_gemm", m=512)) is not None
    assert labels(big("ag_gemm", device_type="cpu")) == ["sequential"]
    assert labels(big("gemm_rs", world=1)) == ["sequential"]
    # A wider output (fp32 from bf16) is overlapped, fused where a kernel is built for it (the
    # default build: bf16 -> fp32 for both ops, fp16 -> fp32 for AG only); from fp32, not at all.
    wide = labels(big("ag_gemm", out_dtype_differs=True))
    assert "decomposed" in wide and "oneshot" in wide and "fused" in wide
    assert "fused" in labels(big("ag_gemm", out_dtype_differs=True, dtype=torch.float16))
    assert "fused" in labels(big("gemm_rs", out_dtype_differs=True))
    assert "fused" not in labels(big("gemm_rs", out_dtype_differs=True, dtype=torch.float16))
    assert labels(big("ag_gemm", out_dtype_differs=True, dtype=torch.float32)) == ["sequential"]
    assert "fused" in labels(big("ag_gemm", dtype=torch.float16))
    assert "fused" not in " ".join(labels(big("ag_gemm", weight_layout="kn")))
    assert "fused" not in " ".join(labels(big("ag_gemm", k=8190)))
    assert "fused" not in " ".join(labels(big("ag_gemm", sm90=False)))
    small = big("ag_gemm", m=512)  # bands of 8 tiles would pad the grid
    assert why_invalid(Candidate.of("fused", config=0, swizzle=1), small) is None
    assert why_invalid(Candidate.of("fused", config=0, swizzle=8), small) is not None
    assert why_invalid(Candidate.of("fused", config=0, swizzle=8), big("ag_gemm", m=3072)) is None
    assert "decomposed(chunks=2)" not in labels(big("gemm_rs", m=256))  # sub-blocks under a tile
    assert why_invalid(Candidate("sequential"), big("ag_gemm", device_type="cpu")) is None
    with pytest.raises(ValueError):
        Problem("ag_gemm", 0, 1, 1, BF16, 2)
    with pytest.raises(ValueError):
        Problem("all_reduce", 1, 1, 1, BF16, 2)


def test_fused_ag_bands_stay_within_a_rank(monkeypatch):
    """The kernel tuner's AG swizzle is halved until a band of M tiles fits one rank's rows (the
    first waves read local rows); a swizzle given as a strategy argument is not (see test_pruning)."""
    from flux.autotune import kernels as K
    from flux.ops import _plans
    from flux.strategies import fused_ag_swizzle

    # config 0: 128-row tiles, clusters of 2 along M: bands of 256 * swizzle rows
    assert fused_ag_swizzle(big("ag_gemm", m=1024, world=2), 0, 4) == 2   # 512 rows per rank
    assert fused_ag_swizzle(big("ag_gemm", m=1024, world=8), 0, 4) == 1   # 128: the cluster spans two ranks
    assert fused_ag_swizzle(big("ag_gemm", m=8192, world=2), 0, 8) == 8
    assert fused_ag_swizzle(big("ag_gemm", m=8192, world=8), 0, 8) == 4
    assert fused_ag_swizzle(big("ag_gemm", m=4096, world=1), 5, 8) == 8   # 1x1 clusters: 1024-row bands
    monkeypatch.setattr(K, "choose_config", lambda op, m, n, k, dt, out, dev: (0, 1, 8))
    assert _plans.kernel_params(big("ag_gemm", m=2048, world=4), None) == {"config": 0, "raster": 1, "swizzle": 2}
    assert _plans.kernel_params(big("gemm_rs", m=2048, world=4), None)["swizzle"] == 8  # RS: one rank's block


def test_m_bucket():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 4096, 4097, 6000)] == [1, 2, 4, 4, 8, 4096, 8192, 8192]


def test_default_candidate_follows_the_thresholds():
    assert autotune.default_candidate(big("ag_gemm")).label == "decomposed"
    assert autotune.default_candidate(big("ag_gemm", m=128)).label == "sequential"
    assert autotune.default_candidate(big("gemm_rs")).label == "decomposed(chunks=1)"
    assert autotune.default_candidate(big("gemm_rs", m=512)).label == "oneshot"
    assert autotune.default_candidate(big("gemm_rs", m=128)).label == "sequential"
    assert autotune.default_candidate(big("gemm_rs", device_type="cpu")).label == "sequential"


def test_topology():
    t = Topology("NVIDIA H200", 132, 2, 2, 1, "nvlink")
    assert t.key == "NVIDIA H200|sm132|2r|1n|nvlink"
    assert "NVLink" not in str(t) and "nvlink" in str(t)
    with pytest.raises(ValueError):
        Topology("x", 1, 2, 2, 1, "carrier-pigeon")
    cpu = autotune.topology(4, torch.device("cpu"))
    assert cpu.link == "cpu" and cpu.world_size == 4


def _entry(choice):
    return {"choice": choice, "default": "sequential", "times_ms": {choice: 1.0, "sequential": 2.0}}


def test_cache_round_trip_and_versioning(tmp_path, monkeypatch):
    key = "cpu|sm0|2r|1n|cpu"
    c = cache_mod.TuneCache(key, str(tmp_path))
    c.put("k1", _entry("oneshot"))
    path = c.save()
    assert cache_mod.TuneCache(key, str(tmp_path)).get("k1")["choice"] == "oneshot"
    assert cache_mod.TuneCache("other|topology", str(tmp_path)).get("k1") is None
    data = json.load(open(path))
    for field, value in (("flux", "0.0.0-other"), ("format", 999), ("topology", "other")):
        bad = dict(data, **{field: value})
        json.dump(bad, open(path, "w"))
        assert cache_mod.TuneCache(key, str(tmp_path)).get("k1") is None, field
    open(path, "w").write("{not json")
    assert cache_mod.TuneCache(key, str(tmp_path)).get("k1") is None
    # Shipped defaults answer what the user's cache does not, and lose to it otherwise.
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(cache_mod, "SHIPPED_DIR", str(shipped))
    s = cache_mod.TuneCache(key, str(tmp_path))
    s.user = {"k1": _entry("decomposed")}
    s.save(str(shipped / cache_mod.file_name(key)))
    s2 = cache_mod.TuneCache(key, str(tmp_path / "user"))
    assert s2.get("k1")["choice"] == "decomposed"
    s2.put("k1", _entry("oneshot"))
    assert s2.get("k1")["choice"] == "oneshot"


def test_shipped_defaults_load_and_name_valid_candidates():
    """Every shipped file loads for its own topology, and each choice parses as a candidate of
    its op (a corrupt or stale shipped file would silently fall back to the default)."""
    import glob

    files = glob.glob(os.path.join(cache_mod.SHIPPED_DIR, "tune-*.json"))
    assert files, "no shipped defaults"
    for path in files:
        data = json.load(open(path))
        assert os.path.basename(path) == cache_mod.file_name(data["topology"]), path
        entries = cache_mod._load(path, data["topology"], check_version=False)
        assert len(entries) == len(data["entries"]) > 0, path
        for key, entry in entries.items():
            op = key.split("|")[0]
            # A point of today's space, or a measured fused point with explicit kernel parameters
            # (still runnable: explicit parameters override the kernel tuner's choice).
            c = Candidate.parse(entry["choice"])
            assert c in space._space(op) or (c.strategy == "fused" and space.param_error(op, "fused", c.kwargs)
                                             is None), key
            assert entry["choice"] in entry["times_ms"] and entry["default"] in entry["times_ms"], key


def test_choice_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUX_CACHE_DIR", str(tmp_path))
    autotune.reset()
    p = big("gemm_rs")
    cpu = torch.device("cpu")
    assert autotune.choose(p, cpu).label == "decomposed(chunks=1)"  # analytic default
    cache = autotune.cache_for(2, cpu)
    cache.put(autotune.key_of(p), _entry("decomposed(chunks=2)"))
    assert autotune.choose(p, cpu).label == "decomposed(chunks=2)"  # tuned
    # the bucket serves every M in (bucket/2, bucket]
    assert autotune.choose(big("gemm_rs", m=8000), cpu).label == "decomposed(chunks=2)"
    assert autotune.choose(big("gemm_rs", m=4096), cpu).label == "decomposed(chunks=1)"
    monkeypatch.setenv("FLUX_STRATEGY_GEMM_RS", "oneshot")
    assert autotune.choose(p, cpu).label == "oneshot"  # forced
    monkeypatch.setenv("FLUX_STRATEGY_GEMM_RS", "fused(config=7)")  # no such configuration
    assert autotune.choose(p, cpu).label == "decomposed(chunks=1)"  # invalid forced: default, logged
    monkeypatch.delenv("FLUX_STRATEGY_GEMM_RS")
    cache.put(autotune.key_of(p), _entry("nonsense"))
    assert autotune.choose(p, cpu).label == "decomposed(chunks=1)"  # an invalid cached choice is ignored
    autotune.reset()


# --------------------------------------------------------------------------------------
# Collective timing in gloo processes


@case("tune-ranks-disagree", worlds=(2, 4))
def _ranks_disagree(rank, world):
    """Each rank measures a different candidate fastest; the max over ranks and the broadcast
    decision still give every rank the same choice."""
    from flux.autotune import tuner

    cands = [Candidate("a"), Candidate("b"), Candidate("c"), Candidate("d")]
    # rank r sees candidate r % 4 as fastest (1 ms) and the others at 5 ms, except that
    # "c" is 3 ms everywhere: the max over ranks makes "c" the best for every rank.
    def timer(c, fn):
        if c.label == "c":
            return 3.0
        return 1.0 if cands.index(c) == rank % 4 else 5.0
    times = tuner.time_candidates(lambda c: None, cands, dist.group.WORLD, torch.device("cpu"), warmup=0,
                                  timer=timer)
    best = tuner.pick(times, cands, dist.group.WORLD, torch.device("cpu"))
    return {"best": best.label, "times": times}


@case("tune-margin", worlds=(2,))
def _margin(rank, world):
    """A candidate replaces the default only if it is more than MARGIN faster; the rounds
    interleave the candidates (a, b, a, b, ...) after one warm-up call each."""
    from flux.autotune import tuner

    cands = [Candidate("sequential"), Candidate("decomposed"), Candidate("oneshot")]
    calls = []

    def timer(c, fn):
        calls.append(c.label)
        return {"sequential": 2.0, "decomposed": 1.0, "oneshot": 0.999}[c.label]
    times = tuner.time_candidates(lambda c: None, cands, dist.group.WORLD, torch.device("cpu"), warmup=0,
                                  rounds=3, timer=timer)
    near = tuner.pick(times, cands, dist.group.WORLD, torch.device("cpu"), default=cands[1])
    times["oneshot"] = 0.9
    far = tuner.pick(times, cands, dist.group.WORLD, torch.device("cpu"), default=cands[1])
    plain = tuner.pick({"sequential": 2.0, "decomposed": 1.0, "oneshot": 0.999}, cands, dist.group.WORLD,
                       torch.device("cpu"))
    return {"near": near.label, "far": far.label, "plain": plain.label, "calls": calls}


@case("tune-drops-wrong", worlds=(2, 4))
def _drops_wrong(rank, world):
    """A candidate that computes the wrong thing on one rank only is dropped on every rank
    before timing; NaN counts as wrong."""
    from flux.autotune import tuner

    ref = torch.arange(12.0).reshape(3, 4) + 1
    cands = [Candidate("sequential"), Candidate("b"), Candidate("c"), Candidate("d")]

    def run(c):
        if c.label == "b" and rank == 1:
            return ref * 1.5
        if c.label == "d":
            return (ref * float("nan"), None)  # tuples: the output comes first
        return ref.clone()
    kept = tuner.correct_candidates(run, cands, dist.group.WORLD, torch.device("cpu"), torch.float32)
    return [c.label for c in kept]


@case("tune-end-to-end", worlds=(2,))
def _tune_end_to_end(rank, world):
    """autotune.tune on a CPU problem: times every valid candidate, records and saves."""
    import tempfile

    d = tempfile.mkdtemp() if rank == 0 else None
    obj = [d]
    dist.broadcast_object_list(obj, src=0)
    os.environ["FLUX_CACHE_DIR"] = obj[0]
    autotune.reset()
    cpu = torch.device("cpu")
    p = Problem("ag_gemm", 64, 24, 40, torch.float32, world, device_type="cpu")
    x, w = torch.randn(32, 40), torch.randn(24, 40)
    from flux.ops import ag_gemm as ag_mod

    entry = autotune.tune(p, lambda c: ag_mod.run_strategy(c.strategy, x, w, check=False), dist.group.WORLD,
                          cpu, iters=3)
    dist.barrier()
    reloaded = cache_mod.TuneCache(autotune.topology(world, cpu).key, obj[0]).get(autotune.key_of(p))
    autotune.reset()
    return {"entry": entry["choice"], "saved": reloaded["choice"] if reloaded else None}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return batches(__file__, "tune-", tmp_path_factory)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_measure_differently_agree(batch, world):
    values = batch(world).assert_ok("tune-ranks-disagree")
    assert all(v["best"] == "c" for v in values), values
    assert all(v == values[0] for v in values), values


@pytest.mark.parametrize("world", [2, 4])
def test_wrong_candidates_are_dropped_everywhere(batch, world):
    values = batch(world).assert_ok("tune-drops-wrong")
    assert values == [["sequential", "c"]] * world, values


def test_default_kept_within_the_margin(batch):
    values = batch(2).assert_ok("tune-margin")
    order = ["sequential", "decomposed", "oneshot"] * 3
    assert values == [{"near": "decomposed", "far": "oneshot", "plain": "oneshot", "calls": order}] * 2, values


def test_per_rank_shape_scales_with_the_world():
    from flux.autotune.space import per_rank_shape

    assert per_rank_shape("ag_gemm", 8192, 8192, 14336, 2) == (14336, 8192)
    assert per_rank_shape("ag_gemm", 8192, 8192, 14336, 4) == (7168, 8192)
    assert per_rank_shape("ag_gemm", 8192, 8192, 14336, 8) == (3584, 8192)
    assert per_rank_shape("gemm_rs", 8192, 14336, 8192, 8) == (8192, 3584)
    assert per_rank_shape("gemm_rs", 128, 14336, 8192, 4, scale=False) == (8192, 14336)
    assert per_rank_shape("ag_gemm", 128, 8192, 200, 8) == (128, 8192)  # rounded, at least one tile


def test_tune_end_to_end(batch):
    values = batch(2).assert_ok("tune-end-to-end")
    assert values == [{"entry": "sequential", "saved": "sequential"}] * 2, values


def test_cli_on_cpu(tmp_path):
    """`torchrun -m flux.autotune` end to end on the CPU (gloo, 2 processes): it tunes the shapes,
    prints the table and writes the cache of this topology."""
    import subprocess
    import sys

    from _dist import free_port

    env = dict(os.environ, FLUX_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "flux.autotune", "--cpu", "--shapes", "ag_gemm:64x32x48,gemm_rs:64x32x48", "--iters", "2"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 shapes in" in proc.stdout and "gemm_rs" in proc.stdout, proc.stdout[-3000:]
    files = list(tmp_path.glob("tune-*.json"))
    assert len(files) == 1, files
    data = json.load(open(files[0]))
    assert data["topology"] == "cpu|sm0|2r|1n|cpu" and len(data["entries"]) == 2, data


def test_cli_suite_on_cpu(tmp_path):
    """`-m flux.autotune --suite --cpu` tunes the public suite divided by 16 (a CPU times it in
    seconds) and writes the cache: every shape has its entry."""
    import subprocess
    import sys

    from _dist import free_port

    env = dict(os.environ, FLUX_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "flux.autotune", "--suite", "--cpu", "--iters", "2"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "13 shapes in" in proc.stdout and "512x512x896" in proc.stdout, proc.stdout[-3000:]
    files = list(tmp_path.glob("tune-*.json"))
    assert len(files) == 1 and len(json.load(open(files[0]))["entries"]) == 13, files
