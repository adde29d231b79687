"""The launch configurations of the MoE kernels (csrc/moe/moe_local.cu, moe_swiglu.cu) against an
sm_90 SM's limits, on CPU, from the sources: every kernel carries ``__launch_bounds__`` no smaller
than the block it is launched with (so ptxas keeps threads x registers within the 65536-register
file), is checked by ``moe_launch::check`` before its launch (the host-side error naming the op),
and the shared memory and grid of each launch stay within 48 KB and [1, 2^31 - 1] for every
(T, E <= 1024, K <= 64) the ``local`` strategy accepts. The GPU side of the same limits is the
check itself (tests/test_moe_local.py runs every kernel)."""
import math
import os
import re

import pytest

from flux.ops.moe import local as _moe_local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["csrc/moe/moe_local.cu", "csrc/moe/moe_swiglu.cu"]
REGISTERS_PER_SM = 65536
MAX_THREADS = 1024
SMEM_PER_BLOCK = 48 * 1024


def _source(path):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    return re.sub(r"//[^\n]*", "", text)  # comments name kernels too


def _constants(text):
    """The file's ``constexpr`` integers, evaluated in order."""
    env = {}
    for name, expr in re.findall(r"constexpr\s+(?:int|int64_t|size_t)\s+(k\w+)\s*=\s*([^;]+);", text):
        expr = expr.replace("/", "//")
        try:
            env[name] = eval(expr, {"__builtins__": {}}, dict(env))  # constants of the file only
        except (NameError, SyntaxError):  # per-type ones (sizeof(scalar_t))
            pass
    return env


def _kernels(text):
    """{kernel name: its __launch_bounds__ expression} for every __global__ function."""
    found = {}
    for m in re.finditer(r"__global__\s+void\s+(__launch_bounds__\(([^)]*)\)\s+)?(\w+)\s*\(", text):
        found[m.group(3)] = m.group(2)
    return found


@pytest.mark.parametrize("path", SOURCES)
def test_every_kernel_is_bounded_and_checked(path):
    text = _source(path)
    env = _constants(text)
    kernels = _kernels(text)
    assert kernels, path
    for name, bound in kernels.items():
        assert bound is not None, f"{path}: {name} has no __launch_bounds__"
        threads = eval(bound, {"__builtins__": {}}, dict(env))
        assert 32 <= threads <= MAX_THREADS and threads % 32 == 0, (name, threads)
        # ptxas holds the kernel to REGISTERS_PER_SM // threads registers (at most 255) per thread
        assert REGISTERS_PER_SM // threads >= 32, (name, threads)
        launches = re.findall(rf"\b{name}(?:<[^<>]*>)?<<<\s*([^,]+),\s*([^,]+),", text)
        checks = re.findall(rf'moe_launch::check\(op,\s*"{name}",\s*{name}(?:<[^<>]*>)?,\s*([^,]+),\s*([^,]+),', text)
        assert launches, f"{path}: {name} is never launched"
        assert len(checks) == len(launches), f"{path}: a launch of {name} is not checked first"
        for grid, block in launches:
            block = block.strip()
            if block in env:
                assert env[block] <= threads, (name, block)
            else:  # a computed block: min(bound, ...) at its definition
                assert re.search(rf"{block}\s*=\s*static_cast<int>\(std::min<int64_t>\({bound},", text), (name, block)


def test_layout_shared_memory_and_grid_for_accepted_shapes():
    env = _constants(_source("csrc/moe/moe_local.cu"))
    # the Python gate (fits) and the kernels agree on what is accepted
    assert env["kMaxLocalExperts"] == _moe_local._MAX_EXPERTS and env["kMaxTopk"] == _moe_local._MAX_TOPK
    assert env["kCombineThreads"] >= env["kMaxTopk"]  # combine stages a token's K rows, one per thread
    pairs = env["kPairsPerBlock"]
    shapes = [(0, 1, 1), (1, 1, 1), (64, 8, 2), (300, 64, 8), (128, 64, 8), (4096, 64, 8), (4096, 1024, 64),
              (1, env["kMaxLocalExperts"], env["kMaxTopk"]), (1 << 20, 256, 8), (300, 16, 6), (65536, 1, 7)]
    for t, e, k in shapes:
        blocks = max(1, math.ceil(t * k / pairs))
        assert 1 <= blocks <= 2**31 - 1
        assert e * 4 + 64 <= SMEM_PER_BLOCK  # count_kernel: int32 [E] (+ its verdict word)
        assert env["kLayoutWarps"] * e * 4 <= SMEM_PER_BLOCK  # place_kernel: int32 [warps, E]
        # bounded_rows_kernel: int32 [warps + 2, E] dynamic, int64 [kPairsPerBlock] rows and its verdict word
        assert (env["kLayoutWarps"] + 2) * e * 4 + pairs * 8 + 64 <= SMEM_PER_BLOCK
        # its count blocks hold whole tokens (pairs - pairs % K of them); its grid (count blocks times
        # parts, kFusedBlocksPerSm per SM at most per count block) stays within a grid's x dimension
        whole = pairs - pairs % k
        fused_blocks = max(1, math.ceil(t * k / whole))
        if fused_blocks * e <= env["kFusedCounts"]:
            assert whole >= pairs // 2 and fused_blocks * (1 + 1024 * env["kFusedBlocksPerSm"]) <= 2**31 - 1
    # scan_kernel: int64 [kMaxLocalExperts] totals plus cub's scan storage (a few words per warp)
    assert env["kMaxLocalExperts"] * 8 + 64 * (env["kScanThreads"] // 32) * 8 <= SMEM_PER_BLOCK
    assert env["kScanThreads"] * env["kScanItems"] == env["kMaxLocalExperts"]
