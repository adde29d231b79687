"""The sequence-parallel MLP block, forward and backward, with flux against NCCL + cuBLAS.

    torchrun --nproc_per_node=2 bench/bench_mlp.py                         # hidden 8192 / FFN 28672, 2048 and 8192 tokens
    torchrun --nproc_per_node=2 bench/bench_mlp.py --sizes 4096x14336 --tokens 2048,8192,16384
    torchrun --nproc_per_node=2 bench/bench_mlp.py --cpu --sizes 64x128 --tokens 32 --steps 3   # gloo smoke run

The block (Megatron's sequence-parallel MLP, bf16 on GPU): x [T/W, H] -> all-gather -> FC1
(W1 [F/W, H], b1) -> GELU -> FC2 (W2 [H, F/W]) -> reduce-scatter (+ b2) -> y [T/W, H]; a step is
the forward and ``y.backward(g)`` with g random. Variants, side by side in one process on the
same tensors:

    nccl   torch.distributed all_gather_into_tensor / reduce_scatter_tensor as autograd functions
           (backward: the other collective) around F.linear: the NCCL + cuBLAS block
    flux   flux.ag_gemm / flux.gemm_rs (their autograd: the other op for the input's gradient)

Protocol: random inputs; the flux block's output and every gradient are compared with the
nccl block's first (relative error, bf16 tolerance 2e-2); then per variant, after warm-up:
  loop   CUDA events around --steps back-to-back steps after a GPU rendezvous; ms per step,
         median of --rounds, maximum over the ranks (an eager training step: host cost shows
         where it exceeds the GPU time);
  host   CPU ms to enqueue one step (forward and backward) while a GPU spin keeps the device
         busy; median, maximum over ranks.
The JSON (--out) records every figure and the command; the table printed last gives the
speedup of flux over nccl and the ratio of their host times (target: flux <= 1.3x nccl).
On the CPU (--cpu: gloo, fp32) it only checks that the script runs and the variants agree.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flux  # noqa: E402
from flux.runtime import all_gather_dim0, reduce_scatter_dim0  # noqa: E402


def _collective(forward, backward):
    """An autograd function running ``forward(x, group)``, whose backward is ``backward`` (the
    other collective): Megatron's sequence-parallel regions."""
    class _Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, g):
            return backward(g.contiguous(), ctx.group), None

    return _Collective


_AllGather = _collective(all_gather_dim0, reduce_scatter_dim0)
_ReduceScatter = _collective(reduce_scatter_dim0, all_gather_dim0)


def nccl_block(x, w1, b1, w2, b2, group):
    h = F.gelu(F.linear(_AllGather.apply(x, group), w1, b1))
    return _ReduceScatter.apply(F.linear(h, w2), group) + b2


def flux_block(x, w1, b1, w2, b2, group):
    return flux.gemm_rs(F.gelu(flux.ag_gemm(x, w1, b1, group=group)), w2, b2, group=group)


