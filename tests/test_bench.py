"""The benchmarks keep running: bench/bench_layers.py on the CPU (gloo, two processes, tiny sizes),
where it checks that the flux block's output and gradients match the NCCL-style block's, and draws
its plot from the JSON."""
import os
import subprocess
import sys

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
