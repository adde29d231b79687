"""The strategy tables (flux/strategies.py) against the C++ side, and their rules, on CPU."""
import os
import re

import torch

from flux import fused_configs, strategies
from flux.autotune import kernel_configs as KC
from flux.strategies import OP_CODES, STRATEGY_CODES, TABLES, Problem, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _enum(text, name):
    body = re.search(r"enum class %s : int64_t \{([^}]*)\}" % name, text).group(1)
    return {k.strip(): int(v) for k, v in (item.split("=") for item in body.split(","))}


def test_header_is_generated_from_the_tables():
    assert _read("csrc/runtime/strategies.h") == strategies.cxx_header(), \
        "run: python -m flux.strategies > csrc/runtime/strategies.h"


def test_cxx_enums_match_the_tables():
    header = _read("csrc/runtime/strategies.h")
    camel = strategies._camel
    assert _enum(header, "StrategyKind") == {camel(n): c for n, c in STRATEGY_CODES.items()}
    assert _enum(header, "OpKind") == {camel(n): c for n, c in OP_CODES.items()}
    # No hand-written copy of the enums elsewhere in the runtime; its dispatch expands the table.
    for path in ("csrc/runtime/runtime.h", "csrc/runtime/runtime.cpp", "csrc/runtime/plans.cpp",
                 "csrc/common/module.cpp"):
        assert "enum class StrategyKind" not in _read(path) and "enum class OpKind" not in _read(path), path
    assert "FLUX_PLAN_STRATEGIES(" in _read("csrc/runtime/plans.cpp")
    rows = re.findall(r"^  X\((\w+), (\w+), (\w+)\)", header, re.M)
    assert len(rows) == sum(len(t) for t in TABLES.values())
    sources = "".join(_read(os.path.join(d, f)) for d in ("csrc/runtime", "csrc/ag_gemm", "csrc/gemm_rs")
                      for f in os.listdir(os.path.join(ROOT, d)) if f.endswith((".cpp", ".cu")))
    for _, _, member in rows:  # declared through the header's list; each defined once
        assert re.search(r"Runtime::%s\(" % member, sources), f"Runtime::{member} is not defined"


def _p(op="ag_gemm", **kw):
    args = dict(op=op, m=8192, n=8192, k=8192, dtype=torch.bfloat16, world=2)
    args.update(kw)
    return Problem(**args)


def test_fallback_chains():
    steps = []
    log = lambda *a: steps.append(a)  # noqa: E731
    assert resolve(_p(sm90=False), "fused", {"config": 1}, log) == ("decomposed", {})
    assert steps[-1][0] == "fused" and steps[-1][2] == "decomposed"
    assert resolve(_p(device_type="cpu"), "fused", {}, log) == ("sequential", {})
    assert resolve(_p(no_symm="no symmetric memory"), "oneshot", {}, log) == ("sequential", {})
    # first8 splits two ranks' rows only; elsewhere decomposed runs whole blocks.
    assert resolve(_p(world=4), "decomposed", {"first8": 6}, log) == ("decomposed", {})
    assert resolve(_p(), "decomposed", {"first8": 6}, log) == ("decomposed", {"first8": 6})
    assert resolve(_p(m=2), "decomposed", {"first8": 4}, log) == ("decomposed", {})  # 1 row: no split
    assert resolve(_p(dtype=torch.float64), "fused", {}, log) == ("sequential", {})
    assert resolve(_p(out_dtype_differs=True, dtype=torch.float32), "decomposed", {}, log) == ("sequential", {})


def test_every_space_point_is_in_its_domain():
    for op, table in TABLES.items():
        for s in table.values():
            assert s.fallback is None or s.fallback in table
            for kw in s.space:
                assert strategies.param_error(op, s.name, kw) is None, (op, s.name, kw)


def test_fused_tiles_come_from_the_kernel_table():
    for op, key in (("ag_gemm", "ag"), ("gemm_rs", "rs")):
        assert strategies.FUSED_TILE_M[op] == {c.id: (c.tile_m, c.cluster_m) for c in fused_configs.CONFIGS[key]}


def test_one_fused_candidate_per_op():
    from flux.autotune.space import Candidate, _space

    for op in TABLES:
        assert [c for c in _space(op) if c.strategy == "fused"] == [Candidate("fused")]


