"""Time one flux strategy under variants of the timing protocol, in one process, to find
which part of a protocol changes the reading (the autotuner against bench_ops.py):

    torchrun --nproc_per_node=2 bench/bench_timing_protocols.py [--shape 16384x8192x4096]

Variants (each: warm-up, then 12 calls, median per rank, max over ranks; host ms = median
wall-clock time of enqueuing the call):
  tuner      flux.autotune.tuner.time_on_rank (spin, GPU rendezvous, call; end.synchronize)
  tuner+sync the same with torch.cuda.synchronize() before each spin
  bench      bench_ops.py's loop (synchronize, spin, rendezvous, call)
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="16384x8192x4096")
    p.add_argument("--strategies", default="decomposed,sequential,fused")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="first: torch.profiler table of 5 decomposed calls")
    p.add_argument("--warm-decomposed", action="store_true", help="first: 3 decomposed calls")
    p.add_argument("--first", default="", help="call this right after init_process_group: topology, nvml, "
                   "peer (torch.cuda.can_device_access_peer)")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.first == "topology":
        from flux import autotune as _at
        print(rank, _at.topology(world, dev), flush=True)
    elif args.first == "nvml":
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    elif args.first == "peer":
        print(rank, [torch.cuda.can_device_access_peer(local, q) for q in range(torch.cuda.device_count()) if q != local])
    import flux
    from flux.autotune import tuner
    from flux.ops import ag_gemm as mod

    m, k, n = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device=dev).manual_seed(1 + rank)
    x = torch.randn(m // world, k, device=dev, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).bfloat16()
    one = torch.zeros(1, device=dev)
    if args.warm_decomposed:
        for _ in range(3):
            mod.run_strategy("decomposed", x, w, check=False)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for _ in range(3):
            mod.run_strategy("sequential", x, w, check=False)
            mod.run_strategy("decomposed", x, w, check=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                mod.run_strategy("decomposed", x, w, check=False)
            torch.cuda.synchronize()
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60),
                  flush=True)
            evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
            evs.sort(key=lambda e: e.time_range.start)
            t0 = evs[0].time_range.start if evs else 0
            for e in evs[:40]:
                print(f"  {e.time_range.start - t0:10.1f} {e.time_range.end - t0:10.1f} us  {e.name[:70]}")
    if args.first == "seqcheck":  # what the CLI does first
        mod.run_strategy("sequential", x, w)
    elif args.first == "correct":  # the tuner's correctness pass first (output of sequential held)
        from flux.autotune import tuner as _t
        from flux.autotune.space import Candidate as _C
        _t.correct_candidates(lambda c: mod.run_strategy(c.strategy, x, w, check=False, **c.kwargs),
                              [_C("sequential"), _C("decomposed")], dist.group.WORLD, dev, torch.bfloat16)

    def align():
        dist.all_reduce(one)

    host = []

    def timed(fn):
        def g():
            h = time.perf_counter()
            r = fn()
            host.append((time.perf_counter() - h) * 1e3)
            return r
        return g

    def v_tuner(fn):
        return tuner.time_on_rank(timed(fn), dev, 12, align)

    def v_tuner_sync(fn):
        s = []
        for _ in range(12):
            torch.cuda.synchronize()
            s.append(tuner.time_on_rank(timed(fn), dev, 1, align))
        return statistics.median(s)

    def v_bench(fn):
        s = []
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(12):
            torch.cuda.synchronize()
            torch.cuda._sleep(1_980_000)
            align()
            a.record()
            timed(fn)()
            b.record()
            b.synchronize()
            s.append(a.elapsed_time(b))
        return statistics.median(s)

    variants = {"tuner": v_tuner, "tuner+sync": v_tuner_sync, "bench": v_bench}
    for _ in range(args.passes):  # two passes: the second shows whether order matters
        for s in args.strategies.split(","):
            fn = (lambda s=s: mod.run_strategy(s, x, w, check=False))
            for _ in range(3):
                fn()
            for name, v in variants.items():
                host.clear()
                dist.barrier()
                torch.cuda.synchronize()
                t = v(fn)
                ts = [None] * world
                dist.all_gather_object(ts, (round(t, 3), round(statistics.median(host), 3)))
                if rank == 0:
                    print(f"{args.shape} {s:>11} {name:>10}: per rank (ms, host ms) {ts}", flush=True)
    # The autotuner's own entry points on the same tensors.
    from flux import autotune
    from flux.autotune.space import Candidate
    from flux.ops._common import problem_of

    cands = [Candidate("sequential"), Candidate("decomposed"), Candidate.of("fused", config=0, swizzle=8)]

    def run(c):
        return mod.run_strategy(c.strategy, x, w, check=False, **c.kwargs)
    for rounds in (1, 3):
        t = tuner.time_candidates(run, cands, dist.group.WORLD, dev, rounds=rounds)
        if rank == 0:
            print(f"{args.shape} time_candidates rounds={rounds}: {t}", flush=True)
    t = tuner.time_candidates(run, cands[1:2], dist.group.WORLD, dev)
    if rank == 0:
        print(f"{args.shape} time_candidates decomposed alone: {t}", flush=True)
    kept = tuner.correct_candidates(run, cands, dist.group.WORLD, dev, torch.bfloat16)
    t = tuner.time_candidates(run, kept, dist.group.WORLD, dev)
    if rank == 0:
        print(f"{args.shape} after correct_candidates: {t}", flush=True)
    entry = autotune.tune(problem_of("ag_gemm", x, w, "nk", None, world, m), run, dist.group.WORLD, dev, save=False)
    if rank == 0:
        print(f"{args.shape} autotune.tune: {entry}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
