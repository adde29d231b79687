"""The README's commands on a machine without a GPU: each runs its CPU path or stops with one line
saying what to do, never with a traceback. CUDA_VISIBLE_DEVICES="" hides any GPU, so these run
alike everywhere. (The benchmarks' --cpu smoke runs are tests/test_bench.py and
tests/test_bench_moe.py.)"""
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
sys.path.insert(0, TESTS_DIR)


def _run(args, tmp_path, torchrun=True, timeout=240):
    from _dist import free_port

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", FLUX_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
                             if torchrun else []), *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env,
                          cwd=str(tmp_path))
    return proc.returncode, proc.stdout


def _no_traceback(out):
    """No traceback from the command itself: under torchrun a worker's non-zero exit makes the
    launcher print its own (ChildFailedError), which is not the command's."""
    import re

    frames = [line for line in out.splitlines()
              if line.strip().startswith(f'File "{REPO}') and "site-packages" not in line]  # a venv inside the repo
    errors = [m for m in re.findall(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception))\b", out, re.M)
              if m != "ChildFailedError"]
    assert not frames and not errors, out[-4000:]


@pytest.mark.parametrize("script", ["bench_ops.py", "bench_layers.py", "bench_moe.py", "bench_moe_tp.py"])
def test_bench_without_gpu_stops_with_one_line(script, tmp_path):
    rc, out = _run([os.path.join(REPO, "bench", script), "--out", str(tmp_path / "r.json")], tmp_path)
    assert rc != 0, out[-4000:]
    _no_traceback(out)
    lines = [line for line in out.splitlines() if "no CUDA device" in line]
    assert lines, out[-4000:]
    if script != "bench_ops.py":  # the others have a CPU smoke run
        assert all("--cpu" in line for line in lines), lines


def test_autotune_suite_without_gpu_runs_the_cpu_path(tmp_path):
    rc, out = _run(["-m", "flux.autotune", "--suite", "--ops", "ag_gemm", "--scale-down", "64", "--warmup", "0",
                    "--iters", "1"], tmp_path)
    assert rc == 0, out[-4000:]
    _no_traceback(out)
    assert "no CUDA device here; tuning the CPU path" in out, out[-4000:]
    assert "shapes in" in out and os.listdir(tmp_path / "cache"), out[-4000:]


@pytest.mark.parametrize("shapes,expect", [("ag_gemm:64x64", "is not MxKxN"), ("ag_gem:64x64x64", "unknown op"),
                                           ("ag_gemm:63x64x64", "not a multiple of the world size")])
def test_autotune_bad_shapes_stop_with_one_line(shapes, expect, tmp_path):
    rc, out = _run(["-m", "flux.autotune", "--cpu", "--shapes", shapes], tmp_path)
    assert rc != 0, out[-4000:]
    _no_traceback(out)
    assert any(line.startswith("flux.autotune:") and expect in line for line in out.splitlines()), out[-4000:]


def test_report_help_and_bad_file(tmp_path):
    rc, out = _run([os.path.join(REPO, "bench", "report.py"), "--help"], tmp_path, torchrun=False)
    assert rc == 0 and "usage:" in out, out
    rc, out = _run([os.path.join(REPO, "bench", "report.py"), str(tmp_path / "missing.json")], tmp_path,
                   torchrun=False)
    assert rc == 2 and "not a readable bench_ops.py JSON file" in out, out
    _no_traceback(out)


@pytest.mark.parametrize("version", ["0.16.1", "0.18.0rc1"])
def test_megatron_integration_refuses_old_megatron_core(version, tmp_path):
    """An unsupported megatron-core (a stand-in package of that version) is refused at import with
    one line naming the installed version and the supported range."""
    pkg = tmp_path / "fake" / "megatron" / "core"
    pkg.mkdir(parents=True)
    (tmp_path / "fake" / "megatron" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), REPO]))
    proc = subprocess.run([sys.executable, "-c", "import flux.integrations.megatron"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and version in last and ">= 0.19" in last, proc.stdout[-2000:]


def test_import_flux_is_light_and_lazy_names_resolve():
    """``import flux`` does not import torch._dynamo (seconds: the import-time budget is measured
    with farm-bench, not here); the names imported on first use resolve."""
    code = ("import sys, flux; assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'; "
            "assert callable(flux.integrations.compile.stats); "
            "from flux import ag_scatter_grouped_mm, TpMoeRouting; import flux.ops; "
            "assert flux.ops.moe_tp.ag_scatter_grouped_mm is ag_scatter_grouped_mm; "
            "assert set(flux.__all__) <= set(dir(flux))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:]


@pytest.mark.parametrize("script", ["bench_layers.py", "bench_moe_tp.py"])
def test_bench_cpu_defaults_are_smoke_sizes(script, tmp_path):
    """``--cpu`` without sizes runs the smoke sizes (the GPU grid would compute for hours on a CPU)."""
    out = tmp_path / "r.json"
    rc, text = _run([os.path.join(REPO, "bench", script), "--cpu", "--steps", "2", "--rounds", "1", "--warmup", "1",
                     "--out", str(out)], tmp_path)
    assert rc == 0, text[-4000:]
    _no_traceback(text)
    assert out.exists(), text[-4000:]


def test_built_extension_loads_the_shared_libstdcxx():
    """Where flux._C is built (pip install with CUDA): it loads libstdc++ as a shared library,
    the one torch uses. A static copy inside it (what some toolchains link by default) crashes the
    process on the first number formatted into an error message; setup.py names the loaded
    libstdc++ on the link line (_loaded_libstdcxx)."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("flux._C")
    if spec is None or not spec.origin:
        pytest.skip("flux._C is not built (FLUX_BUILD_CUDA=0 or no CUDA toolchain)")
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run([readelf, "-d", spec.origin], capture_output=True, text=True).stdout
    assert "libstdc++.so" in dynamic, f"{spec.origin} does not load libstdc++.so:\n{dynamic}"
