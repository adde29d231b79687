"""The fused kernels' targets over bench/bench_fused_gemm.py JSON files, no GPU needed:

    python bench/fused_scoreboard.py bench/results/fused_gemm-h200-models.json \\
        [--choice shipped|served|tuned|analytic|alone] [--against tuned|...] [--timings loop,graph[,spin]]
        [--pool] [--json FILE]

Per shape the library's configuration, as timed in the files (a later file wins for the shapes it
shares with an earlier one; a configuration it did not time is read from the latest file that did,
as its ratio to that file's cuBLAS): ``shipped`` (default), the choice in flux/autotune/shipped/ for the
file's GPU, which is made from such files, so on the files it came from it is, by construction,
their choice; ``served``, the one the run itself used (the library's choice at the run's commit);
``tuned``, the one ``python -m flux.autotune.kernels --from-bench`` would ship from the file;
``analytic``, the analytic default over the default build (flux.autotune.kernels.analytic_config;
untimed where no file timed it); ``alone``, the default build's configuration of least ``spin`` time in the
shape's latest file (one call alone behind a GPU spin, the files' diagnostic timing: as the fused AG strategy
launches its kernel, after a memset and an event wait), a choice nothing ships, for comparison. Ratios are the kernel's
ms over ``torch.mm``'s (cuBLAS) in the same file, per timing; with ``--pool`` (files that repeat one run, e.g. of one
commit on several machines) each ratio is the geometric mean of that ratio over every file that timed the
configuration, the later file no longer winning alone, and the spread between the files is reported: per shape
timed in two or more, the largest over the least of the choice's ratios, median and maximum over the shapes
(``--timings``: loop and graph, the targets' timings, by default; spin too on request), and over the tuned choice's ms. The targets:
AG within 2% of cuBLAS from 1024 rows, within 5% at 256, geometric mean at most 1.00; RS (one
rank's block of rows) faster than ``mm`` then ``add`` from 128 rows, within 2% of ``mm`` from 1024.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flux.autotune import kernels as K  # noqa: E402

TIMINGS = ("loop", "graph")
ALL_TIMINGS = ("loop", "graph", "spin")
CHOICES = ("shipped", "served", "tuned", "analytic", "alone")


def shapes(paths):
    """{(op, m, n, k): [(result, doc), ...]}, the latest file first."""
    out = {}
    for path in paths:
        doc = json.load(open(path))
        for r in doc["results"]:
            out.setdefault((r["op"], r["m"], r["n"], r["k"]), []).insert(0, (r, doc))
    return out


def chosen(r, doc, how, tuned_cache):
    """The label of the configuration ``how`` picks for result ``r`` (None where there is none);
    ``tuned_cache``: the tuner's entries per document (id of a document alive for the call)."""
    if how == "served":
        return r.get("served")
    if how == "analytic":
        cfgs = list(K._allowed("default", doc["dtype"], doc["out_dtype"])[K._op(r["op"])].values())
        return K.label(*K.served_default(r["op"], r["m"], r["n"], r["k"], doc["dtype"], doc["out_dtype"],
                                         doc["sm_count"], cfgs))
    ek = K.entry_key(r["op"], r["m"], r["n"], r["k"], doc["dtype"], doc["out_dtype"])
    if how == "tuned":
        if id(doc) not in tuned_cache:
            tuned_cache[id(doc)] = K.entries_from_bench(doc)[1]
        e = tuned_cache[id(doc)].get(ek)
    else:
        e = K.KernelCache(f"kernels|{doc['device']}|sm{doc['sm_count']}").shipped.get(ek)
    return e["choice"] if e else None


def _each(timed, lab, base, t):
    """Per result of ``timed`` (latest first) in which ``lab`` ran correctly: its ms over ``base``'s in
    timing ``t``, None where either was not timed."""
    out = []
    for r, _ in timed:
        v = r["variants"].get(lab, {}) if lab else {}
        if v.get("ok"):
            ms, ref = (v.get("ms") or {}).get(t), ((r.get(base) or {}).get("ms") or {}).get(t)
            out.append(ms / ref if ms and ref else None)
    return out


def ratios(timed, lab, base, timings=TIMINGS, pool=False):
    """{timing: ms of ``lab`` / ms of ``base``} from the latest of the results ``timed`` (latest
    first) in which ``lab`` ran correctly (``pool``: the geometric mean over all of them); None where
    none did."""
    each = {t: _each(timed, lab, base, t) for t in timings}
    if not any(each.values()):
        return None
    return {t: _geomean([x for x in (xs if pool else xs[:1]) if x]) for t, xs in each.items()}


