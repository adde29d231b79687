"""Expert-parallel MoE token movement: flux.moe_dispatch / moe_combine against NCCL all-to-all.

    torchrun --nproc_per_node=2 bench/bench_moe.py --out moe.json               # the default (reduced) grid
    torchrun --nproc_per_node=2 bench/bench_moe.py --tokens 128,1024,4096,8192 --hidden 4096,7168 \\
        --topk 2,8 --experts 8,64 --routing uniform,skewed                     # the full grid
    torchrun --nproc_per_node=2 bench/bench_moe.py --cpu --steps 2 --rounds 2   # gloo smoke run (smoke sizes)
    FLUX_GLOO_CUDA=1 torchrun --nproc_per_node=2 bench/bench_moe.py --flux-only ...  # ranks sharing one GPU

Grid: tokens per rank T x hidden H x top-k K x experts E (E/W per rank) x routing, bf16 on the GPU.
Routing is random, drawn per rank: ``uniform`` (each token's K experts a uniform sample without
replacement) or ``skewed`` (without replacement, expert i drawn with probability proportional to
(i+1)^-s, ``--skew s``: the first experts, on the first ranks, hot). Weights: a softmax of
normal draws (fp32).

Per cell, each timed after --warmup calls:

  dispatch / combine, flux   flux.moe_dispatch(x, idx, w, E) and flux.moe_combine(y, handle)
                             (y: the dispatched rows), unbounded layout, loop mode
  dispatch, flux unread      world size 1: the unbounded dispatch with read_counts=False (no count
                             read; recv_x [T * K, H]), loop and graph mode, host us
                             (``flux.dispatch_unread``)
  dispatch / combine, flux bounded   the same with max_tokens_per_rank=T, loop mode and graph
                             mode (--steps calls captured once in a CUDA graph, replayed); skipped
                             where the [E/W, W*T, H] slab is over --bounded-max-gib; the
                             dispatch with zero_pad=True (``dispatch``: zeros past the counts) and
                             with the default zero_pad=False (``dispatch_nopad``: left unwritten)
  dispatch / combine, a2a    the baseline below, loop mode (it reads counts on the host, so it
                             cannot be captured)
  host us                    bounded dispatch and combine, unbounded combine: repeat calls after the
                             warm-up (the planned hot path), batches behind a GPU spin (Bench.host_us),
                             median; at world size 1 also the C++ entry alone (``entry_host_us``)
  layer fwd+bwd              flux.nn.MoE (SwiGLU experts, --ffn, unbounded dispatch; its own
                             router on random inputs) forward and y.backward(g), gradients set to
                             None first, with flux's dispatcher and with the baseline: the same
                             layer, the same weights; loop mode
  layer decode               world size 1, --reference grouped, T <= 1024: the layer's forward
                             alone, bounded (max_tokens_per_rank=T), loop and graph mode: as it
                             runs ("masked": flux's masked grouped kernels compute each slab's
                             counted rows only) and with every slab row computed ("padded")

The baseline (``AllToAllDispatcher``) is Megatron's all-to-all token dispatcher in its simplest
form: sort the (token, slot) pairs by global expert (stable, so token then slot order within an
expert), all_to_all_single of the per-expert counts, the counts to the host, all_to_all_single of
the sorted rows (one row per pair), then a permutation of the received rows from (source rank,
expert) order to (expert, source rank) order; combine runs the inverses and sums each token's K
rows times its weights in fp32 (index_add; float64 in float64). It produces flux's layout exactly (rows grouped by
local expert, then source rank, token, slot), so the two are compared row for row.

Loop mode: CUDA events around --steps back-to-back calls after a GPU rendezvous; ms per call,
median of --rounds, maximum over the ranks. Graph mode: the same calls replayed from one CUDA
graph. Both from bench_layers.Bench.

GB/s per direction: the bytes that leave a rank for other ranks in the layout's terms: one row of
H elements (x's dtype) per (token, slot) pair whose expert lives on another rank (dispatch), and
one row of y per such pair coming back (combine); the mean of that over the ranks, divided by the
call time (maximum over ranks). Counts and other metadata are not counted, nor rows a rank keeps.
The same count serves flux and the baseline. flux's dispatch sends a token once per destination
rank (not once per slot), so it moves fewer bytes than counted: ``remote_bytes_dedup`` records
that lower figure (distinct (token, other rank) pairs), and flux's ``symm`` dispatch records also
``gbps_link_*``, its GB/s in those bytes (what crossed NVLink; ``flux_strategy`` names the
strategy). Combine moves one row per pair.

The JSON (--out) records every figure and the command; the table printed last gives ms and GB/s
for each and flux's speedups. On the CPU (--cpu: gloo, fp32) it only checks that the script runs
and that flux and the baseline agree. ``--flux-only`` leaves out the baseline and the layer and
checks flux's rows against ``flux.moe_dispatch_ref`` (and the bounded combine against the
unbounded one), so that ranks sharing a GPU over gloo (FLUX_GLOO_CUDA=1) can run it: a
correctness run, as their timings are those of one GPU time-sliced between processes.
"""
import argparse
import json
import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
if "RANK" not in os.environ:  # plain `python bench/bench_moe.py`: a group of one rank
    for _k, _v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", os.environ.get("FLUX_BENCH_PORT", "29531"))):
        os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flux  # noqa: E402
