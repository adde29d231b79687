"""The symmetric-memory MoE strategy on GPUs: torchrun of tests/gpu_moe_worker.py with two ranks
(NCCL on two GPUs; with one GPU the two ranks share it through gloo, correctness only). Skipped
without a GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)
WORKER = os.path.join(TESTS_DIR, "gpu_moe_worker.py")


def _case_names():
    # The worker's cases, read without importing it (it sets process-wide environment variables).
    names = []
    with open(WORKER) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "@case" and lines[i + 1].startswith("def "):
            names.append(lines[i + 1][4:].split("(")[0])
    return names


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from _dist import free_port

    out = tmp_path_factory.mktemp("moe")
    env = dict(os.environ, FLUX_GPU_RESULTS_DIR=str(out), OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.dirname(TESTS_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           WORKER, "all"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    recs = {}
    for rank in range(2):
        path = out / f"moe.{rank}"
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line.split(" ", 1)[1])
                recs.setdefault(r["case"], {})[rank] = r
    return recs, proc.stdout[-4000:]


@pytest.mark.parametrize("name", _case_names())
def test_gpu_moe_symm(moe_results, name):
    recs, log = moe_results
    got = recs.get(name)
    assert got and len(got) == 2, f"case {name} did not finish on both ranks:\n{log}"
    if all(r["status"] == "skip" for r in got.values()):
        pytest.skip(got[0]["error"])
    bad = {rk: r["error"] for rk, r in got.items() if r["status"] != "ok"}
    assert not bad, f"{name} failed: {bad}"
