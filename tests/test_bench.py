"""The benchmarks keep running: bench/bench_mlp.py on the CPU (gloo, two processes, tiny sizes),
where it checks that the flux block's output and gradients match the NCCL-style block's."""
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
sys.path.insert(0, TESTS_DIR)


def test_bench_mlp_runs_on_cpu(tmp_path):
    from _dist import free_port

    out = tmp_path / "mlp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(REPO, "bench", "bench_mlp.py"), "--cpu", "--sizes", "64x128", "--tokens", "32,64",
           "--steps", "2", "--rounds", "2", "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    import json

    recs = json.load(open(out))["results"]
    assert [r["status"] for r in recs] == ["ok", "ok"], recs
    assert all(r["flux_rel_err"] < 1e-4 for r in recs), recs