VARIANTS = {"nccl": nccl_block, "flux": flux_block}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8192x28672", help="HIDDENxFFN,... (FFN is split over the ranks)")
    p.add_argument("--tokens", default="2048,8192", help="tokens (all ranks together), comma-separated")
    p.add_argument("--steps", type=int, default=10, help="steps per timed loop")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, fp32 (a smoke run)")
    p.add_argument("--out", default=None, help="JSON path (rank 0)")
    return p.parse_args(argv)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None):
    args = parse_args(argv)
    if args.cpu:
        dist.init_process_group("gloo")
        dev, dtype = torch.device("cpu"), torch.float32
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev, dtype = torch.device("cuda", local), torch.bfloat16
        dist.init_process_group("nccl", device_id=dev)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    cuda = dev.type == "cuda"
    one = torch.zeros(1, device=dev)

    def max_all(v):
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def step(fn, params, x, g):
        for p in params:
            p.grad = None
        y = fn(x, *params, group)
        y.backward(g)
        return y

    def loop_ms(fn, params, x, g):
        samples = []
        for _ in range(args.rounds):
            if cuda:
                torch.cuda.synchronize()
                dist.all_reduce(one)  # both GPUs start together
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.steps):
                    step(fn, params, x, g)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / args.steps)
            else:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(fn, params, x, g)
                samples.append((time.perf_counter() - t0) * 1e3 / args.steps)
        return max_all(statistics.median(samples))

    def host_ms(fn, params, x, g):
        samples = []
        for _ in range(args.rounds):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(1980 * 20_000)  # ~20 ms of spin: the step is enqueued behind it
            t0 = time.perf_counter()
            step(fn, params, x, g)
            samples.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                torch.cuda.synchronize()
        return max_all(statistics.median(samples))

    records = []
    for size in args.sizes.split(","):
        hidden, ffn = (int(v) for v in size.split("x"))
        for tokens in (int(t) for t in args.tokens.split(",")):
            gen = torch.Generator(device=dev).manual_seed(100 + rank)
            x = torch.randn(tokens // world, hidden, generator=gen, device=dev).to(dtype).requires_grad_()
            g = torch.randn(tokens // world, hidden, generator=gen, device=dev).to(dtype)
            w1 = (torch.randn(ffn // world, hidden, generator=gen, device=dev) / hidden ** 0.5).to(dtype)
            b1 = torch.randn(ffn // world, generator=gen, device=dev).to(dtype) * 0.1
            w2 = (torch.randn(hidden, ffn // world, generator=gen, device=dev) / ffn ** 0.5).to(dtype)
            b2 = torch.zeros(hidden, device=dev, dtype=dtype).normal_(generator=gen) * 0.1
            params = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
            rec = {"hidden": hidden, "ffn": ffn, "tokens": tokens, "variants": {}}
            ref = step(nccl_block, params, x, g).detach()
            ref_grads = [x.grad.clone()] + [p.grad.clone() for p in params]
            x.grad = None
            y = step(flux_block, params, x, g).detach()
            errs = [rel_err(y, ref)] + [rel_err(a, b) for a, b in zip([x.grad] + [p.grad for p in params], ref_grads)]
            rec["flux_rel_err"] = max_all(max(errs))
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            if not rec["flux_rel_err"] < tol:
                rec["status"] = f"incorrect: flux differs from nccl by {rec['flux_rel_err']:.3g}"
                records.append(rec)
                continue
            for name, fn in VARIANTS.items():
                for _ in range(args.warmup):
                    step(fn, params, x, g)
                rec["variants"][name] = {"loop_ms": loop_ms(fn, params, x, g), "host_ms": host_ms(fn, params, x, g)}
            n, f = rec["variants"]["nccl"], rec["variants"]["flux"]
            rec["speedup_loop"] = n["loop_ms"] / f["loop_ms"]
            rec["host_ratio"] = f["host_ms"] / n["host_ms"]
            rec["status"] = "ok"
            records.append(rec)
            if rank == 0:
                print(f"H={hidden} F={ffn} T={tokens}: nccl {n['loop_ms']:.3f} ms (host {n['host_ms']:.3f}), "
                      f"flux {f['loop_ms']:.3f} ms (host {f['host_ms']:.3f}), {rec['speedup_loop']:.2f}x, "
                      f"host {rec['host_ratio']:.2f}x", flush=True)
            del x, g, params
    if rank == 0:
        meta = {"command": " ".join(["torchrun", f"--nproc_per_node={world}"] + sys.argv), "world_size": world,
                "torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                "dtype": str(dtype), "steps": args.steps, "rounds": args.rounds}
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"metadata": meta, "results": records}, fh, indent=1)
        print(f"\n{'H x F':>12} {'tokens':>7} {'nccl ms':>9} {'flux ms':>9} {'speedup':>8} "
              f"{'nccl host':>10} {'flux host':>10} {'host x':>7}")
        for r in records:
            if r.get("status") != "ok":
                print(f"{r['hidden']}x{r['ffn']:>6} {r['tokens']:>7} {r.get('status')}")
                continue
            n, f = r["variants"]["nccl"], r["variants"]["flux"]
            print(f"{r['hidden']:>5}x{r['ffn']:<6} {r['tokens']:>7} {n['loop_ms']:9.3f} {f['loop_ms']:9.3f} "
                  f"{r['speedup_loop']:7.2f}x {n['host_ms']:10.3f} {f['host_ms']:10.3f} {r['host_ratio']:6.2f}x")
    ok = all(r.get("status") == "ok" for r in records)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
