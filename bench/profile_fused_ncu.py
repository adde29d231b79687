"""The fused GEMM kernels and cuBLAS under Nsight Compute on one GPU: clock, cycles, memory traffic.

    python bench/profile_fused_ncu.py --cases "ag:1024x8192x14336:c2/r1/s1,c2/r1/s4;rs:2048x16384x8192:served" \
        --out ncu.json

A case is op:MxKxN (the kernel's own rows, K, N, as bench/bench_fused_gemm.py's shapes) and the
fused launches to profile: labels c<config>/r<raster>/s<swizzle>, or "served" (the library's
choice). Each case profiles torch.mm (cuBLAS) first, then its labels; every flag set, bf16; each
launch warmed up three times, then one launch inside the profiler's range, after a short GPU spin
(torch.cuda._sleep) that marks where the launch's kernels begin (a split-K launch has two).

The script runs itself under `ncu --profile-from-start off --clock-control none --cache-control
none`: clocks as the card sets them (under its power cap an H200 clocks down where a kernel moves
more bytes through HBM and L2: the SM frequency is part of the reading), caches as a loop of
launches leaves them. Each kernel is replayed once per metric pass, so durations are those of a
kernel run alone; compare kernels within one report. No GPU or no ncu: one line, exit 1.

--sass FILE: also the SASS of every profiled kernel with its per-instruction counters (ncu's source
page, CSV, as ncu prints it; gzip-compressed where FILE ends in .gz), the SourceCounters section added:
where cuBLAS's and the library's kernels differ instruction by instruction (the order and form of the
TMA loads, the tile-index arithmetic, the barrier waits).

JSON (--out): {"format": 1, "command", "commit", "device", "ncu", "sections", "cases": [{"op", "m",
"k", "n", "label" ("cublas" or the fused label; "served" resolved), "kernels": [{"name", "grid",
"block", "metrics": {"<section>/<metric> [unit]": value}}]}]}.
"""
import argparse
import csv
import glob
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "ComputeWorkloadAnalysis",
            "MemoryWorkloadAnalysis", "SchedulerStats")
MARK = "spin_kernel"  # torch.cuda._sleep's kernel: the mark before each profiled launch
SPIN_CYCLES = 1000


def parse_cases(text: str):
    """[(op, m, k, n, [labels])] from "op:MxKxN:label,label;..."."""
    cases = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            op, shape, labels = part.split(":", 2)
            m, k, n = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            raise SystemExit(f"profile_fused_ncu: bad case {part!r} (op:MxKxN:label,...)")
        if op not in ("ag", "rs"):
            raise SystemExit(f"profile_fused_ncu: bad op {op!r} in {part!r} (ag or rs)")
        cases.append((op, m, k, n, [x for x in labels.split(",") if x]))
    return cases


def child(cases) -> None:
    """Under ncu: every launch of every case, each after its mark, in the profiler's range."""
    import torch

    sys.path.insert(0, REPO)
    from flux.autotune import kernels as K
    from flux.autotune.kernel_timing import KernelProblem

    plan = []
    for op, m, k, n, labels in cases:
        pr = KernelProblem(op, m, n, k, torch.bfloat16, torch.bfloat16, torch.device("cuda"), max_sets=1)
        runs = [("cublas", pr.cublas()[0])]
        for lab in labels:
            if lab == "served":
                lab = K.label(*K.choose_config(op, m, n, k, torch.bfloat16, torch.bfloat16, None))
            runs.append((lab, pr.fused(*K.parse_label(lab))[0]))
        for lab, fn in runs:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda._sleep(SPIN_CYCLES)
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            plan.append({"op": op, "m": m, "k": k, "n": n, "label": lab})
        del pr
    print("PLAN " + json.dumps(plan), flush=True)


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def kernels_of(csv_text: str, sections: bool = True):
    """ncu's details page (CSV) -> {kernel ID: {"name", "grid", "block", "metrics": {"<section>/<metric>
    [unit]": value}}} (without the section where ``sections`` is false)."""
    kernels = {}
    for row in csv.DictReader(io.StringIO(csv_text)):
        if not row.get("ID"):
            continue
        kid = int(row["ID"])
        k = kernels.setdefault(kid, {"name": row["Kernel Name"], "grid": row.get("Grid Size"),
                                     "block": row.get("Block Size"), "metrics": {}})
        unit = f" [{row['Metric Unit']}]" if row.get("Metric Unit") else ""
        name = f"{row['Section Name']}/{row['Metric Name']}" if sections else row["Metric Name"]
        k["metrics"][name + unit] = _number(row["Metric Value"])
    return kernels


