"""Tests of flux.ag_gemm and flux.gemm_rs.

CPU part (always runs): the cases below are registered with ``@case`` and run in gloo
process groups of 2 and 4 ranks by tests/_dist.py, one set of processes per world size;
the ``test_*`` functions at the end assert on what each rank reported.

- forward against a float64 reference written here: every rank builds every rank's input
  from seeds, so it can compute the whole expected result alone, without flux's
  references and without any collective. Tolerance comes from a same-precision baseline:
  the unfused result computed with torch in the op's precision, whose error against the
  float64 reference bounds what the op may lose (error <= 2 * baseline + eps);
- autograd in float64 against the analytic gradients;
- every kind of bad input raising the same FluxInputError on every rank, then a good call
  to show that the group is still usable;
- torch.library.opcheck of both ops, and torch.compile(fullgraph=True) of a TP MLP;
- world 4: two TP subgroups of 2 ([0, 1], [2, 3]).

Cases that fail because of a known flux bug are listed in KNOWN_BUGS: they xfail while
the bug is there and fail once it is fixed (so that the entry goes with the bug).

GPU part (skipped without 2 CUDA devices): torchrun of tests/gpu_worker.py with NCCL.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flux
import _ref
from _dist import CASES, TESTS_DIR, case, case_names, run_batch
from _ref import rand, rel_err, w_nk  # noqa: F401
from flux.autotune.space import Candidate

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
WORLDS = (2, 4)
# World size 8 (an 8-GPU tensor-parallel group) runs a subset, 8 processes on the CI's 2 cores.
BIG_WORLD = 8
# Hard bound on one world size's whole batch of cases (process start included).
BATCH_TIMEOUT_S = float(os.environ.get("FLUX_TEST_BATCH_TIMEOUT_S", "150"))



# --------------------------------------------------------------------------------------
# Helpers (run inside the workers)


def check_against(out, ref, base, what):
    err, berr = _ref.check_against(out, ref, base, what)
    return {"err": err, "baseline": berr}


def assert_close64(actual, expected, what):
    assert actual is not None, f"{what}: no gradient"
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


def rank_inputs(world, shape, dtype, seed0):
    return [rand(shape, dtype, seed0 + r) for r in range(world)]


def weight_shape(n, k, layout):
    return (n, k) if layout == "nk" else (k, n)


# --------------------------------------------------------------------------------------
# Forward against float64

DTYPES = {  # name: (input dtype, out_dtype argument)
    "fp32": (F32, None),
    "bf16": (BF16, None),
    "bf16-out32": (BF16, F32),
}
# Not multiples of 128 (nor of 8); "3d" is Megatron's sequence-parallel [s, b, h].
AG_SHAPES = {"2d": (5, (), 37, 19), "3d": (3, (2,), 37, 19)}  # M_local, middle dims, K, N
RS_SHAPES = {"2d": (3, (), 37, 19), "3d": (2, (3,), 37, 19)}  # M / world, middle dims, K_local, N


def _ag_forward(dtype_key, layout, with_bias, shape_key):
    def fn(rank, world):
        dt, out_dt = DTYPES[dtype_key]
        odt = out_dt or dt
        m, mid, k, n = AG_SHAPES[shape_key]
        xs = rank_inputs(world, (m, *mid, k), dt, 1000)
        ws = rank_inputs(world, weight_shape(n, k, layout), dt, 2000)  # each rank its own columns
        bs = rank_inputs(world, (n,), odt, 3000) if with_bias else [None] * world
        x, w, b = xs[rank], ws[rank], bs[rank]

        out = flux.ag_gemm(x, w, b, weight_layout=layout, out_dtype=out_dt)
        out2, gathered = flux.ag_gemm(x, w, b, weight_layout=layout, out_dtype=out_dt, return_gathered=True)

        full = torch.cat(xs, dim=0)
        assert gathered.dtype == dt and torch.equal(gathered, full), "gathered input differs from the concatenation"
        assert out.dtype == odt, f"out dtype {out.dtype}, expected {odt}"
        assert torch.equal(out, out2), "return_gathered=True changed the output"
        wn = w_nk(w, layout)
        ref = full.double() @ wn.double().t()
        if b is not None:
            ref = ref + b.double()
        cdt = odt if out_dt is not None else dt  # the precision the unfused baseline computes in
        base = full.to(cdt) @ wn.to(cdt).t()
        if b is not None:
            base = base + b
        return check_against(out, ref, base.to(odt), "ag_gemm")

    return fn


def _rs_forward(dtype_key, layout, with_bias, shape_key):
    def fn(rank, world):
        dt, out_dt = DTYPES[dtype_key]
        odt = out_dt or dt
        rows, mid, k, n = RS_SHAPES[shape_key]
        m = rows * world
        xs = rank_inputs(world, (m, *mid, k), dt, 1100)  # each rank its own K slice
        ws = rank_inputs(world, weight_shape(n, k, layout), dt, 2100)
        b = rand((n,), odt, 3100) if with_bias else None  # replicated, as in RowParallelLinear
        out = flux.gemm_rs(xs[rank], ws[rank], b, weight_layout=layout, out_dtype=out_dt)
        assert out.dtype == odt, f"out dtype {out.dtype}, expected {odt}"

        ref = sum(xs[r].double() @ w_nk(ws[r], layout).double().t() for r in range(world))
        ref = ref.chunk(world, dim=0)[rank]
        cdt = odt if out_dt is not None else dt
        base = None
        for r in range(world):  # partials in the op's precision, summed in it in rank order
            p = xs[r].to(cdt) @ w_nk(ws[r], layout).to(cdt).t()
            base = p if base is None else base + p
        base = base.chunk(world, dim=0)[rank]
        if b is not None:
            ref = ref + b.double()
            base = base + b
        return check_against(out, ref, base.to(odt), "gemm_rs")

    return fn


for _op, _factory in (("ag", _ag_forward), ("rs", _rs_forward)):
    for _dk in DTYPES:
        for _layout in ("nk", "kn"):
            for _bias in (False, True):
                for _sk in ("2d", "3d"):
                    _big = _layout == "nk" and _bias and _sk == "3d"
                    case(f"fwd-{_op}-{_dk}-{_layout}-{'bias' if _bias else 'nobias'}-{_sk}",
                         worlds=WORLDS + ((BIG_WORLD,) if _big else ()))(_factory(_dk, _layout, _bias, _sk))


def _out_case(op):
    """out=: the result lands in the caller's (NaN-poisoned) tensor, which is returned, and
    equals the call without out= exactly (the same strategy); N-D input."""
    def fn(rank, world):
        m, mid, k, n = (3, (2,), 13, 9)
        rows = m if op == "ag" else m * world
        x = rank_inputs(world, (rows, *mid, k), F32, 1500)[rank]
        w = rank_inputs(world, (n, k), F32, 2500)[rank]
        b = rand((n,), F32, 3500)
        plain = _call(op, x, w, b)
        out = torch.full(plain.shape, float("nan"))
        got = _call(op, x, w, b, out=out)
        assert got is out, "out= must return the caller's tensor"
        assert torch.equal(out, plain), "out= result differs from the plain call"
        # The dispatcher path (opcheck: schema, fake, mutation of out only).
        gname = flux.runtime.group_name(dist.group.WORLD)
        opname = torch.ops.flux.ag_gemm_out if op == "ag" else torch.ops.flux.gemm_rs_out
        torch.library.opcheck(opname.default, (x, w, b, gname, "nk", None, torch.empty_like(plain)))
        # run_strategy hands strategy parameters through: an unknown one is refused.
        mod = flux.ops.ag_gemm if op == "ag" else flux.ops.gemm_rs
        try:
            mod.run_strategy("sequential", x, w, bogus=1)
        except TypeError:
            pass
        else:
            raise AssertionError("run_strategy ignored a strategy parameter")
        return True

    return fn


for _op in ("ag", "rs"):
    case(f"fwd-out-{_op}")(_out_case(_op))


def _slow_path_case(op):
    """The op's slow path is its GemmOp's ``slow`` (the GPU host-cost cases of tests/gpu_worker.py
    count calls through it): patched on the op object, it sees every gloo call (no plan on CPU)."""
    def fn(rank, world):
        x = rank_inputs(world, (3 if op == "ag" else 3 * world, 8), F32, 1600)[rank]
        w = rank_inputs(world, (5, 8), F32, 2600)[rank]
        with _ref.slow_path_calls(op) as seen:
            for _ in range(3):
                _call(op, x, w, None)
        assert len(seen) == 3, f"{len(seen)} of 3 calls went through GemmOp.slow"
        return True

    return fn


for _op in ("ag", "rs"):
    case(f"fwd-slow-path-{_op}", worlds=(2,))(_slow_path_case(_op))


def _every_strategy_case(op):
    """Every strategy, with its parameters, runs on CPU through its
    fallback and gives exactly the sequential result; only 'sequential' is listed as available."""
    def fn(rank, world):
        mod = flux.ops.ag_gemm if op == "ag" else flux.ops.gemm_rs
        rows = 4 if op == "ag" else 4 * world
        x = rank_inputs(world, (rows, 24), F32, 1600)[rank]
        w = rank_inputs(world, (16, 24), F32, 2600)[rank]
        b = rand((16,), F32, 3600)
        ref = mod.run_strategy("sequential", x, w, b)
        labels = list(mod.STRATEGIES)
        if op == "ag":
            labels.append("decomposed(first8=6)")
        else:
            labels.append("fused(segments=4,config=1)")
        for label in labels:
            c = Candidate.parse(label)
            out = mod.run_strategy(c.strategy, x, w, b, **c.kwargs)
            assert torch.equal(out, ref), f"{op} {label} on CPU differs from sequential"
        assert mod.available_strategies(torch.device("cpu")) == ["sequential"]
        return True

    return fn


for _op in ("ag", "rs"):
    case(f"fwd-every-strategy-{_op}")(_every_strategy_case(_op))


# --------------------------------------------------------------------------------------
# Autograd in float64


def _ag_autograd(layout, with_gathered):
    def fn(rank, world):
        m, mid, k, n = (3, (2,), 11, 7) if with_gathered else (4, (), 11, 7)
        xs = rank_inputs(world, (m, *mid, k), F64, 1200)
        ws = rank_inputs(world, weight_shape(n, k, layout), F64, 2200)
        bs = rank_inputs(world, (n,), F64, 3200)
        x = xs[rank].clone().requires_grad_()
        w = ws[rank].clone().requires_grad_()
        b = bs[rank].clone().requires_grad_()
        gs = rank_inputs(world, (m * world, *mid, n), F64, 4200)  # d loss / d out, per rank
        hs = rank_inputs(world, (m * world, *mid, k), F64, 5200)  # d loss / d gathered, per rank
        if with_gathered:
            out, gathered = flux.ag_gemm(x, w, b, weight_layout=layout, return_gathered=True)
            loss = (out * gs[rank]).sum() + (gathered * hs[rank]).sum()
        else:
            out = flux.ag_gemm(x, w, b, weight_layout=layout)
            loss = (out * gs[rank]).sum()
        loss.backward()

        # out_q = cat(xs) @ W_q^T + b_q on every rank q: x_r feeds rows r of every out_q.
        dfull = sum(gs[q] @ w_nk(ws[q], layout) for q in range(world))
        if with_gathered:
            dfull = dfull + sum(hs)
        dx = dfull.chunk(world, dim=0)[rank]
        a2 = torch.cat(xs).reshape(-1, k)
        g2 = gs[rank].reshape(-1, n)
        dw_nk = g2.t() @ a2
        assert_close64(x.grad, dx, "d input")
        assert_close64(w.grad, dw_nk if layout == "nk" else dw_nk.t(), "d weight")
        assert_close64(b.grad, g2.sum(0), "d bias")

    return fn


def _rs_autograd(layout, shape_key):
    def fn(rank, world):
        rows, mid, k, n = (2, (3,), 11, 7) if shape_key == "3d" else (3, (), 11, 7)
        m = rows * world
        xs = rank_inputs(world, (m, *mid, k), F64, 1300)
        ws = rank_inputs(world, weight_shape(n, k, layout), F64, 2300)
        x = xs[rank].clone().requires_grad_()
        w = ws[rank].clone().requires_grad_()
        b = rand((n,), F64, 3300).requires_grad_()
        gs = rank_inputs(world, (rows, *mid, n), F64, 4300)
        out = flux.gemm_rs(x, w, b, weight_layout=layout)
        (out * gs[rank]).sum().backward()

        # out_q = rows q of sum_r x_r @ W_r^T, + b: every x_r feeds every out_q.
        gfull = torch.cat(gs, dim=0)
        dx = gfull @ w_nk(ws[rank], layout)
        dw_nk = gfull.reshape(-1, n).t() @ xs[rank].reshape(-1, k)
        assert_close64(x.grad, dx, "d input")
        assert_close64(w.grad, dw_nk if layout == "nk" else dw_nk.t(), "d weight")
        assert_close64(b.grad, gs[rank].reshape(-1, n).sum(0), "d bias")

    return fn


for _layout in ("nk", "kn"):
    for _g in (False, True):
        case(f"grad-ag-{_layout}-{'gathered' if _g else 'out'}")(_ag_autograd(_layout, _g))
    for _sk in ("2d", "3d"):
        case(f"grad-rs-{_layout}-{_sk}")(_rs_autograd(_layout, _sk))


@case("grad-ag-gathered-grad-shared")
def _ag_shared_grad(rank, world):
    """The gradient reaching ``gathered`` is a tensor that autograd also hands to another
    branch (``gathered + z`` gives both inputs the same tensor): the backward must not
    change it in place (gloo's reduce-scatter is an in-place all-reduce)."""
    m, k, n = 3, 6, 5
    xs = rank_inputs(world, (m, k), F64, 1250)
    w = rand((n, k), F64, 2250 + rank)
    hs = rank_inputs(world, (m * world, k), F64, 5250)
    gs = rank_inputs(world, (m * world, n), F64, 4250)
    x = xs[rank].clone().requires_grad_()
    zl = torch.zeros((m * world, k), dtype=F64, requires_grad=True)
    z = zl * 2  # created before the op, so that the op's backward runs before MulBackward
    out, gathered = flux.ag_gemm(x, w, return_gathered=True)
    (((gathered + z) * hs[rank]).sum() + (out * gs[rank]).sum()).backward()
    assert_close64(zl.grad, 2 * hs[rank], "d z (the branch that shares the gathered input's gradient)")
    ws = rank_inputs(world, (n, k), F64, 2250)
    dx = (sum(hs) + sum(gs[q] @ ws[q] for q in range(world))).chunk(world)[rank]
    assert_close64(x.grad, dx, "d input")


# --------------------------------------------------------------------------------------
# Bad input: the same FluxInputError on every rank, then the group still works.
#
# flux remembers signatures that passed the cross-rank check and skips the exchange for
# them; a bad case must therefore use shapes that no rank has used before, or a rank
# whose signature is remembered would not take part in the exchange (see _checks.py).
# Every bad case gets its own K (BAD_K0 + its index) and N = BAD_N, used nowhere else.

BAD_N, BAD_K0, BAD_M = 29, 60, 2
OPNAMES = {"ag": "flux.ag_gemm", "rs": "flux.gemm_rs"}


def _call(op, x, w, b=None, **kw):
    return (flux.ag_gemm if op == "ag" else flux.gemm_rs)(x, w, b, **kw)


def _good_call(op, rank, world):
    """A valid call after a failed one: it must complete and be right."""
    m, k, n = (4 if op == "ag" else 4 * world), 16, 8
    xs = rank_inputs(world, (m, k), F32, 1400)
    ws = rank_inputs(world, (n, k), F32, 2400)
    out = _call(op, xs[rank], ws[rank])
    if op == "ag":
        ref = torch.cat(xs).double() @ ws[rank].double().t()
    else:
        ref = sum(xs[r].double() @ ws[r].double().t() for r in range(world)).chunk(world)[rank]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _bad_builders():
    """name -> (ops, build(op, rank, world, k) -> (x, w, b, kwargs), expected message fragment)."""
    n, m = BAD_N, BAD_M

    def rows(op, world):
        return m if op == "ag" else m * world

    def std(op, world, k, dtype=F32):
        return rand((rows(op, world), k), dtype, 7), rand((n, k), dtype, 8)

    def k_mismatch(op, rank, world, k):
        x, _ = std(op, world, k)
        return x, rand((n, k + 1), F32, 8), None, {}

    def m_not_divisible(op, rank, world, k):
        return rand((m * world + 1, k), F32, 7), rand((n, k), F32, 8), None, {}

    def dtype_mismatch(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w.to(BF16), None, {}

    def bias_shape(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, rand((n + 1,), F32, 9), {}

    def bias_2d(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, rand((1, n), F32, 9), {}

    def bias_dtype(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, rand((n,), BF16, 9), {}

    def bias_dtype_out(op, rank, world, k):  # bias must be in out_dtype, not the input dtype
        x, w = std(op, world, k, BF16)
        return x, w, rand((n,), BF16, 9), {"out_dtype": F32}

    def noncontig_input(op, rank, world, k):
        _, w = std(op, world, k)
        return rand((k, rows(op, world)), F32, 7).t(), w, None, {}

    def noncontig_weight(op, rank, world, k):
        x, _ = std(op, world, k)
        return x, rand((k, n), F32, 8).t(), None, {}  # [N, K] view of a [K, N] tensor, declared "nk"

    def bad_layout(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, None, {"weight_layout": "NK"}

    def input_1d(op, rank, world, k):
        _, w = std(op, world, k)
        return rand((k,), F32, 7), w, None, {}

    def weight_3d(op, rank, world, k):
        x, _ = std(op, world, k)
        return x, rand((1, n, k), F32, 8), None, {}

    def int_dtype(op, rank, world, k):
        return (torch.ones((rows(op, world), k), dtype=torch.int32), torch.ones((n, k), dtype=torch.int32),
                None, {})

    def int_out_dtype(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, None, {"out_dtype": torch.int32}

    def shape_differs(op, rank, world, k):  # valid everywhere, but rank 1 has more rows
        extra = (1 if op == "ag" else world) if rank == 1 else 0
        return rand((rows(op, world) + extra, k), F32, 7), rand((n, k), F32, 8), None, {}

    def dtype_differs(op, rank, world, k):  # valid everywhere, but rank 1 computes in fp64
        x, w = std(op, world, k, F64 if rank == 1 else F32)
        return x, w, None, {}

    def layout_differs(op, rank, world, k):  # valid everywhere, but rank 1 passes [K, N]
        x, w = std(op, world, k)
        return (x, w.t().contiguous(), None, {"weight_layout": "kn"}) if rank == 1 else (x, w, None, {})

    def weight_on_meta(op, rank, world, k):  # a device mismatch that a CPU-only machine can make
        x, w = std(op, world, k)
        return x, w.to("meta"), None, {}

    def error_on_one_rank(op, rank, world, k):  # only rank 1 has a K mismatch
        x, w = std(op, world, k)
        return x, (rand((n, k + 1), F32, 8) if rank == 1 else w), None, {}

    both = ("ag", "rs")
    def out_rows(op, world):
        return m * world if op == "ag" else m

    def out_shape(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, None, {"out": torch.empty((out_rows(op, world), n + 1))}

    def out_dtype_wrong(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, None, {"out": torch.empty((out_rows(op, world), n), dtype=F64)}

    def out_noncontig(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w, None, {"out": torch.empty((n, out_rows(op, world))).t()}

    def out_overlaps_input(op, rank, world, k):
        buf = rand((max(rows(op, world) * k, out_rows(op, world) * n),), F32, 7)
        x = buf[:rows(op, world) * k].view(rows(op, world), k)
        return x, rand((n, k), F32, 8), None, {"out": buf[:out_rows(op, world) * n].view(out_rows(op, world), n)}

    def out_with_grad(op, rank, world, k):
        x, w = std(op, world, k)
        return x, w.requires_grad_(), None, {"out": torch.empty((out_rows(op, world), n))}

    return {
        "out-shape": (both, out_shape, "out has shape"),
        "out-dtype": (both, out_dtype_wrong, "out has dtype"),
        "out-noncontig": (both, out_noncontig, "out must be contiguous"),
        "out-overlaps-input": (both, out_overlaps_input, "out overlaps input"),
        "out-with-grad": (both, out_with_grad, "does not support autograd"),
        "k-mismatch": (both, k_mismatch, "has K="),
        "m-not-divisible": (("rs",), m_not_divisible, "not divisible by the group size"),
        "dtype-mismatch": (both, dtype_mismatch, "differs from input dtype"),
        "bias-shape": (both, bias_shape, "bias must have shape"),
        "bias-2d": (both, bias_2d, "bias must have shape"),
        "bias-dtype": (both, bias_dtype, "bias dtype"),
        "bias-dtype-out": (both, bias_dtype_out, "bias dtype"),
        "noncontig-input": (both, noncontig_input, "input must be contiguous"),
        "noncontig-weight": (both, noncontig_weight, "weight must be contiguous"),
        "bad-layout": (both, bad_layout, "weight_layout must be"),
        "input-1d": (both, input_1d, "at least 2 dimensions"),
        "weight-3d": (both, weight_3d, "weight must be 2-D"),
        "int-dtype": (both, int_dtype, "is not supported"),
        "int-out-dtype": (both, int_out_dtype, "is not supported"),
        "shape-differs": (both, shape_differs, "differ between ranks"),
        "dtype-differs": (both, dtype_differs, "differ between ranks"),
        "layout-differs": (both, layout_differs, "differ between ranks"),
        "error-on-one-rank": (both, error_on_one_rank, "invalid arguments on rank 1:"),
        "weight-on-meta": (both, weight_on_meta, "weight is on meta"),
    }


def _bad_case(op, build, expect, k):
    def fn(rank, world):
        x, w, b, kw = build(op, rank, world, k)
        try:
            _call(op, x, w, b, **kw)
        except flux.FluxInputError as e:
            msg = str(e)
        else:
            raise AssertionError("no FluxInputError was raised")
        assert msg.startswith(OPNAMES[op] + ":"), f"message does not start with the op name: {msg!r}"
        assert expect in msg, f"expected {expect!r} in {msg!r}"
        if "differ" in expect or "rank 1" in expect:
            assert "rank 1" in msg, f"the offending rank is not named: {msg!r}"
        _good_call(op, rank, world)
        return msg  # compared across ranks by test_bad_input

    return fn


_i = 0
for _name, (_ops, _build, _expect) in _bad_builders().items():
    for _op in _ops:
        _big = _name in ("shape-differs", "error-on-one-rank")
        case(f"bad-{_op}-{_name}", worlds=WORLDS + ((BIG_WORLD,) if _big else ()))(
            _bad_case(_op, _build, _expect, BAD_K0 + _i))
        _i += 1


# --------------------------------------------------------------------------------------
# opcheck and torch.compile
#
# opcheck's default test_utils all apply to these collective ops: every sub-test calls the
# op (or its fake) the same number of times with the same arguments on every rank, so the
# collectives inside match up across ranks.


def _opcheck_ag_args(rank, layout, gathered, grad_input, grad_params, dtype=F32, out_dtype=None, bias=True):
    from flux.runtime import group_name

    x = rand((3, 2, 10), dtype, 1500 + rank).requires_grad_(grad_input)
    w = rand(weight_shape(6, 10, layout), dtype, 2500 + rank).requires_grad_(grad_params)
    b = rand((6,), out_dtype or dtype, 3500 + rank).requires_grad_(grad_params) if bias else None
    return (x, w, b, group_name(dist.group.WORLD), layout, out_dtype, gathered)


@case("opcheck-ag_gemm", worlds=WORLDS)
def _opcheck_ag(rank, world):
    op = torch.ops.flux.ag_gemm.default
    for layout, gathered in (("nk", False), ("kn", True)):
        torch.library.opcheck(op, _opcheck_ag_args(rank, layout, gathered, False, False))
        # Gradient of the input only (the weight's needs the gathered input: see KNOWN_BUGS).
        torch.library.opcheck(op, _opcheck_ag_args(rank, layout, False, True, False))
    torch.library.opcheck(op, _opcheck_ag_args(rank, "nk", False, False, False, BF16, F32, bias=False))


@case("opcheck-ag_gemm-weight-grad", worlds=WORLDS)
def _opcheck_ag_weight_grad(rank, world):
    op = torch.ops.flux.ag_gemm.default
    for layout, gathered in (("nk", False), ("kn", True)):
        torch.library.opcheck(op, _opcheck_ag_args(rank, layout, gathered, True, True))


@case("opcheck-gemm_rs", worlds=WORLDS)
def _opcheck_rs(rank, world):
    from flux.runtime import group_name

    gname = group_name(dist.group.WORLD)
    for layout, grad in (("nk", False), ("kn", True)):
        x = rand((2 * world, 3, 10), F32, 1600 + rank).requires_grad_(grad)
        w = rand(weight_shape(6, 10, layout), F32, 2600 + rank).requires_grad_(grad)
        b = rand((6,), F32, 3600).requires_grad_(grad)
        torch.library.opcheck(torch.ops.flux.gemm_rs.default, (x, w, b, gname, layout, None))
    x, w = rand((2 * world, 10), BF16, 1600), rand((6, 10), BF16, 2600)
    torch.library.opcheck(torch.ops.flux.gemm_rs.default, (x, w, None, gname, "nk", F32))


def _tp_mlp(x, w1, b1, w2, b2):
    """Sequence-parallel MLP: all-gather + column-parallel FC1, row-parallel FC2 + reduce-scatter."""
    h = F.gelu(flux.ag_gemm(x, w1, b1))
    return flux.gemm_rs(h, w2, b2, weight_layout="kn")


def _mlp_args(rank, m=5, k=12, n=8):  # hidden k, FC1 width per rank n
    return [rand((m, k), F32, 1700 + rank), rand((n, k), F32, 2700 + rank), rand((n,), F32, 3700 + rank),
            rand((n, k), F32, 4700 + rank), rand((k,), F32, 5700)]


@case("compile-aot_eager-forward", worlds=WORLDS)
def _compile_forward(rank, world):
    torch._dynamo.reset()
    args = _mlp_args(rank)
    compiled = torch.compile(_tp_mlp, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for m in (5, 7, 5):  # another batch size recompiles (or runs a dynamic graph) correctly
            a = [rand((m, 12), F32, 1800 + rank + m)] + args[1:]
            got, expected = compiled(*a), _tp_mlp(*a)
            assert torch.equal(got, expected), f"M={m}: compiled output differs by {(got - expected).abs().max()}"


def _compile_backward(backend):
    def fn(rank, world):
        torch._dynamo.reset()
        args = _mlp_args(rank)
        eager_args = [a.clone().requires_grad_() for a in args]
        comp_args = [a.clone().requires_grad_() for a in args]
        g = rand((5, 12), F32, 6700 + rank)
        expected = _tp_mlp(*eager_args)
        (expected * g).sum().backward()
        got = torch.compile(_tp_mlp, backend=backend, fullgraph=True)(*comp_args)
        (got * g).sum().backward()
        assert torch.equal(got, expected), f"compiled output differs by {(got - expected).abs().max()}"
        for i, (a, e) in enumerate(zip(comp_args, eager_args)):
            torch.testing.assert_close(a.grad, e.grad, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, i=i: f"gradient of argument {i}: {m}")

    return fn


case("compile-eager-backward", worlds=WORLDS)(_compile_backward("eager"))
case("compile-aot_eager-backward", worlds=WORLDS)(_compile_backward("aot_eager"))


# --------------------------------------------------------------------------------------
# Calls after the first: checked for free, and caught when a rank diverges


@case("fwd-repeat-skips-the-exchange")
def _repeat_skips_exchange(rank, world):
    """Repeated calls of one problem take the fast path: the first call exchanges signatures
    through the store and chooses a strategy; the next nine do neither (on gloo each call still
    exchanges its header through the store, the check that catches a diverging rank)."""
    from flux import autotune
    from flux.ops import _checks

    exchanges, choices = [], []
    orig_exchange, orig_choose = _checks._exchange, autotune._choose
    _checks._exchange = lambda *a, **k: (exchanges.append(1), orig_exchange(*a, **k))[1]
    autotune._choose = lambda *a, **k: (choices.append(1), orig_choose(*a, **k))[1]
    try:
        x, w = rank_inputs(world, (6, 40), F32, 1700)[rank], rand((24, 40), F32, 2700)
        outs = [flux.ag_gemm(x, w) for _ in range(10)]
    finally:
        _checks._exchange, autotune._choose = orig_exchange, orig_choose
    assert len(exchanges) == 1 and len(choices) == 1, (len(exchanges), len(choices))
    assert all(torch.equal(o, outs[0]) for o in outs)
    return True


def _diverging_case(op):
    """A rank that changes its arguments after a checked call: every rank fails at once with
    the same FluxInputError naming the field and the ranks (not after a timeout, not paired with
    another call); then the group works again."""
    def fn(rank, world):
        import time

        call = flux.ag_gemm if op == "ag" else flux.gemm_rs
        rows = 6 if op == "ag" else 6 * world
        x, w = rank_inputs(world, (rows, 44), F32, 1800)[rank], rand((20, 44), F32, 2800)
        first = call(x, w)
        call(x, w)
        other = rank_inputs(world, (rows + world, 44), F32, 1800)[rank]  # rank 1 has one more row (per rank)
        start = time.time()
        try:
            call(other if rank == 1 else x, w)
        except flux.FluxInputError as e:
            msg = str(e)
        else:
            raise AssertionError("the diverging call raised nothing")
        took = time.time() - start
        assert took < 15, f"the diverging call failed only after {took:.1f} s (a timeout, not the check)"
        assert "differ between ranks" in msg and "rank 1" in msg, msg
        assert torch.equal(call(x, w), first), "the group does not work after the diverging call"
        return msg

    return fn


for _op in ("ag", "rs"):
    case(f"bad-diverging-after-checked-call-{_op}")(_diverging_case(_op))


# --------------------------------------------------------------------------------------
# Subgroups (world 4): two tensor-parallel groups of 2, [0, 1] and [2, 3].

_TP = {}


def _tp_group(rank, world):
    """This rank's TP group of 2; every rank creates all of them on first use (new_group
    is collective over the world), so every rank must call this in the same case."""
    if "group" not in _TP:
        groups = [dist.new_group(list(range(i, i + 2))) for i in range(0, world, 2)]
        _TP["group"] = groups[rank // 2]
    return _TP["group"]


@case("group-tp-forward", worlds=(4,))
def _group_forward(rank, world):
    g = _tp_group(rank, world)
    gw, gr, gi = dist.get_world_size(g), dist.get_rank(g), rank // 2  # group size, rank in it, group index
    assert gw == 2 and gr == rank % 2
    m, k, n = 5, 37, 19
    # ag_gemm: the group's shards gathered in group-rank order
    xs = rank_inputs(gw, (m, k), F32, 1900 + 10 * gi)
    w = rand((n, k), F32, 2900 + rank)
    out = flux.ag_gemm(xs[gr], w, group=g)
    full = torch.cat(xs)
    r1 = check_against(out, full.double() @ w.double().t(), full @ w.t(), "ag_gemm on a subgroup")
    # gemm_rs: the group's partials summed, this group rank's rows
    xs = rank_inputs(gw, (m * gw, k), F32, 1950 + 10 * gi)
    ws = rank_inputs(gw, (n, k), F32, 2950 + 10 * gi)
    out = flux.gemm_rs(xs[gr], ws[gr], group=g)
    ref = sum(xs[q].double() @ ws[q].double().t() for q in range(gw)).chunk(gw)[gr]
    base = (xs[0] @ ws[0].t() + xs[1] @ ws[1].t()).chunk(gw)[gr]
    r2 = check_against(out, ref, base, "gemm_rs on a subgroup")
    return [r1, r2]


@case("group-tp-bad-input", worlds=(4,))
def _group_bad(rank, world):
    """Group rank 1 of each TP group (world ranks 1 and 3) has a K mismatch: the error names
    the rank in the group, and is the same on every rank of every group."""
    g = _tp_group(rank, world)
    gr = dist.get_rank(g)
    k, n = 97, 31  # used nowhere else
    x, w = rand((2, k), F32, 7), rand((n, k + (gr == 1)), F32, 8)
    try:
        flux.ag_gemm(x, w, group=g)
    except flux.FluxInputError as e:
        msg = str(e)
    else:
        raise AssertionError("no FluxInputError was raised")
    assert msg.startswith("flux.ag_gemm: invalid arguments on rank 1:"), msg
    xs = rank_inputs(2, (4, 16), F32, 1400)
    w = rand((8, 16), F32, 2400)
    torch.testing.assert_close(flux.ag_gemm(xs[gr], w, group=g).double(), torch.cat(xs).double() @ w.double().t(),
                               rtol=1e-5, atol=1e-5)
    return msg


@case("group-asymmetric-use-then-new_group", worlds=(4,))  # keep last: it may leave the groups out of step
def _group_asymmetric(rank, world):
    """Only the ranks of one group call flux on it (say, one pipeline stage); afterwards the whole world
    creates a new group, as frameworks do (data-parallel groups, checkpoint groups...)."""
    import datetime

    members = [1, 2]  # a set of ranks that no earlier case used as a group
    pair = dist.new_group(members)  # every rank (collective)
    if rank in members:
        flux.ag_gemm(rand((2, 8), F32, rank), rand((4, 8), F32, 10 + rank), group=pair)
    grp = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    t = torch.ones(1)
    dist.all_reduce(t, group=grp)
    assert t.item() == world


# --------------------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def cpu_batch(request, tmp_path_factory):
    """world -> Batch, running each world size's cases once, in one set of processes.
    Only the cases of the selected tests run (``-k`` stays fast)."""
    batches = {}
    wanted = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is sys.modules[__name__] and "world" in params and "name" in params:
            wanted.setdefault(params["world"], set()).add(params["name"])

    def get(world):
        if world not in batches:
            names = [n for n in case_names(world) if n in wanted.get(world, ())]
            batches[world] = run_batch(__file__, world, names, str(tmp_path_factory.mktemp(f"world{world}")),
                                       timeout_s=BATCH_TIMEOUT_S, env={"FLUX_CHECK_TIMEOUT_S": "30"})
        return batches[world]

    return get


def _params(prefix):
    return [pytest.param(w, n, id=f"w{w}-{n[len(prefix):]}") for w in WORLDS + (BIG_WORLD,)
            for n in case_names(w) if n.startswith(prefix)]


# Cases that fail because of a known flux bug: case -> (text expected in the error on
# every failing rank, the bug in a line). They xfail while the bug is there, and fail once
# the case passes, so that the entry is removed together with the bug.
KNOWN_BUGS = {}  # case name -> (error fragment, why); none open


def _check_case(batch, name):
    """The per-rank values of case ``name``, failing the test unless it passed on every
    rank (or xfailing it, for a known bug)."""
    if name in KNOWN_BUGS:
        fragment, why = KNOWN_BUGS[name]
        recs = batch.outcomes(name)
        if all(r["ok"] for r in recs):
            pytest.fail(f"case {name!r} passes now: remove it from KNOWN_BUGS ({why})", pytrace=False)
        if all(fragment in r["error"] for r in recs if not r["ok"]):
            pytest.xfail(why)
    return batch.assert_ok(name)


@pytest.mark.parametrize("world,name", _params("fwd-"))
def test_forward(cpu_batch, world, name):
    _check_case(cpu_batch(world), name)


@pytest.mark.parametrize("world,name", _params("grad-"))
def test_autograd(cpu_batch, world, name):
    _check_case(cpu_batch(world), name)


@pytest.mark.parametrize("world,name", _params("bad-"))
def test_bad_input(cpu_batch, world, name):
    msgs = _check_case(cpu_batch(world), name)
    assert all(m == msgs[0] for m in msgs), "FluxInputError messages differ between ranks:\n" + "\n".join(
        f"rank {r}: {m}" for r, m in enumerate(msgs))


def test_bad_input_cuda_device_mismatch():
    # CPU and CUDA tensors mixed (the usual mistake) needs a CUDA device: tests/gpu_worker.py
    # covers it (bad-*-on-cpu). Here only the meta device can make a mismatch (bad-*-weight-on-meta).
    pytest.skip("a CPU/CUDA device mismatch needs a CUDA device; covered by tests/gpu_worker.py")


@pytest.mark.parametrize("world,name", _params("opcheck-"))
def test_opcheck(cpu_batch, world, name):
    _check_case(cpu_batch(world), name)


@pytest.mark.parametrize("world,name", _params("compile-"))
def test_compile(cpu_batch, world, name):
    _check_case(cpu_batch(world), name)


@pytest.mark.parametrize("world,name", _params("group-"))
def test_subgroups(cpu_batch, world, name):
    values = _check_case(cpu_batch(world), name)
    if name == "group-tp-bad-input":
        assert all(v == values[0] for v in values), values


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_rs_fused_ring_schedule(world):
    """gemm_rs 'fused' moves partial sums around a ring (flux.ops.gemm_rs.ring_steps): run its
    schedule on W simulated ranks, each step reading only what rank - 1 sent one step earlier,
    and check that every rank ends with the sum of its own block over all ranks (the GPU cases
    run it at the world size of the machine; this covers the indices at any world size)."""
    from flux.ops.gemm_rs import ring_steps

    g = torch.Generator().manual_seed(world)
    partial = torch.randn(world, world, 3, generator=g, dtype=torch.float64)  # [rank, block, ...]
    inbox = [[None] * (world - 1) for _ in range(world)]
    result = [None] * world
    steps = [ring_steps(r, world) for r in range(world)]
    for s in range(world):
        sent = []
        for r in range(world):
            block, slot, send = steps[r][s]
            val = partial[r, block] + (inbox[r][slot] if slot is not None else 0)
            if slot is not None:
                assert steps[(r - 1) % world][s - 1][0] == block, "rank - 1 summed another block"
                inbox[r][slot] = None  # read once
            if send is None:
                assert s == world - 1 and block == r, "the last step is the rank's own block"
                result[r] = val
            else:
                sent.append(((r + 1) % world, send, val))
        for dst, slot, val in sent:  # delivered after the step, as the flags order it
            assert inbox[dst][slot] is None, "a slot written twice in one call"
            inbox[dst][slot] = val
    for r in range(world):
        torch.testing.assert_close(result[r], partial[:, r].sum(0), rtol=1e-12, atol=1e-12)


def test_symm_spans_nodes():
    """A group whose ranks sit on different hosts (torchrun's layout: LOCAL_WORLD_SIZE processes
    per host, global ranks numbered host by host) gets no symmetric workspace, so every op falls
    back (or refuses a forced symm strategy) instead of mapping memory it cannot reach."""
    from flux.runtime.symm import spans_nodes

    assert not spans_nodes([0, 1], 2, 2)  # one host
    assert not spans_nodes([0, 1, 2, 3], 8, 4) and not spans_nodes([4, 5, 6, 7], 8, 4)  # TP within a host
    assert spans_nodes([3, 4], 8, 4) and spans_nodes([0, 4], 8, 4)  # across hosts
    assert spans_nodes(range(8), 8, 4)
    assert not spans_nodes([0, 4], 8, 0)  # no torchrun layout known: assume one host
    assert not spans_nodes([0, 1], 0, 0)


def test_case_registry():
    # Every case of this module is collected by one of the parametrized tests (by prefix);
    # other modules' cases ("tune-": tests/test_autotune.py) are theirs.
    prefixes = ("fwd-", "grad-", "bad-", "opcheck-", "compile-", "group-")
    mine = [n for n, c in CASES.items() if c.fn.__module__ == __name__]
    assert all(n.startswith(prefixes) for n in mine), [n for n in mine if not n.startswith(prefixes)]
    assert set(KNOWN_BUGS) <= set(CASES)


# --------------------------------------------------------------------------------------
# GPU part: torchrun of tests/gpu_worker.py (NCCL, every visible GPU, at most 8; FLUX_TEST_NGPUS
# overrides)

GPU_WORKER = os.path.join(TESTS_DIR, "gpu_worker.py")
GPU_TIMEOUT_S = float(os.environ.get("FLUX_TEST_GPU_TIMEOUT_S", "540"))


def _gpu_world():
    n = torch.cuda.device_count()
    return min(int(os.environ.get("FLUX_TEST_NGPUS", min(n, 8))), n)


def _gpu_case_names():
    import gpu_worker

    return list(gpu_worker.CASES)


def _run_gpu_worker(tmp_path_factory, which, world=None, **extra_env):
    n = world or _gpu_world()
    if n < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    from _dist import run_torchrun

    out_dir = tmp_path_factory.mktemp("gpu")
    rc, output = run_torchrun(GPU_WORKER, [which], n, out_dir, GPU_TIMEOUT_S, f"gpu-worker-w{n}.log", **extra_env)
    results = {}
    for rank in range(n):
        path = out_dir / f"results.{rank}"
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                results.setdefault(rec["case"], {})[rec["rank"]] = rec
    return {"results": results, "rc": rc, "world": n, "output": output[-6000:]}


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory):
    return _run_gpu_worker(tmp_path_factory, "all")


@pytest.mark.parametrize("name", _gpu_case_names())
def test_gpu(gpu_results, name):
    _check_gpu_case(gpu_results, name)


def _check_gpu_case(gpu_results, name):
    recs = gpu_results["results"].get(name, {})
    ranks = list(range(gpu_results["world"]))
    if sorted(recs) != ranks:
        pytest.fail(f"GPU case {name!r} reported by ranks {sorted(recs)} only (torchrun exit code "
                    f"{gpu_results['rc']}):\n{gpu_results['output']}", pytrace=False)
    bad = {r: rec["error"] for r, rec in recs.items() if rec["status"] == "fail"}
    assert not bad, f"GPU case {name!r} failed:\n" + "\n".join(f"--- rank {r} ---\n{e}" for r, e in bad.items())
    if all(rec["status"] == "skip" for rec in recs.values()):
        pytest.skip(recs[0]["error"])
    values = [recs[r]["value"] for r in ranks]
    if name.startswith("bad-"):
        assert all(v == values[0] for v in values), f"FluxInputError messages differ between ranks: {values}"


# Shared GPUs: FLUX_TEST_SHARED_WORLD=W runs every GPU case with W ranks on the visible GPUs
# (rank r on GPU r % count, gloo, FLUX_GLOO_CUDA=1; see tests/gpu_worker.py), so that the
# kernels and signal schedules of a world size larger than the machine's GPU count run (all but
# 'fused' above two ranks, which flux/strategies.py excludes there). Off unless asked: ranks sharing a GPU
# take turns on it (minutes). FLUX_TEST_SHARED_CASES=a,b,...: only those cases.
SHARED_WORLD = int(os.environ.get("FLUX_TEST_SHARED_WORLD", "0"))
SHARED_CASES = [c for c in os.environ.get("FLUX_TEST_SHARED_CASES", "").split(",") if c] or _gpu_case_names()


@pytest.fixture(scope="module")
def gpu_shared_results(tmp_path_factory):
    if SHARED_WORLD < 2 or not torch.cuda.is_available():
        pytest.skip("set FLUX_TEST_SHARED_WORLD=W (W >= 2) on a machine with a CUDA device")
    return _run_gpu_worker(tmp_path_factory, ",".join(SHARED_CASES), world=SHARED_WORLD, FLUX_GLOO_CUDA="1")


@pytest.mark.parametrize("name", SHARED_CASES)
def test_gpu_shared(gpu_shared_results, name):
    _check_gpu_case(gpu_shared_results, name)


TIMEOUT_STRATEGIES = ["decomposed", "fused", "fused:rs", "decomposed:ag:drop", "fused:ag:drop", "fused:rs:drop",
                      "decomposed:moetp:drop", "decomposed:moetp_rs:drop"]


@pytest.mark.parametrize("strategy", TIMEOUT_STRATEGIES)
def test_gpu_timeout(strategy):
    """A rank that skips a call: the others' bounded device-side waits fail within seconds and
    name the rank they waited for (FLUX_TIMEOUT_MS=2000), instead of hanging. The signal kernels
    print the message; a fused GEMM records it in host-mapped memory (timeout_report). With
    rank 1 missing altogether, the entry barrier's wait is the first to expire; ":drop": rank 1
    makes the call but sends nothing, so the fused kernels' own waits expire ("decomposed:moetp:drop",
    "decomposed:moetp_rs:drop": the TP MoE exchange's waits for rank 1's block in part 1, part 2).
    Every GPU takes part (at most 8)."""
    n = _gpu_world()
    if n < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    _check_timeout(strategy, n)


@pytest.mark.parametrize("strategy", [s for s in TIMEOUT_STRATEGIES if s.endswith(":drop")])
def test_gpu_timeout_shared(strategy):
    """test_gpu_timeout with FLUX_TEST_SHARED_WORLD ranks sharing the GPUs (see test_gpu_shared),
    the ":drop" cases only: ranks sharing a GPU talk over gloo, where every call first exchanges a
    header through the store (flux/ops/_checks.py), so a rank that skips the call leaves its
    peers in that host exchange (bounded by FLUX_CHECK_TIMEOUT_S), not in a device-side wait. bench/run_gpu.sh --shared leaves
    these out: select them with -k timeout_shared."""
    if SHARED_WORLD < 2 or not torch.cuda.is_available():
        pytest.skip("set FLUX_TEST_SHARED_WORLD=W (W >= 2) on a machine with a CUDA device")
    if strategy.startswith("fused") and SHARED_WORLD > 2 and SHARED_WORLD > torch.cuda.device_count():
        pytest.skip("ranks share a GPU at world size > 2: 'fused' runs 'decomposed' (flux/strategies.py)")
    if SHARED_WORLD > 4 * torch.cuda.device_count():
        # Seen with 6 and 8 ranks on one H200: every waiting rank's bounded wait expires and traps
        # (each prints the timeout naming rank 1), yet one of those processes never returns from the
        # CUDA runtime afterwards (the GPU idle, the others' errors delivered). A driver limit of
        # many contexts faulting at once on one GPU, not a wait of flux: with one rank per GPU the
        # trap is the only context fault on its device.
        pytest.skip(f"{SHARED_WORLD} ranks on {torch.cuda.device_count()} GPU(s): more than 4 contexts trapping at once "
                    "on one GPU leave one process inside the CUDA runtime (tests/test_ops.py)")
    _check_timeout(strategy, SHARED_WORLD, FLUX_GLOO_CUDA="1")


MISMATCH_STRATEGIES = ["decomposed:ag", "fused:rs", "sequential:rs"]


@pytest.mark.parametrize("strategy", MISMATCH_STRATEGIES)
def test_gpu_diverging_call(strategy):
    """Ranks that make different calls after both were planned (rank 0 problem A, the others
    problem B): the entry barrier's token check fails every rank at once, naming the other rank
    and both problems, long before the bounded waits' timeout (FLUX_TIMEOUT_MS=20000)."""
    import re

    from _dist import free_port

    n = _gpu_world()
    if n < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLUX_TIMEOUT_MS="20000")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={free_port()}",
           GPU_WORKER, f"mismatch:{strategy}"]
    out = _run_bounded(cmd, env, 180, f"mismatch:{strategy} at {n} ranks")
    for r in range(n):
        m = re.search(rf"FLUXMISMATCH rank {r} raised after ([0-9.]+) s", out)
        assert m, f"rank {r} did not fail:\n{out[-4000:]}"
        assert float(m.group(1)) < 15, f"rank {r} failed only after {m.group(1)} s (a timeout):\n{out[-4000:]}"
        assert re.search(rf"FLUXMISMATCH report rank {r}: flux: rank {r} and rank \d+ made different flux calls", out), \
            f"rank {r} did not record the differing calls:\n{out[-4000:]}"
    assert "made different flux calls" in out


def _run_bounded(cmd, env, seconds, what):
    """The output of ``cmd`` (torchrun and its ranks, one process group); past ``seconds`` the
    whole group is killed and the test fails with what the ranks printed so far (a rank stuck in
    tests/gpu_worker.py's timeout case dumps its stack before that: faulthandler)."""
    import signal

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=os.path.dirname(TESTS_DIR), start_new_session=True)
    try:
        return proc.communicate(timeout=seconds)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"{what}: not ended after {seconds} s; the ranks printed:\n{out[-6000:]}")


def test_run_bounded_kills_the_whole_group_and_reports_its_output():
    """The GPU timeout tests' runner (CPU): past its bound it kills torchrun's ranks too (none is
    left holding a GPU) and fails with what they printed."""
    import time

    child = "import subprocess, sys, time; print('started', flush=True); " \
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    assert _run_bounded([sys.executable, "-c", "print('ok')"], dict(os.environ), 30, "quick") == "ok\n"
    t0 = time.time()
    with pytest.raises(pytest.fail.Exception, match="slow: not ended after 2 s; the ranks printed:\nstarted"):
        _run_bounded([sys.executable, "-c", child], dict(os.environ), 2, "slow")
    assert time.time() - t0 < 30
    import shutil

    if shutil.which("pgrep"):
        left = subprocess.run(["pgrep", "-f", "time.sleep[(]60[)]"], capture_output=True, text=True).stdout.split()
        assert not left, f"processes of the killed group still run: {left}"


def _check_timeout(strategy, world, **extra_env):
    import re

    from _dist import free_port

    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLUX_TIMEOUT_MS="2000", **extra_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={free_port()}",
           GPU_WORKER, f"timeout:{strategy}"]
    out = _run_bounded(cmd, env, 180, f"timeout:{strategy} at {world} ranks")
    drop = strategy.endswith(":drop")
    for r in range(world):
        if r == 1:
            continue
        assert f"FLUXTIMEOUT rank {r} raised" in out, f"rank {r} did not fail:\n{out[-4000:]}"
        # Whom rank r waited for: rank 1, except in the fused RS ring with rank 1 sending nothing,
        # where each rank waits for its predecessor's partial (rank 2 for rank 1's, which never
        # comes, rank 3 for rank 2's, which is stuck, ..., rank 0 for rank W-1's).
        peer = (r - 1) % world if strategy == "fused:rs:drop" else 1
        if drop and strategy.startswith("fused"):  # the barrier passed: the fused kernel's own wait expired
            expect = rf"rank {r} timed out in a fused kernel waiting for rank {peer};"
        else:
            expect = rf"rank {r} timed out after \d+ ms in .* waiting for rank {peer} .*; rank {peer} did not make"
        assert re.search(expect, out), f"no timeout message of rank {r} naming rank {peer}:\n{out[-4000:]}"
    assert "did not make the same flux call" in out, out[-4000:]
