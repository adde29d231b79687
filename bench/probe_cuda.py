"""What the CUDA probes (bench/probe_*.cu) share: building one with nvcc, running it, reading its JSON
lines and writing the results file. Each probe prints one JSON line per variant it ran."""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def parser(doc: str, variants: str, fields: str, ctas: int, reps: int) -> argparse.ArgumentParser:
    """The probes' common options: --variants (default `variants`, each `fields` colon-separated),
    --ctas, --reps, --out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=variants, help=f"{fields}, comma-separated")
    p.add_argument("--ctas", type=int, default=ctas)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--out", default=None)
    return p


def find_nvcc():
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    cand = os.path.join(home, "bin", "nvcc")
    return cand if os.path.exists(cand) else shutil.which("nvcc")


def parse_lines(text: str):
    """The probe's JSON lines (one per variant), other lines ignored."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def usable(name: str):
    """nvcc's path where a GPU and nvcc are there; else says so (the probe's `name`) and returns None."""
    import torch

    nvcc = find_nvcc()
    if not torch.cuda.is_available() or nvcc is None:
        print(f"{name}: needs a CUDA GPU and nvcc; nothing probed")
        return None
    return nvcc


def build_and_run(nvcc: str, source: str, args, then=None):
    """(rows, what `then` returned): `source` built for sm_90a, run with `args`, its JSON lines; then
    `then(exe, rows)` while the binary exists. (None, None) where the run failed (its output printed)."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "probe")
        subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90a", "-o", exe, source], check=True)
        run = subprocess.run([exe, *args], capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stdout, run.stderr, sep="\n")
            return None, None
        rows = parse_lines(run.stdout)
        return rows, (then(exe, rows) if then else None)


def write(path: str, script: str, argv, rows, **extra) -> None:
    """The results file: format, command, commit, device, `extra`, the variants' rows."""
    import torch

    sys.path.insert(0, HERE)
    from bench_fused_gemm import commit

    cmd = "python " + " ".join(shlex.quote(a) for a in [script] + list(argv if argv is not None else sys.argv[1:]))
    doc = {"format": 1, "command": cmd, "commit": commit(), "device": torch.cuda.get_device_name(), **extra,
           "variants": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
