"""The whole problem of a tensor-parallel MoE MLP and its shards, built from seeds on every rank
(tests/test_moe_tp.py on gloo, tests/gpu_moe_worker.py on GPUs): each rank takes its shard and
checks its results against a single-process computation from the full tensors."""
import torch
import torch.nn.functional as F

F64 = torch.float64


def problem(seed, world, tl, h, f, e, k, drop=0.25, integer=False, skew=None, idx_dtype=torch.int64):
    """Full tensors: x [T, H], topk_idx [T, K] (distinct experts per token, a fraction ``drop`` of
    the slots -1; ``skew``: every valid slot of the first half of the tokens to expert ``skew``
    where possible), topk_weights [T, K], w13 [E, 2F, H] (gate rows, then up rows), w2 [E, H, F].
    ``integer``: integer-valued x and weights in [-4, 4] and power-of-two routing weights
    (products and sums exact in float64)."""
    g = torch.Generator().manual_seed(seed)
    t = world * tl
    if integer:
        def rnd(*shape):
            return torch.randint(-4, 5, shape, generator=g).to(F64)
        tw = 2.0 ** torch.randint(-2, 2, (t, k), generator=g).to(F64)
    else:
        def rnd(*shape):
            return torch.randn(shape, generator=g, dtype=F64)
        tw = torch.rand((t, k), generator=g, dtype=F64) + 0.1
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if skew is not None:
        first = idx[: t // 2]
        has = (first == skew).any(1)
        first[~has, 0] = skew
    idx[torch.rand((t, k), generator=g) < drop] = -1
    return dict(x=rnd(t, h), idx=idx.to(idx_dtype), tw=tw, w13=rnd(e, 2 * f, h) / (1 if integer else h ** 0.5),
                w2=rnd(e, h, f) / (1 if integer else f ** 0.5))


def shard(p, rank, world, layout="nk", gated=True):
    """Rank ``rank``'s (x, topk_idx, topk_weights, w1 or w13 shard, w2 shard), weights in ``layout``."""
    t, _ = p["x"].shape
    f = p["w2"].shape[2]
    tl, fl = t // world, f // world
    rows = slice(rank * tl, (rank + 1) * tl)
    cols = slice(rank * fl, (rank + 1) * fl)
    w1 = p["w13"][:, :f]
    if gated:
        w1 = torch.cat([w1[:, cols], p["w13"][:, f:][:, cols]], dim=1)  # [E, 2F/W, H]: gate, then up
    else:
        w1 = w1[:, cols]  # [E, F/W, H]
    w2 = p["w2"][:, :, cols]
    if layout == "kn":
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    return p["x"][rows].clone(), p["idx"][rows].clone(), p["tw"][rows].clone(), w1.contiguous(), w2.contiguous()


def act(y, gated):
    if gated:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(y)


def full_mlp(p, gated=True):
    """The unsharded MoE MLP on all tokens (autograd through it): out [T, H]."""
    x, idx, tw, w13, w2 = p["x"], p["idx"].to(torch.int64), p["tw"], p["w13"], p["w2"]
    f = w2.shape[2]
    out = torch.zeros(x.shape, dtype=F64, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        w1 = w13[e] if gated else w13[e, :f]
        a = act(x[tok] @ w1.t(), gated)
        out = out.index_add(0, tok, tw[tok, slot][:, None] * (a @ w2[e].t()))
    return out
