"""What does a kernel launch cost on the GPU, in a CUDA graph and in a loop?

At 256-1024 rows the fused kernels pay a fixed cost per launch under graphs that cuBLAS's kernels do not
(docs/performance.md §9). Three things set them apart from a plain kernel: 1,904 bytes of parameters
(CUTLASS's TMA descriptors and the schedulers' arguments), a 2-CTA cluster on most configurations, and
programmatic dependent launch. bench/probe_launch.cu launches a kernel that spins a set number of cycles
with each of these varied:

- bytes: the by-value parameter block (64, 512, 1024, 2048, 4096);
- cluster: 1 or 2 CTAs;
- pdl: the programmatic-stream-serialization attribute (the kernel waits for the grid before it);
- spin: cycles each CTA spins (0: the launch alone; 10000: about 5 µs, a small GEMM's length).

    python bench/probe_launch.py [--variants bytes:cluster:pdl:spin,...] [--ctas 132] [--out FILE]

Each variant: the median µs per call over samples of 20 back-to-back calls, replayed as a CUDA graph
and enqueued eagerly. No GPU, no nvcc: one line, exit 1.

JSON (--out): {"format": 1, "command", "commit", "device", "variants": [{"bytes", "cluster", "pdl",
"spin", "ctas", "calls", "us": {"graph", "loop"}}]}.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from probe_cuda import build_and_run, parser, usable, write  # noqa: E402

SOURCE = os.path.join(HERE, "probe_launch.cu")
VARIANTS = ",".join(f"{b}:{c}:{p}:{s}" for s in (0, 10000) for b in (64, 2048, 4096) for c in (1, 2) for p in (0, 1))


def main(argv=None) -> int:
    p = parser(__doc__, VARIANTS, "bytes:cluster:pdl:spin", ctas=132, reps=30)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    nvcc = usable("probe_launch")
    if nvcc is None:
        return 1
    rows, _ = build_and_run(nvcc, SOURCE, ["--calls", str(args.calls), "--reps", str(args.reps), "--ctas",
                                           str(args.ctas), *[v for v in args.variants.split(",") if v]])
    if rows is None:
        return 1
    print(f"{'bytes':>6} {'cluster':>7} {'pdl':>4} {'spin':>6} {'graph us':>9} {'loop us':>8}")
    for r in rows:
        print(f"{r['bytes']:>6} {r['cluster']:>7} {r['pdl']:>4} {r['spin']:>6} {r['us']['graph']:>9.2f} "
              f"{r['us']['loop']:>8.2f}")
    if args.out:
        write(args.out, "bench/probe_launch.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
