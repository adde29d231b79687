"""bench/bench_moe.py and bench/bench_moe_tp.py keep running: on the CPU (gloo, two processes, tiny
sizes) they check that flux.moe_dispatch / moe_combine and the MoE layer agree with the all-to-all
baseline, and the tensor-parallel MoE ops with their references, and write every figure to the
JSON."""
import json
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
sys.path.insert(0, TESTS_DIR)


def run_bench(script, args, tmp_path):
    """(the JSON, the console output) of ``torchrun --nproc_per_node=2 bench/<script> --cpu
    <args> --steps 2 --rounds 1 --warmup 1 --out ...``, after checking it exited with 0."""
    from _dist import free_port

    out = tmp_path / (script + ".json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(REPO, "bench", script), "--cpu", *args, "--steps", "2", "--rounds", "1", "--warmup", "1",
           "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.load(open(out))
    assert script in data["metadata"]["command"]
    return data, proc.stdout


def test_bench_moe_runs_on_cpu(tmp_path):
    data, stdout = run_bench("bench_moe.py", ["--tokens", "8,24", "--hidden", "16", "--topk", "1,2", "--experts", "4",
                                              "--routing", "uniform,skewed", "--ffn", "8"], tmp_path)
    recs = data["results"]
    assert len(recs) == 8 and all(r["status"] == "ok" for r in recs), recs
    for r in recs:
        assert r["bounded_status"] == "ok" and r["remote_bytes"] > 0, r
        for name in ("flux", "a2a", "flux_bounded"):
            for op in ("dispatch", "combine"):
                assert r[name][op]["loop_ms"] > 0 and r[name][op]["gbps_loop"] > 0, (name, op, r)
        assert r["flux_bounded"]["dispatch"]["graph_status"] == "cpu"
        assert r["layer"]["rel_err"] < 1e-5 and r["layer"]["flux"]["loop_ms"] > 0, r
    assert "layer ms" in stdout.splitlines()[-len(recs) - 2]  # the table, printed last


def test_bench_moe_tp_runs_on_cpu(tmp_path):
    """bench/bench_moe_tp.py on gloo: every variant agrees with the references and is timed."""
    data, stdout = run_bench("bench_moe_tp.py", ["--tokens", "16", "--shapes", "32x16x4x2,16x8x6x3"], tmp_path)
    recs = data["results"]
    assert len(recs) == 2 and all(r["status"] == "ok" for r in recs), recs
    for r in recs:
        assert r["rows"] > 0 and r["choice"] == "sequential", r  # gloo: no overlap chosen
        for mode in ("fwd", "fwdbwd"):
            assert "decomposed" not in r[mode], r[mode]  # GPU only
            for v in ("ref", "sequential", "chunked", "flux"):
                t = r[mode][v]
                assert t["rel_err"] < 1e-5 and t["loop_ms"] > 0 and t["host_ms"] > 0, (mode, v, t)
                assert t["single_ms"] is None, t  # GPU only
    assert "flux/ref" in stdout


def test_bench_moe_cpu_defaults_to_smoke_sizes():
    """``bench_moe.py --cpu`` with no sizes takes smoke sizes (the GPU grid would run for hours on
    the CPU); without --cpu the GPU grid. Parsed in a child process: the script sets RANK and
    friends when imported."""
    code = ("import sys; sys.path.insert(0, 'bench'); import bench_moe as b; "
            "c, g = b.parse_args(['--cpu']), b.parse_args([]); "
            "print([(a.tokens, a.hidden, a.topk, a.experts, a.ffn) for a in (c, g)])")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stdout[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str([("16", "32", "2", "4", 16), ("128,4096", "7168", "2,8", "8,64",
                                                                                       2048)])


def test_gemm_floors_agree_when_one_expert_holds_every_row():
    """bench_moe.gemms_only (the layer's grouped GEMMs, forward and backward) and its dense variant
    (the same FLOPs as one GEMM per weight) run on the CPU, and where every pair is routed to expert
    0 they compute the same product and the same gradient of expert 0's weights (the dense floor
    measures the grouped one's per-group cost, not other arithmetic); the table prints their ratio."""
    import types

    import torch

    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_moe

    gen = torch.Generator().manual_seed(3)
    e, h, f, rows = 4, 32, 16, 48
    layer = types.SimpleNamespace(
        hidden=h, ffn=f,
        w13=torch.nn.Parameter(torch.randn(e, 2 * f, h, generator=gen).to(torch.bfloat16)),
        w2=torch.nn.Parameter(torch.randn(e, h, f, generator=gen).to(torch.bfloat16)))
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    idx = torch.zeros(rows, 1, dtype=torch.int64)
    got = {}
    for dense in (False, True):
        layer.w13.grad = layer.w2.grad = None
        step = bench_moe.gemms_only(layer, x, idx, dense=dense)
        y = step()
        w13, w2 = step.weights
        got[dense] = (y.float(), w13.grad.reshape(-1, 2 * f, h)[0].float().clone(),
                      w2.grad.reshape(-1, h, f)[0].float().clone())
    assert layer.w13.grad is None and layer.w2.grad is None  # dense: no gradient of the full parameters
    for a, b in zip(got[False], got[True]):
        assert torch.isfinite(a).all() and a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    # routed over every expert, the grouped floor gives each expert's rows its own weights
    idx = torch.arange(rows).remainder(e).unsqueeze(1)
    y = bench_moe.gemms_only(layer, x, idx)()
    assert not torch.allclose(y.float(), got[True][0], rtol=2e-2, atol=2e-2)
    rec = {"status": "ok", "tokens": rows, "hidden": h, "topk": 1, "experts": e,
           "layer": {"flux": {"loop_ms": 2.0}, "grouped": {"loop_ms": 3.0}, "gemms": {"loop_ms": 1.5},
                     "dense": {"loop_ms": 1.2}}}
    table = bench_moe.layer_table([rec])
    assert "gemms/dense" in table and "1.25" in table.splitlines()[1], table
