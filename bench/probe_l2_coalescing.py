"""What lets Hopper's L2 request coalescer merge the TMA loads of CTAs reading the same rows?

With cuBLAS's own tile, cluster, bytes and requests, the fused kernels read 1.4-1.5x cuBLAS's sectors
from the L2 slices, the coalescer merging 27-35% of cuBLAS's coalescable sectors and under 3% of
theirs (docs/performance.md §9, "Same tile, more L2 reads"). This probe isolates the A side of a
GEMM mainloop (bench/probe_l2_coalescing.cu: one wave of CTAs, each loading 64 x 64 bf16 boxes along
K through a ring of 10 stages, as a 64-row tile's A loads) and varies what might decide the merging:

- group: consecutive CTAs that read the same rows (a tile row of A shared by its N tiles; 1 = none,
  though 128 CTAs of distinct rows then read 64 MiB at K 4096, more than L2 holds: the staggered
  variants are the default's control instead);
- stagger: CTA j of a group runs its K loop rotated by j * stagger boxes, reaching each box that many
  steps before CTA 0 (0 = in step; by default every CTA starts at a grid-wide barrier, so the CTAs must
  fit in one wave);
- delay: cycles the consumer holds each stage (the MMA time it stands for);
- policy: the L2 cache-policy operand of each load (0 = none; 1000000000000000 = CUTLASS's
  evict-normal, which every TMA load of the fused kernels carries; 12f0... evict-first, 14f0... evict-last);
- spread (optional, with barrier): 1 = the CTAs sharing rows are C/group apart in launch order instead of
  consecutive (C CTAs), so that they land on other SMs and GPCs;
- barrier (optional): 0 = each CTA starts its K loop when it is dispatched, as a GEMM's CTAs do, instead
  of at the grid-wide barrier;
- cluster (optional, after barrier): 2 = clusters of 2 CTAs reading different rows (the two M tiles of a
  2x1 cluster), group and spread then counting clusters: the CTAs sharing rows are in different clusters,
  as in the fused kernels with a 2x1 cluster;
- sched (optional, after cluster): the launch's cluster scheduling policy, 0 the driver's default, 1 spread
  (cuBLAS's launches ask for it: bench/probe_cublas_launch.py, attribute 5), 2 load balancing;
- promotion: the tensor map's L2 promotion in bytes (CUTLASS's is 128; in the fused kernels 0-256 left
  the L2-slice reads unchanged, docs/performance.md §9, so the default variants keep 128).

    python bench/probe_l2_coalescing.py [--variants g:s:d:policy:promo[:spread:barrier[:cluster[:sched]]],...] [--ctas 128]
        [--k 4096] [--out FILE]

Compiles the probe with nvcc (sm_90a), times each variant (median of CUDA-event-timed launches),
then, where Nsight Compute is installed, profiles one launch per variant for the L2 metrics
(--metrics; clocks and caches left as the card sets them). No GPU, no nvcc: one line, exit 1.

JSON (--out): {"format": 1, "command", "commit", "device", "ncu", "variants": [{"group", "stagger",
"delay", "policy", "promotion", "spread", "barrier", "cluster", "sched", "ctas", "rows", "k", "ms", "smid" (the SM of each CTA
in the last launch), "start_ns" (when each began its K loop, after the first), "metrics": {"<metric> [unit]":
value}}]}.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from probe_cuda import build_and_run, parser, usable, write  # noqa: E402

SOURCE = os.path.join(HERE, "probe_l2_coalescing.cu")
NORMAL, FIRST, LAST = "1000000000000000", "12f0000000000000", "14f0000000000000"
VARIANTS = (f"8:0:0:0:128,8:0:0:{NORMAL}:128,8:0:256:0:128,8:0:256:{NORMAL}:128,8:0:256:{FIRST}:128,"
            f"8:0:256:{LAST}:128,8:1:256:0:128,8:4:256:0:128,8:0:256:0:128:1:1,8:0:256:0:128:0:0,8:0:256:0:128:1:0,"
            "8:0:0:0:128:0:0")
METRICS = ("lts__t_sectors_op_read.sum,lrc__lts2lrc_sectors_op_read.sum,lrc__request_sectors_op_read_coalescable.sum,"
           "lrc__xbar2lrc_requests_op_read.sum,gpu__time_duration.sum")


def parse_ncu(csv_text: str, launches_per_variant: int = 2):
    """ncu's details page (CSV) -> per variant the metrics of its probe kernel's last launch (the first is
    its warm-up)."""
    sys.path.insert(0, HERE)
    from profile_fused_ncu import kernels_of

    kernels = kernels_of(csv_text, sections=False)
    ids = sorted(i for i, k in kernels.items() if "probe_kernel" in k["name"])  # not a memset, say
    if len(ids) % launches_per_variant:
        raise SystemExit(f"probe_l2_coalescing: {len(ids)} profiled launches, not a multiple of {launches_per_variant}")
    return [kernels[ids[i + launches_per_variant - 1]]["metrics"] for i in range(0, len(ids), launches_per_variant)]


def probe(nvcc: str, ncu, args, variants):
    """(one row per variant, ncu's version): built, timed, and where `ncu` is given profiled; (None, None)
    where the probe failed."""
    from profile_fused_ncu import details_page, ncu_version

    common = ["--ctas", str(args.ctas), "--k", str(args.k)]

    def profile(exe, rows):
        if not ncu:
            return None
        rep = exe + "-prof"
        prof = subprocess.run([ncu, "--clock-control", "none", "--cache-control", "none", "--metrics", args.metrics,
                               "-o", rep, exe, "--once", *common, *variants], capture_output=True, text=True)
        if prof.returncode != 0:
            print(prof.stdout[-2000:], prof.stderr[-2000:], "probe_l2_coalescing: ncu run failed", sep="\n")
            return None
        for row, metrics in zip(rows, parse_ncu(details_page(ncu, rep + ".ncu-rep"))):
            row["metrics"] = metrics
        return ncu_version(ncu)

    return build_and_run(nvcc, SOURCE, ["--reps", str(args.reps), *common, *variants], profile)


def main(argv=None) -> int:
    p = parser(__doc__, VARIANTS, "group:stagger:delay:policy_hex:promotion[:spread:barrier[:cluster[:sched]]]", ctas=128, reps=50)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--metrics", default=METRICS)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    from profile_fused_ncu import find_ncu

    nvcc = usable("probe_l2_coalescing")
    if nvcc is None:
        return 1
    rows, version = probe(nvcc, find_ncu(), args, variants)
    if rows is None:
        return 1
    print(f"{'group':>5} {'stagger':>7} {'delay':>5} {'policy':>18} {'promo':>5} {'spread':>6} {'barrier':>7} "
          f"{'cluster':>7} {'sched':>5} {'ms':>8} {'start us':>8} {'L2 sectors':>11} {'coalescable':>11}")
    for r in rows:
        m = r.get("metrics", {})
        get = lambda name: next((v for k, v in m.items() if k.startswith(name)), "-")  # noqa: E731
        print(f"{r['group']:>5} {r['stagger']:>7} {r['delay']:>5} {r['policy']:>18} {r['promotion']:>5} "
              f"{r['spread']:>6} {r['barrier']:>7} {r.get('cluster', 1):>7} {r.get('sched', 0):>5} {r['ms'] if r['ms'] is not None else '-':>8} "
              f"{max(r['start_ns']) / 1e3:>8.2f} {get('lts__t_sectors_op_read.sum'):>11} "
              f"{get('lrc__request_sectors_op_read_coalescable.sum'):>11}")
    if args.out:
        write(args.out, "bench/probe_l2_coalescing.py", argv, rows, ncu=version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
