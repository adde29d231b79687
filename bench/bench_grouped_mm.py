"""The expert GEMMs of a MoE layer alone, on one GPU: ``flux.ops.grouped_mm`` as flux.nn.MoE
calls it (``auto``: flux's CUTLASS grouped kernels where its rule picks one, else torch's; the
counts on the host), flux's kernels for every product (``cutlass``), torch._grouped_mm with
flux's backward (``kernel``), with the Triton weight gradient (``hybrid``), through the Triton
prototype (``triton``);
torch._grouped_mm with torch's own autograd (``torch``, what the stock layer runs); one dense
``torch.mm`` of the same FLOPs (``dense``: the floor a grouped GEMM would reach without any
per-group cost). ``--wgrad``: also the weight gradient alone (dW_e = dy_e^T x_e), torch's kernel
against each built flux configuration, as ``"wgrad": {"torch": ms, "c<id>": ms, "status"}`` per cell (the
figures the rule in flux/ops/grouped_mm.py is set from).

For T tokens routed top-k (uniformly at random) over E experts, R = T x k rows sorted by expert,
the layer's two GEMMs: W13 (N = 2 x FFN, K = H) and W2 (N = H, K = FFN), weights "nk", bf16.
Each cell times the forward and the forward+backward (dx and dW) as a loop of --steps calls
between CUDA events, after --warmup calls, --rounds times: the median ms per call. Before timing,
the Triton and CUTLASS outputs are compared with torch._grouped_mm's (relative error recorded).

    python bench/bench_grouped_mm.py --out grouped_mm.json
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from bench_layers import _commit, _f, attempt, ratio, rel_err  # noqa: E402
from flux.ops.grouped_mm import grouped_mm  # noqa: E402

IMPLS = ("auto", "cutlass", "kernel", "hybrid", "triton", "torch", "dense")
DEV = "cuda"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096", help="T, comma-separated")
    p.add_argument("--experts", default="8,64", help="E, comma-separated")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--impls", default=",".join(IMPLS), help=f"among {IMPLS}")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="calls per timed loop")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wgrad", action="store_true", help="also the weight gradient alone, torch's kernel and "
                   "each built flux configuration")
    p.add_argument("--out", default=None, help="JSON file")
    return p.parse_args(argv)


def loop_ms(fn, args):
    """Median over rounds of (events around ``steps`` back-to-back calls) / steps."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / args.steps)
    return statistics.median(times)


def calls(impl, x, w, offs, dy, counts_host):
    """(forward, forward+backward) closures of one implementation."""
    if impl == "dense":  # [R, K] @ [K, N]: the same FLOPs as the grouped product
        wd = w.reshape(-1, x.shape[1])[: dy.shape[1]].t().detach().requires_grad_()

        def fwd():
            return x @ wd
        return fwd, lambda: torch.autograd.grad(fwd(), (x, wd), dy)

    if impl == "torch":
        def fwd():
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return fwd, lambda: torch.autograd.grad(fwd(), (x, w), dy)

    def fwd():
        return grouped_mm(x, w, offs, cumulative=True, impl=impl, counts_host=counts_host)
    return fwd, lambda: torch.autograd.grad(fwd(), (x, w), dy)


