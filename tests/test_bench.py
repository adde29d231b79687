"""The benchmarks keep running: bench/bench_layers.py on the CPU (gloo, two processes, tiny sizes),
where it checks that the flux block's output and gradients match the NCCL-style block's, and draws
its plot from the JSON; bench/profile_fused_ncu.py's reading of Nsight Compute's report;
bench/power_fused_gemm.py's reading of nvidia-smi."""
import json
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
sys.path.insert(0, TESTS_DIR)


def test_bench_layers_runs_on_cpu(tmp_path):
    from _dist import free_port

    out = tmp_path / "mlp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(REPO, "bench", "bench_layers.py"), "--cpu", "--blocks", "mlp,megatron", "--sizes", "64x128",
           "--tokens", "32,64",
           "--steps", "2", "--rounds", "2", "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    import json

    recs = json.load(open(out))["results"]
    mlp = [r for r in recs if r["block"] == "mlp"]
    assert [r["status"] for r in mlp] == ["ok", "ok"], recs
    assert all(r["rel_err"]["flux"] < 1e-4 for r in mlp), recs
    assert all(set(r["variants"]) == {"nccl", "flux"} and set(r["variants"]["flux"]) == {"fwd", "fwdbwd"}
               for r in mlp), recs
    assert all(r["status"].startswith("skipped") for r in recs if r["block"] == "megatron"), recs  # GPU only
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return
    png = tmp_path / "mlp.png"
    subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_layers.py"), "--plot", str(out), "--png",
                    str(png)], check=True, timeout=120, cwd=REPO)
    assert png.stat().st_size > 1000


