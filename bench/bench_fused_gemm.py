"""The fused GEMM kernels alone on one GPU (every flag set: nothing waits) against cuBLAS:
    python bench/bench_fused_gemm.py --out fused.json    # model grid, both ops (~3-5 min, H200)
    python bench/bench_fused_gemm.py --op ag --shapes 4096x8192x14336 [--configs 0,2] [--quick] [--pdl 0,1]
Shapes are the kernel's own MxKxN (flux/autotune/model_grid.py): --grid models (default) = every AG
(QKV, FC1) and RS (O-proj, FC2) GEMM of Llama-3 8B/70B/405B at TP 2/4/8, M in {256 .. 16384}; ag
runs all M gathered rows, rs one rank's block of M/TP rows adding the peer's partial (random) in its
epilogue. Baselines: torch.mm into the output dtype ('cublas'); rs also mm then the add ('cublas_add') and,
output in the input dtype, cuBLAS adding into its output in place ('cublas_beta1': out.addmm_, beta = 1; a
diagnostic of what reading the partial costs cuBLAS).
Protocol: correctness first (random data, NaN-poisoned output, relative error of sampled rows vs an
fp32 reference; above max(2 x cuBLAS's error, 1e-3) a config is reported, never timed); then all
calls interleaved round by round (each round starting one variant further; from 0.5 ms a call, each
variant first runs untimed for 60 ms, so that the clock is its own: flux/autotune/kernel_timing.py),
median over rounds after warm-up, timed as loop (calls back to
back, events around the loop), graph (that loop as a CUDA graph, replayed) and spin (one call behind
a GPU spin: a kernel-time diagnostic, never the headline); inputs rotate among 2-4 sets where one set
fits in L2. --pdl 0,1: each fused variant also without programmatic dependent launch ("<label>/pdl0";
own, best and summary are the PDL-on ones, "by_pdl" and "*_pdl0" the others). --ag-world 2,1,8: each AG
variant also with its rows as 1 and 8 ranks' shards ("<label>/w1", "/w8": 1 reads no flag), the first
world the primary. --rounds N: at least N rounds (samples of more than 5 ms get 3 by default).
--sample-ms MS: samples of about MS of GPU time instead of 2 (20 where a call takes 0.5 ms or more; the
loop's calls back to back, and the graph of that loop). --lead: loop and graph samples start behind a
~50 us GPU spin, so that the host's launch of the first call (a start gap that short loops of long calls
otherwise include) is not timed. --top-from FILE [--top N]: per shape that FILE (an earlier run's JSON,
same GPU model and dtypes) holds, only its N variants of least score (the worse of loop and graph
against cuBLAS: the kernel tuner's rule, flux.autotune.kernels.bench_scores; default 3) among those
still selected, plus the analytic and served choices: a second, fresh look at a first run's winners,
whose least time among many variants favours them by the spread of one sample; selected shapes that FILE
does not hold are left out (one line says how many). Pool the two runs with python -m
flux.autotune.kernels --from-bench FIRST SECOND.
No GPU: one line, exit 1.
JSON (--out, stable): {"format": 1, "command", "commit", "device", "sm_count", "torch", "cuda",
 "dtype", "ag_world", "out_dtype", "timings": ["loop", "graph", "spin"], "configs": {op: {"source", "list": [{"id",
 "tile" (".../sk": stream-K, ".../k4": split-K into 4), "scheduler", "describe", "dtypes"}]}}, "results": [{"op", "m", "n", "k",
 "layers", "flop", "input_sets", "calls_per_sample", "rounds", "tolerance", "cublas" (rs: and "cublas_add",
 "cublas_beta1" where the output is in the input dtype):
 {"ms": {timing: ms}, "tflops": {timing: TFLOP/s}, "rel_err"}, "own" (the analytic default): {"label", "ms", "tflops",
 "vs_cublas": {timing: ratio}}, "served" (choose_config's label: tuned cache, else analytic), "best":
 {timing: {"label", "ms", "vs_cublas"}}, "variants": {"c<id>/r<raster>/s<swizzle>": {"config",
 "raster", "swizzle", "tile", "pdl", "ag_world"?, "ms", "tflops", "rel_err", "ok", "error"?}}, "by_pdl"?: {"0": {"own",
 "best"}}}], "pdl": [settings], "lead": bool, "summary": {op: {timing: {"shapes", "own_within_2pct", "own_within_5pct",
 "best_within_2pct", "best_within_5pct", "own_wrong", "geomean_own_over_cublas", "geomean_best_over_cublas",
 "geomean_own_over_best", "geomean_served_over_cublas", "geomean_{own,best}_over_cublas_pdl0"?}}}}; untimed: null.
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # flux, from this checkout
TIMINGS = ("loop", "graph", "spin")
HEADLINE = ("loop", "graph")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=("ag", "rs"), default=None, help="default: both")
    p.add_argument("--shapes", default=None, help="MxKxN,... (the kernel's own rows); needs --op")
    p.add_argument("--grid", choices=("models",), default=None)
    p.add_argument("--models", default=None, help="--grid subset: llama3-8b,llama3-70b,llama3-405b")
    p.add_argument("--tp", default=None, help="--grid subset of TP sizes, e.g. 8")
    p.add_argument("--m", default=None, help="--grid subset of M (rows of the whole batch)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--out-dtype", nargs="?", const="fp32", choices=("fp32", "same"), default="same",
                   help="fp32: fp32 output (the kernels' fp32-out variants); default: the input dtype")
    p.add_argument("--configs", default=None, help="configuration ids to time, e.g. 0,2 (default: all built)")
    p.add_argument("--swizzles", default="1,2,4,8", help="bands of cluster_m * swizzle M tiles to time")
    p.add_argument("--rasters", default="1", help="1 along N (as the strategies launch), 2 along M, 0 CUTLASS's")
    p.add_argument("--pdl", default="1", help="programmatic dependent launch of the fused kernels: 1 (default), 0, "
                   "or 0,1 (both, interleaved)")
    p.add_argument("--ag-world", default="2",
                   help="ag: the rows as the shards of W ranks (this one rank 0, the peers' flags set; default 2); "
                   "1: no flag read; e.g. 2,1,8: each variant also at the others, interleaved (the readiness "
                   "wait's cost, a diagnostic)")
    p.add_argument("--quick", action="store_true", help="shorter samples, 3 rounds")
    p.add_argument("--rounds", type=int, default=0,
                   help="at least this many rounds per shape (default: 5, 3 where a sample is long or --quick); "
                   "more rounds narrow the median where calls run for milliseconds")
    p.add_argument("--sample-ms", type=float, default=0.0, metavar="MS",
                   help="GPU time per sample (default 2, 1 with --quick): longer samples, more calls back to back")
    p.add_argument("--lead", action="store_true",
                   help="loop and graph samples start behind a ~50 us GPU spin: the first call's launch is not timed")
    p.add_argument("--top-from", default=None, metavar="FILE",
                   help="an earlier run's JSON: per shape it holds, time only its --top variants of least score "
                   "(plus the analytic and served choices)")
    p.add_argument("--top", type=int, default=3, help="with --top-from: variants per shape (default 3)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.top < 1:
        p.error("--top takes 1 or more")
    if args.shapes and not args.op:
        p.error("--shapes needs --op")
    from flux.autotune.kernels import SWIZZLES
    try:
        args.swizzle_list = [int(x) for x in args.swizzles.split(",")]
    except ValueError:
        args.swizzle_list = []
    if not args.swizzle_list or any(x not in SWIZZLES for x in args.swizzle_list):
        p.error(f"--swizzles takes bands among {','.join(map(str, SWIZZLES))} "
                "(CUTLASS's scheduler runs a larger one as 8)")
    if not args.shapes and not args.grid:
        args.grid = "models"
    try:
        args.pdl_list = sorted({int(x) for x in args.pdl.split(",")}, reverse=True)  # the primary (1) first
    except ValueError:
        args.pdl_list = []
    if not args.pdl_list or any(x not in (0, 1) for x in args.pdl_list):
        p.error("--pdl takes 1, 0 or 0,1")
    try:
        args.worlds = list(dict.fromkeys(int(x) for x in args.ag_world.split(",")))  # the primary first
    except ValueError:
        args.worlds = []
    if not args.worlds or any(not 1 <= w <= 64 for w in args.worlds):
        p.error("--ag-world takes rank counts 1..64, e.g. 2 or 2,1,8")
    return args


def _pdl_switch():
    """torch.ops.flux.set_fused_pdl, or None with a flux._C that has no such switch."""
    try:
        return torch.ops.flux.set_fused_pdl
    except (AttributeError, RuntimeError):
        return None


def _with_pdl(fns, pdl, switch):
    """The launchers with the process-wide PDL switch set by the first of them: a loop, a graph
    capture or a spin sample starts with it, and a variant's calls are never interleaved with
    another's, so the others inherit the setting (one switch call per input-set cycle)."""
    first = fns[0]

    def set_then_call():
        switch(bool(pdl))
        first()
    return [set_then_call, *fns[1:]]


