"""CPU stand-ins for the kernels of the MoE ``local`` strategy (csrc/moe/moe_local.cu), with the
same schemas and semantics, written with torch ops: registered where flux._C is absent so that
tests/test_moe_local.py runs the strategy's Python path (flux/ops/moe/local.py, the checks,
autograd, the dispatcher ops) on the CPU. They state what the kernels compute; the GPU run
compares the kernels themselves with the references."""
import torch

_SCHEMAS = {
    "moe_local_dispatch": "moe_local_dispatch(Tensor x, Tensor topk_idx, int num_experts, int capacity, "
                          "int host_code, bool zero_pad) -> Tensor[]",
    "moe_local_combine": "moe_local_combine(Tensor y, Tensor? weights, Tensor pair_row, int k) -> Tensor",
    "moe_local_combine_backward": "moe_local_combine_backward(Tensor grad_out, Tensor? weights, Tensor pair_row, "
                                  "Tensor send_pairs, Tensor? y, int k) -> Tensor[]",
}
_LIB = None


def _gather(x, send_pairs, k, rows, zero_pad=True):
    n = x.shape[0] * k
    sp = send_pairs[:rows]
    valid = (sp >= 0) & (sp < n)
    ext = torch.cat([x, x.new_zeros((1, x.shape[1]))])
    return ext[torch.where(valid, torch.div(sp, k, rounding_mode="floor"), x.shape[0])]


def dispatch(x, topk_idx, num_experts, capacity, host_code, zero_pad):
    """capacity C >= 0: bounded; -2: unbounded at the worst case, recv [T * K, H], rows past the
    counts' sum padding (send_pairs T * K); -3: the same, then info read to the host (a CPU copy)
    and, where the verdict is 0, recv and send_pairs cut to the counts' sum."""
    if capacity < 0 and capacity not in (-2, -3):
        raise RuntimeError(f"flux.moe_local_dispatch: capacity must be -2 (unbounded, T * K rows), -3 (the same, "
                           f"counts read) or >= 0, got {capacity}")
    if capacity == -3:
        out = dispatch(x, topk_idx, num_experts, -2, host_code, False)
        info = out[5].clone()
        if int(info[num_experts]) == 0:
            rows = int(info[:num_experts].sum())
            out[0], out[4] = out[0][:rows], out[4][:rows]
        out[5] = info
        return out
    worst = capacity == -2
    capacity = -1 if worst else capacity
    t, k = topk_idx.shape
    n = t * k
    flat = topk_idx.reshape(-1).to(torch.int64)
    bad = (flat < -1) | (flat >= num_experts)
    e = torch.where(bad, torch.full_like(flat, -1), flat)
    srt = e.view(t, k).sort(dim=1).values
    dup = bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()) if t else False
    code = int(host_code) | (2 if bool(bad.any()) else 0) | (4 if dup else 0)
    counts = torch.bincount(e[e >= 0], minlength=num_experts)
    if code:
        counts = torch.zeros_like(counts)
    # info, pair_row and send_pairs: views of one tensor, as the kernels' entry returns them
    n_rows = num_experts * capacity if capacity >= 0 else n
    buf = torch.empty(num_experts + 1 + n + n_rows, dtype=torch.int64)
    info, pair_row, send_pairs = buf.split([num_experts + 1, n, n_rows])
    info.copy_(torch.cat([counts, torch.tensor([code])]))
    pair_row.fill_(-1)
    send_pairs.fill_(n)
    if not code:
        key = torch.where(e >= 0, e, num_experts)
        order = torch.sort(key, stable=True).indices
        se = key[order]
        order, se = order[se < num_experts], se[se < num_experts]
        start = counts.cumsum(0) - counts
        rank = torch.arange(order.numel()) - start[se]
        row = se * capacity + rank if capacity >= 0 else start[se] + rank
        pair_row[order] = row
        send_pairs[row] = order
    if capacity >= 0:
        recv = _gather(x, send_pairs, k, num_experts * capacity).view(num_experts, capacity, x.shape[1])
    else:
        recv = _gather(x, send_pairs, k, n)
    return [recv, info[:num_experts], info[num_experts:], pair_row, send_pairs, info]


def combine(y, weights, pair_row, k):
    y = y.reshape(-1, y.shape[-1])  # recv_x's layout, any leading dimensions
    t = pair_row.numel() // k
    pos = pair_row.view(t, k)
    out = torch.zeros((t, y.shape[1]), dtype=torch.float32)
    ext = torch.cat([y, y.new_zeros((1, y.shape[1]))]).float()
    for j in range(k):
        r = pos[:, j]
        valid = r >= 0
        w = torch.ones(t) if weights is None else weights.reshape(t, k)[:, j].float()
        w = torch.where(valid, w, torch.zeros(()))
        out += w[:, None] * ext[torch.where(valid, r, y.shape[0])]
    return out.to(y.dtype)


def combine_backward(grad_out, weights, pair_row, send_pairs, y, k):
    y = None if y is None else y.reshape(-1, y.shape[-1])
    t, n = grad_out.shape[0], grad_out.shape[0] * k
    valid = (send_pairs >= 0) & (send_pairs < n)
    tok = torch.where(valid, torch.div(send_pairs, k, rounding_mode="floor"), t)
    g = torch.cat([grad_out, grad_out.new_zeros((1, grad_out.shape[1]))]).float()[tok]
    w = torch.ones(n) if weights is None else weights.reshape(-1).float()
    wr = torch.where(valid, torch.cat([w, torch.zeros(1)])[torch.where(valid, send_pairs, n)], torch.zeros(()))
    dy = (g * wr[:, None]).to(grad_out.dtype)
    if y is None:
        return [dy, torch.zeros(0)]
    dot = (g * y.float()).sum(-1)
    dw = torch.zeros(n + 1)
    dw[torch.where(valid, send_pairs, n)] = torch.where(valid, dot, torch.zeros(()))
    return [dy, dw[:n].clone()]


def register() -> bool:
    """Register the stand-ins for the CPU; False where the real kernels exist (nothing done)."""
    global _LIB
    if hasattr(torch.ops.flux, "moe_local_dispatch"):
        return False
    if _LIB is None:
        _LIB = torch.library.Library("flux", "FRAGMENT")
        for name, schema in _SCHEMAS.items():
            _LIB.define(schema)
        _LIB.impl("moe_local_dispatch", dispatch, "CPU")
        _LIB.impl("moe_local_combine", combine, "CPU")
        _LIB.impl("moe_local_combine_backward", combine_backward, "CPU")
    return True
