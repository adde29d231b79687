"""GPU cases of flux's ops, run by tests/test_ops.py::test_gpu through

    torchrun --nproc_per_node=2 tests/gpu_worker.py all        (or a comma-separated list of cases)

with NCCL, one process per GPU. Each rank prints one line per case,
``FLUXCASE {"case", "rank", "status": ok|fail|skip, "error", "value"}``, and writes the
same JSON line to $FLUX_GPU_RESULTS_DIR/results.<rank> when that is set (test_ops reads
those files). Every case runs on both ranks in the same order; a failing case does not stop the
others (a broken communicator makes the rest fail, and test_ops bounds the whole run).

Checks, against a float64 reference computed here from inputs that every rank builds for
every rank from seeds (no collective and no flux reference involved), with the tolerance
derived from a same-precision baseline (the unfused result in the op's dtype: error <=
2 * baseline + eps):
- both ops in bf16 and fp16, odd shapes (M_local=999, K=4096+64, N=1000) and public ones
  (ag_gemm 8192x8192x5120 with M the gathered M; gemm_rs 4096x14336x8192 with K the full K),
  for every strategy that ``available_strategies(device)`` lists (so new strategies are
  tested without touching this file), and through the public functions;
- 50 back-to-back calls on alternating shapes, each output kept and compared at the end
  (buffer and signal reuse);
- bad input raising the same FluxInputError on both ranks, the group usable afterwards;
- the extension kernel ``torch.ops.flux.reduce_chunks_`` (when built) against an fp32
  accumulation in rank order, output poisoned with NaN before the call.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1),
forced here before torch or NCCL start.

Shared GPUs (``FLUX_GLOO_CUDA=1``, tests/test_ops.py::test_gpu_shared): more ranks than GPUs,
rank r on GPU r % (GPU count), with a gloo group (NCCL refuses two ranks on one GPU) and
PyTorch's symmetric memory allowed to map several ranks' buffers of one GPU. Every kernel and
signal path of that world size runs; ranks sharing a GPU take turns on it, so it is slow.
"""
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
SHARED_GPUS = os.environ.get("FLUX_GLOO_CUDA", "0") == "1"
if SHARED_GPUS:
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"

import faulthandler  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flux  # noqa: E402
import _ref  # noqa: E402
from _ref import rand, rel_err, w_nk  # noqa: E402,F401
from flux.ops import ag_gemm as ag_mod  # noqa: E402
from flux.ops import gemm_rs as rs_mod  # noqa: E402
from flux.autotune.space import Candidate  # noqa: E402
import flux.testing  # noqa: E402
from flux.runtime import symm  # noqa: E402

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
CASE_TIMEOUT_S = 240
TIMEOUT_CASE_S = 90  # timeout_case: bound of one rank's whole run

CASES = {}


class Skip(Exception):
    pass


def gcase(name):
    def deco(fn):
        CASES[name] = fn
        return fn

    return deco


def check_against(out, ref, base, what):
    return [round(v, 8) for v in _ref.check_against(out, ref, base, what)]


# --------------------------------------------------------------------------------------
# The problems: inputs of every rank, reference and baseline, computed on every rank.


class AgProblem:
    """ag_gemm: x_r [m_local, K], weight_r (each rank its own N columns), bias_r [N]."""

    def __init__(self, rank, world, dev, m_local, k, n, dtype, layout="nk", bias=False, out_dtype=None, seed=0,
                 wseed=None):
        odt = out_dtype or dtype
        wseed = seed if wseed is None else wseed  # weight and bias seed (fixed across a graph's replays)
        self.xs = [rand((m_local, k), dtype, seed + 1000 + r, dev) for r in range(world)]
        self.w = rand((n, k) if layout == "nk" else (k, n), dtype, wseed + 2000 + rank, dev)
        self.b = rand((n,), odt, wseed + 3000 + rank, dev) if bias else None
        self.x, self.layout, self.out_dtype = self.xs[rank], layout, out_dtype
        self.full = torch.cat(self.xs)
        wn = w_nk(self.w, layout)
        self.ref = self.full.double() @ wn.double().t()
        cdt = odt if out_dtype is not None else dtype
        base = self.full.to(cdt) @ wn.to(cdt).t()
        if self.b is not None:
            self.ref += self.b.double()
            base = base + self.b
        self.base = base.to(odt)

    def kwargs(self):
        return dict(weight_layout=self.layout, out_dtype=self.out_dtype)

    def check(self, out, what):
        return check_against(out, self.ref, self.base, what)


class RsProblem:
    """gemm_rs: x_r [M, K_local], weight_r [N, K_local], bias [N] replicated."""

    def __init__(self, rank, world, dev, m, k_local, n, dtype, layout="nk", bias=False, out_dtype=None, seed=0,
                 wseed=None):
        odt = out_dtype or dtype
        wseed = seed if wseed is None else wseed  # weight and bias seed (fixed across a graph's replays)
        xs = [rand((m, k_local), dtype, seed + 1100 + r, dev) for r in range(world)]
        ws = [rand((n, k_local) if layout == "nk" else (k_local, n), dtype, wseed + 2100 + r, dev)
              for r in range(world)]
        self.x, self.w, self.layout, self.out_dtype = xs[rank], ws[rank], layout, out_dtype
        self.b = rand((n,), odt, wseed + 3100, dev) if bias else None
        ref, base = None, None
        cdt = odt if out_dtype is not None else dtype
        for r in range(world):  # rank order; partials in the op's precision
            wn = w_nk(ws[r], layout)
            p64 = (xs[r].double() @ wn.double().t()).chunk(world)[rank]
            p = (xs[r].to(cdt) @ wn.to(cdt).t()).chunk(world)[rank]
            ref = p64 if ref is None else ref + p64
            base = p if base is None else base + p
        if self.b is not None:
            ref = ref + self.b.double()
            base = base + self.b
        self.ref, self.base = ref, base.to(odt)

    def kwargs(self):
        return dict(weight_layout=self.layout, out_dtype=self.out_dtype)

    def check(self, out, what):
        return check_against(out, self.ref, self.base, what)