def cell(args, rec, impls, gen):
    tokens, experts, n, k = rec["tokens"], rec["experts"], rec["n"], rec["k"]
    dev, dtype = torch.device(DEV), torch.bfloat16
    idx = torch.rand(tokens, experts, generator=gen).topk(args.topk, dim=1).indices
    counts = torch.bincount(idx.flatten(), minlength=experts)
    rec["counts_min_max"] = [int(counts.min()), int(counts.max())]
    offs = counts.cumsum(0).to(dev, torch.int32)
    rows = tokens * args.topk
    x = torch.randn(rows, k, generator=gen).to(dev, dtype).requires_grad_()
    w = (torch.randn(experts, n, k, generator=gen) / k ** 0.5).to(dev, dtype).requires_grad_()
    dy = torch.randn(rows, n, generator=gen).to(dev, dtype)
    flops = 2.0 * rows * n * k
    fns = {impl: calls(impl, x, w, offs, dy, counts.tolist()) for impl in impls}
    for other in ("triton", "cutlass"):
        if "kernel" in fns and other in fns:
            with torch.no_grad():
                rec[f"{other}_vs_kernel_rel_err"] = rel_err(fns[other][0](), fns["kernel"][0]())
    for impl, (fwd, both) in fns.items():
        sub = {}
        rec[impl] = sub

        def run(fwd=fwd, both=both, sub=sub):
            with torch.no_grad():
                sub["fwd_ms"] = loop_ms(fwd, args)
            sub["fwd_bwd_ms"] = loop_ms(both, args)
            sub["fwd_tflops"] = flops / sub["fwd_ms"] / 1e9
            sub["fwd_bwd_tflops"] = 3 * flops / sub["fwd_bwd_ms"] / 1e9
        attempt(sub, run)
    if args.wgrad:
        rec["wgrad"] = {}
        with torch.no_grad():
            attempt(rec["wgrad"], lambda: wgrad_alone(args, rec["wgrad"], x, dy, offs))


def wgrad_alone(args, out, x, dy, offs):
    """``out``: ms of dW = dy_e^T x_e per expert, "torch" (torch._grouped_mm) and "c<id>" (each
    built flux configuration)."""
    from flux import fused_configs
    from flux.ops.grouped_mm import grouped_built

    kind = fused_configs.GROUPED_KINDS.index("wgrad")
    x, dy = x.detach(), dy.detach()
    out["torch"] = loop_ms(lambda: torch._grouped_mm(dy.t(), x, offs=offs), args)
    for c in sorted(c for c, k in grouped_built() if k == "wgrad"):
        out[f"c{c}"] = loop_ms(lambda c=c: torch.ops.flux.grouped_mm_cutlass(dy, x, offs, kind, c), args)


def table(records, impls):
    head = f"{'T':>5} {'E':>3} {'gemm':>4} " + " ".join(f"{i + ' fwd':>11} {i + ' f+b':>11}" for i in impls)
    others = [i for i in ("auto", "cutlass", "hybrid", "triton", "torch") if i in impls]
    head += "".join(f"  {i + '/kernel':>14}" for i in others)
    lines = [head + "  err (triton, cutlass)", "-" * len(head)]
    for r in records:
        ms = [(r.get(i, {}).get("fwd_ms"), r.get(i, {}).get("fwd_bwd_ms")) for i in impls]
        kern = r.get("kernel", {}).get("fwd_bwd_ms")
        lines.append(f"{r['tokens']:>5} {r['experts']:>3} {r['gemm']:>4} "
                     + " ".join(f"{_f(a):>11} {_f(b):>11}" for a, b in ms)
                     + "".join(f"  {ratio(r.get(i, {}).get('fwd_bwd_ms'), kern):>14}" for i in others)
                     + f"  {_f(r.get('triton_vs_kernel_rel_err'), '.1e')}"
                     + f" {_f(r.get('cutlass_vs_kernel_rel_err'), '.1e')}")
    return "\n".join(lines) + "\n(ms per call, median; x/kernel: forward+backward, < 1: faster than the kernel path)"


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_grouped_mm: needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = [i for i in args.impls.split(",") if i]
    gen = torch.Generator().manual_seed(args.seed)
    records = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for experts in [int(e) for e in args.experts.split(",")]:
            for gemm, n, k in (("w13", 2 * args.ffn, args.hidden), ("w2", args.hidden, args.ffn)):
                rec = {"tokens": tokens, "experts": experts, "topk": args.topk, "gemm": gemm, "n": n, "k": k}
                attempt(rec, lambda rec=rec: cell(args, rec, impls, gen))
                records.append(rec)
                print(json.dumps(rec), flush=True)
    meta = {"command": " ".join(["python"] + sys.argv), "commit": _commit(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "weight_layout": "nk",
            "triton": getattr(sys.modules.get("triton"), "__version__", None),  # imported by the triton cells
            **{k: v for k, v in vars(args).items() if k != "out"}}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"metadata": meta, "results": records}, fh, indent=1)
    print("\n" + table(records, impls))
    ok = all(r["status"] == "ok" and all(r.get(i, {}).get("status") == "ok" for i in impls) for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
