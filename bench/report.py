"""Markdown tables from a bench_ops.py JSON file (for docs/):

    python bench/report.py bench/results/bench_ops-h200x2-run3.json

One table per op: the baselines (cuBLAS alone, the NCCL collective alone, NCCL then cuBLAS,
PyTorch async-TP) and every flux strategy, in ms, with E = (t_seq - t) / (t_seq - t_gemm)
and the speedup over NCCL then cuBLAS; the best flux strategy and the automatic choice last.
"""
import json
import sys


def _cell(m):
    if not m or m.get("status") != "ok" or m.get("t_ms") is None:
        return (m or {}).get("status", "-")
    return f"{m['t_ms']:.3f} ({m['E']:+.2f}, {m['speedup']:.2f}x)"


def report(path):
    d = json.load(open(path))
    meta = d["metadata"]
    lines = [f"`{meta['command']}` — {meta['date']}, {meta['world_size']}x {meta['gpu']}, torch {meta['torch']}, "
             f"NCCL {meta['nccl']}; cells: ms (E, speedup vs NCCL then cuBLAS)", ""]
    for op, v in d["results"].items():
        strategies = [k for k in v["shapes"][0]["methods"] if k.startswith("flux:") and k != "flux:auto"]
        head = ["M×K×N", "cuBLAS", "NCCL", "NCCL then cuBLAS", "async-TP"] + [s[5:] for s in strategies] + [
            "best flux", "flux (auto)"]
        lines += [f"**{op}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in v["shapes"]:
            ms = s["methods"]
            ok = [(k, m) for k, m in ms.items() if k in strategies and m.get("status") == "ok"]
            best = min(ok, key=lambda km: km[1]["t_ms"]) if ok else None
            row = [s["shape"], f"{s['t_gemm_ms']:.3f}", f"{s['t_comm_ms']:.3f}", f"{s['t_seq_ms']:.3f}",
                   _cell(ms.get("async_tp"))] + [_cell(ms.get(k)) for k in strategies]
            row += [f"{best[0][5:]} {_cell(best[1])}" if best else "-", _cell(ms.get("flux:auto"))]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1]))