def _built_only(monkeypatch, text):
    """flux._C reporting ``text`` as its built fused kernels."""
    monkeypatch.setattr(torch.ops.flux, "fused_kernels_built", lambda: text, raising=False)
    KC.reset()


def test_fused_eligibility_follows_the_built_kernels(monkeypatch):
    """fp16 in, fp32 out from bf16/fp16: fused where a kernel is built for that pair (the
    table filtered by flux._C's list), else decomposed with the reason logged."""
    steps = []
    log = lambda *a: steps.append(a)  # noqa: E731
    try:
        _built_only(monkeypatch, "ag:0:bf16 ag:5:fp16 rs:0:bf16_fp32 rs:4:bf16")
        wide = dict(out_dtype_differs=True, out_dtype=torch.float32)
        assert resolve(_p(dtype=torch.float16), "fused", {}, log) == ("fused", {})
        assert resolve(_p("gemm_rs", dtype=torch.float16), "fused", {"segments": 16}, log) == ("decomposed", {})
        assert "no fused gemm_rs kernel is built for torch.float16 -> torch.float16" in steps[-1][1]
        assert resolve(_p("gemm_rs", **wide), "fused", {}, log) == ("fused", {})
        assert resolve(_p("gemm_rs", dtype=torch.float16, **wide), "fused", {}, log)[0] == "decomposed"
        assert resolve(_p(**wide), "fused", {}, log)[0] == "decomposed"
        # A configuration not built for the dtypes: the plan takes the kernel tuner's choice.
        assert resolve(_p(dtype=torch.float16), "fused", {"config": 0, "swizzle": 1}, log) == ("fused", {"swizzle": 1})
        assert "configuration 0 is not built" in steps[-1][1]
        assert resolve(_p(dtype=torch.float16), "fused", {"config": 5}, log) == ("fused", {"config": 5})
        _built_only(monkeypatch, "")  # flux._C built without fused kernels
        assert resolve(_p(), "fused", {}, log)[0] == "decomposed"
    finally:
        KC.reset()


def test_fused_excluded_where_ranks_share_a_gpu_beyond_two():
    steps = []
    log = lambda *a: steps.append(a)  # noqa: E731
    for op in TABLES:
        assert resolve(_p(op, shared_gpu=True), "fused", {}, log) == ("fused", {})  # two ranks: pushes go first
        assert resolve(_p(op, world=4, shared_gpu=True), "fused", {}, log) == ("decomposed", {})
        assert "ranks share a GPU" in steps[-1][1]
        assert resolve(_p(op, world=4), "fused", {}, log) == ("fused", {})


def test_one_dtype_code_table():
    from flux.ops import _checks, _plans

    assert _plans.DTYPE_CODES is strategies.DTYPE_CODES
    assert _checks.dtype_code(torch.bfloat16) == strategies.DTYPE_CODES[torch.bfloat16] == 15
    assert _checks.dtype_code(None) == -1 and _checks.describe("out_dtype", -1) == "None"
    assert _checks.describe("x.dtype", 5) == "float16"


def test_fused_plan_parameters_come_from_the_kernel_tuner():
    """A 'fused' plan without config: (config, raster, swizzle) of choose_config for the kernel's
    rows (ag_gemm: all gathered rows; gemm_rs: one rank's block)."""
    from flux.autotune import kernels
    from flux.ops import _plans

    from flux.ops._common import problem_of

    x, w = torch.zeros(1024, 512, dtype=torch.bfloat16), torch.zeros(4096, 512, dtype=torch.bfloat16)
    for op, m, key in (("ag_gemm", 4096, "ag"), ("gemm_rs", 256, "rs")):
        want = kernels.choose_config(key, m, 4096, 512, torch.bfloat16, torch.bfloat16, torch.device("cpu"))
        p = problem_of(op, x, w, "nk", None, 4, 4096 if op == "ag_gemm" else 1024)
        got = _plans.kernel_params(p, torch.device("cpu"))
        assert (got["config"], got["raster"], got["swizzle"]) == want
    assert strategies.PARAM_ORDER[-1] == "raster" and strategies.PARAM_DEFAULTS["raster"] == 1


