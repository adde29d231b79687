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


# moe_scatter_rows_ alone, in one process: the "workspaces" are ordinary tensors whose addresses
# the kernel gets as the device pointer array, as it gets the symmetric buffers' bases.
_SCATTER_SCRIPT = r"""
import sys, torch, flux
from flux.runtime import extension
assert extension.cuda_kernels_available(), extension.extension_error()
W, CAP, H, N = 3, 40, 96, 64
g = torch.Generator(device="cuda").manual_seed(5)
src = torch.randn(N + 7, H, device="cuda", dtype=torch.bfloat16, generator=g)
src_rows = torch.randperm(N + 7, device="cuda", generator=g)[:N]
ranks = torch.randint(-1, W, (N,), device="cuda", generator=g)
rows = torch.empty(N, dtype=torch.int64, device="cuda")
for r in range(W):  # distinct rows per destination rank
    sel = (ranks == r).nonzero().flatten()
    rows[sel] = torch.randperm(CAP, device="cuda", generator=g)[:sel.numel()]
tags = torch.randint(0, 1 << 30, (N,), device="cuda", generator=g, dtype=torch.int32)
off, tag_off = 256, 256 + CAP * H * 2
bufs = [torch.full((tag_off + CAP * 4,), 0x7F, dtype=torch.uint8, device="cuda") for _ in range(W)]
ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
local = torch.full((CAP, H), float("nan"), dtype=torch.bfloat16, device="cuda")
rank, mode = 1, sys.argv[1]
if mode == "src":
    src_rows[int((ranks >= 0).nonzero()[0])] = N + 7
elif mode in ("dst", "local"):
    i = int((((ranks >= 0) & (ranks != rank)) if mode == "dst" else (ranks == rank)).nonzero()[0])
    rows[i] = CAP
torch.ops.flux.moe_scatter_rows_(src, src_rows, ranks, rows, tags, ptrs.data_ptr(), W, off, tag_off, local, rank, CAP)
torch.cuda.synchronize()
for r in range(W):
    sel = (ranks == r).nonzero().flatten()
    if r == rank:
        got = local[rows[sel]]
    else:
        got = bufs[r][off:tag_off].view(torch.bfloat16).view(CAP, H)[rows[sel]]
    assert torch.equal(got.view(torch.int16), src[src_rows[sel]].view(torch.int16)), f"rows to rank {r}"
    got_tags = bufs[r][tag_off:].view(torch.int32)[rows[sel]]
    assert torch.equal(got_tags, tags[sel]), f"tags to rank {r}"
    if r != rank:  # nothing else written into the region
        mask = torch.ones(CAP, dtype=torch.bool, device="cuda")
        mask[rows[sel]] = False
        rest = bufs[r][off:tag_off].view(CAP, H * 2)[mask]
        assert bool((rest == 0x7F).all()), f"rank {r}: rows written outside the routing"
print("scatter ok")
"""


@pytest.mark.parametrize("mode", ["ok", "src", "dst", "local"])
def test_gpu_scatter_rows_bounds(mode):
    """Rows land exactly where the routing says (every rank's region, local_out, tags), and a row
    index outside its buffer stops the kernel with a message naming the bound instead of writing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _SCATTER_SCRIPT, mode], capture_output=True, text=True, timeout=300,
                       env=env)
    out = p.stdout + p.stderr
    if mode == "ok":
        assert p.returncode == 0 and "scatter ok" in out, out[-3000:]
    else:
        assert p.returncode != 0 and "scatter ok" not in out, out[-3000:]
        what = {"src": "source", "dst": "destination", "local": "local_out"}[mode]
        assert f"has {what} row" in out and "outside [0," in out, out[-3000:]
