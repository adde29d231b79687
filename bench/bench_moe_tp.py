"""Tensor-parallel MoE MLP: flux.ag_scatter_grouped_mm -> SwiGLU -> flux.grouped_mm_gather_rs
against the unfused references.

    torchrun --nproc_per_node=2 bench/bench_moe_tp.py --out moe_tp.json
    torchrun --nproc_per_node=2 bench/bench_moe_tp.py --tokens 1024,4096 --shapes 4096x14336x8x2,7168x2048x64x8
    torchrun --nproc_per_node=2 bench/bench_moe_tp.py --cpu --tokens 16 --shapes 32x16x4x2 --steps 2  # gloo smoke run

Shapes ``HxFxExK``: hidden H, expert FFN size F (split over the W ranks: w13 ``[E, 2F/W, H]``,
w2 ``[E, H, F/W]``, SwiGLU), E experts, top-K; tokens: tokens per rank T_l (the sequence-parallel
shard; every rank computes on all W * T_l tokens). Routing: each token's K experts a uniform
sample without replacement, softmax weights (fp32). bf16 on the GPU.

Variants, side by side on the same tensors and weights:

    ref         flux.ag_scatter_grouped_mm_ref / grouped_mm_gather_rs_ref: all-gather, a per-expert
                selection and one torch.mm per expert, then the weighted sum and reduce-scatter
                (the unfused layer, one GEMM per expert)
    sequential  flux's ops with FLUX_STRATEGY_MOE_TP=sequential: the same collectives around one
                grouped GEMM per part (no overlap)
    chunked     FLUX_STRATEGY_MOE_TP=chunked: W grouped GEMMs per part overlapped with NCCL
                point-to-point transfers (not with CUDA tensors on gloo)
    decomposed  FLUX_STRATEGY_MOE_TP=decomposed: the same blocks, the transfers by the copy engine
                into the symmetric workspace (GPU only; ``symm``, its former name, is accepted)
    flux        the public ops with their automatic choice (recorded as ``choice``)

Modes: fwd (under torch.no_grad) and fwdbwd (forward, then ``y.backward(g)``, gradients of x,
w13, w2 and the routing weights; set to None first). Every variant's output (and gradients) is
compared with ref's first (relative error, bf16 tolerance 2e-2). Timings after --warmup steps:
loop (CUDA events around --steps back-to-back steps after a GPU rendezvous, median of --rounds,
maximum over the ranks), single (one step on an idle GPU: synchronise, rendezvous, events around
it; median of --rounds, maximum over ranks) and host (CPU ms to enqueue one step behind a GPU
spin; median, maximum over ranks; part 1 reads its counts on the host, so its host time includes
waiting for the routing's all-gather). No graph timing: part 1 sizes its output from counts read
on the host, which a CUDA graph cannot capture.

The JSON (--out) records every figure and the command; the table printed last gives ms per
variant and the speedups of flux over ref and over sequential.
"""
import argparse
import os
import statistics
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flux  # noqa: E402
from flux.ops import moe_tp  # noqa: E402
from flux.strategies import canonical_strategy  # noqa: E402
from bench_layers import _f, attempt, finish, ratio, rel_err, start  # noqa: E402

VARIANTS = ("ref", "sequential", "chunked", "decomposed", "flux")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default 1024,4096, with --cpu 16)")
    p.add_argument("--shapes", default=None, help="HxFxExK, comma-separated (default 4096x14336x8x2,7168x2048x64x8, "
                   "with --cpu 32x16x4x2)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--steps", type=int, default=10, help="steps per timed loop")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, fp32 (a smoke run)")
    p.add_argument("--out", default=None, help="JSON path (rank 0)")
    args = p.parse_args(argv)
    # A CPU smoke run at the GPU sizes would compute for hours without printing anything.
    args.tokens = args.tokens or ("16" if args.cpu else "1024,4096")
    args.shapes = args.shapes or ("32x16x4x2" if args.cpu else "4096x14336x8x2,7168x2048x64x8")
    return args


def swiglu(y):
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_step(variant, x, idx, tw, w13, w2, group, mode, g):
    """step() -> (out, [grads]) of one variant; the strategy forced around the call."""
    fns = ((flux.ag_scatter_grouped_mm_ref, flux.grouped_mm_gather_rs_ref) if variant == "ref"
           else (flux.ag_scatter_grouped_mm, flux.grouped_mm_gather_rs))
    forced = variant if variant in moe_tp.STRATEGIES else None
    leaves = (x, w13, w2, tw)

    def forward():
        h, routing = fns[0](x, idx, w13, group=group)
        return fns[1](swiglu(h), w2, routing, tw, group=group)

    def step():
        old = os.environ.get(moe_tp.STRATEGY_ENV)
        if forced:
            os.environ[moe_tp.STRATEGY_ENV] = forced
        try:
            if mode == "fwd":
                with torch.no_grad():
                    return forward(), []
            for t in leaves:
                t.grad = None
            y = forward()
            y.backward(g)
            return y.detach(), [t.grad for t in leaves]
        finally:
            if forced:
                if old is None:
                    os.environ.pop(moe_tp.STRATEGY_ENV, None)
                else:
                    os.environ[moe_tp.STRATEGY_ENV] = old
    return step


