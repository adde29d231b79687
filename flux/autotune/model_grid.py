"""The GEMMs that the fused kernels run in the tensor-parallel layers of real models.

Llama-3 8B, 70B and 405B at tensor-parallel sizes 2, 4 and 8, for M in {256, 1024, 4096, 16384}
rows (tokens of the whole batch). Each entry is one fused kernel's own problem on one GPU:

  ag  (column-parallel, AllGather+GEMM): the kernel runs all M gathered rows,
      QKV: N = (q_heads + 2 kv_heads) * head_dim / TP, K = hidden;
      FC1: N = 2 * ffn / TP (gate and up), K = hidden.
  rs  (row-parallel, GEMM+ReduceScatter): the kernel runs one rank's own block of rows,
      m = M / TP rows, adding the peer's partial of that block in its epilogue,
      O-proj: K = hidden / TP, N = hidden;  FC2: K = ffn / TP, N = hidden.

Identical (op, m, n, k) problems of several layers are listed once, with every layer's name.
"""
from typing import Dict, List, Sequence, Tuple

# name -> (hidden, ffn, q heads, kv heads, head dim)
MODELS = {
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "llama3-70b": (8192, 28672, 64, 8, 128),
    "llama3-405b": (16384, 53248, 128, 8, 128),
}
TP_SIZES = (2, 4, 8)
M_ROWS = (256, 1024, 4096, 16384)


def layer_gemms(model: str, tp: int) -> List[Tuple[str, str, int, int]]:
    """[(op, layer, n, k)] of one model at tensor-parallel size ``tp`` (rows not included)."""
    hidden, ffn, q, kv, hd = MODELS[model]
    return [("ag", "qkv", (q + 2 * kv) * hd // tp, hidden),
            ("ag", "fc1", 2 * ffn // tp, hidden),
            ("rs", "oproj", hidden, q * hd // tp),
            ("rs", "fc2", hidden, ffn // tp)]


def model_grid(ops: Sequence[str] = ("ag", "rs"), models: Sequence[str] = tuple(MODELS),
               tp_sizes: Sequence[int] = TP_SIZES, m_rows: Sequence[int] = M_ROWS) -> List[Dict]:
    """The grid's distinct kernel problems, in a stable order (op, then model, TP, M, layer):
    [{"op", "m", "n", "k", "layers": ["llama3-70b tp4 qkv M=4096", ...]}], where m is the
    kernel's rows (ag: M, rs: M / TP)."""
    out: Dict[Tuple[str, int, int, int], Dict] = {}
    for op in ops:
        for model in models:
            for tp in tp_sizes:
                for m_total in m_rows:
                    for gop, layer, n, k in layer_gemms(model, tp):
                        if gop != op:
                            continue
                        m = m_total if op == "ag" else m_total // tp
                        key = (op, m, n, k)
                        rec = out.setdefault(key, {"op": op, "m": m, "n": n, "k": k, "layers": []})
                        rec["layers"].append(f"{model} tp{tp} {layer} M={m_total}")
    return list(out.values())


def parse_shapes(op: str, text: str) -> List[Dict]:
    """'MxKxN,...' (the kernel's own rows, K and N) as grid entries labelled 'custom'."""
    recs = []
    for s in text.split(","):
        s = s.strip()
        if not s:
            continue
        try:
            m, k, n = (int(v) for v in s.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {s!r} is not MxKxN") from None
        if min(m, k, n) < 1:
            raise ValueError(f"shape {s!r}: sizes must be positive")
        recs.append({"op": op, "m": m, "n": n, "k": k, "layers": [f"custom {s}"]})
    return recs