AG_SHAPES = {  # name: (M_local, K, N); M = world * M_local
    "odd": (999, 4096 + 64, 1000),
    "public-8192x8192x5120": (8192 // 2, 8192, 5120),
}
RS_SHAPES = {  # name: (M_local, K_local, N); M = world * M_local, K = world * K_local
    "odd": (999, 4096 + 64, 1000),
    "public-4096x14336x8192": (4096 // 2, 14336 // 2, 8192),
}


def _fwd(op, shape_name, dtype):
    def fn(rank, world, dev):
        if op == "ag":
            m, k, n = AG_SHAPES[shape_name]
            prob = AgProblem(rank, world, dev, m, k, n, dtype)
            mod = ag_mod
        else:
            m, k, n = RS_SHAPES[shape_name]
            prob = RsProblem(rank, world, dev, m * world, k, n, dtype)
            mod = rs_mod
        result = {}
        for name in mod.available_strategies(dev):
            out = mod.run_strategy(name, prob.x, prob.w, prob.b, **prob.kwargs())
            result[name] = prob.check(out, f"strategy {name}")
            del out
        out = (flux.ag_gemm if op == "ag" else flux.gemm_rs)(prob.x, prob.w, prob.b, **prob.kwargs())
        result["public"] = prob.check(out, "public function")
        return result

    return fn


for _op, _shapes in (("ag", AG_SHAPES), ("rs", RS_SHAPES)):
    for _s in _shapes:
        for _dn, _dt in (("bf16", BF16), ("fp16", F16)):
            gcase(f"fwd-{_op}-{_dn}-{_s}")(_fwd(_op, _s, _dt))


def _options(op):
    """Bias, "kn" layout, fp32 out_dtype and return_gathered on a small odd shape, every strategy."""
    def fn(rank, world, dev):
        result = {}
        mod = ag_mod if op == "ag" else rs_mod
        for layout in ("nk", "kn"):
            for out_dtype in (None, F32):
                if op == "ag":
                    prob = AgProblem(rank, world, dev, 77, 264, 136, BF16, layout, True, out_dtype, seed=7)
                else:
                    prob = RsProblem(rank, world, dev, 77 * world, 264, 136, BF16, layout, True, out_dtype, seed=7)
                names = mod.available_strategies(dev)
                if op == "ag" and world == 2 and len(names) > 1:
                    names = names + ["decomposed(first8=6)"]  # the rest of the local rows copied
                for name in names:
                    if op == "ag":
                        c = Candidate.parse(name)
                        out, gathered = mod.run_strategy(c.strategy, prob.x, prob.w, prob.b, return_gathered=True,
                                                         **prob.kwargs(), **c.kwargs)
                        assert torch.equal(gathered, prob.full), f"strategy {name}: gathered input differs"
                    else:
                        out = mod.run_strategy(name, prob.x, prob.w, prob.b, **prob.kwargs())
                    result[f"{name}-{layout}-{out_dtype}"] = prob.check(out, f"strategy {name} {layout} {out_dtype}")
        return result

    return fn


def _out(op):
    """out=: every strategy writes into a NaN-poisoned caller tensor (through the public
    function, strategy forced), returns it, and is right."""
    from flux import autotune

    def fn(rank, world, dev):
        mod = ag_mod if op == "ag" else rs_mod
        prob = (AgProblem(rank, world, dev, 136, 512, 264, BF16, bias=True, seed=60) if op == "ag"
                else RsProblem(rank, world, dev, 136 * world, 512, 264, BF16, bias=True, seed=60))
        call = flux.ag_gemm if op == "ag" else flux.gemm_rs
        result = {}
        for name in mod.available_strategies(dev):
            autotune.force("ag_gemm" if op == "ag" else "gemm_rs", name)
            try:
                out = torch.full(tuple(prob.ref.shape), float("nan"), dtype=BF16, device=dev)
                got = call(prob.x, prob.w, prob.b, out=out)
            finally:
                autotune.force("ag_gemm" if op == "ag" else "gemm_rs", None)
            assert got is out, f"strategy {name}: out= did not return the caller's tensor"
            result[name] = prob.check(out, f"strategy {name}, out=")
        return result

    return fn


def _candidates(op):
    """Every candidate of the autotuner's search space for a few problems (every chunk count;
    'fused' with the kernel tuner's configuration), and 'fused' in every built configuration
    with bands of 1 and 8 tiles where they fit, run through run_strategy with its parameters,
    against the float64 reference."""
    from flux.autotune.kernel_configs import kernel_configs
    from flux.autotune.space import Candidate, Problem, candidates, why_invalid

    def fn(rank, world, dev):
        mod = ag_mod if op == "ag" else rs_mod
        result = {}
        for m_rows, k, n in ((2048, 1024, 1536), (999, 4160, 1000), (4096, 2048, 12288)):
            if op == "ag":
                prob = AgProblem(rank, world, dev, m_rows, k, n, BF16, bias=True, seed=70)
                p = Problem("ag_gemm", m_rows * world, n, k, BF16, world)
            else:
                prob = RsProblem(rank, world, dev, m_rows * world, k, n, BF16, bias=True, seed=70)
                p = Problem("gemm_rs", m_rows * world, n, k, BF16, world)
            cands = candidates(p)
            if any(c.strategy == "fused" for c in cands):
                cands += [c for c in (Candidate.of("fused", config=kc.id, swizzle=s)
                                      for kc in kernel_configs(op, BF16) for s in (1, 8)) if why_invalid(c, p) is None]
            for c in cands:
                try:  # a kernel fault names its candidate
                    out = mod.run_strategy(c.strategy, prob.x, prob.w, prob.b, **c.kwargs)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    raise RuntimeError(f"{c.label} on {m_rows}x{k}x{n} (rank {rank}): {type(e).__name__}: "
                                       f"{str(e).splitlines()[0]}") from e
                result[f"{m_rows}x{k}x{n} {c.label}"] = prob.check(out, f"{c.label} on {m_rows}x{k}x{n}")[0]
                del out
        return result

    return fn


gcase("candidates-ag")(_candidates("ag"))
gcase("candidates-rs")(_candidates("rs"))
gcase("out-ag")(_out("ag"))
gcase("out-rs")(_out("rs"))
gcase("options-ag")(_options("ag"))
gcase("options-rs")(_options("rs"))


def _repeat(op, names=None):
    """50 back-to-back calls alternating two shapes, no synchronisation in between; all
    outputs kept, then compared (a strategy reusing a buffer or signal too early shows).
    ``names``: the strategies (candidate labels) to run; default: every available one."""
    def fn(rank, world, dev):
        if op == "ag":
            probs = [AgProblem(rank, world, dev, 999, 4160, 1000, BF16, seed=11),
                     AgProblem(rank, world, dev, 256, 2048, 768, BF16, bias=True, seed=12)]
            mod = ag_mod
        else:
            probs = [RsProblem(rank, world, dev, 999 * world, 4160, 1000, BF16, seed=11),
                     RsProblem(rank, world, dev, 256 * world, 2048, 768, BF16, bias=True, seed=12)]
            mod = rs_mod
        result = {}
        for name in names or mod.available_strategies(dev):
            c = Candidate.parse(name)
            outs = [mod.run_strategy(c.strategy, probs[i % 2].x, probs[i % 2].w, probs[i % 2].b,
                                     **probs[i % 2].kwargs(), **c.kwargs)
                    for i in range(50)]
            torch.cuda.synchronize()
            errs = [probs[i % 2].check(o, f"strategy {name}, call {i}")[0] for i, o in enumerate(outs)]
            result[name] = max(errs)
        return result

    return fn


gcase("repeat50-ag")(_repeat("ag"))
gcase("repeat50-rs")(_repeat("rs"))


def _bad(op, kind):
    """Bad input: the same FluxInputError on both ranks; then a good call succeeds.
    Each kind uses shapes used nowhere else (remembered signatures skip the exchange)."""
    def fn(rank, world, dev):
        call = flux.ag_gemm if op == "ag" else flux.gemm_rs
        m = 3 if op == "ag" else 3 * world
        k, n = {"k-on-rank1": 301, "weight-on-cpu": 302, "input-on-cpu": 303}[kind], 45
        x, w = rand((m, k), BF16, 1, dev), rand((n, k), BF16, 2, dev)
        if kind == "k-on-rank1" and rank == 1:
            w = rand((n, k + 1), BF16, 2, dev)
        elif kind == "weight-on-cpu":
            w = w.cpu()
        elif kind == "input-on-cpu":
            x = x.cpu()
        try:
            call(x, w)
        except flux.FluxInputError as e:
            msg = str(e)
        else:
            raise AssertionError("no FluxInputError was raised")
        prefix = "flux.ag_gemm:" if op == "ag" else "flux.gemm_rs:"
        assert msg.startswith(prefix), msg
        prob = (AgProblem(rank, world, dev, 64, 128, 96, BF16) if op == "ag"
                else RsProblem(rank, world, dev, 64 * world, 128, 96, BF16))
        prob.check(call(prob.x, prob.w), "good call after the bad one")
        return msg

    return fn


for _op in ("ag", "rs"):
    for _kind in ("k-on-rank1", "weight-on-cpu", "input-on-cpu"):
        gcase(f"bad-{_op}-{_kind}")(_bad(_op, _kind))


@gcase("bad-rs-strategy-differs")
def _strategy_differs(rank, world, dev):
    """Ranks that would choose different strategies (here: one rank forces one) get the same
    FluxInputError before any data moves, instead of a hang; then the group still works."""
    from flux import autotune

    x, w = rand((8 * world, 304), BF16, 1, dev), rand((40, 304), BF16, 2, dev)
    autotune.force("gemm_rs", "oneshot" if rank == 1 else None)
    try:
        flux.gemm_rs(x, w)
    except flux.FluxInputError as e:
        msg = str(e)
    else:
        raise AssertionError("no FluxInputError was raised")
    finally:
        autotune.force("gemm_rs", None)
    assert msg.startswith("flux.gemm_rs:") and "strategy" in msg, msg
    prob = RsProblem(rank, world, dev, 64 * world, 128, 96, BF16)
    prob.check(flux.gemm_rs(prob.x, prob.w), "good call after the bad one")
    return msg


@gcase("bad-ops-differ")
def _ops_differ(rank, world, dev):
    """Rank 0 calls one flux op, the others another, on the same tensors: every rank raises the
    same FluxInputError naming both ops, and the group works afterwards. NCCL: ag_gemm / gemm_rs
    (first calls, which meet in the store exchange; planned calls: test_gpu_diverging_call). Ranks
    sharing GPUs over gloo (FLUX_GLOO_CUDA=1) also run ag_gemm / moe_dispatch and gemm_rs /
    ag_scatter_grouped_mm (on gloo every check's header goes through the store)."""
    # Shapes no other case uses: a plan of rank 0's problem left by an earlier case would take the
    # hot path (the entry barrier) while the others wait in the first-call exchange.
    x, w = rand((16, 24), BF16, 100 + rank, dev), rand((20, 24), BF16, 200, dev)
    idx = (torch.arange(2, device=dev) + torch.arange(16, device=dev)[:, None]) % (2 * world)
    ops = {"ag_gemm": lambda: flux.ag_gemm(x, w), "gemm_rs": lambda: flux.gemm_rs(x, w),
           "moe_dispatch": lambda: flux.moe_dispatch(x, idx, torch.ones(idx.shape, device=dev), 2 * world),
           "ag_scatter_grouped_mm": lambda: flux.ag_scatter_grouped_mm(x, idx % 4, rand((4, 20, 24), BF16, 7, dev))}
    pairs = [("ag_gemm", "gemm_rs")]
    if SHARED_GPUS:
        pairs += [("ag_gemm", "moe_dispatch"), ("gemm_rs", "ag_scatter_grouped_mm")]
    msgs = []
    for a, b in pairs:
        try:
            ops[a if rank == 0 else b]()
            torch.cuda.synchronize()
        except flux.FluxInputError as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"{a} on rank 0 and {b} elsewhere raised nothing")
        assert f"rank 0 called flux.{a} but rank 1 called flux.{b}" in msgs[-1], msgs[-1]
    xs = [rand((4, 24), BF16, 300 + r, dev) for r in range(world)]
    out = flux.ag_gemm(xs[rank], w)
    ref = torch.cat(xs).double() @ w.double().t()
    assert rel_err(out, ref) < 2e-2, "the group does not work after the mismatched calls"
    return msgs


@gcase("reduce_chunks")
def _reduce_chunks(rank, world, dev):
    if not flux.cuda_kernels_available():
        raise Skip(f"flux._C is not loaded: {flux.runtime.extension_error()}")
    op = torch.ops.flux.reduce_chunks_
    checked = 0
    for in_dt in (BF16, F16, F32):
        for out_dt in sorted({in_dt, F32}, key=str):
            for nw, rows, cols in ((2, 37, 1001), (4, 5, 7), (3, 64, 1024), (8, 3, 4096 + 8)):
                for bias_on in (False, True):
                    for misalign in (0, 1):  # 1: views at an odd element offset (the unvectorised path)
                        pbuf = rand((nw * rows * cols + misalign,), in_dt, 10 + checked, dev)
                        partials = pbuf[misalign:].view(nw, rows, cols)
                        obuf = torch.full((rows * cols + misalign,), float("nan"), dtype=out_dt, device=dev)
                        out = obuf[misalign:].view(rows, cols)
                        bias = rand((cols,), out_dt, 20 + checked, dev) if bias_on else None
                        op(out, partials, bias)
                        acc = bias.float() if bias_on else torch.zeros(cols, device=dev)
                        acc = acc.expand(rows, cols).clone()
                        for i in range(nw):  # fp32 accumulation in rank order, rounded once
                            acc += partials[i].float()
                        expected = acc.to(out_dt)
                        what = f"{in_dt}->{out_dt} W={nw} {rows}x{cols} bias={bias_on} offset={misalign}"
                        assert not torch.isnan(out).any().item(), f"{what}: NaN left in the output"
                        if not torch.equal(out, expected):
                            d = (out.float() - expected.float()).abs().max().item()
                            raise AssertionError(f"{what}: differs from the rank-order fp32 sum (max {d})")
                        checked += 1
    # The schema (in-place on out, returns nothing) and its fake/meta behaviour.
    out = torch.full((5, 7), float("nan"), device=dev)
    torch.library.opcheck(op.default, (out, rand((2, 5, 7), F32, 1, dev), rand((7,), F32, 2, dev)))
    return checked


def _overlapped(mod, dev):
    return [n for n in mod.available_strategies(dev) if n != "sequential"]


def _delayed(op, names=None):
    """1,000 back-to-back calls of every overlapped strategy (and, AG at two ranks, of
    decomposed(first8=6)), each through its plan; before every 10th call one rank
    (alternating) stalls its current stream and the runtime's communication stream with
    torch.cuda._sleep, so the peer's device-side waits really wait. Every output is kept
    and compared at the end (signals and buffers reused across 1,000 calls)."""
    def fn(rank, world, dev):
        if op == "ag":
            prob, mod = AgProblem(rank, world, dev, 48, 320, 136, BF16, bias=True, seed=31), ag_mod
        else:
            prob, mod = RsProblem(rank, world, dev, 48 * world, 320, 136, BF16, bias=True, seed=31), rs_mod
        result = {}
        extra = ["decomposed(first8=6)"] if op == "ag" and world == 2 else []
        for name in names or (_overlapped(mod, dev) + extra):
            c = Candidate.parse(name)
            call = mod.prepare_strategy(c.strategy, prob.x, prob.w, prob.b, **c.kwargs)
            comm = flux.testing.comm_stream(dist.group.WORLD)
            outs = []
            for i in range(1000):
                if i % 10 == 0 and (i // 10) % world == rank:
                    torch.cuda._sleep(200_000)  # ~0.1 ms at 2 GHz
                    comm.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(comm):
                        torch.cuda._sleep(200_000)
                res = call()
                outs.append(res[0] if op == "ag" else res)
            torch.cuda.synchronize()
            stacked = torch.stack(outs)
            first = prob.check(outs[0], f"strategy {name}, call 0")
            same = (stacked == outs[0]).flatten(1).all(1)
            assert bool(same.all()), f"strategy {name}: calls {same.logical_not().nonzero().flatten()[:10].tolist()} differ from call 0"
            result[name] = first
        return result

    return fn


gcase("delayed1000-ag")(_delayed("ag"))
gcase("delayed1000-rs")(_delayed("rs"))


def _graph(op, names=None):
    """Every strategy captured in a CUDA graph (after one eager warm-up call) and replayed an
    odd number of times (3), each replay on new input data copied into the static input,
    with the weight and bias fixed; every replay's output is checked."""
    def fn(rank, world, dev):
        mod = ag_mod if op == "ag" else rs_mod
        make = ((lambda s: AgProblem(rank, world, dev, 130, 512, 264, BF16, bias=True, seed=s, wseed=40))
                if op == "ag" else
                (lambda s: RsProblem(rank, world, dev, 130 * world, 512, 264, BF16, bias=True, seed=s, wseed=40)))
        probs = [make(40 + i) for i in range(3)]
        result = {}
        for name in names or mod.available_strategies(dev):
            if SHARED_GPUS and name == "sequential":
                continue  # its collective runs on gloo there, which a CUDA graph cannot capture
            c = Candidate.parse(name)
            static_x = probs[0].x.clone()
            w, b = probs[0].w, probs[0].b
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                mod.run_strategy(c.strategy, static_x, w, b, **c.kwargs)  # warm-up: workspace, check, cuBLAS
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = mod.run_strategy(c.strategy, static_x, w, b, **c.kwargs)
            errs = []
            for p in probs:
                static_x.copy_(p.x)
                graph.replay()
                torch.cuda.synchronize()
                errs.append(p.check(static_out.clone(), f"strategy {name}, replay {len(errs)}")[0])
            result[name] = max(errs)
            del graph, static_out
        return result

    return fn


@gcase("graph-first-call-refused")
def _graph_first_call(rank, world, dev):
    """A problem's first call inside a CUDA graph capture raises a clear FluxInputError (its slow
    path cannot be captured) on every rank; once called eagerly, the same call captures and
    replays right."""
    from flux import autotune

    # Ranks sharing a GPU talk over gloo, where the automatic choice, 'sequential', runs in
    # Python and makes no plan: force a strategy that plans there.
    forced = SHARED_GPUS
    if forced:
        autotune.force("ag_gemm", "decomposed")
    try:
        return _graph_first_call_checks(rank, world, dev)
    finally:
        if forced:
            autotune.force("ag_gemm", None)


def _graph_first_call_checks(rank, world, dev):
    prob = AgProblem(rank, world, dev, 100, 264, 136, BF16, seed=95)  # a shape used nowhere else
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            flux.ag_gemm(prob.x, prob.w)
    except flux.FluxInputError as e:
        msg = str(e)
    else:
        raise AssertionError("capturing a problem's first call raised nothing")
    assert msg.startswith("flux.ag_gemm:") and "call it once eagerly" in msg, msg
    torch.cuda.synchronize()
    prob.check(flux.ag_gemm(prob.x, prob.w), "eager call after the refused capture")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flux.ag_gemm(prob.x, prob.w)
    graph.replay()
    torch.cuda.synchronize()
    prob.check(static_out.clone(), "replay after an eager call")
    return msg


gcase("graph-ag")(_graph("ag"))
gcase("graph-rs")(_graph("rs"))


# gemm_rs 'fused' beyond the generic cases: its configurations and segment counts, shapes,
# out=, and cases that skip where it would fall back (so they cannot pass by testing 'decomposed').

def _need_rs_fused(world, dev):
    from flux.ops._common import _fused_kernels_built

    if not _fused_kernels_built() or torch.cuda.get_device_capability(dev) != (9, 0):
        raise Skip("gemm_rs 'fused' needs sm_90a and a flux._C built for it")
    if SHARED_GPUS and world > 2 and world > torch.cuda.device_count():
        raise Skip("ranks share a GPU at world size > 2: 'fused' runs 'decomposed' (flux/strategies.py)")


RS_FUSED_LABELS = ["fused", "fused(config=6)", "fused(segments=1)", "fused(segments=16,swizzle=8)"]


@gcase("fwd-rs-fused")
def _rs_fused_fwd(rank, world, dev):
    """gemm_rs 'fused' (each built configuration, 1 to 16 segments) against the float64
    reference, on odd and tile-multiple shapes, with and without bias, N-D input and out=."""
    from flux.autotune.kernel_configs import kernel_configs

    _need_rs_fused(world, dev)
    labels = RS_FUSED_LABELS + [f"fused(config={c.id})" for c in kernel_configs("rs", BF16)]
    result = {}
    for m_rows, k, n, bias in ((2048, 1024, 1536, True), (999, 4160, 1000, True), (128, 512, 264, False),
                               (4096, 2048, 8192, True)):
        prob = RsProblem(rank, world, dev, m_rows * world, k, n, BF16, bias=bias, seed=80)
        for label in labels:
            c = Candidate.parse(label)
            out = rs_mod.run_strategy(c.strategy, prob.x, prob.w, prob.b, **prob.kwargs(), **c.kwargs)
            result[f"{m_rows}x{k}x{n} {label}"] = prob.check(out, f"{label} on {m_rows}x{k}x{n}")[0]
            del out
    # N-D input [s, b, h] (rows scattered on dim 0), and the caller's out (aligned and not).
    prob = RsProblem(rank, world, dev, 64 * world, 512, 264, BF16, bias=True, seed=81)
    x3 = prob.x.view(64 * world // 4, 4, 512)
    out3 = rs_mod.run_strategy("fused", x3, prob.w, prob.b, **prob.kwargs())
    result["N-D"] = prob.check(out3.reshape(-1, 264), "fused, N-D input")[0]
    buf = torch.empty(64 * 264 + 1, dtype=BF16, device=dev)
    for name, dest in (("out aligned", buf[:64 * 264].view(64, 264)), ("out unaligned", buf[1:].view(64, 264))):
        dest.fill_(float("nan"))
        res = rs_mod.prepare_strategy("fused", prob.x, prob.w, prob.b, out=dest)()
        assert res.data_ptr() == dest.data_ptr(), f"fused did not return the caller's out ({name})"
        result[name] = prob.check(dest, f"fused into {name}")[0]
    return result


def _rs_fused_only(fn):
    """A case of gemm_rs 'fused' that skips where the strategy would fall back (so that it
    cannot pass by testing 'decomposed' instead)."""
    def case_fn(rank, world, dev):
        _need_rs_fused(world, dev)
        return fn(rank, world, dev)

    return case_fn


gcase("repeat50-rs-fused")(_rs_fused_only(_repeat("rs", RS_FUSED_LABELS[1:3])))
gcase("delayed1000-rs-fused")(_rs_fused_only(_delayed("rs", ["fused(segments=4)"])))


def _host_us(call, calls=200, batch=20):
    """Median host microseconds to enqueue ``call()`` while the GPU is kept busy (a spin ahead of
    each batch, so that no call waits for the device)."""
    import statistics
    import time

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls // batch):
        torch.cuda._sleep(1980 * (2000 + 500 * batch))  # cycles: ~2 ms + 0.5 ms per call at 1.98 GHz
        for _ in range(batch):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def _host_cost(op):
    """The per-call path's host cost: every strategy through the public function (its plan, from
    C++) enqueues a call in at most 1.5x the host time of NCCL + torch.mm measured here, in the
    same process (GPU kept busy; a ratio, not an absolute time; the maximum over the ranks of
    each). Also: of 20 public calls of one problem only the first takes the slow path. Reports
    the C++ entry alone (``runtime.call``) too, to show what the Python wrapper adds."""
    from flux import autotune
    from flux.ops import _gemm_op

    def fn(rank, world, dev):
        if SHARED_GPUS:
            raise Skip("the baseline is NCCL + torch.mm, and ranks sharing a GPU talk over gloo, where every call "
                       "exchanges a header on the host (no hot path): bench/profile_host.py times the strategies there")
        mod = ag_mod if op == "ag" else rs_mod
        name = "ag_gemm" if op == "ag" else "gemm_rs"
        public = flux.ag_gemm if op == "ag" else flux.gemm_rs
        if op == "ag":
            prob = AgProblem(rank, world, dev, 512, 1024, 1024, BF16, seed=80)

            def baseline():  # what flux replaces: NCCL all-gather into a new tensor, then torch.mm
                gathered = torch.empty((512 * world, 1024), dtype=BF16, device=dev)
                dist.all_gather_into_tensor(gathered, prob.x)
                return torch.mm(gathered, prob.w.t())
        else:
            prob = RsProblem(rank, world, dev, 512 * world, 1024, 1024, BF16, seed=80)

            def baseline():
                out = torch.empty((512, 1024), dtype=BF16, device=dev)
                dist.reduce_scatter_tensor(out, torch.mm(prob.x, prob.w.t()))
                return out
        measured = {"nccl+mm": _host_us(baseline)}
        slow_calls = {}
        strategies = mod.available_strategies(dev)
        try:
            with _ref.slow_path_calls(op) as slow:
                for strategy in strategies:
                    autotune.force(name, strategy)
                    slow.clear()
                    outs = [public(prob.x, prob.w) for _ in range(20)]
                    slow_calls[strategy] = len(slow)
                    prob.check(outs[-1], f"{strategy}, 20th call")
                    measured[strategy] = _host_us(lambda: public(prob.x, prob.w))
                    rt = _gemm_op._hot.get(dist.group.WORLD)
                    measured[f"{strategy} (C++ entry)"] = _host_us(
                        lambda: rt.call(0 if op == "ag" else 1, prob.x, prob.w, None, None, 0, -1, False))
        finally:
            autotune.force(name, None)
        # Every rank asserts on the same numbers: the maximum over the ranks.
        t = torch.tensor(list(measured.values()), dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        result = {k: round(v, 1) for k, v in zip(measured, t.tolist())}
        assert all(n == 1 for n in slow_calls.values()), f"slow-path calls of 20: {slow_calls}"
        over = {s: result[s] for s in strategies if result[s] > 1.5 * result["nccl+mm"]}
        assert not over, f"host us per call over 1.5x NCCL + torch.mm: {over}; all: {result}"
        return result

    return fn


gcase("host-cost-ag")(_host_cost("ag"))
gcase("host-cost-rs")(_host_cost("rs"))


@gcase("autograd-mlp")
def _autograd_mlp(rank, world, dev):
    """The sequence-parallel MLP block, y = gemm_rs(gelu(ag_gemm(x, W1, b1)), W2, b2), forward and
    backward in bf16 with each pair of strategies forced, against float64 autograd of the
    unsharded block (every rank builds every rank's tensors from seeds); tolerance from the same
    block in bf16 on one GPU. d b2 is this rank's rows' share (summed over the group by the user,
    as Megatron does)."""
    from flux import autotune

    m_local, h, f_local = 256, 512, 384
    xs = [rand((m_local, h), BF16, 900 + r, dev) for r in range(world)]
    w1s = [rand((f_local, h), BF16, 910 + r, dev) * 0.05 for r in range(world)]
    b1s = [rand((f_local,), BF16, 920 + r, dev) for r in range(world)]
    w2s = [rand((h, f_local), BF16, 930 + r, dev) * 0.05 for r in range(world)]
    b2 = rand((h,), BF16, 940, dev)
    gs = [rand((m_local, h), BF16, 950 + r, dev) for r in range(world)]

    def unsharded(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (torch.cat(xs), *w1s, *b1s, *w2s, b2)]
        x, w1, b1, w2, bb = leaves[0], leaves[1:1 + world], leaves[1 + world:1 + 2 * world], \
            leaves[1 + 2 * world:1 + 3 * world], leaves[-1]
        y = sum(torch.nn.functional.gelu(x @ w1[r].t() + b1[r]) @ w2[r].t() for r in range(world)) + bb
        (y * torch.cat(gs).to(dtype)).sum().backward()
        rows = slice(rank * m_local, (rank + 1) * m_local)
        db2 = gs[rank].to(dtype).sum(0)  # this rank's rows' share
        return y[rows].detach(), {"x": x.grad[rows], "w1": w1[rank].grad, "b1": b1[rank].grad, "w2": w2[rank].grad,
                                  "b2": db2}

    ref_y, ref = unsharded(torch.float64)
    base_y, base = unsharded(BF16)
    result = {}
    for ag_s, rs_s in (("sequential", "sequential"), ("decomposed", "decomposed"), ("fused", "fused"),
                       ("oneshot", "oneshot")):
        if ag_s not in ag_mod.available_strategies(dev):
            continue
        autotune.force("ag_gemm", ag_s)
        autotune.force("gemm_rs", rs_s)
        try:
            x = xs[rank].clone().requires_grad_()
            w1, b1 = w1s[rank].clone().requires_grad_(), b1s[rank].clone().requires_grad_()
            w2, bb = w2s[rank].clone().requires_grad_(), b2.clone().requires_grad_()
            for _ in range(2):  # the second step runs every op from its plan
                for t in (x, w1, b1, w2, bb):
                    t.grad = None
                y = flux.gemm_rs(torch.nn.functional.gelu(flux.ag_gemm(x, w1, b1)), w2, bb)
                (y * gs[rank]).sum().backward()
        finally:
            autotune.force("ag_gemm", None)
            autotune.force("gemm_rs", None)
        errs = {"y": check_against(y, ref_y, base_y, f"{ag_s}/{rs_s} y")[0]}
        for k, t in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", bb)):
            errs[k] = check_against(t.grad, ref[k], base[k], f"{ag_s}/{rs_s} d{k}")[0]
        result[f"{ag_s}/{rs_s}"] = errs
    return result


def mismatch_case(rank, world, dev, strategy="decomposed", op="ag"):
    """Run alone (it breaks the CUDA contexts): every rank makes calls A and B twice (so both are
    planned), then rank 0 calls A while the others call B: the entry barrier's token check makes
    every rank fail at once (well within FLUX_TIMEOUT_MS), each naming the other."""
    import time

    from flux import autotune

    name = "ag_gemm" if op == "ag" else "gemm_rs"
    autotune.force(name, strategy)
    if op == "ag":
        probs, call = [AgProblem(rank, world, dev, m, 256, 128, BF16, seed=90) for m in (64, 128)], flux.ag_gemm
    else:
        probs, call = [RsProblem(rank, world, dev, m * world, 256, 128, BF16, seed=90) for m in (64, 128)], flux.gemm_rs
    for _ in range(2):
        for p in probs:
            call(p.x, p.w)
    torch.cuda.synchronize()
    dist.barrier()
    mine = probs[0] if rank == 0 else probs[1]
    start = time.time()
    try:
        call(mine.x, mine.w)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"FLUXMISMATCH rank {rank} raised after {time.time() - start:.1f} s: {type(e).__name__}: {e}",
              flush=True)
        print(f"FLUXMISMATCH report rank {rank}: {symm.timeout_report()}", flush=True)
        os._exit(0)
    print(f"FLUXMISMATCH rank {rank} did not fail", flush=True)
    os._exit(1)


def timeout_case(rank, world, dev, strategy="decomposed", op="ag", mode="skip"):
    """Run alone (it breaks the CUDA contexts): all ranks make one call, then rank 1 skips
    the next one (mode "skip": the entry barrier's wait expires first), or makes it but sends
    nothing (mode "drop": the barrier passes and the waits for data expire, inside the fused
    kernels for 'fused'); the others' bounded waits must fail within seconds, naming rank 1 (in
    the fused RS ring with rank 1 sending nothing: each rank's ring predecessor). op "moetp" /
    "moetp_rs": flux.ag_scatter_grouped_mm / flux.grouped_mm_gather_rs with
    FLUX_STRATEGY_MOE_TP=strategy (mode "drop" only: a rank skipping part 1 altogether leaves the
    others in the routing's all-gather, a host collective)."""
    import time

    if op in ("moetp", "moetp_rs"):  # the TP MoE ops' exchange (flux/ops/moe/tp_strategies.py): part 1, part 2
        os.environ["FLUX_STRATEGY_MOE_TP"] = strategy
        gen = torch.Generator().manual_seed(60 + rank)
        x = torch.randn(64, 256, generator=gen).to(dev, BF16)
        idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(64)]).to(dev)
        w1 = torch.randn(8, 128, 256, generator=gen).to(dev, BF16)
        if op == "moetp":
            def call():
                flux.ag_scatter_grouped_mm(x, idx, w1)
        else:
            _, routing = flux.ag_scatter_grouped_mm(x, idx, w1)  # every rank, before any drop
            h = torch.randn(routing.num_rows, 128, generator=gen).to(dev, BF16)
            w2 = torch.randn(8, 256, 128, generator=gen).to(dev, BF16)
            tw = torch.rand(64, 2, generator=gen).to(dev)

            def call():
                flux.grouped_mm_gather_rs(h, w2, routing, tw)
    else:
        if op == "ag":
            prob, mod = AgProblem(rank, world, dev, 64, 256, 128, BF16, seed=50), ag_mod
        else:
            prob, mod = RsProblem(rank, world, dev, 64 * world, 256, 128, BF16, seed=50), rs_mod

        def call():
            mod.run_strategy(strategy, prob.x, prob.w)
    # The expected run takes seconds (the waits' 2 s bound, rank 1's 20 s sleep): a rank still here
    # after TIMEOUT_CASE_S prints every thread's stack and exits, which the test reports.
    faulthandler.dump_traceback_later(TIMEOUT_CASE_S, exit=True)
    call()
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1 and mode == "drop":
        flux.testing.drop_transfers(dist.group.WORLD)
        call()  # the peers' data reach this rank: it finishes
        torch.cuda.synchronize()
        time.sleep(20)
        print("FLUXTIMEOUT rank 1 made the call without sending", flush=True)
        os._exit(0)
    if rank == 1:
        time.sleep(20)
        print("FLUXTIMEOUT rank 1 skipped the call", flush=True)
        os._exit(0)
    start = time.time()
    try:
        call()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"FLUXTIMEOUT rank {rank} raised after {time.time() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
        print(f"FLUXTIMEOUT report: {symm.timeout_report()}", flush=True)
        os._exit(0)
    print(f"FLUXTIMEOUT rank {rank} did not fail", flush=True)
    os._exit(1)


# --------------------------------------------------------------------------------------


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if SHARED_GPUS:
        local %= torch.cuda.device_count()
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if SHARED_GPUS:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    faulthandler.enable()
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which.startswith("timeout"):  # timeout[:<strategy>[:<op>[:<mode>]]]
        timeout_case(dist.get_rank(), dist.get_world_size(), dev, *which.split(":")[1:])
    if which.startswith("mismatch"):  # mismatch[:<strategy>[:<op>]]
        mismatch_case(dist.get_rank(), dist.get_world_size(), dev, *which.split(":")[1:])
    if which == "all":
        names = list(CASES)
    else:
        names = which.split(",")
    out_dir = os.environ.get("FLUX_GPU_RESULTS_DIR")
    results = open(os.path.join(out_dir, f"results.{rank}"), "w") if out_dir else None
    for name in names:
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # a hung case ends the run, with stacks
        rec = {"case": name, "rank": rank, "status": "ok", "error": None, "value": None}
        try:
            rec["value"] = CASES[name](rank, world, dev)
            torch.cuda.synchronize()
        except Skip as e:
            rec.update(status="skip", error=str(e))
        except Exception as e:  # noqa: BLE001  (reported to the test)
            report = symm.timeout_report()  # a fused kernel's timeout, recorded before it trapped
            rec.update(status="fail", error=(f"{report}\n" if report else "") +
                       f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        faulthandler.cancel_dump_traceback_later()
        line = json.dumps(rec)
        print("FLUXCASE " + line, flush=True)
        if results is not None:  # a file per rank: long lines of two ranks never interleave
            results.write(line + "\n")
            results.flush()
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
