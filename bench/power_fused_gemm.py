"""The fused GEMM kernels and cuBLAS each in steady state on one GPU: time per call, power, SM clock.

    python bench/power_fused_gemm.py --op ag --shapes 16384x16384x4608,4096x4096x14336 [--labels served,c0/r1/s8] \\
        [--seconds 2] --out power.json

Shapes are the kernel's own MxKxN, as bench/bench_fused_gemm.py's. Per shape, torch.mm (cuBLAS) and then
each label (c<config>/r<raster>/s<swizzle>, or "served": the library's choice), every flag set, bf16:
each replayed as a CUDA graph of back-to-back calls for --seconds, while nvidia-smi samples the card's
power draw and SM clock every 50 ms. Per launcher, over the second half of its run (the first half
lets the clock settle to the power this kernel draws): ms per call, mean power (W), mean SM clock
(MHz). A card under its power cap clocks down where a kernel draws more power,
so of two kernels of equal work per clock the one that moves more bytes through L2 and HBM runs
slower in steady state; this is the reading that shows it. No GPU or no nvidia-smi: one line, exit 1.

JSON (--out): {"format": 1, "command", "commit", "device", "seconds", "results": [{"op", "m", "k", "n",
"runs": [{"label", "ms", "watts", "sm_mhz", "samples"}]}]}.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # flux, from this checkout
sys.path.insert(0, HERE)


def parse_line(line: str):
    """(watts, MHz) from a line of nvidia-smi's CSV ("693.12, 1425"), or None ("[N/A]", a header)."""
    try:
        watts, mhz = (float(x) for x in line.split(","))
    except ValueError:
        return None
    return watts, mhz


class Sampler:
    """nvidia-smi's power draw and SM clock every 50 ms, with this host's clock."""

    def __init__(self, index: int):
        self.samples = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(index), "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            got = parse_line(line)
            if got is not None:
                self.samples.append((time.time(), *got))

    def between(self, t0: float, t1: float):
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=5)


def steady(fns, seconds: float, sampler: Sampler) -> dict:
    """``fns`` (one launcher per input set) as a graph replayed for ``seconds``; the second half's figures."""
    import torch
    from flux.autotune.kernel_timing import estimate_ms, loop_of
    from flux.autotune.tuner import capture

    t_ms = estimate_ms(fns)
    calls = max(len(fns), min(256, round(20.0 / max(t_ms, 1e-3))))  # replays of ~20 ms
    graph = capture(loop_of(fns, calls), calls=1)
    replay = graph.replay if graph is not None else loop_of(fns, calls)
    half = max(1, round(seconds * 500.0 / (calls * t_ms)))  # replays per half
    for _ in range(half):
        replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    for _ in range(half):
        replay()
    end.record()
    end.synchronize()
    t1 = time.time()
    got = sampler.between(t0, t1)
    mean = (lambda i: sum(s[i] for s in got) / len(got)) if got else (lambda i: None)
    ms = start.elapsed_time(end) / (half * calls)
    return {"ms": ms, "watts": mean(1), "sm_mhz": mean(2), "samples": len(got)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("ag", "rs"), required=True)
    p.add_argument("--shapes", required=True, help="MxKxN,... (the kernel's own rows)")
    p.add_argument("--labels", default="served", help="fused launches: served and/or c<id>/r<raster>/s<swizzle>")
    p.add_argument("--seconds", type=float, default=2.0, help="per launcher (the second half is measured)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        print("power_fused_gemm: needs a CUDA GPU and nvidia-smi; nothing measured")
        return 1
    from bench_fused_gemm import commit
    from flux.autotune import kernels as K
    from flux.autotune.kernel_timing import KernelProblem
    from flux.autotune.model_grid import parse_shapes

    sampler = Sampler(torch.cuda.current_device())
    results = []
    try:
        for rec in parse_shapes(args.op, args.shapes):
            op, m, n, k = rec["op"], rec["m"], rec["n"], rec["k"]
            pr = KernelProblem(op, m, n, k, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
            runs = [("cublas", pr.cublas())]
            for lab in filter(None, args.labels.split(",")):
                if lab == "served":
                    lab = K.label(*K.choose_config(op, m, n, k, torch.bfloat16, torch.bfloat16, None))
                runs.append((lab, pr.fused(*K.parse_label(lab))))
            out = {"op": op, "m": m, "k": k, "n": n, "runs": []}
            for lab, fns in runs:
                r = dict(label=lab, **steady(fns, args.seconds, sampler))
                out["runs"].append(r)
                print(f"{op} {m}x{k}x{n} {lab:14s} {r['ms']:.4f} ms  {r['watts'] or 0:.0f} W  "
                      f"{r['sm_mhz'] or 0:.0f} MHz  ({r['samples']} samples)", flush=True)
            results.append(out)
            del pr, runs
    finally:
        sampler.stop()
    if args.out:
        doc = {"format": 1, "command": "python " + " ".join(shlex.quote(a) for a in ["bench/power_fused_gemm.py"] +
                                                          (argv if argv is not None else sys.argv[1:])),
               "commit": commit(), "device": torch.cuda.get_device_name(), "seconds": args.seconds,
               "results": results}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