def problems(args):
    from flux.autotune.model_grid import MODELS, M_ROWS, TP_SIZES, model_grid, parse_shapes

    ops = [args.op] if args.op else ["ag", "rs"]
    recs = []
    if args.grid:
        models = args.models.split(",") if args.models else list(MODELS)
        tps = [int(t) for t in args.tp.split(",")] if args.tp else TP_SIZES
        ms = [int(m) for m in args.m.split(",")] if args.m else M_ROWS
        recs += model_grid(ops, models, tps, ms)
    if args.shapes:
        recs += parse_shapes(args.op, args.shapes)
    return recs


def commit() -> str:
    """FLUX_COMMIT where the runner sets it (a copied tree may carry stale git metadata), else git's HEAD."""
    if os.environ.get("FLUX_COMMIT"):
        return os.environ["FLUX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or os.environ.get("FLUX_COMMIT", "unknown")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("FLUX_COMMIT", "unknown")


def _ratio(a, b):
    return a / b if a is not None and b else None


def bench_shape(rec, args, dtype, out_dtype, sm, device=None):
    from flux.autotune import kernels as K
    from flux.autotune.kernel_timing import KernelProblem, estimate_ms, plan_sampling, time_calls, warm_calls
    from flux.autotune.space import m_bucket

    op, m, n, k = rec["op"], rec["m"], rec["n"], rec["k"]
    built = [c for c in K.kernel_configs(op, dtype, out_dtype) if c.applies(m, n, k)]
    subset = {int(c) for c in args.configs.split(",")} if args.configs else None
    cfgs = [c for c in built if subset is None or c.id in subset]
    prev = getattr(args, "top_records", {}).get((op, m, n, k))
    labs = (top_labels(prev, cfgs, args.top) if prev is not None
            else K.variants(op, m, cfgs, args.swizzle_list, [int(r) for r in args.rasters.split(",")], n))
    own = K.label(*K.served_default(op, m, n, k, dtype, out_dtype, sm, built))
    served = K.label(*K.choose_config(op, m, n, k, dtype, out_dtype, device))
    labs += [x for x in dict.fromkeys([own, served]) if x not in labs]
    prob = KernelProblem(op, m, n, k, dtype, out_dtype, device or torch.device("cuda"))
    worlds = getattr(args, "worlds", [2]) if op == "ag" else [2]
    base = {"cublas": prob.cublas()}
    if op == "rs":
        base["cublas_add"] = prob.cublas(add=True)
        if out_dtype == dtype:
            base["cublas_beta1"] = prob.cublas_beta1()
    out = dict(rec, flop=prob.flop, input_sets=prob.n_sets, served=served)
    errs = {name: prob.rel_err(prob.cublas_beta1(check=True) if name == "cublas_beta1" else fns,
                               with_partial=name != "cublas") for name, fns in base.items()}
    tol = max(2 * max(errs.values()), 1e-3)
    out["tolerance"] = tol
    desc = {c.id: c.desc for c in built}
    pdls = getattr(args, "pdl_list", [1])
    switch = _pdl_switch() if pdls != [1] else None
    if pdls != [1] and switch is None:
        raise RuntimeError("--pdl " + args.pdl + ": this flux._C has no torch.ops.flux.set_fused_pdl")
    var, fns = {}, {}
    for base_lab in labs:
        for pdl, world in [(p, w) for p in pdls for w in worlds]:
            lab = base_lab + ("" if pdl == pdls[0] else f"/pdl{pdl}") + ("" if world == worlds[0] else f"/w{world}")
            cfg, raster, swz = K.parse_label(base_lab)
            v = {"config": cfg, "raster": raster, "swizzle": swz, "tile": desc[cfg], "pdl": pdl}
            if op == "ag":
                v["ag_world"] = world
            try:
                f = prob.fused(cfg, raster, swz, world)
                if switch is not None:
                    f = _with_pdl(f, pdl, switch)
                v["rel_err"] = prob.rel_err(f)
                if math.isinf(v["rel_err"]):
                    v["rel_err"], v["error"] = None, "output left NaN (tiles not written)"
            except RuntimeError as e:
                v["rel_err"], v["error"] = None, (str(e).splitlines() or ["RuntimeError"])[0][:200]
            v["ok"] = v["rel_err"] is not None and v["rel_err"] <= tol
            if v["ok"]:
                fns[lab] = f
            var[lab] = v
    t_est = estimate_ms(base["cublas"])
    calls, rounds = plan_sampling(t_est, args.quick, args.rounds, args.sample_ms)
    out.update(calls_per_sample=calls, rounds=rounds)
    t = time_calls({**base, **fns}, calls, rounds, TIMINGS, settle=t_est < 1.0, warm=warm_calls(t_est),
                   lead=args.lead)

    def tflops(ms):
        return {tm: (prob.flop / (v * 1e-3) / 1e12 if v else None) for tm, v in ms.items()}

    for name in base:
        out[name] = {"ms": t[name], "tflops": tflops(t[name]), "rel_err": errs[name]}
    cub = t["cublas"]
    for lab, v in var.items():
        v["ms"] = t.get(lab, {tm: None for tm in TIMINGS})
        v["tflops"] = tflops(v["ms"])
    out["variants"] = var

    def own_and_best(pdl, suffix):
        own_ms = var[own + suffix]["ms"]
        o = {"label": own + suffix, "ms": own_ms, "tflops": var[own + suffix]["tflops"],
             "vs_cublas": {tm: _ratio(own_ms[tm], cub[tm]) for tm in TIMINGS}}
        best = {}
        for tm in TIMINGS:
            timed = {lab: v["ms"][tm] for lab, v in var.items()
                     if v["ms"][tm] is not None and v["pdl"] == pdl and v.get("ag_world", worlds[0]) == worlds[0]}
            if timed:
                b = min(timed, key=timed.get)
                best[tm] = {"label": b, "ms": timed[b], "vs_cublas": _ratio(timed[b], cub[tm])}
            else:
                best[tm] = {"label": None, "ms": None, "vs_cublas": None}
        return o, best

    out["own"], out["best"] = own_and_best(pdls[0], "")
    if len(pdls) > 1:
        out["by_pdl"] = {}
        for pdl in pdls[1:]:
            o, b = own_and_best(pdl, f"/pdl{pdl}")
            out["by_pdl"][str(pdl)] = {"own": o, "best": b}
    if switch is not None:
        switch(bool(pdls[0]))  # the process default again
    del prob, fns, base
    return out


def summarize(results):
    summ = {}
    for op in sorted({r["op"] for r in results}):
        summ[op] = {}
        rs = [r for r in results if r["op"] == op]
        for tm in TIMINGS:
            own = [r["own"]["vs_cublas"][tm] for r in rs if r["own"]["vs_cublas"][tm]]
            best = [r["best"][tm]["vs_cublas"] for r in rs if r["best"][tm]["vs_cublas"]]
            ob = [r["own"]["ms"][tm] / r["best"][tm]["ms"] for r in rs
                  if r["own"]["ms"][tm] and r["best"][tm]["ms"]]

            def gm(xs):
                return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None
            summ[op][tm] = {"shapes": len(rs), "own_within_2pct": sum(x <= 1.02 for x in own),
                            "own_within_5pct": sum(x <= 1.05 for x in own),
                            "best_within_2pct": sum(x <= 1.02 for x in best),
                            "best_within_5pct": sum(x <= 1.05 for x in best),
                            "geomean_own_over_cublas": gm(own), "geomean_best_over_cublas": gm(best),
                            "geomean_own_over_best": gm(ob),
                            "geomean_served_over_cublas": gm(
                                [_ratio(r["variants"][r["served"]]["ms"][tm], r["cublas"]["ms"][tm]) for r in rs
                                 if r["variants"][r["served"]]["ms"][tm] and r["cublas"]["ms"][tm]]),
                            "own_wrong": sum(not r["variants"][r["own"]["label"]]["ok"] for r in rs)}
            for pdl in sorted({p for r in rs for p in r.get("by_pdl", {})}):
                sub = [r["by_pdl"][pdl] for r in rs if pdl in r.get("by_pdl", {})]
                summ[op][tm][f"geomean_own_over_cublas_pdl{pdl}"] = gm(
                    [x["own"]["vs_cublas"][tm] for x in sub if x["own"]["vs_cublas"][tm]])
                summ[op][tm][f"geomean_best_over_cublas_pdl{pdl}"] = gm(
                    [x["best"][tm]["vs_cublas"] for x in sub if x["best"][tm]["vs_cublas"]])
    return summ


def _f(x, fmt="8.3f"):
    return format(x, fmt) if x is not None else " " * (int(fmt.split(".")[0]) - 1) + "-"


def print_table(results, summ):
    print(f"\n{'op':2} {'M':>6} {'K':>6} {'N':>6} | {'cuBLAS loop/graph':>17} | {'own':>9} {'loop/graph':>15} | "
          f"{'best loop/graph':>15} {'(label)':>10} | own/cuB l g  best/cuB l g")
    for r in results:
        c, o = r["cublas"]["ms"], r["own"]
        b = r["best"]
        print(f"{r['op']:2} {r['m']:6d} {r['k']:6d} {r['n']:6d} | {_f(c['loop'])} {_f(c['graph'])} | "
              f"{o['label']:>9} {_f(o['ms']['loop'], '7.3f')} {_f(o['ms']['graph'], '7.3f')} | "
              f"{_f(b['loop']['ms'], '7.3f')} {_f(b['graph']['ms'], '7.3f')} {str(b['graph']['label']):>10} | "
              f"{_f(o['vs_cublas']['loop'], '5.3f')} {_f(o['vs_cublas']['graph'], '5.3f')}  "
              f"{_f(b['loop']['vs_cublas'], '5.3f')} {_f(b['graph']['vs_cublas'], '5.3f')}")
    for op, per in summ.items():
        for tm, s in per.items():
            tag = "" if tm in HEADLINE else " (diagnostic)"
            print(f"summary {op} {tm}{tag}: {s['shapes']} shapes; analytic default (\"own\") within 2%/5% of cuBLAS: "
                  f"{s['own_within_2pct']}/{s['own_within_5pct']}; best config: {s['best_within_2pct']}/"
                  f"{s['best_within_5pct']}; geomean analytic/cuBLAS {_f(s['geomean_own_over_cublas'], '5.3f')}, "
                  f"best/cuBLAS {_f(s['geomean_best_over_cublas'], '5.3f')}, analytic/best "
                  f"{_f(s['geomean_own_over_best'], '5.3f')}, served/cuBLAS "
                  f"{_f(s['geomean_served_over_cublas'], '5.3f')}")
            for key in sorted(k for k in s if k.startswith("geomean_best_over_cublas_pdl")):
                pdl = key.rsplit("_pdl", 1)[1]
                print(f"summary {op} {tm}{tag} PDL {pdl}: geomean analytic/cuBLAS "
                      f"{_f(s['geomean_own_over_cublas_pdl' + pdl], '5.3f')}, best/cuBLAS {_f(s[key], '5.3f')}")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused_gemm: needs a CUDA GPU and flux._C with the sm_90a fused kernels (no GPU visible); "
              "nothing run")
        return 1
    import flux  # noqa: F401  (loads flux._C)
    from flux.autotune import kernels as K
    from flux.autotune.kernel_timing import DTYPES
    from flux.runtime.extension import cuda_kernels_available

    if not (cuda_kernels_available() and bool(torch.ops.flux.ag_gemm_fused_supported())):
        print("bench_fused_gemm: flux._C with the sm_90a fused kernels is not built or not loaded; nothing run")
        return 1
    dtype = DTYPES[args.dtype]
    out_dtype = torch.float32 if args.out_dtype == "fp32" else dtype
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    recs = problems(args)
    if args.top_from:
        try:
            args.top_records = top_records(args.top_from, torch.cuda.get_device_name(0), args.dtype,
                                           "fp32" if args.out_dtype == "fp32" else args.dtype)
        except (OSError, ValueError) as e:
            print(f"bench_fused_gemm: --top-from {args.top_from}: {e}; nothing run")
            return 1
        recs, left = top_shapes(recs, args.top_records)
        if left:
            print(f"bench_fused_gemm: --top-from: {left} selected shape(s) not in {args.top_from}, left out")
        if not recs:
            print(f"bench_fused_gemm: --top-from: no selected shape is in {args.top_from}; nothing run")
            return 1
    ops = sorted({r["op"] for r in recs})
    for op in ops:
        if not K.kernel_configs(op, dtype, out_dtype):
            print(f"bench_fused_gemm: no {op} configuration built for {args.dtype} -> "
                  f"{'fp32' if args.out_dtype == 'fp32' else args.dtype}; nothing run")
            return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    switch = _pdl_switch()
    if args.pdl_list != [1] and switch is None:
        print(f"bench_fused_gemm: --pdl {args.pdl} needs torch.ops.flux.set_fused_pdl (flux._C is older); nothing run")
        return 1
    if switch is not None:
        switch(bool(args.pdl_list[0]))
    results = []
    for i, rec in enumerate(recs):
        r = bench_shape(rec, args, dtype, out_dtype, sm)
        results.append(r)
        bad = [lab for lab, v in r["variants"].items() if not v["ok"]]
        print(f"[{i + 1}/{len(recs)}] {r['op']} {r['m']}x{r['k']}x{r['n']}: cuBLAS {_f(r['cublas']['ms']['loop'])} "
              f"own {r['own']['label']} {_f(r['own']['ms']['loop'])} best {r['best']['loop']['label']} "
              f"{_f(r['best']['loop']['ms'])} ms (loop)" + (f"  WRONG: {','.join(bad)}" if bad else ""), flush=True)
        if args.out:
            _document(args, ops, results, sm, dtype)
    doc = _document(args, ops, results, sm, dtype)
    print_table(results, doc["summary"])
    return 0