def spread(timed, lab, base="cublas", timings=TIMINGS):
    """{timing: the largest over the least ratio of ``lab`` to ``base`` among the files that timed it}
    (repeats of one run: how far one run's figure may move); None where fewer than two files did."""
    out = {}
    for t in timings:
        each = [x for x in _each(timed, lab, base, t) if x]
        out[t] = max(each) / min(each) if len(each) > 1 else None
    return out


def _geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def beta1_over_mm(timed, timings=TIMINGS, pool=False):
    """{timing: cuBLAS adding into its output / mm} from the latest of ``timed`` that timed both
    (``pool``: the geometric mean over all of them); None where none did."""
    runs = [r for r, _ in timed if r.get("cublas_beta1")]
    if not runs:
        return None
    return {t: _geomean([r["cublas_beta1"]["ms"][t] / r["cublas"]["ms"][t] for r in (runs if pool else runs[:1])
                         if r["cublas_beta1"]["ms"].get(t) and r["cublas"]["ms"].get(t)]) for t in timings}


def alone_choice(timed):
    """The label of least spin time against cuBLAS's among the default build's configurations that the
    shape's latest file timed correctly (one run, as the tuned choice); None where it timed none."""
    r, doc = timed[0]
    cfgs = {i: c for i, c in K._allowed("default", doc["dtype"], doc["out_dtype"])[K._op(r["op"])].items()
            if c.applies(r["m"], r["n"], r["k"])}
    labels = {lab for lab, v in r["variants"].items()
              if v.get("ok") and v.get("config") in cfgs and v.get("tile") == cfgs[v["config"]].desc
              and lab == K.label(v["config"], v["raster"], v["swizzle"])}
    spins = {lab: (ratios(timed, lab, "cublas", ("spin",)) or {}).get("spin") for lab in labels}
    spins = {lab: x for lab, x in spins.items() if x}
    return min(spins, key=spins.get) if spins else None


