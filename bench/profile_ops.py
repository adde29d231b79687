"""Where the time of one call goes: the GPU timeline of a strategy, kernel by kernel, per rank.

    torchrun --nproc_per_node=2 bench/profile_ops.py --op ag_gemm --shape 4096x8192x14336 \
        --methods 'cublas,cublas_split,decomposed,decomposed(kernel_put=1),fused' --out prof.json

Shapes and inputs as in bench_ops.py (M gathered, N or K scaled with the world size). Each
method is called --warmup times, then --calls times under torch.profiler (CUDA activity, i.e.
CUPTI's record of every kernel, copy and memset with its stream, start and end on the GPU),
each call behind the same head start and GPU rendezvous as bench_ops.py's rounds (a GPU spin,
then an NCCL all-reduce of one element). A call's window starts where that all-reduce's
kernel ends. For each call and rank: its span (window start to the end of its last GPU
activity: what bench_ops.py times, plus CUPTI's own small overhead) and every activity in it
(name, stream, start and duration in us, and for kernels grid, block, registers per thread
and shared memory: the configuration cuBLAS chose). Stream memory operations
(cuStreamWriteValue32 / WaitValue32) are not CUPTI activities and do not appear.

Methods: 'cublas' (one GEMM over the whole problem, t_gemm), 'cublas_split' (the W row
blocks as the decomposed strategies run them, no communication), and flux strategies with
parameters as in bench_ops.py --strategies. Rank 0 prints each method's last call per rank
and writes everything to --out (JSON).
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from flux.autotune.space import Candidate, per_rank_shape  # noqa: E402
from bench_ops import split_labels  # noqa: E402  (same folder)

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=["ag_gemm", "gemm_rs"], required=True)
    p.add_argument("--shape", required=True, help="MxKxN, M gathered")
    p.add_argument("--methods", default="cublas,cublas_split,decomposed",
                   help="comma-separated: cublas, cublas_split, or flux strategies with parameters")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--queue-ahead-us", type=float, default=1000.0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _short(name: str, limit: int = 90) -> str:
    return name if len(name) <= limit else name[:limit - 3] + "..."


def _activities(trace_path: str):
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    acts = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        a = e.get("args", {})
        rec = {"name": e.get("name", "?"), "cat": e["cat"], "stream": a.get("stream", e.get("tid")),
               "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))}
        for key, short in (("grid", "grid"), ("block", "block"), ("registers per thread", "regs"),
                           ("shared memory", "smem"), ("bytes", "bytes")):
            if key in a:
                rec[short] = a[key]
        acts.append(rec)
    acts.sort(key=lambda r: r["ts"])
    return acts


def _split_calls(acts, calls: int):
    """Cut the activities into calls at the rendezvous all-reduce kernels."""
    marks = [i for i, r in enumerate(acts) if r["cat"] == "kernel" and "AllReduce" in r["name"]]
    marks = marks[-calls:]
    out = []
    for j, i in enumerate(marks):
        end = marks[j + 1] if j + 1 < len(marks) else len(acts)
        t0 = acts[i]["ts"] + acts[i]["dur"]
        # (the next round's head-start spin, torch.cuda._sleep, is not part of this call)
        body = [dict(r, start_us=round(r["ts"] - t0, 2), dur_us=round(r["dur"], 2)) for r in acts[i + 1:end]
                if "spin_kernel" not in r["name"]]
        for r in body:
            del r["ts"], r["dur"]
        span = max((r["start_us"] + r["dur_us"] for r in body), default=0.0)
        out.append({"span_us": round(span, 2), "activities": body})
    return out


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import flux.ops.ag_gemm as ag_mod
    import flux.ops.gemm_rs as rs_mod

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(minutes=10))
    group = dist.group.WORLD
    m, k, n = (int(x) for x in args.shape.lower().split("x"))
    n_loc, k_loc = per_rank_shape(args.op, m, k, n, world, True)
    dt = torch.bfloat16
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + rank)
    weight = torch.randn((n_loc, k_loc), device=dev, dtype=dt, generator=gen) / math.sqrt(k_loc)
    rows = m // world
    if args.op == "ag_gemm":
        x = torch.randn((rows, k_loc), device=dev, dtype=dt, generator=gen)
        full = torch.randn((m, k_loc), device=dev, dtype=dt, generator=gen)
        mod = ag_mod
    else:
        x = torch.randn((m, k_loc), device=dev, dtype=dt, generator=gen)
        full = x
        mod = rs_mod

    def make(method):
        if method == "cublas":
            return lambda: F.linear(full, weight)
        if method == "cublas_split":
            blocks = [full[p * rows:(p + 1) * rows] for p in range(world)]
            outs = [torch.empty((rows, n_loc), device=dev, dtype=dt) for _ in range(world)]

            def split():
                for b, o in zip(blocks, outs):
                    torch.matmul(b, weight.t(), out=o)
            return split
        c = Candidate.parse(method)
        return lambda: mod.run_strategy(c.strategy, x, weight, group=group, weight_layout="nk", check=False,
                                        **c.kwargs)

    token = torch.zeros(1, device=dev)
    spin = int(args.queue_ahead_us * 1980)

    def one(fn):
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        dist.all_reduce(token, group=group)
        fn()

    results = {}
    for method in split_labels(args.methods):
        fn = make(method)
        for _ in range(args.warmup):
            one(fn)
        torch.cuda.synchronize()
        dist.barrier(group=group, device_ids=[local])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                one(fn)
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
            path = tf.name
        prof.export_chrome_trace(path)
        calls = _split_calls(_activities(path), args.calls)
        os.unlink(path)
        gathered = [None] * world
        dist.all_gather_object(gathered, calls, group=group)
        if rank == 0:
            spans = [[c["span_us"] for c in per_rank] for per_rank in gathered]
            results[method] = {"span_us_median_per_rank": [statistics.median(s) if s else None for s in spans],
                               "calls_per_rank": gathered}
            print(f"\n== {method}: span median per rank (us) "
                  f"{[round(statistics.median(s), 1) if s else None for s in spans]}", flush=True)
            for r, per_rank in enumerate(gathered):
                if not per_rank:
                    continue
                last = per_rank[-1]
                print(f"  rank {r}, last call, span {last['span_us']} us", flush=True)
                for a in last["activities"]:
                    extra = ""
                    if a["cat"] == "kernel":
                        extra = f" grid={a.get('grid')} block={a.get('block')} regs={a.get('regs')} smem={a.get('smem')}"
                    elif "bytes" in a:
                        extra = f" bytes={a['bytes']}"
                    print(f"    s{a['stream']:<4} {a['start_us']:>9.1f} +{a['dur_us']:>8.1f}  "
                          f"{_short(a['name'])}{extra}", flush=True)
    if rank == 0 and args.out:
        meta = {"command": "torchrun --nproc_per_node=%d bench/profile_ops.py " % world + shlex.join(sys.argv[1:]),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "gpu": torch.cuda.get_device_name(dev), "world": world, "torch": torch.__version__,
                "op": args.op, "shape": args.shape, "local": {"N": n_loc, "K": k_loc}}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "methods": results}, f, indent=1)
    dist.barrier(group=group, device_ids=[local])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
