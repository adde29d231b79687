"""The strategy tables (flux/strategies.py) against the C++ side, and their rules, on CPU."""
import os
import re

import torch

from flux import strategies
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
    assert resolve(_p("gemm_rs", dtype=torch.float16), "fused", {"segments": 16}, log) == ("decomposed", {})
    assert resolve(_p(out_dtype_differs=True, dtype=torch.float32), "decomposed", {}, log) == ("sequential", {})


def test_every_space_point_is_in_its_domain():
    for op, table in TABLES.items():
        for s in table.values():
            assert s.fallback is None or s.fallback in table
            for kw in s.space:
                assert strategies.param_error(op, s.name, kw) is None, (op, s.name, kw)