from flux.ops.grouped_mm import grouped_mm  # noqa: E402
from bench_layers import _commit, _f, attempt, finish, ratio, rel_err, start  # noqa: E402


# --------------------------------------------------------------------------------------
# The baseline: all-to-all token dispatcher


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 with the given splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x, out_splits, in_splits, group):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class A2AHandle:
    """What the baseline's combine needs: the sender's sort, the receiver's permutation, the splits."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class AllToAllDispatcher:
    """Megatron's all-to-all token dispatcher, simplest form, with flux.moe_dispatch's signature
    and layouts (``dispatch`` -> ``(recv_x, counts, handle)``, ``combine(y, handle)``); autograd
    through both. ``max_tokens_per_rank=C`` places the rows in flux's bounded layout
    ``[E/W, W*C, H]`` (after the same exchange)."""

    @staticmethod
    def dispatch(x, topk_idx, topk_weights, num_experts, *, group=None, max_tokens_per_rank=None):
        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        el = num_experts // world
        t, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        valid = flat >= 0
        # Stable sort of the (token, slot) pairs by expert: token, then slot, within an expert;
        # pairs with no expert (-1) last, never sent.
        order = torch.sort(torch.where(valid, flat, num_experts), stable=True).indices
        send_counts = torch.bincount(flat[valid], minlength=num_experts)  # [E]: (dest rank, local expert)
        recv_counts = torch.empty_like(send_counts)  # [W * El]: (source rank, local expert)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        host = torch.cat([send_counts, recv_counts]).tolist()  # the one host synchronisation
        send_h, recv_h = host[:num_experts], host[num_experts:]
        in_splits = [sum(send_h[r * el:(r + 1) * el]) for r in range(world)]
        out_splits = [sum(recv_h[s * el:(s + 1) * el]) for s in range(world)]
        pairs = order[:sum(in_splits)]
        recv = _AllToAll.apply(x.index_select(0, pairs // k), out_splits, in_splits, group)
        # Received in (source, expert) chunks; regroup to (expert, source) by a stable sort of the
        # chunk keys expert * W + source.
        chunk_counts = recv_counts.view(world, el)
        chunk = torch.arange(world * el, device=x.device).view(world, el)
        key = (chunk % el) * world + chunk // el
        row_key = torch.repeat_interleave(key.reshape(-1), chunk_counts.reshape(-1), output_size=recv.shape[0])
        perm = torch.sort(row_key, stable=True).indices
        recv_x = recv.index_select(0, perm)
        counts = chunk_counts.sum(0)
        counts_host = [sum(recv_h[s * el + e] for s in range(world)) for e in range(el)]
        slot = None
        if max_tokens_per_rank is not None:
            cap = world * max_tokens_per_rank
            starts = torch.cumsum(counts, 0) - counts
            expert_of_row = torch.repeat_interleave(torch.arange(el, device=x.device), counts,
                                                    output_size=recv_x.shape[0])
            slot = expert_of_row * cap + torch.arange(recv_x.shape[0], device=x.device) - starts[expert_of_row]
            slab = recv_x.new_zeros(el * cap, *recv_x.shape[1:]).index_copy(0, slot, recv_x)
            recv_x = slab.view(el, cap, *recv_x.shape[1:])
            counts_host = None
        handle = A2AHandle(pairs=pairs, k=k, tokens=t, perm=perm, in_splits=in_splits, out_splits=out_splits,
                           group=group, topk_weights=topk_weights, slot=slot, counts_host=counts_host)
        return recv_x, counts, handle

    @staticmethod
    def combine(y, handle):
        if handle.slot is not None:
            y = y.reshape(-1, *y.shape[2:]).index_select(0, handle.slot)
        inv = torch.empty_like(handle.perm)
        inv[handle.perm] = torch.arange(handle.perm.numel(), device=handle.perm.device)
        back = _AllToAll.apply(y.index_select(0, inv), handle.in_splits, handle.out_splits, handle.group)
        acc = torch.promote_types(y.dtype, torch.float32)  # fp32 accumulation (float64 stays float64)
        w = handle.topk_weights.reshape(-1).index_select(0, handle.pairs).to(acc)
        out = torch.zeros(handle.tokens, *y.shape[1:], dtype=acc, device=y.device)
        return out.index_add(0, handle.pairs // handle.k, back.to(acc) * w.view(-1, *([1] * (y.dim() - 1)))).to(y.dtype)


# --------------------------------------------------------------------------------------
# World size 1 (--reference grouped): the MoE layer users write with stock PyTorch


def grouped_reference_layer(layer):
    """``fn(x) -> out``: the layer of ``layer`` (same router and weights, its routing function)
    as written with stock PyTorch: sort the (token, slot) pairs by expert, gather the rows,
    ``torch._grouped_mm`` for W13, SwiGLU, ``torch._grouped_mm`` for W2, scale each row by its
    routing weight, ``index_add_`` back (in x's dtype). Autograd through torch's own formulas."""
    import torch.nn.functional as F

    def fn(x):
        idx, w = layer.route(x)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=layer.num_experts)
        offs = counts.cumsum(0).to(torch.int32)
        tok = order // k
        h = torch._grouped_mm(x[tok], layer.w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, layer.w2.transpose(-2, -1), offs=offs)
        y = y * w.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)

    return fn


def gemms_only(layer, x, idx, dense=False, impl="flux"):
    """``step()`` of the layer's grouped GEMMs alone, forward and backward (the floor): W13 on the
    dispatched rows, W2 on an [R, F] input, each backward (dx, dW) from a fixed gradient.
    ``impl``: "flux", flux.grouped_mm as flux.nn.MoE calls it (the counts on the host), or
    "torch", torch._grouped_mm with torch's autograd (what the stock layer runs).
    ``dense``: the same rows through one dense GEMM per weight (expert 0's, for every row): the
    same FLOPs at the dense-GEMM rate, what a grouped GEMM would reach without per-group cost."""
    flat = idx.reshape(-1)
    flat = flat[flat >= 0]
    counts = torch.bincount(flat, minlength=layer.w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    r = flat.numel()
    gen = torch.Generator(device=x.device).manual_seed(5)
    xp = torch.randn(r, layer.hidden, generator=gen, device=x.device).to(x.dtype).requires_grad_()
    a = torch.randn(r, layer.ffn, generator=gen, device=x.device).to(x.dtype).requires_grad_()
    gh = torch.randn(r, 2 * layer.ffn, generator=gen, device=x.device).to(x.dtype)
    gy = torch.randn(r, layer.hidden, generator=gen, device=x.device).to(x.dtype)

    # dense: leaves of expert 0's weights alone, so that the backward writes their gradients only
    # (a slice of the full parameters would zero-fill every expert's gradient each step).
    w13, w2 = ((layer.w13[0].detach().clone().requires_grad_(), layer.w2[0].detach().clone().requires_grad_())
               if dense else (layer.w13, layer.w2))

    counts_host = counts.tolist()

    def mm(rows, w):
        if dense:
            return rows @ w.t()
        if impl == "flux":
            return grouped_mm(rows, w, offs, cumulative=True, counts_host=counts_host)
        return torch._grouped_mm(rows, w.transpose(-2, -1), offs=offs)

    def step():
        for p in (xp, a, w13, w2):
            p.grad = None
        h = mm(xp, w13)
        y = mm(a, w2)
        torch.autograd.backward([h, y], [gh, gy])
        return y

    step.weights = (w13, w2)
    return step


# --------------------------------------------------------------------------------------
# The benchmark


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default=None,
                   help="tokens per rank, comma-separated (default 128,4096, with --cpu 16; full grid: "
                        "128,1024,4096,8192)")
    p.add_argument("--hidden", default=None, help="hidden sizes (default 7168, with --cpu 32; full grid: 4096,7168)")
    p.add_argument("--topk", default=None, help="experts per token (default 2,8, with --cpu 2)")
    p.add_argument("--experts", default=None,
                   help="experts in all, divisible by the world size (default 8,64, with --cpu 4)")
    p.add_argument("--routing", default="uniform", help="uniform, skewed (comma-separated)")
    p.add_argument("--skew", type=float, default=1.0, help="skewed routing: expert i drawn with weight (i+1)^-skew")
    p.add_argument("--ffn", type=int, default=None, help="the layer's expert FFN size (default 2048, with --cpu 16)")
    p.add_argument("--no-layer", action="store_true", help="skip the MoE layer forward+backward")
    p.add_argument("--profile-layer", action="store_true",
                   help="world size 1, CUDA: also run the flux and stock layers' loops under torch.profiler: "
                        "per step, wall ms and the GPU's busy ms (the sum of its kernels' times) in the same loop, "
                        "and the kernels taking most of it (layer.profile in the JSON)")
    p.add_argument("--no-bounded", action="store_true", help="skip the bounded (max_tokens_per_rank) variant")
    p.add_argument("--flux-only", action="store_true",
                   help="only flux (checked against flux.moe_dispatch_ref), no baseline and no layer: for ranks "
                        "sharing a GPU (FLUX_GLOO_CUDA=1, gloo), where NCCL cannot run")
    p.add_argument("--bounded-max-gib", type=float, default=16.0,
                   help="skip the bounded variant where its [E/W, W*T, H] slab is larger (GiB)")
    p.add_argument("--steps", type=int, default=10, help="calls per timed loop and per graph")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, fp32 (a smoke run)")
    p.add_argument("--reference", default="a2a", choices=("a2a", "grouped"),
                   help="grouped: also time the layer users write with stock PyTorch (torch._grouped_mm, same "
                        "weights) and its grouped GEMMs alone (the floor); world size 1")
    p.add_argument("--no-host", action="store_true", help="skip the host-time measurements")
    p.add_argument("--host-calls", type=int, default=200,
                   help="calls timed on the host per measurement, in batches of 20 behind a GPU spin")
    p.add_argument("--out", default=None, help="JSON path (rank 0)")
    args = p.parse_args(argv)
    # Sizes not given: the GPU grid, or smoke sizes with --cpu (the GPU sizes would compute on the
    # CPU for hours without printing anything).
    for name, gpu, cpu in (("tokens", "128,4096", "16"), ("hidden", "7168", "32"), ("topk", "2,8", "2"),
                           ("experts", "8,64", "4"), ("ffn", 2048, 16)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if args.cpu else gpu)
    return args


def routing(kind, tokens, experts, topk, skew, gen, dev):
    """(topk_idx [T, K] int64, topk_weights [T, K] fp32) of one rank."""
    if kind == "uniform":
        idx = torch.rand(tokens, experts, generator=gen, device=dev).topk(topk, dim=-1).indices
    elif kind == "skewed":
        p = torch.arange(1, experts + 1, device=dev, dtype=torch.float32).pow(-skew)
        idx = torch.multinomial(p.expand(tokens, experts), topk, replacement=False, generator=gen)
    else:
        raise ValueError(f"unknown routing {kind!r} (uniform, skewed)")
    w = torch.randn(tokens, topk, generator=gen, device=dev).softmax(-1)
    return idx.to(torch.int64), w


def remote_bytes(idx, experts, rank, world, hidden, itemsize, dev):
    """(mean over ranks of the bytes of rows leaving a rank, the same deduplicated per (token, rank))."""
    el = experts // world
    dest = idx // el
    remote = dest != rank
    pairs = remote.sum()
    seen = torch.zeros(idx.shape[0], world, dtype=torch.bool, device=dev)
    seen.scatter_(1, dest, True)
    seen[:, rank] = False
    t = torch.stack([pairs, seen.sum()]).to(torch.float64)
    dist.all_reduce(t)
    t = t / world
    return float(t[0]) * hidden * itemsize, float(t[1]) * hidden * itemsize


def gbps(nbytes, ms):
    return None if ms is None or ms <= 0 else nbytes / (ms * 1e-3) / 1e9


def timed(bench, step, args, graph, host=False, entry=None):
    """loop ms; graph ms (graph); host us per call of repeat calls (host: calls that do not read
    the device on the host; Bench.host_us), and of ``entry`` (the C++ entry alone) where given."""
    for _ in range(args.warmup):
        step()
    res = {"loop_ms": bench.loop_ms(step)}
    if graph:
        res["graph_ms"], res["graph_status"] = bench.graph_ms(step)
    if host and not args.no_host and bench.cuda:
        step()  # after the graph capture (its own memory pool): the outputs' blocks back in the allocator's cache
        res["host_us"] = bench.host_us(step, args.host_calls)
        if entry is not None:
            entry()
            res["entry_host_us"] = bench.host_us(entry, args.host_calls)
    return res


def check_same(bench, what, flux_out, base_out, tol):
    """The maximum over ranks of the relative difference; raises where it exceeds tol."""
    err = bench.max_all(max(rel_err(a, b) for a, b in zip(flux_out, base_out)))
    if not err <= tol:
        raise AssertionError(f"{what}: flux and the all-to-all baseline differ by {err:.3g} (tolerance {tol})")
    return err


def layer_case(args, bench, layer, tokens, topk, dev, dtype, rank, tol):
    """Forward+backward ms of the layer with each dispatcher, after comparing the two."""
    from flux.nn.moe import FluxDispatcher

    layer.top_k = topk
    gen = torch.Generator(device=dev).manual_seed(300 + rank)
    x = torch.randn(tokens, layer.hidden, generator=gen, device=dev).to(dtype).requires_grad_()
    g = torch.randn(tokens, layer.hidden, generator=gen, device=dev).to(dtype)
    params = list(layer.parameters())

    def fwd_bwd(module):
        def run():
            for p in params:
                p.grad = None
            x.grad = None
            y = module(x)
            y.backward(g)
            return y
        return run

    step = fwd_bwd(layer)

    out = {}
    for name, disp in (("a2a", AllToAllDispatcher()), ("flux", FluxDispatcher())):
        layer.dispatcher = disp
        y = step().detach()
        out[name] = [y, x.grad.clone()] + [p.grad.clone() for p in params]
    res = {"rel_err": check_same(bench, "layer output and gradients", out["flux"], out["a2a"], tol)}
    for name, disp in (("a2a", AllToAllDispatcher()), ("flux", FluxDispatcher())):
        layer.dispatcher = disp
        res[name] = timed(bench, step, args, graph=False)
    layer.dispatcher = FluxDispatcher()
    if args.reference == "grouped" and dist.get_world_size() == 1 and bench.cuda:
        ref_step = fwd_bwd(grouped_reference_layer(layer))

        try:  # recorded, not raised: the flux layer's figures above stand whatever happens here
            y = ref_step().detach()
            got = [y, x.grad.clone()] + [p.grad.clone() for p in params]
            err = bench.max_all(max(rel_err(a, b) for a, b in zip(out["flux"], got)))
            res["grouped_rel_err"] = err
            res["grouped_status"] = "ok" if err <= tol else f"differs from flux by {err:.3g} (tolerance {tol})"
            del got
            res["grouped"] = timed(bench, ref_step, args, graph=False)
            with torch.no_grad():
                idx, _ = layer.route(x)
            res["gemms"] = timed(bench, gemms_only(layer, x, idx), args, graph=False)
            res["gemms_torch"] = timed(bench, gemms_only(layer, x, idx, impl="torch"), args, graph=False)
        except Exception as e:  # noqa: BLE001
            res["grouped_status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
        try:
            res["dense"] = timed(bench, gemms_only(layer, x, idx, dense=True), args, graph=False)
        except Exception as e:  # noqa: BLE001
            res["dense_status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
        if tokens <= 1024:
            res["decode"] = decode_case(args, bench, layer, x)
        if args.profile_layer:
            res["profile"] = {}
            for name, s in (("flux", step), ("stock", ref_step)):
                try:
                    res["profile"][name] = gpu_busy(s, args.steps)
                except Exception as e:  # noqa: BLE001
                    res["profile"][name] = {"status": f"error: {type(e).__name__}: {str(e)[:300]}"}
    return res


def decode_case(args, bench, layer, x):
    """The layer's forward alone (no autograd), bounded (max_tokens_per_rank = T), loop and graph
    timing: as it runs ("masked": where the layer takes flux's masked grouped kernels
    (``MoE.skip_padding``, recorded), only the counted rows of each slab are computed and the
    dispatch writes no zeros) and with every slab row computed ("padded": the dispatch's zeros
    and batched GEMMs over the whole slabs)."""
    res = {}
    xd = x.detach()
    saved = layer.max_tokens_per_rank
    layer.max_tokens_per_rank = xd.shape[0]
    try:
        outs = {}
        for name, skip in (("masked", None), ("padded", lambda t, cap: False)):
            if skip is not None:
                layer.skip_padding = skip  # an instance attribute over the method
            try:
                with torch.no_grad():
                    outs[name] = layer(xd)
                    res[name] = timed(bench, lambda: layer(xd), args, graph=True)
                res[name]["skip_padding"] = bool(layer.skip_padding(xd, xd.shape[0]))
            except Exception as e:  # noqa: BLE001
                res[name] = {"status": f"error: {type(e).__name__}: {str(e)[:300]}"}
            finally:
                layer.__dict__.pop("skip_padding", None)
        if len(outs) == 2:
            res["rel_err"] = rel_err(outs["masked"], outs["padded"])
    finally:
        layer.max_tokens_per_rank = saved
    return res


def gpu_busy(step, steps, top=12):
    """``steps`` calls of ``step`` under torch.profiler (CUDA activity): per call, the wall ms
    (events around the loop) and the GPU's busy ms (the sum of its kernels' and copies' times):
    their difference is where the GPU waited for the host. The ``top`` device activities by time."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
    acts = [(e.key, e.self_device_time_total / 1e3 / steps) for e in prof.key_averages() if e.self_device_time_total > 0]
    acts.sort(key=lambda a: -a[1])
    return {"wall_ms": start.elapsed_time(end) / steps, "gpu_busy_ms": sum(t for _, t in acts),
            "top": [[k[:120], t] for k, t in acts[:top]]}


def run(args):
    dev, dtype, group, rank, world, bench = start(args)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    itemsize = torch.empty((), dtype=dtype).element_size()
    records, layers = [], {}
    for hidden in (int(v) for v in args.hidden.split(",")):
        for experts in (int(v) for v in args.experts.split(",")):
            if experts % world:
                records.append({"hidden": hidden, "experts": experts, "status": f"skipped: {experts} experts "
                                f"not divisible by {world} ranks"})
                continue
            for topk in (int(v) for v in args.topk.split(",")):
                for tokens in (int(v) for v in args.tokens.split(",")):
                    for kind in args.routing.split(","):
                        rec = {"tokens": tokens, "hidden": hidden, "topk": topk, "experts": experts, "routing": kind}
                        records.append(rec)
                        status = attempt(rec, lambda: cell(args, bench, rec, group, rank, world, dev, dtype,
                                                           itemsize, tol, layers))
                        if rank == 0 and status != "ok":
                            print(f"T={tokens} H={hidden} K={topk} E={experts} {kind}: {status}", flush=True)
                        if rank == 0 and args.out:  # a run cut short keeps the cells it finished
                            with open(args.out, "w") as fh:
                                json.dump({"metadata": {"partial": True, "commit": _commit()}, "results": records},
                                          fh, indent=1)
    text = (table(records) + ("\n\n" + layer_table(records) if world == 1 else "")) if rank == 0 else ""
    launcher = ["python"] if "TORCHELASTIC_RUN_ID" not in os.environ else ["torchrun", f"--nproc_per_node={world}"]
    if os.environ.get("FLUX_GROUPED_MM"):  # the layer's grouped GEMM implementation (flux.ops.grouped_mm)
        launcher = [f"FLUX_GROUPED_MM={os.environ['FLUX_GROUPED_MM']}"] + launcher
    return finish(args, dev, dtype, records, text, ffn=args.ffn, skew=args.skew,
                  command=" ".join(launcher + sys.argv),
                  bytes=("HBM traffic: (valid pairs + T) x H x itemsize (bounded dispatch: (E x T + T) rows)"
                         if world == 1 else "rows of remote (token, slot) pairs x H x itemsize, mean over ranks"))


def layer_table(records):
    """World size 1: the layer's forward+backward (loop ms) against the stock grouped-GEMM layer and
    its GEMMs alone; the bounded dispatch and combine in graph replay and host us per repeat call
    (in parentheses: the C++ entry alone)."""
    lines = [f"{'T':>5} {'H':>5} {'K':>2} {'E':>3} | {'flux':>7} {'stock':>7} {'gemms':>7} {'torch':>7} "
             f"{'stock/flux':>10} {'flux/gemms':>10} {'gemms/dense':>11} | {'bnd disp graph us':>17} "
             f"{'host us (C++)':>13} | "
             f"{'bnd comb graph us':>17} {'host us (C++)':>13}"]
    for r in records:
        if r.get("status") != "ok":
            continue
        lay = r.get("layer") or {}
        f = (lay.get("flux") or {}).get("loop_ms")
        s = (lay.get("grouped") or {}).get("loop_ms")
        g = (lay.get("gemms") or {}).get("loop_ms")
        gt = (lay.get("gemms_torch") or {}).get("loop_ms")
        d = (lay.get("dense") or {}).get("loop_ms")
        b = r.get("flux_bounded", {})

        def us(op, key):
            v = (b.get(op) or {}).get(key)
            return "-" if v is None else f"{v * (1e3 if key.endswith('_ms') else 1):.1f}"

        def host(op):
            return f"{us(op, 'host_us')} ({us(op, 'entry_host_us')})"

        lines.append(f"{r['tokens']:>5} {r['hidden']:>5} {r['topk']:>2} {r['experts']:>3} | {_f(f):>7} {_f(s):>7} "
                     f"{_f(g):>7} {_f(gt):>7} {ratio(s, f):>10} {ratio(f, g):>10} {ratio(g, d):>11} | "
                     f"{us('dispatch', 'graph_ms'):>17} "
                     f"{host('dispatch'):>13} | {us('combine', 'graph_ms'):>17} {host('combine'):>13}")
    for r in records:
        dec = (r.get("layer") or {}).get("decode") or {}
        if dec:
            lines.append(f"T={r['tokens']} E={r['experts']} bounded forward, loop / graph ms: " + ", ".join(
                f"{n} {_f((dec.get(n) or {}).get('loop_ms'))} / {_f((dec.get(n) or {}).get('graph_ms'))}"
                for n in ("masked", "padded")) + f" (rel. difference {_f(dec.get('rel_err'), '.2g')})")
    for r in records:
        prof = (r.get("layer") or {}).get("profile") or {}
        if prof:
            lines.append(f"T={r['tokens']} E={r['experts']} under the profiler, wall / GPU-busy ms per step: "
                         + ", ".join(f"{n} {_f(p.get('wall_ms'))} / {_f(p.get('gpu_busy_ms'))}" for n, p in prof.items()))
    lines.append("layer: flux.nn.MoE forward+backward, loop ms; stock: the same layer in stock PyTorch "
                 "(--reference grouped); gemms: flux's grouped GEMMs alone (flux.grouped_mm, as the layer calls "
                 "it); torch: the stock layer's (torch._grouped_mm); dense: the same FLOPs as dense GEMMs; "
                 "host us: repeat calls (the hot path), "
                 "batches behind a GPU spin, median")
    return "\n".join(lines)


def cell(args, bench, rec, group, rank, world, dev, dtype, itemsize, tol, layers):
    tokens, hidden, topk, experts = rec["tokens"], rec["hidden"], rec["topk"], rec["experts"]
    gen = torch.Generator(device=dev).manual_seed(1000 * rank + 7)
    idx, w = routing(rec["routing"], tokens, experts, topk, args.skew, gen, dev)
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(dtype)
    rec["remote_bytes"], rec["remote_bytes_dedup"] = remote_bytes(idx, experts, rank, world, hidden, itemsize, dev)
    if world == 1:  # a local permutation: count HBM traffic (each pair's row written, each token read once)
        pairs = int((idx >= 0).sum())
        rec["hbm_bytes"] = (pairs + tokens) * hidden * itemsize
        rec["hbm_bytes_bounded"] = (experts * tokens + tokens) * hidden * itemsize  # zero padding written too
    base = AllToAllDispatcher()

    def fx_dispatch(cap=None, zero_pad=True):
        return lambda: flux.moe_dispatch(x, idx, w, experts, group=group, max_tokens_per_rank=cap, zero_pad=zero_pad)

    def a2a_dispatch():
        return base.dispatch(x, idx, w, experts, group=group)

    def reference(cap=None):
        if args.flux_only:  # rows and counts from the reference (combines are compared with flux's unbounded)
            rr, rc = flux.moe_dispatch_ref(x, idx, w, experts, group=group, max_tokens_per_rank=cap)
            return rr, rc, None
        rr, rc, rh = base.dispatch(x, idx, w, experts, group=group, max_tokens_per_rank=cap)
        return rr, rc, lambda y: base.combine(y, rh)

    # Correctness: the same rows, counts and combined output.
    fr, fc, fh = fx_dispatch()()
    rec["flux_strategy"] = fh.strategy
    br, bc, bcomb = reference()
    check_same(bench, "dispatched rows", [fr, fc.float()], [br, bc.float()], 0.0)
    if not args.flux_only:
        rec["rel_err_combine"] = check_same(bench, "combine", [flux.moe_combine(fr, fh)], [bcomb(br)], tol)
    rec["flux"] = {"dispatch": timed(bench, fx_dispatch(), args, graph=False),
                   "combine": timed(bench, lambda: flux.moe_combine(fr, fh), args, graph=False, host=True)}
    if fh.strategy == "local":  # one rank: the unbounded dispatch without the count read (read_counts=False)
        def unread():
            return flux.moe_dispatch(x, idx, w, experts, group=group, read_counts=False)

        ur, uc, _ = unread()
        check_same(bench, "dispatched rows, read_counts=False", [ur[:fr.shape[0]], uc.float()], [fr, fc.float()], 0.0)
        del ur, uc
        rec["flux"]["dispatch_unread"] = timed(bench, unread, args, graph=True, host=True)
    if not args.flux_only:
        rec["a2a"] = {"dispatch": timed(bench, a2a_dispatch, args, graph=False),
                      "combine": timed(bench, lambda: bcomb(br), args, graph=False)}
    unbounded_out = flux.moe_combine(fr, fh)
    del fr, fc, br, bc
    slab_gib = experts // world * world * tokens * hidden * itemsize / 2 ** 30
    if args.no_bounded:
        rec["bounded_status"] = "skipped (--no-bounded)"
    elif slab_gib > args.bounded_max_gib:
        rec["bounded_status"] = f"skipped: the slab is {slab_gib:.1f} GiB (--bounded-max-gib {args.bounded_max_gib})"
    else:
        br, bc, bcomb = reference(tokens)
        fr, fc, fbh = fx_dispatch(tokens)()
        fbh.check()
        check_same(bench, "bounded dispatched rows", [fr, fc.float()], [br, bc.float()], 0.0)
        # Combine of the dispatched rows themselves: the unbounded combine's result.
        check_same(bench, "bounded combine", [flux.moe_combine(fr, fbh)],
                   [unbounded_out if args.flux_only else bcomb(br)], tol)
        # zero_pad=False: the rows past the counts unwritten; the rows up to them the same.
        nr, nc, _ = fx_dispatch(tokens, zero_pad=False)()
        keep = (torch.arange(nr.shape[1], device=dev)[None, :] < nc[:, None])[..., None]
        check_same(bench, "bounded dispatched rows, zero_pad=False", [torch.where(keep, nr, 0), nc.float()],
                   [fr, fc.float()], 0.0)
        del nr, nc, keep
        entry_d = entry_c = None
        if fbh.strategy == "local":  # the C++ entries of the public calls, with the same arguments
            entry_d = lambda: torch.ops.flux.moe_local_dispatch(x, idx, experts, tokens, 0, True)  # noqa: E731
            entry_c = lambda: torch.ops.flux.moe_local_combine(fr, w, fbh.recv_dest, topk)  # noqa: E731
        rec["flux_bounded"] = {"dispatch": timed(bench, fx_dispatch(tokens), args, graph=True, host=True,
                                                 entry=entry_d),
                               "dispatch_nopad": timed(bench, fx_dispatch(tokens, zero_pad=False), args, graph=True),
                               "combine": timed(bench, lambda: flux.moe_combine(fr, fbh), args, graph=True,
                                                host=True, entry=entry_c)}
        rec["bounded_status"] = "ok"
        del fr, fc, fbh, br, bc
    for name in ("flux", "a2a", "flux_bounded"):
        for op in ("dispatch", "dispatch_unread", "dispatch_nopad", "combine"):
            r = rec.get(name, {}).get(op)
            if r is not None:
                nbytes = rec["remote_bytes"]
                if world == 1:
                    bounded_dispatch = name == "flux_bounded" and op == "dispatch"
                    nbytes = rec["hbm_bytes_bounded"] if bounded_dispatch else rec["hbm_bytes"]
                r["gbps_loop"] = gbps(nbytes, r["loop_ms"])
                if r.get("graph_ms") is not None:
                    r["gbps_graph"] = gbps(nbytes, r["graph_ms"])
                # symm's dispatch sends one row per (token, other rank): its link GB/s too
                if name != "a2a" and op != "combine" and rec["flux_strategy"] == "symm":
                    r["gbps_link_loop"] = gbps(rec["remote_bytes_dedup"], r["loop_ms"])
                    if r.get("graph_ms") is not None:
                        r["gbps_link_graph"] = gbps(rec["remote_bytes_dedup"], r["graph_ms"])
    fh = unbounded_out = None  # free before the layer
    if not args.no_layer and not args.flux_only:
        key = (hidden, experts)
        if key not in layers:
            layers.clear()  # one layer at a time on the device
            layers[key] = flux.nn.MoE(hidden, args.ffn, experts, topk, group=group, seed=1, dtype=dtype, device=dev)
        rec["layer"] = layer_case(args, bench, layers[key], tokens, topk, dev, dtype, rank, tol)
    if rank == 0:
        print(f"T={tokens} H={hidden} K={topk} E={experts} {rec['routing']}: " + "; ".join(
            f"{n} {op} {_f(rec[n][op]['loop_ms'])}" for n in ("flux", "a2a") if n in rec
            for op in ("dispatch", "combine"))
            + (f"; layer flux {_f(rec['layer']['flux']['loop_ms'])} a2a {_f(rec['layer']['a2a']['loop_ms'])}"
               if "layer" in rec else ""), flush=True)


def table(records):
    """One line per cell: dispatch and combine ms (loop; the bounded variant also graph) and GB/s,
    flux against the all-to-all baseline, and the layer's forward+backward."""
    lines = [f"{'T':>5} {'H':>5} {'K':>2} {'E':>3} {'routing':<8} | {'dispatch ms f/a2a':>17} {'bnd l/g (np)':>21} "
             f"{'GB/s f/a2a':>11} {'x':>5} | {'combine ms f/a2a':>17} {'bnd l/g':>13} {'GB/s f/a2a':>11} {'x':>5} | "
             f"{'layer ms f/a2a':>15} {'x':>5}"]

    for r in records:
        head = f"{r.get('tokens', '-'):>5} {r['hidden']:>5} {r.get('topk', '-'):>2} {r['experts']:>3} {r.get('routing', '-'):<8}"
        if r.get("status") != "ok":
            lines.append(f"{head} | {r.get('status')}")
            continue
        parts = []
        for op in ("dispatch", "combine"):
            f, a = r["flux"][op], r.get("a2a", {}).get(op, {})
            b = r.get("flux_bounded", {}).get(op)
            bnd = "-" if b is None else f"{_f(b['loop_ms'])}/{_f(b.get('graph_ms'))}"
            nopad = r.get("flux_bounded", {}).get("dispatch_nopad") if op == "dispatch" else None
            if nopad is not None:
                bnd += f" ({_f(nopad.get('graph_ms'))})"
            unread = r["flux"].get("dispatch_unread") if op == "dispatch" else None
            if unread is not None:
                bnd += f" u{_f(unread['loop_ms'])}/{_f(unread.get('graph_ms'))}"
            g = f"{_f(f['gbps_loop'], '.1f')}/{_f(a.get('gbps_loop'), '.1f')}"
            parts.append(f"{_f(f['loop_ms']):>8}/{_f(a.get('loop_ms')):<8} {bnd:>{21 if op == 'dispatch' else 13}} {g:>11} "
                         f"{ratio(a.get('loop_ms'), f['loop_ms']):>5}")
        lay = r.get("layer")
        lay_s = "-" if lay is None else f"{_f(lay['flux']['loop_ms']):>7}/{_f(lay['a2a']['loop_ms']):<7}"
        lay_x = "-" if lay is None else ratio(lay["a2a"]["loop_ms"], lay["flux"]["loop_ms"])
        lines.append(f"{head} | {parts[0]} | {parts[1]} | {lay_s:>15} {lay_x:>5}")
    lines.append("x: the baseline's ms / flux's (loop mode); bnd: flux with max_tokens_per_rank=T, loop/graph ms "
                 "(dispatch: with zero_pad=False, graph ms, in parentheses; u: one rank, unbounded with "
                 "read_counts=False, loop/graph ms); "
                 "GB/s: remote rows' bytes per call (see the module docstring)")
    return "\n".join(lines)


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
