"""Tune flux's strategy choice for this machine and write the cache:

    torchrun --nproc_per_node=N -m flux.autotune --suite
    torchrun --nproc_per_node=N -m flux.autotune --shapes ag_gemm:8192x8192x14336,gemm_rs:4096x14336x8192

Shapes are M x K x N as in bench/bench_ops.py (M all rows; for ag_gemm each rank holds M/W
rows of K and N columns of the weight; for gemm_rs each rank holds K columns of its shard).
The suite's shapes are scaled with the world size as bench_ops.py scales them (N or K times
2/W, flux.autotune.space.per_rank_shape), so that the cache covers what the benchmark runs;
--no-scale-with-world tunes them unscaled; --shapes are taken as given. Every rank times every valid
candidate of a shape together (flux/autotune/tuner.py); the choice, the default and all
times go to the cache of this topology (flux/autotune/cache.py), or with --ship to the
shipped defaults in the source tree, written after every shape. Prints what it chose and by
how much it beat the analytic default. --cpu (gloo) tunes the suite divided by 16 in every
dimension (--scale-down), which a CPU times in seconds.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parse_shapes(args, world):
    from flux.autotune.space import PUBLIC_SUITE, per_rank_shape

    if args.suite:
        d = args.scale_down
        out = []
        for op in args.ops:
            for s in PUBLIC_SUITE[op]:
                m, k, n = (int(x) for x in s.split("x"))
                n, k = per_rank_shape(op, m, k, n, world, args.scale_with_world)
                if d > 1:  # every dimension divided, M kept a multiple of W, N and K of 8
                    m = max(world, m // d // world * world)
                    k, n = max(8, k // d // 8 * 8), max(8, n // d // 8 * 8)
                out.append((op, f"{m}x{k}x{n}"))
        return out
    out = []
    for item in args.shapes.split(","):
        op, _, shape = item.strip().rpartition(":")
        dims = shape.lower().split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise SystemExit(f"flux.autotune: {shape!r} in --shapes {item!r} is not MxKxN (three positive integers, "
                             "e.g. ag_gemm:8192x8192x14336)")
        if int(dims[0]) % world:
            raise SystemExit(f"flux.autotune: M = {dims[0]} in --shapes {item!r} is not a multiple of the world size "
                             f"{world}")
        ops = [op] if op else args.ops
        for o in ops:
            if o not in ("ag_gemm", "gemm_rs"):
                raise SystemExit(f"flux.autotune: unknown op {o!r} in {item!r} (ag_gemm or gemm_rs)")
            out.append((o, shape))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flux.autotune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--suite", action="store_true", help="the public shape suite")
    g.add_argument("--shapes", help="comma-separated [op:]MxKxN")
    p.add_argument("--ops", default="ag_gemm,gemm_rs", help="ops for --suite or for shapes without op:")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ship", action="store_true", help="write the shipped defaults (flux/autotune/shipped/)")
    p.add_argument("--scale-with-world", action=argparse.BooleanOptionalAction, default=True,
                   help="--suite: scale N (ag_gemm) or K (gemm_rs) by 2/W as bench_ops.py does")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (tests the tool; only 'sequential' runs there)")
    p.add_argument("--scale-down", type=int, default=None,
                   help="--suite: divide M, K and N by this (default 16 with --cpu, where the full suite "
                        "takes many minutes, else 1)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        # No GPU (or no driver): the CPU path is the only one that can run; say so in one line.
        if int(os.environ.get("RANK", "0")) == 0:
            print("flux.autotune: no CUDA device here; tuning the CPU path (gloo), as --cpu does "
                  "(on a GPU machine this tunes the GPU strategies)", flush=True)
        args.cpu = True
    elif not args.cpu and int(os.environ.get("LOCAL_RANK", "0")) >= torch.cuda.device_count():
        raise SystemExit(f"flux.autotune: local rank {os.environ.get('LOCAL_RANK')} has no GPU (this machine has "
                         f"{torch.cuda.device_count()}): use --nproc_per_node={torch.cuda.device_count()} or fewer")
    if args.scale_down is None:
        args.scale_down = 16 if args.cpu else 1
    args.ops = args.ops.split(",")
    bad = [o for o in args.ops if o not in ("ag_gemm", "gemm_rs")]
    if bad:
        raise SystemExit(f"flux.autotune: unknown op(s) {bad} in --ops (ag_gemm, gemm_rs)")

    # Arguments are checked before any process group exists, so a bad one stops every rank at once.
    shapes = _parse_shapes(args, int(os.environ.get("WORLD_SIZE", "1")))
    if args.cpu:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    import flux
    from flux import autotune
    from flux.autotune import cache as cache_mod
    from flux.ops._common import problem_of

    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    topo = autotune.topology(world, device)
    dtype = DTYPES[args.dtype]
    if rank == 0:
        print(f"flux.autotune: {topo}\n  topology key {topo.key!r}, flux {flux.__version__}, {len(shapes)} shapes",
              flush=True)
    cache = autotune.cache_for(world, device)
    target = os.path.join(cache_mod.SHIPPED_DIR, cache_mod.file_name(topo.key)) if args.ship else None
    writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    path = None
    start, rows = time.time(), []
    for i, (op, shape) in enumerate(shapes, 1):
        m, k, n = (int(x) for x in shape.lower().split("x"))
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        # The values of bench/bench_ops.py (x ~ N(0, 1), w ~ N(0, 1/K), as trained layers have):
        # GEMM times depend on the numbers, not only on the shapes (docs/tuning.md).
        x = torch.randn(m // world if op == "ag_gemm" else m, k, generator=gen, device=device,
                        dtype=torch.float32).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device, dtype=torch.float32) / k ** 0.5).to(dtype)
        mod = flux.ops.ag_gemm if op == "ag_gemm" else flux.ops.gemm_rs
        cuda = device.type == "cuda"
        problem = problem_of(op, x, w, "nk", None, world, m)
        mod.run_strategy("sequential", x, w)  # argument check, workspace, cuBLAS handles

        def run(c, x=x, w=w, mod=mod):
            return mod.run_strategy(c.strategy, x, w, check=False, **c.kwargs)

        def prepare(c, x=x, w=w, mod=mod):
            return mod.prepare_strategy(c.strategy, x, w, check=False, **c.kwargs)

        entry = autotune.tune(problem, run, group, device, save=False, warmup=args.warmup, iters=args.iters,
                              prepare=prepare)
        t = entry["times_ms"]
        gain = t[entry["default"]] / t[entry["choice"]] - 1
        rows.append((op, shape, entry["choice"], t[entry["choice"]], entry["default"], t[entry["default"]], gain))
        if rank == 0:
            print(f"  [{i}/{len(shapes)}] {op} {shape}: {entry['choice']} {t[entry['choice']]:.3f} ms"
                  f" (default {entry['default']} {t[entry['default']]:.3f} ms, {100 * gain:+.1f}%)", flush=True)
        if writer:  # after every shape: an interrupted run keeps what it tuned
            path = cache.save(target)
        del x, w
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"\nflux.autotune: {len(shapes)} shapes in {time.time() - start:.1f} s; wrote {path}")
        print(f"{'op':8} {'shape':>16} {'choice':>22} {'ms':>8} {'default':>22} {'ms':>8} {'gain':>7}")
        for op, shape, c, tc, d, td, gain in rows:
            print(f"{op:8} {shape:>16} {c:>22} {tc:8.3f} {d:>22} {td:8.3f} {100 * gain:+6.1f}%")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
