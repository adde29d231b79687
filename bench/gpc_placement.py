"""Which GPC each CTA of the fused AG kernels and of the L2 probe ran in, read from recorded JSONs
(no GPU): the CTAs of a cluster always run in one GPC, so the SMs of the 2-CTA clusters in
bench/probe_pdl_trace.py --cta traces show how SM numbers map to GPCs; with that map, the per-CTA
pace of lone launches and the L2 request coalescer's merging in bench/probe_l2_coalescing.py runs.

    python bench/gpc_placement.py [--traces FILE,...] [--probes FILE,...] [--json OUT]

Reported:
  clusters   per trace file, the clusters' SM pairs and how many of those on two TPCs below SM 120 lie in
             one GPC of INTERLEAVED (below), and the groups of SMs the pairs join (union over every sample);
  pace       per traced lone launch (and back to back), each CTA's time from its release to its end per
             tile, split at the widest gap: how many CTAs are in the faster group, its SMs, and whether
             that set recurs in the file's other runs; and how many pairs of CTAs in one GPC (SMs above 119
             placed by the clusters that join them to one below) share rows of A, or weight columns, in
             their first tiles;
  merging    per L2-probe variant, over the groups of CTAs that read the same rows: how many GPCs each
             group spans (by INTERLEAVED) and the share of coalescable sectors the L2 slices did not read.

INTERLEAVED: on the H100s of the traces, SM numbers deal TPCs (SM pairs 2j, 2j + 1) to the GPCs in
turn: below 64, GPC (s mod 16) div 2 (a block of 16 numbers holds one TPC of each of 8 GPCs); 64-119
in blocks of 14 (7 GPCs, from the second); above 119 the pairs are not resolved here (one group each).
"""
import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RESULTS = os.path.join(REPO, "bench", "results")

from flux.autotune.placement import join  # noqa: E402  (the union-find, shared with the library)

TRACES = ("pdl_trace-h100-cta-1280.json", "pdl_trace-h100-cta-more.json", "pdl_trace-h100-diag-1280.json",
          "pdl_trace-h100-orders-1280.json", "pdl_trace-h100-orders-768.json")
PROBES = ("probe_l2-h200-placement.json", "probe_l2-h100-cluster.json", "probe_l2-h100-sched.json")


