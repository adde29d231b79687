"""Markdown tables from a bench_ops.py JSON file (for docs/):

    python bench/report.py bench/results/bench_ops-h200x2-run36.json [--strategies]

Per op, one table of the headline: cuBLAS alone (graph), NCCL then cuBLAS, PyTorch async-TP
and flux's automatic choice, each timed the four ways of bench_ops.py (graph, loop, single in
ms; host µs per call), then E = (t_seq - t) / (t_seq - t_gemm) and the speedups of flux over
NCCL then cuBLAS (graph, loop, single) and over async-TP (graph). ``--strategies``: also a
table of every flux strategy in graph and loop timing.
"""
import json
import sys

MODES = ("graph", "loop", "single")


def _ms(e, mode):
    v = (e or {}).get(f"{mode}_ms")
    return "-" if v is None else f"{v:.3f}"


def _host(e):
    v = (e or {}).get("host_us")
    return "-" if v is None else f"{v:.0f}"


def _ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def headline(path):
    d = json.load(open(path))
    meta = d["metadata"]
    lines = [f"`{meta['command']}` — {meta['date']}, {meta['world_size']}x {meta['gpu']}, torch {meta['torch']}, "
             f"NCCL {meta['nccl']}. Times in ms per call (host: µs of CPU per call); E and speedups per mode.", ""]
    for op, v in d["results"].items():
        head = ["M×K×N", "cuBLAS", "NCCL+cuBLAS g / l / s (host)", "async-TP g / l / s (host)",
                "flux g / l / s (host)", "E g / l", "× NCCL+cuBLAS g / l / s", "× async-TP g", "choice"]
        lines += [f"**{op}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in v["shapes"]:
            if s.get("status") != "ok":
                lines.append(f"| {s.get('shape')} | {s.get('status')} |")
                continue
            b, m = s["baselines"], s["methods"]
            seq, atp, auto = b["seq"], m.get("async_tp"), m.get("flux:auto")

            def cell(e):
                return " / ".join(_ms(e, mode) for mode in MODES) + f" ({_host(e)})"
            E = (auto or {}).get("E") or {}
            e_cell = " / ".join("-" if E.get(mode) is None else f"{E[mode]:+.2f}" for mode in ("graph", "loop"))
            speed = " / ".join(_ratio(seq.get(f"{mode}_ms"), (auto or {}).get(f"{mode}_ms")) for mode in MODES)
            row = [s["shape"], _ms(b["gemm"], "graph"), cell(seq), cell(atp), cell(auto), e_cell, speed,
                   _ratio((atp or {}).get("graph_ms"), (auto or {}).get("graph_ms")), (auto or {}).get("choice", "-")]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def strategies(path):
    d = json.load(open(path))
    lines = []
    for op, v in d["results"].items():
        if not v.get("shapes"):  # a --matrix-only run
            continue
        names = [k for k in v["shapes"][0].get("methods", {}) if k.startswith("flux:") and k != "flux:auto"]
        head = ["M×K×N", "NCCL+cuBLAS"] + [n[5:] for n in names]
        lines += [f"**{op}**, ms per call, graph / loop", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in v["shapes"]:
            if s.get("status") != "ok":
                continue
            row = [s["shape"], f"{_ms(s['baselines']['seq'], 'graph')} / {_ms(s['baselines']['seq'], 'loop')}"]
            row += [f"{_ms(s['methods'].get(n), 'graph')} / {_ms(s['methods'].get(n), 'loop')}" for n in names]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(prog="python bench/report.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="a JSON file written by bench/bench_ops.py")
    p.add_argument("--strategies", action="store_true", help="also a table of every flux strategy")
    args = p.parse_args(argv)
    try:
        print(headline(args.file))
        if args.strategies:
            print(strategies(args.file))
    except (OSError, ValueError, KeyError) as e:
        p.exit(2, f"bench/report.py: {args.file}: not a readable bench_ops.py JSON file ({type(e).__name__}: {e})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
