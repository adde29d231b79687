"""Tensor-parallel layers end to end: flux against NCCL + cuBLAS and PyTorch async-TP.

    torchrun --nproc_per_node=2 bench/bench_layers.py --out layers.json
    torchrun --nproc_per_node=2 bench/bench_layers.py --blocks mlp --sizes 4096x14336 --tokens 2048,16384
    torchrun --nproc_per_node=2 bench/bench_layers.py --cpu --sizes 64x128 --tokens 32 --steps 2   # gloo smoke run
    python3 bench/bench_layers.py --plot layers.json --png layers.png      # the plot, from the JSON

Blocks (bf16 on GPU, sequence parallel: activations [T/W, H] between layers, T tokens, W ranks):

    mlp       Megatron's sequence-parallel MLP: x -> all-gather -> FC1 (W1 [F/W, H], b1) -> GELU
              -> FC2 (W2 [H, F/W]) -> reduce-scatter (+ b2)
    megatron  a whole megatron-core GPT TransformerLayer (attention and MLP, sequence parallel;
              needs megatron-core; GPU only): its stock local spec against the flux spec of
              flux.integrations.megatron

Variants, side by side in one process on the same tensors and weights:

    nccl      NCCL all_gather_into_tensor / reduce_scatter_tensor as autograd functions (the
              backward of each is the other) around F.linear: the NCCL + cuBLAS block
              (megatron: the stock layer)
    flux      flux.ag_gemm / flux.gemm_rs (megatron: the flux layer spec)
    asynctp   (mlp, GPU) the same block written with functional collectives and compiled by
              torch.compile (fullgraph, static shapes, a fresh compile per configuration) with
              Inductor's micro-pipeline TP pass (PyTorch async-TP), which turns all-gather -> mm
              and mm -> reduce-scatter into symmetric-memory fused ops (FC1's bias is added
              after its GEMM, which the pass needs); the JSON records how many fused ops the
              pass made in the graphs of each mode (``asynctp_fused_ops``: 0 means async-TP
              fused nothing there)

Modes: fwd (the forward under torch.no_grad: prefill / inference) and fwdbwd (forward and
``y.backward(g)`` with g random, gradients set to None first: a training step without the
optimizer). Protocol: random inputs; every variant's output and gradients are compared with
nccl's first (relative error, bf16 tolerance 2e-2); then per variant and mode, after warm-up:
  loop   CUDA events around --steps back-to-back steps after a GPU rendezvous; ms per step,
         median of --rounds, maximum over the ranks (an eager loop: host cost shows where it
         exceeds the GPU time);
  graph  the --steps steps captured once in a CUDA graph and replayed (median of --rounds
         replays, maximum over ranks): no host cost; a capture that fails on any rank is
         recorded as the variant's graph_status and not replayed;
  host   CPU ms to enqueue one step while a GPU spin keeps the device busy; median, maximum
         over ranks.
The JSON (--out) records every figure and the command; the table printed last gives each
variant's ms and the speedup of flux over nccl and over asynctp. --plot draws the JSON as a
PNG (step time per configuration, one bar per variant; needs matplotlib).
On the CPU (--cpu: gloo, fp32) it only checks that the script runs and the variants agree.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flux  # noqa: E402
from flux.runtime import differentiable_all_gather_dim0, differentiable_reduce_scatter_dim0  # noqa: E402

MODES = ("fwd", "fwdbwd")


def nccl_mlp(x, w1, b1, w2, b2, group):
    # The NCCL + cuBLAS block: Megatron's sequence-parallel regions (each collective's backward is
    # the other) around F.linear.
    h = F.gelu(F.linear(differentiable_all_gather_dim0(x, group), w1, b1))
    return differentiable_reduce_scatter_dim0(F.linear(h, w2), group) + b2


def flux_mlp(x, w1, b1, w2, b2, group):
    return flux.gemm_rs(F.gelu(flux.ag_gemm(x, w1, b1, group=group)), w2, b2, group=group)


def asynctp_mlp(group):
    """The MLP on functional collectives (differentiable ones), compiled with Inductor's
    micro-pipeline TP pass; None and the reason where this torch cannot."""
    try:
        import torch._inductor.config as inductor_config
        import torch.distributed._functional_collectives as fc
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as e:  # noqa: BLE001
        return None, f"unavailable: {e}"
    ag = getattr(fc, "all_gather_tensor_autograd", None)
    rs = getattr(fc, "reduce_scatter_tensor_autograd", None)
    if ag is None or rs is None:
        return None, f"torch {torch.__version__} has no differentiable functional collectives"
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group.group_name)
    inductor_config._micro_pipeline_tp = True
    _count_fused_ops()

    def block(x, w1, b1, w2, b2):
        # The bias outside the GEMM: Inductor keeps a bf16 F.linear with bias as addmm, which the
        # micro-pipeline pass does not fuse (it takes mm and _scaled_mm only).
        h = F.gelu(F.linear(ag(x, 0, group), w1) + b1)
        return rs(F.linear(h, w2), "sum", 0, group) + b2

    # A fresh compile per configuration: otherwise the second one is traced with dynamic shapes
    # (automatic dynamic), which is not what a user compiling one model gets.
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    return (lambda x, w1, b1, w2, b2, _group: compiled(x, w1, b1, w2, b2)), None


_FUSED = {"ops": 0}  # symmetric-memory fused ops in the graphs the micro-pipeline TP pass rewrote


def _count_fused_ops():
    """Count what Inductor's micro-pipeline TP pass produces (torch.ops.symm_mem.* nodes), so the
    benchmark can say whether async-TP really fused anything."""
    import torch._inductor.fx_passes.post_grad as post_grad

    if getattr(post_grad.micro_pipeline_tp_pass, "_flux_counting", False):
        return
    original = post_grad.micro_pipeline_tp_pass

    def counting(graph):
        original(graph)
        _FUSED["ops"] += sum(1 for n in graph.nodes if n.op == "call_function" and "symm_mem" in str(n.target))

    counting._flux_counting = True
    post_grad.micro_pipeline_tp_pass = counting


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", default="mlp,megatron", help="mlp, megatron (comma-separated)")
    p.add_argument("--sizes", default=None, help="HIDDENxFFN,... (FFN split over the ranks; default "
                   "8192x28672,4096x14336, with --cpu 64x128)")
    p.add_argument("--tokens", default=None, help="tokens (all ranks together), comma-separated (default 2048,8192, "
                   "with --cpu 32)")
    p.add_argument("--variants", default="nccl,flux,asynctp")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--heads", type=int, default=0, help="megatron: attention heads (default hidden / 128)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed loop and per graph")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, fp32 (a smoke run)")
    p.add_argument("--out", default=None, help="JSON path (rank 0)")
    p.add_argument("--plot", default=None, help="draw this JSON as a PNG (no torchrun needed) and exit")
    p.add_argument("--png", default=None, help="--plot: the PNG path (default: the JSON's, .png)")
    args = p.parse_args(argv)
    # A CPU smoke run at the GPU sizes would compute for hours without printing anything.
    args.sizes = args.sizes or ("64x128" if args.cpu else "8192x28672,4096x14336")
    args.tokens = args.tokens or ("32" if args.cpu else "2048,8192")
    return args


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


class Bench:
    """Timing of one step function (``step()`` enqueues a step and returns its output)."""

    def __init__(self, args, dev):
        self.args, self.dev = args, dev
        self.cuda = dev.type == "cuda"
        self.one = torch.zeros(1, device=dev)

    def max_all(self, v):
        t = torch.tensor([float("nan") if v is None else v], dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return None if t.isnan().item() else float(t.item())

    def loop_ms(self, step):
        samples = []
        for _ in range(self.args.rounds):
            if self.cuda:
                torch.cuda.synchronize()
                dist.all_reduce(self.one)  # both GPUs start together
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.args.steps):
                    step()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / self.args.steps)
            else:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(self.args.steps):
                    step()
                samples.append((time.perf_counter() - t0) * 1e3 / self.args.steps)
        return self.max_all(statistics.median(samples))

    HOST_BATCH = 20  # host_us: calls per batch behind one GPU spin

    def host_us(self, step, calls):
        """Median host us per call of repeat calls of ``step`` (after the caller's warm-up): batches
        of HOST_BATCH calls back to back, enqueued behind a GPU spin of 2 ms + 0.5 ms per call that
        outlasts them, so that no call waits for the GPU; the maximum over the ranks."""
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        cycles_per_us = getattr(props, "clock_rate", 1_980_000) / 1e3  # kHz; torch.cuda._sleep counts cycles
        samples = []
        torch.cuda.synchronize()
        for _ in range(max(1, calls // self.HOST_BATCH)):
            torch.cuda._sleep(int((2000 + 500 * self.HOST_BATCH) * cycles_per_us))
            for _ in range(self.HOST_BATCH):
                t0 = time.perf_counter()
                step()
                samples.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        return self.max_all(statistics.median(samples) * 1e6)

    def host_ms(self, step):
        """Median over --rounds of one call's host ms, each enqueued behind a GPU spin right after a
        synchronize (a call from an idle host; host_us times repeat calls)."""
        samples = []
        for _ in range(self.args.rounds):
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(1980 * 20_000)  # ~20 ms of spin: the step is enqueued behind it
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
            if self.cuda:
                torch.cuda.synchronize()
        return self.max_all(statistics.median(samples))

    def graph_ms(self, step):
        """(ms per step in graph replay, status); every rank takes the same path."""
        if not self.cuda:
            return None, "cpu"
        graph, side, failure = torch.cuda.CUDAGraph(), torch.cuda.Stream(), None
        try:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up on a side stream, as torch.cuda.graph asks
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(self.args.steps):
                    step()
        except Exception as e:  # noqa: BLE001
            failure = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        torch.cuda.synchronize()
        failed = torch.tensor([0.0 if failure is None else 1.0], device=self.dev)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            return None, failure or "capture failed on another rank"
        samples = []
        for _ in range(self.args.rounds):
            torch.cuda.synchronize()
            dist.all_reduce(self.one)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / self.args.steps)
        del graph
        return self.max_all(statistics.median(samples)), "ok"


def mlp_case(args, dev, dtype, group, hidden, ffn, tokens):
    """(inputs, {variant: fn(x) -> y}, params) of the MLP block."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    # The weights are the same on every rank's view of the full layer only where they are
    # replicated (b2); the shards are independent draws, as a sharded model holds them.
    w1 = (torch.randn(ffn // world, hidden, generator=gen, device=dev) / hidden ** 0.5).to(dtype)
    b1 = torch.randn(ffn // world, generator=gen, device=dev).to(dtype) * 0.1
    w2 = (torch.randn(hidden, ffn // world, generator=gen, device=dev) / ffn ** 0.5).to(dtype)
    b2 = (torch.randn(hidden, generator=torch.Generator(device=dev).manual_seed(7), device=dev) * 0.1).to(dtype)
    params = [t.requires_grad_() for t in (w1, b1, w2, b2)]
    fns, skipped = {}, {}
    for name in args.variants.split(","):
        if name == "nccl":
            fns[name] = lambda x: nccl_mlp(x, *params, group)
        elif name == "flux":
            fns[name] = lambda x: flux_mlp(x, *params, group)
        elif name == "asynctp":
            if dev.type != "cuda":
                skipped[name] = "GPU only"
                continue
            fn, why = asynctp_mlp(group)
            if fn is None:
                skipped[name] = why
            else:
                fns[name] = (lambda f: lambda x: f(x, *params, group))(fn)
    return params, fns, skipped


def build_layer_pair(hidden, ffn, heads, dtype, group):
    """A megatron-core GPT TransformerLayer from megatron's local spec (sequence parallel) and one
    from flux's spec, the same weights: the construction of tests/gpu_megatron_worker.py (one
    layer config, seeded random weights, the flux layer loading the stock layer's state)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import gpu_megatron_worker as mw
    from flux.integrations import megatron as fm

    world, dev = dist.get_world_size(group), torch.device("cuda", torch.cuda.current_device())
    mw.setup_megatron(world, cuda=True)
    config = mw.layer_config(world, dtype, dev, hidden=hidden, heads=heads, ffn=ffn)
    stock = mw.build_layer(mw.stock_spec(), config, dev, dtype)
    mw.randomize(stock, hidden, ffn, 1234)
    flux_layer = mw.build_layer(fm.get_gpt_layer_flux_spec(), config, dev, dtype)
    flux_layer.load_state_dict(stock.state_dict())
    return stock, flux_layer


def megatron_case(args, dev, dtype, group, hidden, ffn, tokens):
    """(params per variant, {variant: fn(x) -> y}, skipped) of a megatron-core TransformerLayer,
    stock (nccl) and flux spec, the same weights."""
    if dev.type != "cuda":
        return None, {}, {"*": "GPU only"}
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return None, {}, {"*": "megatron-core is not installed"}
    heads = args.heads or hidden // 128
    try:
        stock, flux_layer = build_layer_pair(hidden, ffn, heads, dtype=dtype, group=group)
    except Exception as e:  # noqa: BLE001
        return None, {}, {"*": f"could not build the layers: {type(e).__name__}: {str(e)[:300]}"}
    x_shape = (tokens // dist.get_world_size(group), 1, hidden)  # [s/W, b, h]
    fns = {"nccl": lambda x: stock(x.view(x_shape), attention_mask=None)[0],
           "flux": lambda x: flux_layer(x.view(x_shape), attention_mask=None)[0]}
    params = {"nccl": list(stock.parameters()), "flux": list(flux_layer.parameters())}
    return params, {k: v for k, v in fns.items() if k in args.variants.split(",")}, {}


def init_distributed(cpu: bool):
    """(device, dtype) of a benchmark process under torchrun: gloo and fp32 on the CPU (smoke
    runs), else NCCL on this rank's GPU and bf16; with FLUX_GLOO_CUDA=1, ranks may share GPUs
    over gloo (what flux's own ops can run there; timings are then not those of separate GPUs)."""
    if cpu:
        dist.init_process_group("gloo")
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: no CUDA device here; add --cpu for a gloo smoke run "
                         "on the CPU (timings need GPUs)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if os.environ.get("FLUX_GLOO_CUDA") == "1":  # ranks sharing GPUs (flux's test mode): gloo, flux only
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    return dev, torch.bfloat16


def start(args):
    """(device, dtype, group, rank, world, Bench) of a benchmark process (init_distributed)."""
    dev, dtype = init_distributed(args.cpu)
    return dev, dtype, dist.group.WORLD, dist.get_rank(), dist.get_world_size(), Bench(args, dev)


def attempt(rec, fn):
    """Run one cell ``fn()``; its status in ``rec``: "ok", or the error (recorded, so that the
    other cells still run). Frees the allocator's cache after it on a GPU."""
    try:
        fn()
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        rec["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return rec["status"]


def run(args):
    dev, dtype, group, rank, world, bench = start(args)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    records = []
    for block in args.blocks.split(","):
        for size in args.sizes.split(","):
            hidden, ffn = (int(v) for v in size.split("x"))
            for tokens in (int(t) for t in args.tokens.split(",")):
                rec = {"block": block, "hidden": hidden, "ffn": ffn, "tokens": tokens, "variants": {}}
                records.append(rec)
                case = mlp_case if block == "mlp" else megatron_case
                params, fns, skipped = case(args, dev, dtype, group, hidden, ffn, tokens)
                rec["skipped"] = skipped
                if not fns:
                    rec["status"] = f"skipped: {skipped}"
                    continue
                plist = params if isinstance(params, dict) else {k: params for k in fns}
                gen = torch.Generator(device=dev).manual_seed(200 + rank)
                x = torch.randn(tokens // world, hidden, generator=gen, device=dev).to(dtype).requires_grad_()
                g = torch.randn(tokens // world, hidden, generator=gen, device=dev).to(dtype)

                def train_step(fn, ps):
                    def step():
                        for p in ps:
                            p.grad = None
                        x.grad = None
                        y = fn(x)
                        y.backward(g.view_as(y))
                        return y
                    return step

                def fwd_step(fn):
                    def step():
                        with torch.no_grad():
                            return fn(x)
                    return step

                # Correctness: every variant against nccl (output and gradients of x and weights;
                # megatron's two layers hold the same weights, compared parameter by parameter).
                ref_y = train_step(fns["nccl"], plist["nccl"])().detach().float()
                ref_g = [x.grad.clone()] + [p.grad.clone() for p in plist["nccl"]]
                rec["rel_err"] = {}
                for name, fn in fns.items():
                    if name == "nccl":
                        continue
                    try:
                        fused_before = _FUSED["ops"]
                        y = train_step(fn, plist[name])().detach()  # asynctp: compiles forward and backward
                        if name == "asynctp":
                            rec["asynctp_fused_ops"] = {"fwdbwd": _FUSED["ops"] - fused_before}
                        errs = [rel_err(y, ref_y)] + [rel_err(a, b) for a, b in
                                                      zip([x.grad] + [p.grad for p in plist[name]], ref_g)]
                        err = max(errs)
                    except Exception as e:  # noqa: BLE001
                        err, skipped[name] = float("inf"), f"{type(e).__name__}: {str(e)[:200]}"
                    rec["rel_err"][name] = bench.max_all(err)
                    if not rec["rel_err"][name] < tol:
                        skipped.setdefault(name, f"incorrect: differs from nccl by {rec['rel_err'][name]:.3g}")
                fns = {k: v for k, v in fns.items() if k not in skipped}
                for name, fn in fns.items():
                    res = {}
                    for mode in args.modes.split(","):
                        step = train_step(fn, plist[name]) if mode == "fwdbwd" else fwd_step(fn)
                        fused_before = _FUSED["ops"]
                        for _ in range(args.warmup):
                            step()
                        if name == "asynctp" and mode == "fwd":  # the no-grad graph, compiled here
                            rec.setdefault("asynctp_fused_ops", {})["fwd"] = _FUSED["ops"] - fused_before
                        gms, gstat = bench.graph_ms(step)
                        res[mode] = {"loop_ms": bench.loop_ms(step), "graph_ms": gms, "graph_status": gstat,
                                     "host_ms": bench.host_ms(step)}
                    rec["variants"][name] = res
                    if rank == 0:
                        print(f"{block} H={hidden} F={ffn} T={tokens} {name}: " + "; ".join(
                            f"{m} loop {r['loop_ms']:.3f} graph {_f(r['graph_ms'])} host {r['host_ms']:.3f}"
                            for m, r in res.items()), flush=True)
                rec["status"] = "ok"
    return finish(args, dev, dtype, records, table(records))


def _commit():
    """FLUX_COMMIT where the runner sets it (a copied tree may carry stale git metadata), else git's HEAD."""
    if os.environ.get("FLUX_COMMIT"):
        return os.environ["FLUX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def finish(args, dev, dtype, records, text, **metadata) -> int:
    """The end of a benchmark run: rank 0 writes the JSON (--out: the metadata with the command
    and the commit, then the records) and prints ``text`` (the table); every rank leaves the group. Returns the
    exit code: 0 when every record is ok or skipped."""
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        meta = {"command": " ".join(["torchrun", f"--nproc_per_node={world}"] + sys.argv), "world_size": world,
                "torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "dtype": str(dtype), "steps": args.steps, "rounds": args.rounds, "commit": _commit(), **metadata}
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"metadata": meta, "results": records}, fh, indent=1)
        print("\n" + text)
    ok = all(r.get("status", "").startswith(("ok", "skipped")) for r in records)
    dist.destroy_process_group()
    return 0 if ok else 1


def _f(v, fmt=".3f"):
    return "-" if v is None else format(v, fmt)


def ratio(a, b):
    """a / b for the tables ("-" where either is missing)."""
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def table(records):
    """One line per (configuration, mode): each variant's loop / graph ms, flux's speedups."""
    lines = [f"{'block':<9} {'H x F':>11} {'tokens':>6} {'mode':<6} {'nccl loop/graph':>16} {'flux loop/graph':>16} "
             f"{'asynctp loop/graph':>19} {'flux/nccl l,g':>14} {'flux/atp l,g':>13} {'host ms n/f':>12}"]
    for r in records:
        head = f"{r['block']:<9} {r['hidden']:>5}x{r['ffn']:<5} {r['tokens']:>6}"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')}")
            continue
        v = r["variants"]
        for mode in MODES:
            if not any(mode in e for e in v.values()):
                continue

            def lg(name, mode=mode):
                e = v.get(name, {}).get(mode)
                return "-" if e is None else f"{_f(e['loop_ms'])}/{_f(e['graph_ms'])}"

            def sp(base, mode=mode):
                b, f = v.get(base, {}).get(mode), v.get("flux", {}).get(mode)
                if b is None or f is None:
                    return "-"
                def one(key):
                    return "-" if b[key] is None or f[key] is None else f"{b[key] / f[key]:.2f}"
                return f"{one('loop_ms')},{one('graph_ms')}"

            hosts = "/".join(_f(v.get(n, {}).get(mode, {}).get("host_ms"), ".2f") for n in ("nccl", "flux"))
            lines.append(f"{head} {mode:<6} {lg('nccl'):>16} {lg('flux'):>16} {lg('asynctp'):>19} "
                         f"{sp('nccl'):>14} {sp('asynctp'):>13} {hosts:>12}")
    return "\n".join(lines)


def plot(path, png):
    """Bars of ms per step (graph timing where measured, else loop) per configuration and mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    recs = [r for r in data["results"] if r.get("status") == "ok"]
    names = ["nccl", "flux", "asynctp"]
    rows = [(r, m) for r in recs for m in MODES if any(m in e for e in r["variants"].values())]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(rows)), 4.5))
    for ax, key in zip(axes, ("loop_ms", "graph_ms")):
        width = 0.8 / len(names)
        for i, nm in enumerate(names):
            vals = [(r["variants"].get(nm, {}).get(m) or {}).get(key) or 0.0 for r, m in rows]
            ax.bar([j + i * width for j in range(len(rows))], vals, width, label=nm)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
        ax.set_xticklabels([f"{r['block']}\n{r['hidden']}x{r['ffn']}\nT={r['tokens']}\n{m}" for r, m in rows],
                           fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_yscale("log")
        ax.set_title(f"{key.split('_')[0]} timing ({data['metadata'].get('device')}, W={data['metadata']['world_size']})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.png or os.path.splitext(args.plot)[0] + ".png")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
