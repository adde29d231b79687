"""Where back-to-back launches of a fused kernel overlap: kernel start and end times from the CUDA
profiler (CUPTI, through torch.profiler), for calls back to back and for calls on an idle GPU.

Loop and graph timing (bench/bench_fused_gemm.py) read some fused kernels faster back to back under
programmatic dependent launch than alone (docs/performance.md §9). This probe records when each
kernel of a run of calls starts and ends on the GPU, so that the time a call takes back to back
splits into its own duration and its overlap with the kernel before it:

    python bench/probe_pdl_trace.py [--op ag] [--shapes 1024x8192x1280] [--configs served,75,76]
        [--pdl 1,0] [--calls 16] [--cta] [--out FILE]

Per shape and variant (cuBLAS's ``torch.mm``, and each fused configuration with each PDL setting):
``calls`` launches back to back behind a GPU spin (so that the host enqueues ahead), then ``calls``
launches each alone (synchronised, behind a spin). From the profiler's kernel records, medians over
the calls after the first: ``dur_us`` (a kernel's start to its end), ``step_us`` (one start to the
next), ``overlap_us`` (the previous kernel's end minus this one's start; positive where they overlap),
and ``alone_us`` (duration of a lone call). The spin kernel is left out.

--cta (ag only): the fused kernels also record, per CTA, their SM and %globaltimer times
(torch.ops.flux.set_fused_trace; csrc/ag_gemm/ag_tile_scheduler.hpp AgTrace): when its tile scheduler is
built, when its producer may first load (after the wait for the preceding grids), and when its producer and
consumer warp groups run out of tiles. Per call, in µs from the call's first CTA: ``built_spread`` (the
last CTA built), ``go_spread`` (the last producer released), ``go_after_built`` (median and max per CTA),
``work`` (first release to last end), ``span`` (first CTA built to last end), ``end_spread`` (first to last
CTA end), and back to back ``after_prev`` (this call's first release after the previous call's last end);
medians over the calls after the first, and one call's per-CTA times in full.

--orders (ag, persistent configurations): each fused variant again with its cluster tiles permuted
(torch.ops.flux.set_fused_order; what each CTA computes is unchanged, only which tile runs where and when):
``identity`` (none), ``random:SEED`` (a uniform permutation), ``pdl`` (each SM pair of a lone launch given the
cluster tile that a back-to-back launch under PDL ran on those SMs: the lone launch's placement made like
the one back to back; ``matched`` is the share of cluster tiles that got it), ``gpc`` and ``gpc-m`` (the
clusters of a lone launch that run in one GPC given consecutive cluster tiles, along N: sharing rows of A,
or along M: sharing columns of the weight), and ``deal`` (no table: the kernel itself deals the cluster tiles
of a one-wave launch of 2-CTA clusters by the GPC each cluster lands in, torch.ops.flux.set_fused_deal, in
every launch, alone or back to back). The GPCs are those learnt from clustered launches
(flux/autotune/placement.py), joined with those the traces of every variant so far show: the CTAs of a
cluster run in one GPC; the groups found are recorded per variant. Questions of placement: does a lone launch with the tiles where back-to-back launches put them,
or with the CTAs that share an operand in one GPC (whose loads the L2's request coalescer may merge), run
as fast as back-to-back launches do?

No GPU: one line, exit 1.

JSON (--out): {"format": 1, "command", "commit", "device", "results": [{"op", "m", "n", "k", "variant",
"pdl", "order"?, "matched"?, "kernels": [names], "back_to_back": {"dur_us", "step_us", "overlap_us", "n"},
"alone": {"dur_us", "n"}, "cta"?: {"alone": {metric: µs, "ctas", "sms", "tick_ns", "sample": {slot: [per CTA]}},
"back_to_back": {...}}} and, with the pdl or gpc orders, {"op", "m", "n", "k", "variant", "gpc_groups": [[SM
ids of one GPC], ...]}]}.
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
sys.path.insert(0, os.path.join(REPO, "bench"))
from gpc_placement import clusters, join  # noqa: E402

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


SLOTS = ("sm", "built", "go", "producer_end", "consumer0_end", "consumer1_end", "tiles", "first_tile")
MAX_CTAS = 4096


def _cta_metrics(buf, calls):
    """Per-call metrics (µs) of the trace buffers buf[i] ([MAX_CTAS, 8] int64), medians over calls 1..."""
    rows = []
    for i in range(calls):
        t = buf[i].cpu()
        t = t[t[:, 1] != 0]
        if len(t) == 0:
            return None
        worked = t[t[:, 6] > 0]  # a CTA handed no tile has no release time
        if len(worked) == 0:
            return None
        built, go = t[:, 1].double(), worked[:, 2].double()
        end = t[:, 3:6].max(dim=1).values.double()
        t0 = built.min()
        r = {"ctas": len(t), "sms": len(set(t[:, 0].tolist())),
             "built_spread": float(built.max() - t0) / 1e3, "go_spread": float(go.max() - go.min()) / 1e3,
             "go_after_built_median": float((go - worked[:, 1].double()).median()) / 1e3,
             "go_after_built_max": float((go - worked[:, 1].double()).max()) / 1e3,
             "work": float(end.max() - go.min()) / 1e3, "span": float(end.max() - t0) / 1e3,
             "end_spread": float(end.max() - end.min()) / 1e3, "_go0": float(go.min()), "_end": float(end.max())}
        d = (built - t0)
        nz = d[d > 0]
        r["tick_ns"] = float(nz.min()) if len(nz) else None
        rows.append(r)
    for i in range(1, calls):
        rows[i]["after_prev"] = (rows[i]["_go0"] - rows[i - 1]["_end"]) / 1e3
    keys = [k for k in rows[-1] if not k.startswith("_")]
    out = {k: _median([r[k] for r in rows[1:] if r.get(k) is not None]) for k in keys}
    t = buf[calls // 2].cpu()
    t = t[t[:, 1] != 0]
    t0 = int(t[:, 1].min())
    out["sample"] = {name: [int(v) - (t0 if 1 <= j <= 5 else 0) for v in t[:, j].tolist()]
                     for j, name in enumerate(SLOTS)}
    out["_placements"] = []  # every call's (SM, tiles, first tile) per CTA: gpc_groups
    for i in range(calls):
        t = buf[i].cpu()
        t = t[t[:, 1] != 0]
        out["_placements"].append({"sm": t[:, 0].tolist(), "tiles": t[:, 6].tolist(), "first_tile": t[:, 7].tolist()})
    return out


def trace_ctas(fns, calls):
    """{"alone": ..., "back_to_back": ...} of the per-CTA trace (_cta_metrics); ``_placements`` (every
    call's SMs and first tiles) is for the orders below, not the JSON."""
    set_trace = torch.ops.flux.set_fused_trace
    out = {}
    for mode in ("alone", "back_to_back"):
        buf = torch.zeros(calls, MAX_CTAS, len(SLOTS), dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        try:
            if mode == "back_to_back":
                torch.cuda._sleep(SPIN_CYCLES)
            for i in range(calls):
                if mode == "alone":
                    torch.cuda.synchronize()
                    torch.cuda._sleep(SPIN_CYCLES // 10)
                set_trace(buf[i].data_ptr())
                fns[i % len(fns)]()
        finally:
            set_trace(0)
        torch.cuda.synchronize()
        out[mode] = _cta_metrics(buf, calls)
    return out


def _cluster_grid(op, config, m, n):
    """(cluster rows, cluster columns, (cluster_m, cluster_n)) of the persistent AG scheduler's cluster
    tiles (csrc/ag_gemm/ag_tile_scheduler.hpp)."""
    from flux import fused_configs as fc
    c = fc.config(op, config)
    rows = -(-(-(-m // c.tile[0])) // c.cluster[0])
    cols = -(-(-(-n // c.tile[1])) // c.cluster[1])
    return rows, cols, c.cluster


def _cluster_tile(first_tile, cols, cluster):
    return (first_tile >> 32) // cluster[0] * cols + (first_tile & 0xFFFFFFFF) // cluster[1]


def pdl_order(alone, b2b, rows, cols, cluster):
    """(permutation, matched): the cluster tile each cluster of a lone launch (its CTAs on the SMs of
    ``alone``'s sample, identity order) serves so that its SMs compute what ``b2b``'s sample (a launch
    back to back under PDL) computed on them; clashes and the tiles of later waves go first come, first
    served. ``matched``: the share of cluster tiles placed as back to back."""
    count = rows * cols
    on_sm = {}
    for sm, ft, tiles in zip(b2b["sm"], b2b["first_tile"], b2b["tiles"]):
        if tiles > 0:
            on_sm[sm] = _cluster_tile(ft, cols, cluster)
    sms_of = {}  # identity cluster tile -> the SMs of the lone launch that served it first
    for sm, ft, tiles in zip(alone["sm"], alone["first_tile"], alone["tiles"]):
        if tiles > 0:
            sms_of.setdefault(_cluster_tile(ft, cols, cluster), []).append(sm)
    perm, taken = [None] * count, set()
    for c, sms in sorted(sms_of.items()):
        wants = [on_sm[s] for s in sms if s in on_sm]
        for want in sorted(set(wants), key=lambda w: -wants.count(w)):
            if want not in taken and want < count:
                perm[c] = want
                taken.add(want)
                break
    matched = sum(p is not None for p in perm) / count
    free = iter(c for c in range(count) if c not in taken)
    perm = [p if p is not None else next(free) for p in perm]
    return perm, matched


def gpc_groups(placements, cluster, joined=()):
    """The SMs grouped by GPC as far as the placements show: the CTAs of a cluster run in one GPC
    (CUDA's guarantee), so the SMs of every cluster of every call are joined (bench/gpc_placement.py),
    and so are those of ``joined`` (SM lists of clusters seen before, of any configuration: the GPCs are
    the machine's); back-to-back launches under PDL place clusters across the GPC, lone ones on
    neighbouring SMs. Every SM that ran is in some group; sorted lists of SM ids, largest group first."""
    sms = sorted({sm for pl in placements for sm in pl["sm"]})
    return join([[sm] for sm in sms] + list(joined) + [c for pl in placements for c in clusters(pl, cluster)])


def gpc_order(alone, groups, rows, cols, cluster, along="n"):
    """A permutation that deals the cluster tiles to the GPCs of a lone launch in runs: the clusters
    whose SMs (``alone``'s sample, identity order) lie in one group of ``groups`` take consecutive
    cluster tiles, along N (``along`` "n": a GPC's clusters share rows of A) or along M ("m": they
    share columns of the weight); tiles no first-wave cluster took keep the rest of that sequence."""
    count = rows * cols
    seq = list(range(count)) if along == "n" else [r * cols + c for c in range(cols) for r in range(rows)]
    group_of = {sm: i for i, g in enumerate(groups) for sm in g}
    gpc_of_tile = {}  # identity cluster tile -> its group
    for sm, ft, tiles in zip(alone["sm"], alone["first_tile"], alone["tiles"]):
        if tiles > 0:
            gpc_of_tile.setdefault(_cluster_tile(ft, cols, cluster), group_of.get(sm, len(groups)))
    perm, it = [None] * count, iter(seq)
    for c, _ in sorted(gpc_of_tile.items(), key=lambda x: (x[1], x[0])):
        if c < count:
            perm[c] = next(it)
    taken = {p for p in perm if p is not None}
    rest = iter(t for t in seq if t not in taken)
    return [p if p is not None else next(rest) for p in perm]


def order_table(perm, device="cuda"):
    """The table set_fused_order reads: the permutation, then its inverse (int32)."""
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return torch.tensor(perm + inv, dtype=torch.int32, device=device)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("ag", "rs"), default="ag")
    p.add_argument("--shapes", default="1024x8192x1280", help="MxKxN,... (the kernel's own rows)")
    p.add_argument("--configs", default="served",
                   help="'served', configuration ids (raster along N, no band) or labels, e.g. served,75,c75/r2/s1")
    p.add_argument("--pdl", default="1,0")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--cta", action="store_true", help="ag: also the per-CTA trace of the fused kernels")
    p.add_argument("--orders", default="identity",
                   help="ag: cluster-tile orders of each fused variant: identity, random:SEED, pdl, gpc, gpc-m "
                        "(see above)")
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
    from flux.autotune import placement as learnt
    deal = None  # (table, claims, sms) for the deal order, made at its first run
    try:  # the GPCs learnt from clustered launches; the clusters traced below join in
        machine = learnt.gpc_groups()
    except RuntimeError as e:
        print(f"probe_pdl_trace: GPCs from the traces only ({e})", flush=True)
        machine = []
    for rec in parse_shapes(args.op, args.shapes):
        m, n, k = rec["m"], rec["n"], rec["k"]
        prob = KernelProblem(args.op, m, n, k, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
        served = K.label(*K.choose_config(args.op, m, n, k, torch.bfloat16, torch.bfloat16))
        labels = []
        for c in args.configs.split(","):
            labels.append(served if c == "served" else c if c.startswith("c") else f"c{int(c)}/r1/s1")
        variants = [("cublas", None, prob.cublas())]
        for lab in dict.fromkeys(labels):
            cfg, raster, swz = K.parse_label(lab)
            for pdl in (int(x) for x in args.pdl.split(",")):
                variants.append((lab, pdl, prob.fused(cfg, raster, swz)))
        runs = []  # (name, pdl, fns, order): order None (not set), or (label, table, matched)
        placement = []  # the GPC groups the traces showed, per variant
        for name, pdl, fns in variants:
            if pdl is None or args.op != "ag" or args.orders == "identity":
                runs.append((name, pdl, fns, None))
                continue
            rows, cols, cluster = _cluster_grid(args.op, K.parse_label(name)[0], m, n)
            seen = None  # identity traces of this variant (pdl, gpc orders)
            for o in args.orders.split(","):
                if o == "identity":
                    runs.append((name, pdl, fns, ("identity", None, None)))
                elif o == "deal":  # no table: the kernel deals by the GPC each cluster runs in
                    runs.append((name, pdl, fns, ("deal", None, None)))
                elif o.startswith("random:"):
                    g = torch.Generator().manual_seed(int(o.split(":")[1]))
                    perm = torch.randperm(rows * cols, generator=g).tolist()
                    runs.append((name, pdl, fns, (o, order_table(perm), None)))
                elif o in ("pdl", "gpc", "gpc-m"):
                    if seen is None:
                        switch(True)
                        seen = trace_ctas(fns, max(8, args.calls))
                        pls = seen["alone"]["_placements"] + seen["back_to_back"]["_placements"]
                        groups = gpc_groups(pls, cluster, machine)
                        machine += [c for pl in pls for c in clusters(pl, cluster)]
                        placement.append({"variant": name, "gpc_groups": groups})
                    if o == "pdl":
                        perm, matched = pdl_order(seen["alone"]["sample"], seen["back_to_back"]["sample"], rows,
                                                  cols, cluster)
                        runs.append((name, pdl, fns, (o, order_table(perm), matched)))
                    else:
                        perm = gpc_order(seen["alone"]["sample"], groups, rows, cols, cluster,
                                         "m" if o == "gpc-m" else "n")
                        runs.append((name, pdl, fns, (o, order_table(perm), None)))
                else:
                    raise SystemExit(f"probe_pdl_trace: unknown order {o!r} (identity, random:SEED, pdl, gpc, gpc-m, "
                                     "deal)")
        set_order = torch.ops.flux.set_fused_order if any(r[3] for r in runs) else None
        for name, pdl, fns, order in runs:
            if pdl is not None:
                switch(bool(pdl))
            if order is not None and order[1] is not None:
                set_order(order[1].data_ptr(), order[1].numel() // 2)
            if order is not None and order[0] == "deal":
                if deal is None:
                    deal = learnt.deal_buffers()
                torch.ops.flux.set_fused_deal(deal[0].data_ptr(), deal[1].data_ptr(), deal[2])
            try:
                r = dict(op=args.op, m=m, n=n, k=k, variant=name, pdl=pdl, **trace_variant(fns, args.calls))
                if order is not None:
                    r["order"] = order[0]
                    if order[2] is not None:
                        r["matched"] = order[2]
                if args.cta and args.op == "ag" and pdl is not None:
                    r["cta"] = trace_ctas(fns, args.calls)
                    for c in r["cta"].values():
                        if c:
                            c.pop("_placements", None)
            finally:
                if set_order is not None:
                    set_order(0, 0)
                if deal is not None:
                    torch.ops.flux.set_fused_deal(0, 0, 0)
            switch(True)
            results.append(r)
            if order is not None:
                name = f"{name}/{order[0]}"
            b, a = r["back_to_back"], r["alone"]
            print(f"{args.op} {m}x{k}x{n} {name:>12} pdl={pdl}: back to back dur {b['dur_us']:.1f} step "
                  f"{b['step_us']:.1f} overlap {b['overlap_us']:.1f} us; alone {a['dur_us']:.1f} us", flush=True)
            for mode, c in (r.get("cta") or {}).items():
                if c:
                    print(f"    cta {mode:>12}: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()
                                                          if k != "sample" and v is not None), flush=True)
        for g in placement:
            results.append(dict(op=args.op, m=m, n=n, k=k, **g))
            print(f"{args.op} {m}x{k}x{n} {g['variant']}: GPC groups of SMs "
                  + " ".join(str(len(x)) for x in g["gpc_groups"]), flush=True)
        del prob
        if args.out:  # after every shape: a run cut short by its time limit keeps what it measured
            doc = {"format": 1, "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                   "commit": commit(), "device": torch.cuda.get_device_name(), "results": results}
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