def test_former_strategy_names_are_read_as_the_current_ones(monkeypatch):
    """One vocabulary across the op families: the MoE families' former names (``all_to_all``,
    TP MoE's ``symm``) are read as ``sequential`` / ``decomposed`` in one table; every alias names
    a current strategy of its family and is not itself one (MoE's own ``symm`` stays a name)."""
    from flux.ops import moe, moe_tp
    from flux.strategies import STRATEGY_ALIASES, canonical_strategy

    current = {"moe": moe.STRATEGIES, "moe_tp": moe_tp.STRATEGIES}
    assert set(STRATEGY_ALIASES) <= set(current)
    for family, aliases in STRATEGY_ALIASES.items():
        for old, new in aliases.items():
            assert new in current[family] and old not in current[family], (family, old, new)
    assert canonical_strategy("moe", "all_to_all") == "sequential"
    assert canonical_strategy("moe", " symm ") == "symm"  # MoE's SM-driven strategy keeps its name
    assert canonical_strategy("moe_tp", "symm") == "decomposed"
    assert canonical_strategy("moe_tp", "chunked") == "chunked"
    assert canonical_strategy("moe_tp", "nccl") == "nccl"  # unknown names are the caller's to reject
    assert canonical_strategy("moe", None) == ""
    # The environment variables go through it: FLUX_STRATEGY_MOE ...
    monkeypatch.setenv("FLUX_STRATEGY_MOE", " all_to_all ")
    assert moe.strategies._forced() == "sequential"
    monkeypatch.setenv("FLUX_STRATEGY_MOE", "symm")
    assert moe.strategies._forced() == "symm"
    # ... and FLUX_STRATEGY_MOE_TP (the workspace's availability stubbed: that needs GPUs).
    from flux.ops.moe import tp_routing
    monkeypatch.setattr(tp_routing, "decomposed_usable", lambda device, group: None)
    for name in ("symm", "decomposed"):
        monkeypatch.setenv("FLUX_STRATEGY_MOE_TP", name)
        assert moe_tp._choose_strategy(torch.device("cpu"), None, 1, 1) == ("decomposed", None)
    monkeypatch.setenv("FLUX_STRATEGY_MOE_TP", "all_to_all")  # a former name of the other family only
    assert moe_tp._choose_strategy(torch.device("cpu"), None, 1, 1)[1] is not None


def test_automatic_moe_choices_follow_the_two_gpu_measurements(monkeypatch):
    """docs/performance.md §11: at two GPUs the unbounded ``symm`` path and the overlapped TP MoE
    strategies lost to the all-to-all / ``sequential`` in every measured cell. So, on a CUDA NCCL
    group with a symmetric workspace (stubbed here: no GPU needed): MoE's bounded calls take
    ``symm`` and unbounded ones ``sequential``; TP MoE overlaps from three ranks only, above its
    shard threshold."""
    import torch.distributed as dist

    from flux.ops.moe import strategies as moe_strategies
    from flux.ops.moe import tp_routing

    monkeypatch.delenv("FLUX_STRATEGY_MOE", raising=False)
    monkeypatch.delenv("FLUX_STRATEGY_MOE_TP", raising=False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(moe_strategies, "group_device", lambda group: cuda)
    monkeypatch.setattr(moe_strategies._moe_local, "usable", lambda group, dev: "a group of more than one rank")
    monkeypatch.setattr(moe_strategies._moe_symm, "usable", lambda group, dev: None)
    x = torch.empty(1)
    assert moe_strategies._choose_strategy(x, None, True) == "symm"
    assert moe_strategies._choose_strategy(x, None, False) == "sequential"
    monkeypatch.setenv("FLUX_STRATEGY_MOE", "symm")  # still there when asked for
    assert moe_strategies._choose_strategy(x, None, False) == "symm"

    world = {"n": 2}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world["n"])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(tp_routing, "decomposed_usable", lambda device, group: None)
    big = tp_routing.OVERLAP_MIN_SHARD  # T_l * H at the threshold
    assert tp_routing._choose_strategy(cuda, None, big, 1) == ("sequential", None)
    for n in (3, 4, 8):
        world["n"] = n
        assert tp_routing._choose_strategy(cuda, None, big, 1) == ("decomposed", None)
        assert tp_routing._choose_strategy(cuda, None, big - 1, 1) == ("sequential", None)