def scoreboard(paths, how="shipped", timings=TIMINGS, against="tuned", pool=False):
    """The targets' figures per timing, with the shapes each one missed, and each choice's time over
    the ``against`` choice's (``vs_<against>``); ``pool``: the files are repeats (``ratios``)."""
    rows, tuned = [], {}

    def pick(how, r, doc, timed):
        return alone_choice(timed) if how == "alone" else chosen(r, doc, how, tuned)
    key = f"vs_{against}"
    for (op, m, n, k), timed in sorted(shapes(paths).items()):
        r, doc = timed[0]
        lab, other = pick(how, r, doc, timed), pick(against, r, doc, timed)
        mine, best = ratios(timed, lab, "cublas", timings, pool), ratios(timed, other, "cublas", timings, pool)
        vs = ({t: mine[t] / best[t] if mine[t] and best[t] else None for t in timings} if mine and best else None)
        rows.append({"op": op, "m": m, "n": n, "k": k, "choice": lab, "vs_cublas": mine,
                     "vs_cublas_add": ratios(timed, lab, "cublas_add", timings, pool) if op == "rs" else None,
                     "vs_cublas_beta1": ratios(timed, lab, "cublas_beta1", timings, pool) if op == "rs" else None,
                     "beta1_vs_cublas": beta1_over_mm(timed, timings, pool) if op == "rs" else None, key: vs,
                     "spread": spread(timed, lab, "cublas", timings) if pool else None})
    untimed = [f"{x['op']} {x['m']}x{x['n']}x{x['k']}" for x in rows if x["vs_cublas"] is None]
    out = {"files": list(paths), "choice": how, "against": against, "pool": pool, "shapes": len(rows), "untimed": untimed,
           "timings": {}}
    for t in timings:
        def over(op, rows_min, rows_max, limit, key="vs_cublas", geomean=False):
            sel = [x for x in rows if x["op"] == op and rows_min <= x["m"] <= rows_max and x[key]
                   and x[key][t] is not None]
            bad = [f"{x['m']}x{x['n']}x{x['k']} {x[key][t]:.3f}" for x in sel if x[key][t] > limit]
            got = {"shapes": len(sel), "missed": len(bad), "which": bad}
            if geomean:
                got["geomean"] = _geomean([x[key][t] for x in sel])
            return got
        out["timings"][t] = {
            "ag_within_2pct_from_1024": over("ag", 1024, 1 << 40, 1.02),
            "ag_within_5pct_at_256": over("ag", 256, 256, 1.05),
            "ag_geomean": _geomean([x["vs_cublas"][t] for x in rows
                                    if x["op"] == "ag" and x["vs_cublas"] and x["vs_cublas"][t]]),
            "rs_faster_than_mm_add_from_128": over("rs", 128, 1 << 40, 1.0 - 1e-12, "vs_cublas_add"),
            "rs_within_2pct_of_mm_from_1024": over("rs", 1024, 1 << 40, 1.02),
            # Diagnostics where the files time cuBLAS adding into its output (cublas_beta1): that
            # GEMM's time over mm's, and the choice's over it, from 1024 rows per rank.
            "rs_beta1_over_mm_from_1024": over("rs", 1024, 1 << 40, 1.02, "beta1_vs_cublas", True),
            "rs_within_2pct_of_beta1_from_1024": over("rs", 1024, 1 << 40, 1.02, "vs_cublas_beta1", True)}
        sel = [x for x in rows if x[key] and x[key][t]]
        vt = [x[key][t] for x in sel]
        out["timings"][t][key] = {
            "shapes": len(vt), "geomean": _geomean(vt),
            "over_5pct": sum(v > 1.05 for v in vt), "max": max(vt) if vt else None,
            "which": [f"{x['op']} {x['m']}x{x['n']}x{x['k']} {x['choice']} {x[key][t]:.3f}"
                      for x in sel if x[key][t] > 1.05]}
        if pool:  # the choice's ratio to cuBLAS between the files, per shape timed in two or more
            sp = sorted(x["spread"][t] for x in rows if x["spread"] and x["spread"][t])
            out["timings"][t]["spread"] = {"shapes": len(sp), "median": sp[len(sp) // 2] if sp else None,
                                           "max": sp[-1] if sp else None}
    return out


def text(s):
    lines = [f"{s['shapes']} shapes, choice: {s['choice']}" + (", pooled over the files" if s.get("pool") else "") + (f"; untimed: {len(s['untimed'])}" if s["untimed"] else "")]
    names = (("ag_within_2pct_from_1024", "AG over 2% of cuBLAS, M >= 1024"), ("ag_within_5pct_at_256",
             "AG over 5% of cuBLAS, M = 256"), ("rs_faster_than_mm_add_from_128", "RS not faster than mm + add, "
             ">= 128 rows"), ("rs_within_2pct_of_mm_from_1024", "RS over 2% of mm, >= 1024 rows"))
    for t, v in s["timings"].items():
        parts = [f"{label}: {v[key]['missed']} of {v[key]['shapes']}" for key, label in names]
        vt = v[f"vs_{s['against']}"]
        gm = v["ag_geomean"]
        b1, vb1 = v["rs_beta1_over_mm_from_1024"], v["rs_within_2pct_of_beta1_from_1024"]
        lines.append(f"{t}: " + "; ".join(parts) + (f"; AG geometric mean {gm:.3f}" if gm is not None else "")
                     + (f"; over the {s['against']} choice: geometric mean {vt['geomean']:.3f}, {vt['over_5pct']} "
                        f"of {vt['shapes']} over 5%, max {vt['max']:.2f}" if vt["shapes"] else "")
                     + (f"; cuBLAS adding into its output (beta = 1), >= 1024 rows: {b1['geomean']:.3f} x mm "
                        f"({b1['missed']} of {b1['shapes']} over 2%), RS {vb1['geomean']:.3f} x it ({vb1['missed']} "
                        f"over 2%)" if b1["shapes"] and vb1["shapes"] else "")
                     + (f"; between the files, the choice's ratio per shape moved by a median {v['spread']['median']:.3f}x, "
                        f"at most {v['spread']['max']:.3f}x ({v['spread']['shapes']} shapes)"
                        if v.get("spread", {}).get("shapes") else ""))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--choice", choices=CHOICES, default="shipped")
    p.add_argument("--against", choices=CHOICES, default="tuned", help="the choice each one's time is put over")
    p.add_argument("--timings", default=",".join(TIMINGS), help="of " + ",".join(ALL_TIMINGS))
    p.add_argument("--pool", action="store_true",
                   help="the files repeat one run: each ratio the geometric mean over every file that timed it")
    p.add_argument("--json", default=None, help="write the figures (and the shapes that missed) here")
    args = p.parse_args(argv)
    timings = tuple(args.timings.split(","))
    if not timings or any(t not in ALL_TIMINGS for t in timings):
        p.error(f"--timings: a comma list of {', '.join(ALL_TIMINGS)}")
    s = scoreboard(args.files, args.choice, timings, args.against, args.pool)
    print(text(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
