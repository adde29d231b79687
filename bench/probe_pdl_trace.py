"""Where back-to-back launches of a fused kernel overlap: kernel start and end times from the CUDA
profiler (CUPTI, through torch.profiler), for calls back to back and for calls on an idle GPU.

Loop and graph timing (bench/bench_fused_gemm.py) read some fused kernels faster back to back under
programmatic dependent launch than alone (docs/performance.md §9). This probe records when each
kernel of a run of calls starts and ends on the GPU, so that the time a call takes back to back
splits into its own duration and its overlap with the kernel before it:

    python bench/probe_pdl_trace.py [--op ag] [--shapes 1024x8192x1280] [--configs served,75,76]
        [--pdl 1,0] [--calls 16] [--out FILE]

Per shape and variant (cuBLAS's ``torch.mm``, and each fused configuration with each PDL setting):
``calls`` launches back to back behind a GPU spin (so that the host enqueues ahead), then ``calls``
launches each alone (synchronised, behind a spin). From the profiler's kernel records, medians over
the calls after the first: ``dur_us`` (a kernel's start to its end), ``step_us`` (one start to the
next), ``overlap_us`` (the previous kernel's end minus this one's start; positive where they overlap),
and ``alone_us`` (duration of a lone call). The spin kernel is left out.

No GPU: one line, exit 1.

JSON (--out): {"format": 1, "command", "commit", "device", "results": [{"op", "m", "n", "k", "variant",
"pdl", "kernels": [names], "back_to_back": {"dur_us", "step_us", "overlap_us", "n"}, "alone": {"dur_us",
"n"}}]}.
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SPIN_CYCLES = 2_000_000  # ~1 ms: the host enqueues every call of a back-to-back run behind it


def _kernels(trace_path):
    """[(name, start_us, end_us)] of the GPU kernels in a chrome trace, the spin left out, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") != "kernel" or e.get("ph") != "X":
            continue
        name = e.get("name", "")
        if "spin" in name or "sleep" in name.lower():
            continue
        out.append((name, float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return sorted(out, key=lambda x: x[1])


def _profiled(run):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        prof.export_chrome_trace(path)
        return _kernels(path)
    finally:
        os.unlink(path)


def _median(xs):
    return statistics.median(xs) if xs else None


def trace_variant(fns, calls):
    """{"back_to_back": ..., "alone": ..., "kernels": names} of launcher list ``fns`` (one call each)."""
    for f in fns:  # warm-up, outside the profile
        f()
    torch.cuda.synchronize()

    def b2b():
        torch.cuda._sleep(SPIN_CYCLES)
        for i in range(calls):
            fns[i % len(fns)]()

    def alone():
        for i in range(calls):
            torch.cuda.synchronize()
            torch.cuda._sleep(SPIN_CYCLES // 10)
            fns[i % len(fns)]()

    ks = _profiled(b2b)
    # Calls that launch several kernels (split-K's reduction): the call's span is its first kernel's
    # start to its last's end.
    per = max(1, len(ks) // calls)
    spans = [(ks[i][1], max(e for _, _, e in ks[i:i + per])) for i in range(0, per * calls, per)]
    b = {"dur_us": _median([e - s for s, e in spans[1:]]),
         "step_us": _median([spans[i][0] - spans[i - 1][0] for i in range(2, len(spans))]),
         "overlap_us": _median([spans[i - 1][1] - spans[i][0] for i in range(2, len(spans))]),
         "n": len(spans)}
    ka = _profiled(alone)
    aspans = [(ka[i][1], max(e for _, _, e in ka[i:i + per])) for i in range(0, per * calls, per)]
    a = {"dur_us": _median([e - s for s, e in aspans[1:]]), "n": len(aspans)}
    return {"kernels": sorted({n[:120] for n, _, _ in ks}), "back_to_back": b, "alone": a}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("ag", "rs"), default="ag")
    p.add_argument("--shapes", default="1024x8192x1280", help="MxKxN,... (the kernel's own rows)")
    p.add_argument("--configs", default="served", help="'served' and/or configuration ids, e.g. served,75,76")
    p.add_argument("--pdl", default="1,0")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pdl_trace: needs a CUDA GPU; nothing run")
        return 1
    import flux  # noqa: F401
    from flux.autotune import kernels as K
    from flux.autotune.kernel_timing import KernelProblem
    from flux.autotune.model_grid import parse_shapes
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from bench_fused_gemm import commit

    switch = torch.ops.flux.set_fused_pdl
    results = []
    for rec in parse_shapes(args.op, args.shapes):
        m, n, k = rec["m"], rec["n"], rec["k"]
        prob = KernelProblem(args.op, m, n, k, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
        served = K.label(*K.choose_config(args.op, m, n, k, torch.bfloat16, torch.bfloat16))
        labels = []
        for c in args.configs.split(","):
            labels.append(served if c == "served" else f"c{int(c)}/r1/s1")
        variants = [("cublas", None, prob.cublas())]
        for lab in dict.fromkeys(labels):
            cfg, raster, swz = K.parse_label(lab)
            for pdl in (int(x) for x in args.pdl.split(",")):
                variants.append((lab, pdl, prob.fused(cfg, raster, swz)))
        for name, pdl, fns in variants:
            if pdl is not None:
                switch(bool(pdl))
            r = dict(op=args.op, m=m, n=n, k=k, variant=name, pdl=pdl, **trace_variant(fns, args.calls))
            switch(True)
            results.append(r)
            b, a = r["back_to_back"], r["alone"]
            print(f"{args.op} {m}x{k}x{n} {name:>12} pdl={pdl}: back to back dur {b['dur_us']:.1f} step "
                  f"{b['step_us']:.1f} overlap {b['overlap_us']:.1f} us; alone {a['dur_us']:.1f} us", flush=True)
        del prob
    if args.out:
        doc = {"format": 1, "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "commit": commit(),
               "device": torch.cuda.get_device_name(), "results": results}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