def _load_bench(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_fused_ncu_splits_the_report_at_its_marks():
    """Nsight Compute's details page (CSV) -> one entry per profiled launch, its kernels between
    two marks (a split-K launch has two); cases parse; a report short of marks is an error."""
    import pytest

    ncu = _load_bench("profile_fused_ncu")
    assert ncu.parse_cases("ag:1024x8192x14336:c2/r1/s1,served; rs:64x4096x512:c6/r1/s8") == [
        ("ag", 1024, 8192, 14336, ["c2/r1/s1", "served"]), ("rs", 64, 4096, 512, ["c6/r1/s8"])]
    with pytest.raises(SystemExit):
        ncu.parse_cases("mm:1x2x3:c0/r1/s1")
    head = '"ID","Kernel Name","Grid Size","Block Size","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = []
    for kid, name in enumerate(["at::cuda::spin_kernel(long)", "nvjet_sm90_tst_176x128", "at::cuda::spin_kernel(long)",
                                "cutlass::device_kernel<A>", "flux::split_k_reduce_kernel<B>"]):
        rows.append(f'"{kid}","{name}","(2, 66, 1)","(384, 1, 1)","GPU Speed Of Light Throughput","Elapsed Cycles",'
                    f'"cycle","{468424 + kid:,}"\n')
        rows.append(f'"{kid}","{name}","(2, 66, 1)","(384, 1, 1)","GPU Speed Of Light Throughput","SM Frequency",'
                    f'"Ghz","1.57"\n')
    plan = [{"op": "ag", "m": 1024, "k": 8192, "n": 14336, "label": "cublas"},
            {"op": "ag", "m": 1024, "k": 8192, "n": 14336, "label": "c41/r1/s1"}]
    got = ncu.parse_details(head + "".join(rows), plan)
    assert [c["label"] for c in got] == ["cublas", "c41/r1/s1"]
    assert [k["name"] for k in got[1]["kernels"]] == ["cutlass::device_kernel<A>", "flux::split_k_reduce_kernel<B>"]
    assert got[0]["kernels"][0]["metrics"] == {"GPU Speed Of Light Throughput/Elapsed Cycles [cycle]": 468425.0,
                                               "GPU Speed Of Light Throughput/SM Frequency [Ghz]": 1.57}
    with pytest.raises(SystemExit):
        ncu.parse_details(head + "".join(rows[:4]), plan + plan)


def test_profile_fused_ncu_writes_the_source_page(tmp_path):
    """--sass: ncu's source page of the report, as ncu prints it, plain or gzip-compressed."""
    import gzip

    ncu = _load_bench("profile_fused_ncu")
    fake = tmp_path / "ncu"
    fake.write_text('#!/bin/sh\necho "$@"\necho \'"Address","Source","Instructions Executed"\'\n'
                    'echo \'"00007f00","UTMALDG.3D [UR8], [UR4], desc[UR6]","4096"\'\n')
    fake.chmod(0o755)
    ncu.write_sass(str(fake), "prof.ncu-rep", str(tmp_path / "s.csv"))
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert lines[0] == "-i prof.ncu-rep --page source --print-source sass --csv" and "UTMALDG" in lines[2]
    ncu.write_sass(str(fake), "prof.ncu-rep", str(tmp_path / "s.csv.gz"))
    with gzip.open(tmp_path / "s.csv.gz", "rt") as f:
        assert f.read().splitlines() == lines


def test_profile_fused_ncu_without_a_gpu_says_so():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would profile")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "profile_fused_ncu.py"), "--cases",
                        "ag:256x512x256:c0/r1/s1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "nothing profiled" in r.stdout


def test_probe_l2_coalescing_reads_its_lines_and_ncu():
    """The probe's JSON lines, one per variant; ncu's details page -> each variant's last launch of
    the probe kernel (the first is its warm-up; other kernels skipped); a launch missing is an error."""
    import pytest

    probe = _load_bench("probe_l2_coalescing")
    tools = _load_bench("probe_cuda")
    out = ('{"group": 8, "stagger": 0, "delay": 256, "policy": "0x0", "promotion": 128, "ctas": 128, "rows": 1024, '
           '"k": 4096, "ms": 0.0123}\nnoise\n')
    assert tools.parse_lines(out) == [{"group": 8, "stagger": 0, "delay": 256, "policy": "0x0", "promotion": 128,
                                       "ctas": 128, "rows": 1024, "k": 4096, "ms": 0.0123}]
    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = "".join(f'"{i}","{name}","Command line profiler metrics","lts__t_sectors_op_read.sum","sector",'
                   f'"{1000 * (i + 1):,}"\n'
                   for i, name in enumerate(["probe_kernel(a)", "probe_kernel(a)", "memset", "probe_kernel(a)",
                                             "probe_kernel(a)"]))
    assert probe.parse_ncu(head + rows) == [{"lts__t_sectors_op_read.sum [sector]": 2000.0},
                                            {"lts__t_sectors_op_read.sum [sector]": 5000.0}]
    with pytest.raises(SystemExit):
        probe.parse_ncu(head + rows.split("\n", 1)[1])


def test_probe_pdl_trace_orders_place_tiles_as_back_to_back():
    """probe_pdl_trace's orders: ``pdl``, each lone cluster gets the cluster tile that the back-to-back
    launch ran on its SMs (clashes and unplaced tiles first come, first served); the GPCs joined from
    the SMs of each cluster; ``gpc``, a GPC's clusters take consecutive cluster tiles; always a
    permutation, whose table holds its inverse after it; the grid of a configuration's cluster tiles."""
    probe = _load_bench("probe_pdl_trace")
    cols, cluster = 3, (2, 1)

    def first(m, n):
        return (m << 32) | n
    # A lone launch: cluster tile c (tiles (2r, n), (2r + 1, n)) on SMs 2c, 2c + 1; 6 cluster tiles, one
    # (5) not first in any CTA (a later wave).
    alone = {"sm": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "tiles": [1] * 10,
             "first_tile": [first(2 * (c // cols) + i, c % cols) for c in range(5) for i in (0, 1)]}
    # Back to back: SMs 0, 1 ran cluster tile 4, SMs 2, 3 tile 4 as well (a clash), 4, 5 tile 0, SM 6 tile 2,
    # SM 7 tile 1 (split), SMs 8, 9 none.
    b2b = {"sm": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "tiles": [1] * 8 + [0, 0],
           "first_tile": [first(2, 1), first(3, 1), first(2, 1), first(3, 1), first(0, 0), first(1, 0),
                          first(0, 2), first(1, 1), 0, 0]}
    perm, matched = probe.pdl_order(alone, b2b, 2, cols, cluster)
    assert sorted(perm) == list(range(6))
    assert perm[0] == 4 and perm[2] == 0 and perm[3] in (2, 1)
    assert perm[1] not in (4, 0) and matched == 3 / 6
    table = probe.order_table(perm, device="cpu")
    assert table.dtype == probe.torch.int32 and table.tolist()[:6] == perm
    assert [table.tolist()[6 + p] for p in perm] == list(range(6))
    # Two GPCs, {0, 1, 4, 5} and {2, 3, 6, 7}: lone clusters on SM pairs, back-to-back ones across them.
    lone = {"sm": list(range(8)), "tiles": [1] * 8,
            "first_tile": [first(2 * (c // 2) + i, c % 2) for c in range(4) for i in (0, 1)]}
    b2b = {"sm": [1, 4, 3, 6, 0, 5, 2, 7], "tiles": [1] * 8, "first_tile": lone["first_tile"]}
    groups = probe.gpc_groups([lone, b2b], cluster)
    assert groups == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert probe.gpc_groups([lone], cluster) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Clusters seen before (another configuration's back-to-back launches) join a lone launch's SMs.
    assert probe.gpc_groups([lone], cluster, [[1, 4], [3, 6]]) == groups
    # Cluster tiles 0 and 1 share rows of A (one cluster row): along N they go to the first GPC's clusters.
    assert probe.gpc_order(lone, groups, 2, 2, cluster, "n") == [0, 2, 1, 3]
    assert probe.gpc_order(lone, groups, 2, 2, cluster, "m") == [0, 1, 2, 3]
    from flux import fused_configs as fc
    cfg = fc.config("ag", 75)
    rows, cols, cl = probe._cluster_grid("ag", 75, 1024, 1280)
    assert cl == cfg.cluster and rows * cl[0] * cfg.tile[0] >= 1024 and cols * cl[1] * cfg.tile[1] >= 1280
    assert (rows - 1) * cl[0] * cfg.tile[0] < 1024 and (cols - 1) * cl[1] * cfg.tile[1] < 1280


def test_probe_pdl_trace_runs_every_order_with_the_gpu_parts_stubbed(tmp_path, monkeypatch, capsys):
    """probe_pdl_trace's main, its launches and traces replaced by stand-ins: each order is set before
    its variant's runs and cleared after, the GPC groups are recorded, and the JSON holds a result per
    (variant, order)."""
    import torch

    probe = _load_bench("probe_pdl_trace")
    from flux.autotune import kernel_timing, kernels

    class Problem:
        def __init__(self, *a, **k):
            pass

        def cublas(self):
            return ["mm"]

        def fused(self, cfg, raster, swz):
            return [f"c{cfg}"]
    # AG 75 on 256 x 320: tiles 2 x 4, cluster tiles 1 x 4; a lone launch on SM pairs, back to back across.
    def first(m, n):
        return (m << 32) | n
    lone = {"sm": list(range(8)), "tiles": [1] * 8, "first_tile": [first(i, c) for c in range(4) for i in (0, 1)]}
    b2b = {"sm": [1, 4, 3, 6, 0, 5, 2, 7], "tiles": [1] * 8, "first_tile": lone["first_tile"]}
    sample = dict(lone, go=[0] * 8, built=[0] * 8, producer_end=[1] * 8, consumer0_end=[1] * 8,
                  consumer1_end=[0] * 8)
    set_orders, traced = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(kernel_timing, "KernelProblem", Problem)
    monkeypatch.setattr(kernels, "choose_config", lambda *a, **k: (75, 1, 1))
    monkeypatch.setattr(torch.ops.flux, "set_fused_pdl", lambda on: None, raising=False)
    monkeypatch.setattr(torch.ops.flux, "set_fused_order", lambda a, c: set_orders.append(c), raising=False)
    deals = []
    monkeypatch.setattr(torch.ops.flux, "set_fused_deal", lambda p, s, n: deals.append(n), raising=False)
    from flux.autotune import placement
    monkeypatch.setattr(placement, "gpc_groups", lambda device=None: [[0, 1], [2, 3]])
    monkeypatch.setattr(placement, "deal_buffers", lambda device=None: (torch.zeros(72, dtype=torch.int32),
                                                                         torch.zeros(130, dtype=torch.int32), 8))
    monkeypatch.setattr(probe, "order_table", lambda perm: probe.torch.tensor(perm + perm, dtype=probe.torch.int32))
    monkeypatch.setattr(probe, "trace_variant", lambda fns, calls: (
        traced.append((fns[0], len(set_orders) and set_orders[-1])),
        {"kernels": [fns[0]], "back_to_back": {"dur_us": 1.0, "step_us": 1.0, "overlap_us": 0.0, "n": calls},
         "alone": {"dur_us": 1.0, "n": calls}})[1])
    monkeypatch.setattr(probe, "trace_ctas", lambda fns, calls: {
        "alone": {"work": 1.0, "sample": sample, "_placements": [lone]},
        "back_to_back": {"work": 1.0, "sample": dict(sample, sm=b2b["sm"]), "_placements": [b2b]}})
    out = tmp_path / "o.json"
    assert probe.main(["--shapes", "256x64x320", "--configs", "75", "--pdl", "1", "--cta",
                       "--orders", "identity,gpc,gpc-m,pdl,random:3,deal", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    got = [(r["variant"], r.get("order")) for r in doc["results"] if "gpc_groups" not in r]
    assert got == [("cublas", None)] + [("c75/r1/s1", o) for o in ("identity", "gpc", "gpc-m", "pdl", "random:3",
                                                                   "deal")]
    # The fused runs: no order for identity and deal, a 4-tile order for the others, each cleared after
    # its run; the deal set for its run only (8 SMs) and cleared after it.
    assert [c for _, c in traced[1:]] == [0, 4, 4, 4, 4, 0]
    assert set_orders == [0, 0] + [4, 0] * 4 + [0]  # cleared after cuBLAS's run and after each fused one
    assert deals == [8, 0]
    (groups,) = [r for r in doc["results"] if "gpc_groups" in r]
    assert groups["gpc_groups"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert all("_placements" not in c for r in doc["results"] for c in (r.get("cta") or {}).values())
    printed = capsys.readouterr().out
    for name in ("cublas", "c75/r1/s1/identity", "c75/r1/s1/gpc", "c75/r1/s1/gpc-m", "c75/r1/s1/pdl",
                 "c75/r1/s1/random:3", "c75/r1/s1/deal"):
        assert f" {name} pdl=" in printed, name  # one line per run, each named with its order


def test_gpc_placement_reads_clusters_paces_and_merging(tmp_path):
    """bench/gpc_placement.py: the interleaved numbering; a cluster's SMs joined into one group and checked
    against it (pairs of one TPC say nothing); two paces split at the widest gap; per L2-probe variant the
    GPCs each row-sharing group spans and the share merged."""
    g = _load_bench("gpc_placement")
    assert [g.interleaved_gpc(s) for s in (2, 18, 34, 50, 66, 80, 94)] == [1, 1, 1, 1, 2, 2, 2]
    assert g.interleaved_gpc(15) == 7 and g.interleaved_gpc(120) == ("tpc", 60)

    def first(m, n):
        return (m << 32) | n
    sample = {"sm": [2, 18, 4, 6, 8, 9], "tiles": [1] * 6,
              "first_tile": [first(0, 0), first(1, 0), first(0, 1), first(1, 1), first(0, 2), first(1, 2)],
              "go": [0] * 6, "producer_end": [30000, 31000, 40000, 41000, 30500, 40500],
              "consumer0_end": [0] * 6, "consumer1_end": [0] * 6}
    doc = {"commit": "x", "device": "d", "results": [
        {"m": 256, "n": 384, "k": 64, "variant": "c75/r1/s1", "pdl": 1, "cta": {"alone": {"sample": sample}}}]}
    (tmp_path / "t.json").write_text(json.dumps(doc))
    t = g.trace_report(str(tmp_path / "t.json"))
    # (2, 18): two TPCs, one GPC; (4, 6): two TPCs, two GPCs; (8, 9): one TPC, not counted.
    assert t["cluster_pairs"] == 3 and t["pairs_across_tpcs_below_sm_120"] == 2
    assert t["pairs_in_one_interleaved_gpc"] == 1
    assert t["gpc_groups"] == [[2, 18], [4, 6], [8, 9]]
    (run,) = t["pace"]
    assert run["faster"] == 3 and run["faster_sms"] == [2, 8, 18] and run["us"] == [30.0, 41.0]
    # In GPC 1 (SMs 2, 18) and GPC 4 (8, 9) the two CTAs share a tile column, none a row.
    assert (run["a_row_pairs_in_a_gpc"], run["weight_column_pairs_in_a_gpc"]) == (0, 2)
    # An SM above 119 takes the GPC of the SM below 120 a cluster joined it to; alone, none.
    assert g.gpc_map([[102, 120], [124, 125]]) == {102: 6, 120: 6}
    probe = {"commit": "y", "device": "d", "variants": [
        {"group": 2, "smid": [2, 18, 4, 6], "spread": 0, "metrics": {
            "lts__t_sectors_op_read.sum [sector]": 75.0, "lrc__request_sectors_op_read_coalescable.sum [sector]": 100.0}}]}
    (tmp_path / "p.json").write_text(json.dumps(probe))
    (v,) = g.probe_report(str(tmp_path / "p.json"))["variants"]
    assert v["groups"] == 2 and v["groups_in_one_gpc"] == 1 and v["gpcs_per_group"] == 1.5 and v["merged"] == 0.25


@pytest.mark.parametrize("name,marks", [
    ("probe_l2_coalescing", ("complete_tx::bytes.L2::cache_hint", "complete_tx::bytes [")),
    ("probe_launch", ("griddepcontrol.wait",))])
def test_probes_compile_and_need_a_gpu(tmp_path, name, marks):
    """Each probe's CUDA source compiles for sm_90a where nvcc is installed (with the instructions it is
    about in its PTX); without a GPU the script says so and exits 1."""
    import torch

    probe = _load_bench(name)
    nvcc = _load_bench("probe_cuda").find_nvcc()
    if nvcc:
        subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-ptx", "-o", str(tmp_path / "p.ptx"), probe.SOURCE],
                       check=True, timeout=300)
        ptx = (tmp_path / "p.ptx").read_text()
        assert all(m in ptx for m in marks)
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would probe")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", name + ".py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "nothing probed" in r.stdout


def test_power_fused_gemm_reads_nvidia_smi_and_needs_a_gpu():
    """nvidia-smi's CSV lines -> (watts, MHz), others skipped; without a GPU: one line, exit 1."""
    import pytest
    import torch

    power = _load_bench("power_fused_gemm")
    assert power.parse_line("693.12, 1425\n") == (693.12, 1425.0)
    assert power.parse_line("[N/A], 1425") is None and power.parse_line("power.draw [W], clocks.sm [MHz]") is None
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would measure")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "power_fused_gemm.py"), "--op", "ag", "--shapes",
                        "256x512x256"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "nothing measured" in r.stdout