def interleaved_gpc(sm: int):
    """The GPC of SM ``sm`` under the interleaved numbering (see above); ("tpc", j) where unresolved."""
    if sm < 64:
        return (sm % 16) // 2
    if sm < 120:
        return (sm - 64) % 14 // 2 + 1
    return ("tpc", sm // 2)


def clusters(sample, cluster=(2, 1)):
    """[[SM, ...] per cluster] of one traced launch: the CTAs whose first tiles lie in one cluster tile
    (``cluster`` = (cluster_m, cluster_n) tiles), where more than one ran."""
    members = {}
    for sm, tiles, ft in zip(sample["sm"], sample["tiles"], sample["first_tile"]):
        if tiles > 0:
            members.setdefault(((ft >> 32) // cluster[0], (ft & 0xFFFFFFFF) // cluster[1]), []).append(sm)
    return [sms for sms in members.values() if len(sms) > 1]


def _traced(doc):
    """(label, mode, sample, cluster) of every launch of a multi-CTA cluster traced in a probe_pdl_trace
    JSON; cluster: (cluster_m, cluster_n) of its configuration (flux/fused_configs.py)."""
    from flux import fused_configs as fc
    for r in doc["results"]:
        cluster = tuple(fc.config("ag", int(r["variant"].split("/")[0][1:])).cluster) if "cta" in r else (1, 1)
        for mode, c in (r.get("cta") or {}).items():
            if c and c.get("sample") and cluster[0] * cluster[1] > 1:
                order = f" order {r['order']}" if r.get("order") else ""
                yield f"{r['m']}x{r['n']}x{r['k']} {r['variant']} pdl{r['pdl']}{order}", mode, c["sample"], cluster


def _pace(sample):
    """(per-tile µs per SM, threshold at the widest gap, the faster SMs)."""
    s = sample
    t = {}
    for j, sm in enumerate(s["sm"]):
        if s["tiles"][j] > 0:
            end = max(s["producer_end"][j], s["consumer0_end"][j], s["consumer1_end"][j])
            t[sm] = (end - s["go"][j]) / 1000 / s["tiles"][j]
    vals = sorted(t.values())
    gap, i = max((vals[i + 1] - vals[i], i) for i in range(len(vals) - 1))
    thr = (vals[i] + vals[i + 1]) / 2
    return t, gap, thr, sorted(sm for sm, v in t.items() if v < thr)


def gpc_map(pairs):
    """{SM: GPC}: INTERLEAVED below SM 120; above, the GPC of an SM below 120 that a cluster joined it to."""
    out = {}
    for g in join(pairs):
        known = {interleaved_gpc(s) for s in g if s < 120}
        for s in g:
            if s < 120:
                out[s] = interleaved_gpc(s)
            elif len(known) == 1:
                out[s] = next(iter(known))
    return out


def sharing(sample, gpc_of):
    """(pairs of CTAs in one GPC whose first tiles share a tile row, i.e. rows of A; pairs sharing a tile
    column, i.e. columns of the weight), over the CTAs whose SM's GPC is known."""
    by = {}
    for sm, tiles, ft in zip(sample["sm"], sample["tiles"], sample["first_tile"]):
        if tiles > 0 and sm in gpc_of:
            by.setdefault(gpc_of[sm], []).append((ft >> 32, ft & 0xFFFFFFFF))
    rows = cols = 0
    for tiles in by.values():
        for i, x in enumerate(tiles):
            for y in tiles[i + 1:]:
                rows += x[0] == y[0]
                cols += x[1] == y[1]
    return rows, cols


def trace_report(path):
    doc = json.load(open(path))
    pairs, runs, samples = [], [], []
    for label, mode, sample, cluster in _traced(doc):
        cl = clusters(sample, cluster)
        pairs += cl
        samples.append(sample)
        t, gap, thr, fast = _pace(sample)
        runs.append({"run": f"{label} {mode}", "ctas": len(t), "idle_sms": sorted(set(range(132)) - set(t))[:16],
                     "gap_us": round(gap, 2), "split_us": round(thr, 2), "faster": len(fast),
                     "faster_sms": fast if len(fast) <= 48 else None,
                     "us": [round(min(t.values()), 2), round(max(t.values()), 2)]})
    gpc_of = gpc_map(pairs)
    for r, sample in zip(runs, samples):
        r["a_row_pairs_in_a_gpc"], r["weight_column_pairs_in_a_gpc"] = sharing(sample, gpc_of)
    # Pairs of one TPC (SMs 2j, 2j + 1) say nothing of the numbering; the others do.
    resolved = [sms for sms in pairs if max(sms) < 120 and len({s // 2 for s in sms}) > 1]
    same = sum(len({interleaved_gpc(s) for s in sms}) == 1 for sms in resolved)
    sets = {}
    for r in runs:
        if r["faster_sms"]:
            sets.setdefault(tuple(r["faster_sms"]), []).append(r["run"])
    return {"file": os.path.basename(path), "commit": doc.get("commit"), "device": doc.get("device"),
            "cluster_pairs": len(pairs), "pairs_across_tpcs_below_sm_120": len(resolved), "pairs_in_one_interleaved_gpc": same,
            "gpc_groups": join(pairs), "pace": runs,
            "faster_sets": [{"sms": list(k), "runs": v} for k, v in sets.items()]}


def probe_report(path):
    doc = json.load(open(path))
    out = []
    for v in doc["variants"]:
        sm, g, cl = v["smid"], v["group"], v.get("cluster", 1) or 1
        units = len(sm) // cl
        per = units // g
        spans = []
        for j in range(per):
            us = [j + i * per for i in range(g)] if v.get("spread") else [j * g + i for i in range(g)]
            for r in range(cl):
                spans.append(len({interleaved_gpc(sm[u * cl + r]) for u in us}))
        m = v["metrics"]
        read = m.get("lts__t_sectors_op_read.sum [sector]")
        asked = m.get("lrc__request_sectors_op_read_coalescable.sum [sector]")
        out.append({"variant": {k: v.get(k) for k in ("group", "stagger", "delay", "policy", "spread", "barrier",
                                                       "cluster", "sched")},
                    "gpcs_per_group": round(sum(spans) / len(spans), 2),
                    "groups_in_one_gpc": sum(x == 1 for x in spans), "groups": len(spans),
                    "merged": round(1 - read / asked, 3) if read and asked else None})
    return {"file": os.path.basename(path), "commit": doc.get("commit"), "device": doc.get("device"), "variants": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=",".join(TRACES), help="probe_pdl_trace --cta JSONs (in bench/results or paths)")
    p.add_argument("--probes", default=",".join(PROBES), help="probe_l2_coalescing JSONs")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    def path(name):
        return name if os.path.exists(name) else os.path.join(RESULTS, name)
    doc = {"command": "python bench/gpc_placement.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "traces": [trace_report(path(f)) for f in args.traces.split(",") if f],
           "probes": [probe_report(path(f)) for f in args.probes.split(",") if f]}
    for t in doc["traces"]:
        print(f"{t['file']} ({t['device']}): {t['pairs_in_one_interleaved_gpc']} of the "
              f"{t['pairs_across_tpcs_below_sm_120']} cluster pairs across two TPCs below SM 120 in one interleaved GPC ({t['cluster_pairs']} pairs); groups of SMs "
              f"joined: {[len(g) for g in t['gpc_groups']]}")
        for r in t["pace"]:
            print(f"  {r['run']}: {r['ctas']} CTAs {r['us'][0]}-{r['us'][1]} us per tile, widest gap "
                  f"{r['gap_us']} us at {r['split_us']}: {r['faster']} faster; pairs in a GPC sharing rows of A "
                  f"{r['a_row_pairs_in_a_gpc']}, weight columns {r['weight_column_pairs_in_a_gpc']}")
        for s in t["faster_sets"]:
            if len(s["runs"]) > 1:
                print(f"  the same {len(s['sms'])} faster SMs in {len(s['runs'])} runs: {s['sms']}")
    for pr in doc["probes"]:
        print(f"{pr['file']} ({pr['device']}):")
        for v in pr["variants"]:
            print(f"  {v['variant']}: {v['groups_in_one_gpc']} of {v['groups']} row-sharing groups in one GPC, "
                  f"{v['gpcs_per_group']} GPCs per group; merged {v['merged']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
