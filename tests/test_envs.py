"""flux/envs.py declares every FLUX_* variable, and flux reads them there (CPU)."""
import os
import re

from flux import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Modules that still read FLUX_* variables themselves, to move onto flux.envs.
NOT_YET = set()


def _sources():
    for base, _, files in os.walk(os.path.join(ROOT, "flux")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                yield os.path.relpath(path, ROOT), open(path).read()


def test_every_variable_is_declared():
    named = set()
    for _, text in _sources():
        named |= set(re.findall(r"\bFLUX_[A-Z0-9_]*[A-Z0-9]\b", text))
    named -= {"FLUX_STRATEGY", "FLUX_CLASSES", "FLUX_PLAN_STRATEGIES"}  # a prefix; names, not variables
    assert named <= set(envs.VARS), sorted(named - set(envs.VARS))


def test_read_in_one_place():
    readers = {path for path, text in _sources()
               if re.search(r"os\.environ(\.get)?[\[(]\s*(f?\"FLUX_|[A-Z_]*ENV\b)", text) and path != "flux/envs.py"}
    assert readers <= NOT_YET, sorted(readers - NOT_YET)


def test_defaults_and_parsing(monkeypatch):
    monkeypatch.delenv("FLUX_TIMEOUT_MS", raising=False)
    assert envs.TIMEOUT_MS.get() == 30000
    monkeypatch.setenv("FLUX_TIMEOUT_MS", "500")
    assert envs.TIMEOUT_MS.get() == 500
    monkeypatch.setenv("FLUX_CHECK_EVERY_CALL", "1")
    assert envs.CHECK_EVERY_CALL.get() is True
    monkeypatch.setenv("FLUX_STRATEGY_GEMM_RS", "decomposed(chunks=2)")
    assert envs.forced_strategy("gemm_rs") == "decomposed(chunks=2)"
