"""The MoE GPU cases: torchrun of tests/gpu_moe_worker.py with two ranks (FLUX_TEST_MOE_WORLD: more)
(NCCL on two GPUs; with one GPU the two ranks share it through gloo, correctness only). Skipped
without a GPU."""
import json
import os
import sys

import pytest
import torch

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)
WORKER = os.path.join(TESTS_DIR, "gpu_moe_worker.py")
# Ranks (FLUX_TEST_MOE_WORLD, default 2): more ranks than GPUs share them (gloo, correctness only).
WORLD = int(os.environ.get("FLUX_TEST_MOE_WORLD", "2"))


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
    from _dist import run_torchrun

    out = tmp_path_factory.mktemp("moe")
    _, output = run_torchrun(WORKER, ["all"], WORLD, out, 600, "gpu-moe-worker.log")
    recs = {}
    for rank in range(WORLD):
        path = out / f"moe.{rank}"
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line.split(" ", 1)[1])
                recs.setdefault(r["case"], {})[rank] = r
    return recs, output[-4000:]


@pytest.mark.parametrize("name", _case_names())
def test_gpu_moe_symm(moe_results, name):
    recs, log = moe_results
    got = recs.get(name)
    assert got and len(got) == WORLD, f"case {name} did not finish on all {WORLD} ranks:\n{log}"
    if all(r["status"] == "skip" for r in got.values()):
        pytest.skip(got[0]["error"])
    bad = {rk: r["error"] for rk, r in got.items() if r["status"] != "ok"}
    assert not bad, f"{name} failed: {bad}"