def single_ms(bench, step):
    """One step on an idle GPU (host time included): median over rounds, maximum over ranks."""
    if not bench.cuda:
        return None
    samples = []
    for _ in range(bench.args.rounds):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return bench.max_all(statistics.median(samples))


def cell(args, bench, rec, group, rank, world, dev, dtype, tol):
    h, f, e, k, tl = rec["hidden"], rec["ffn"], rec["experts"], rec["topk"], rec["tokens"]
    gen = torch.Generator(device=dev).manual_seed(500 + rank)
    x = torch.randn(tl, h, generator=gen, device=dev).to(dtype).requires_grad_()
    idx = torch.rand(tl, e, generator=gen, device=dev).topk(k, dim=-1).indices
    tw = torch.randn(tl, k, generator=gen, device=dev).softmax(-1).requires_grad_()
    w13 = (torch.randn(e, 2 * f // world, h, generator=gen, device=dev) / h ** 0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(e, h, f // world, generator=gen, device=dev) / f ** 0.5).to(dtype).requires_grad_()
    g = torch.randn(tl, h, generator=gen, device=dev).to(dtype)
    # chunked moves CUDA tensors through NCCL: not on gloo (ranks sharing a GPU); decomposed: GPUs only
    skip = {"chunked": dev.type == "cuda" and moe_tp._is_gloo(group),
            "decomposed": moe_tp.decomposed_usable(dev, group) is not None}
    variants = [canonical_strategy("moe_tp", v) for v in args.variants.split(",")]  # former names too
    variants = [v for v in variants if not skip.get(v)]
    with torch.no_grad():
        _, routing = flux.ag_scatter_grouped_mm(x, idx, w13, group=group)
    rec["rows"] = routing.num_rows
    rec["choice"] = moe_tp._choose_strategy(dev, group, tl, h)[0]
    for mode in args.modes.split(","):
        res = rec.setdefault(mode, {})
        first = None
        for v in variants:
            step = make_step(v, x, idx, tw, w13, w2, group, mode, g)
            out, grads = step()
            got = [out] + [t.clone() for t in grads]
            if first is None:
                first = got
            err = bench.max_all(max(rel_err(a, b) for a, b in zip(got, first)))
            if not err <= tol:
                raise AssertionError(f"{mode} {v}: differs from {variants[0]} by {err:.3g} (tolerance {tol})")
            del got
            for _ in range(args.warmup):
                step()
            res[v] = {"rel_err": err, "loop_ms": bench.loop_ms(step), "single_ms": single_ms(bench, step),
                      "host_ms": bench.host_ms(step)}
        del first
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def run(args):
    dev, dtype, group, rank, world, bench = start(args)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    records = []
    for shape in args.shapes.split(","):
        h, f, e, k = (int(v) for v in shape.split("x"))
        for tl in (int(v) for v in args.tokens.split(",")):
            rec = {"hidden": h, "ffn": f, "experts": e, "topk": k, "tokens": tl}
            records.append(rec)
            if f % world:
                rec["status"] = f"skipped: F={f} not divisible by {world} ranks"
                continue
            status = attempt(rec, lambda: cell(args, bench, rec, group, rank, world, dev, dtype, tol))
            if rank == 0:
                print(f"H={h} F={f} E={e} K={k} T_l={tl}: {status}", flush=True)
    return finish(args, dev, dtype, records, table(records) if rank == 0 else "",
                  routing="uniform top-K without replacement, softmax weights")


def table(records):
    lines = [f"{'H':>5} {'F':>6} {'E':>3} {'K':>2} {'T_l':>5} {'mode':<6} | "
             + " | ".join(f"{v + ' l/s (host)':>22}" for v in VARIANTS) + f" | {'flux/ref l,s':>12} {'flux/seq l,s':>12} choice"]

    for r in records:
        head = f"{r['hidden']:>5} {r['ffn']:>6} {r['experts']:>3} {r['topk']:>2} {r['tokens']:>5}"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')}")
            continue
        for mode in ("fwd", "fwdbwd"):
            m = r.get(mode)
            if not m:
                continue
            cells = []
            for v in VARIANTS:
                t = m.get(v)
                cells.append("-".rjust(22) if t is None else
                             f"{_f(t['loop_ms']) + '/' + _f(t['single_ms']) + ' (' + _f(t['host_ms']) + ')':>22}")
            fl, rf, sq = m.get("flux", {}), m.get("ref", {}), m.get("sequential", {})
            x_ref = f"{ratio(rf.get('loop_ms'), fl.get('loop_ms'))},{ratio(rf.get('single_ms'), fl.get('single_ms'))}"
            x_seq = f"{ratio(sq.get('loop_ms'), fl.get('loop_ms'))},{ratio(sq.get('single_ms'), fl.get('single_ms'))}"
            lines.append(f"{head} {mode:<6} | " + " | ".join(cells) + f" | {x_ref:>12} {x_seq:>12} {r['choice']}")
    lines.append("ms per step: loop / single (host ms to enqueue); flux/ref, flux/seq: their ms / flux's (loop, single)")
    return "\n".join(lines)


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