def top_labels(record, cfgs, top):
    """The ``top`` variant labels of least score in an earlier run's record of a shape, among the
    configurations ``cfgs`` (selected and built now); least first."""
    from flux.autotune import kernels as K

    return K.least_labels(record, {c.id: c for c in cfgs}, top)


def top_shapes(recs, records):
    """(the selected shapes ``recs`` that an earlier run's ``records`` hold, how many it does not):
    a second look re-times only what the first run timed."""
    kept = [r for r in recs if (r["op"], r["m"], r["n"], r["k"]) in records]
    return kept, len(recs) - len(kept)


def top_records(path, device, dtype, out_dtype):
    """{(op, m, n, k): record} of an earlier run's JSON (a later record of a shape wins), which must
    come from the same GPU model and dtypes: the variants it ranks are those of this run."""
    with open(path) as f:
        doc = json.load(f)
    got = (doc.get("device"), doc.get("dtype"), doc.get("out_dtype"))
    if got != (device, dtype, out_dtype):
        raise ValueError(f"it timed {got[1]} -> {got[2]} on {got[0]}, this run {dtype} -> {out_dtype} on {device}")
    return {(r["op"], r["m"], r["n"], r["k"]): r for r in doc.get("results", [])}


def _document(args, ops, results, sm, dtype):
    """The JSON document of the shapes measured so far (written after each shape, so that a run
    stopped early keeps what it measured)."""
    from flux import fused_configs as FC
    from flux.autotune import kernels as K
    summ = summarize(results)
    doc = {"format": 1, "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "commit": commit(),
           "device": torch.cuda.get_device_name(), "sm_count": sm, "torch": torch.__version__,
           "cuda": torch.version.cuda, "dtype": args.dtype, "ag_world": args.worlds,
           "out_dtype": "fp32" if args.out_dtype == "fp32" else args.dtype,
           "timings": list(TIMINGS), "pdl": getattr(args, "pdl_list", [1]), "lead": args.lead,
           "configs": {op: {"source": K.config_source(op),
                            "list": [{"id": c.id, "tile": c.desc, "scheduler": c.scheduler,
                                      "describe": FC.config(op, c.id).describe(), "dtypes": [list(p) for p in c.dtypes]}
                                     for c in K.kernel_configs(op)]} for op in ops},
           "results": results, "summary": summ}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    sys.exit(main())