def parse_details(csv_text: str, plan):
    """ncu's details page (CSV) -> the plan's entries with their kernels, split at the marks."""
    kernels = kernels_of(csv_text)
    out, cur = [], None
    for kid in sorted(kernels):
        k = kernels[kid]
        if MARK in k["name"]:
            if len(out) == len(plan):
                raise SystemExit("profile_fused_ncu: more marks in the report than launches planned")
            cur = dict(plan[len(out)], kernels=[])
            out.append(cur)
        elif cur is not None:
            cur["kernels"].append(k)
    if len(out) != len(plan):
        raise SystemExit(f"profile_fused_ncu: {len(out)} marked launches in the report, {len(plan)} planned")
    return out


def write_sass(ncu: str, report: str, path: str) -> None:
    """ncu's source page of every kernel in `report` (SASS and its counters, CSV) into `path`."""
    run = subprocess.run([ncu, "-i", report, "--page", "source", "--print-source", "sass", "--csv"],
                         capture_output=True, text=True)
    text = run.stdout if run.returncode == 0 else ""
    if not text.strip():
        print(f"profile_fused_ncu: ncu printed no source page (rc {run.returncode}): {run.stderr[-400:]}")
    if path.endswith(".gz"):
        import gzip

        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


def details_page(ncu: str, report: str) -> str:
    """ncu's details page of `report` (CSV; kernels_of reads it)."""
    return subprocess.run([ncu, "-i", report, "--page", "details", "--csv"], capture_output=True, text=True,
                          check=True).stdout


def ncu_version(ncu: str):
    lines = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return lines[-1] if lines else None


def find_ncu():
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) +
                                        sorted(glob.glob("/usr/local/cuda*/bin/ncu"))), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", required=True, help='"op:MxKxN:label,...;..." (labels c<id>/r<r>/s<s> or served)')
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="ncu sections, comma-separated (e.g. add InstructionStats,SourceCounters)")
    p.add_argument("--metrics", default="",
                   help="further ncu metrics, comma-separated (ncu's --metrics: names or regex:...); they come "
                   "back under the section \"Command line profiler metrics\"")
    p.add_argument("--out", default=None)
    p.add_argument("--sass", default=None, metavar="FILE",
                   help="write every kernel's SASS with per-instruction counters (ncu's source page) to FILE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cases = parse_cases(args.cases)
    if args.child:
        child(cases)
        return 0
    import torch

    ncu = find_ncu()
    if not torch.cuda.is_available() or ncu is None:
        print("profile_fused_ncu: needs a CUDA GPU and Nsight Compute (ncu); nothing profiled")
        return 1
    sys.path.insert(0, HERE)
    from bench_fused_gemm import commit

    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "prof")
        cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none"]
        sections = [x for x in args.sections.split(",") if x]
        if args.sass and "SourceCounters" not in sections:
            sections.append("SourceCounters")
        for s in sections:
            cmd += ["--section", s]
        if args.metrics:
            cmd += ["--metrics", args.metrics]
        cmd += ["-o", rep, sys.executable, os.path.abspath(__file__), "--child", "--cases", args.cases]
        run = subprocess.run(cmd, capture_output=True, text=True)
        plan = [json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("PLAN ")]
        if run.returncode != 0 or not plan:
            print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
            print(f"profile_fused_ncu: ncu run failed (rc {run.returncode})")
            return 1
        details = details_page(ncu, rep + ".ncu-rep")
        if args.sass:
            write_sass(ncu, rep + ".ncu-rep", args.sass)
        version = ncu_version(ncu)
    got = parse_details(details, plan[0])
    doc = {"format": 1, "command": "python " + " ".join(shlex.quote(a) for a in ["bench/profile_fused_ncu.py"] +
                                                        list(argv if argv is not None else sys.argv[1:])),
           "commit": commit(), "device": torch.cuda.get_device_name(), "ncu": version,
           "sections": sections, "cases": got}
    keys = ("GPU Speed Of Light Throughput/SM Frequency", "GPU Speed Of Light Throughput/Elapsed Cycles",
            "GPU Speed Of Light Throughput/Duration", "GPU Speed Of Light Throughput/DRAM Throughput",
            "GPU Speed Of Light Throughput/L2 Cache Throughput")
    print(f"{'case':34s} {'label':12s} {'kernel':40s} " + " ".join(f"{k.split('/')[1][:12]:>12s}" for k in keys))
    for c in got:
        for k in c["kernels"]:
            vals = [next((v for mk, v in k["metrics"].items() if mk.startswith(key)), "-") for key in keys]
            print(f"{c['op'] + ' ' + str(c['m']) + 'x' + str(c['k']) + 'x' + str(c['n']):34s} {c['label']:12s} "
                  f"{k['name'][:40]:40s} " + " ".join(f"{v:>12}" for v in vals))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
