"""Ranks that call different flux ops, or skip a call: every rank fails, within the check's bound
(FLUX_CHECK_TIMEOUT_S), with a FluxInputError naming both ops or the rank that did not come.

CPU part: gloo process groups of 2 and 4 ranks (tests/_dist.py). Rank 0 calls one op, the
others another, with tensors for which the two ops' argument fields coincide where they can
(x [16, 16], w [12, 16]): the op's identity, the first field of every signature and of every
check's header, is what tells them apart. Then every rank makes a good call on the same group to
show that it still works. A rank that skips a call (and stays alive) makes its peers fail after
FLUX_CHECK_TIMEOUT_S (2 s here, on a fresh group, which the skip leaves out of step).

GPU part (skipped without a CUDA device): tests/gpu_worker.py's "bad-ops-differ" case, two ranks
sharing the GPU over gloo (FLUX_GLOO_CUDA=1), three of the pairs with CUDA tensors.
"""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import flux
from _dist import case, case_names, run_batch
from _ref import rand

F32 = torch.float32
WORLDS = (2, 4)
SKIP_TIMEOUT_S = 2.0


def _ag(x, w, group=None):
    return flux.ag_gemm(x, w, group=group)


def _rs(x, w, group=None):
    return flux.gemm_rs(x, w, group=group)


def _moe(x, w, group=None):
    world = dist.get_world_size(group)
    idx = torch.stack([torch.arange(2) + r % world for r in range(x.shape[0])]) % (2 * world)
    return flux.moe_dispatch(x, idx, torch.ones(idx.shape), 2 * world, group=group)


def _tp_moe(x, w, group=None):
    world = dist.get_world_size(group)
    idx = torch.stack([torch.arange(2) + r for r in range(x.shape[0])]) % 4
    return flux.ag_scatter_grouped_mm(x, idx, rand((4, 12, 16), F32, 77), group=group)


OPS = {"ag_gemm": _ag, "gemm_rs": _rs, "moe_dispatch": _moe, "ag_scatter_grouped_mm": _tp_moe}
PAIRS = [("ag_gemm", "gemm_rs"), ("gemm_rs", "ag_gemm"), ("ag_gemm", "moe_dispatch"), ("moe_dispatch", "ag_gemm"),
         ("gemm_rs", "ag_scatter_grouped_mm"), ("ag_scatter_grouped_mm", "gemm_rs")]


def _expect_raise(fn):
    t0 = time.monotonic()
    try:
        fn()
    except flux.FluxInputError as e:
        return str(e), time.monotonic() - t0
    raise AssertionError("no FluxInputError was raised")


def _still_works(rank, world):
    xs = [rand((4, 16), F32, 900 + r) for r in range(world)]
    w = rand((12, 16), F32, 901)
    torch.testing.assert_close(flux.ag_gemm(xs[rank], w), torch.cat(xs) @ w.t(), rtol=1e-5, atol=1e-5)


def _pair_case(first, other, warm):
    def fn(rank, world):
        x, w = rand((16, 16), F32, 100 + rank), rand((12, 16), F32, 200)
        if warm:  # the same signature checked before: the per-call header must still catch it
            for _ in range(2):
                OPS[first](x, w)
        op = OPS[first] if rank == 0 else OPS[other]
        msg, _ = _expect_raise(lambda: op(x, w))
        assert f"rank 0 called flux.{first} but rank 1 called flux.{other}" in msg, msg
        _still_works(rank, world)
        return msg

    return fn


for _a, _b in PAIRS:
    case(f"mismatch-{_a}-vs-{_b}", worlds=WORLDS)(_pair_case(_a, _b, False))
case("mismatch-ag_gemm-vs-gemm_rs-after-checked-calls", worlds=WORLDS)(_pair_case("ag_gemm", "gemm_rs", True))


def _skip_case(op_name):
    """Rank 1 skips the call and stays alive; its peers fail after FLUX_CHECK_TIMEOUT_S, naming it."""
    def fn(rank, world):
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
        x, w = rand((16, 16), F32, 100 + rank), rand((12, 16), F32, 200)
        OPS[op_name](x, w, group=group)  # a checked call first: the skipped one is a repeat
        if rank == 1:
            return None
        old = os.environ.get("FLUX_CHECK_TIMEOUT_S")
        os.environ["FLUX_CHECK_TIMEOUT_S"] = str(SKIP_TIMEOUT_S)
        try:
            msg, took = _expect_raise(lambda: OPS[op_name](x, w, group=group))
        finally:
            if old is None:
                del os.environ["FLUX_CHECK_TIMEOUT_S"]
            else:
                os.environ["FLUX_CHECK_TIMEOUT_S"] = old
        assert "rank 1 did not reach a flux call" in msg and f"FLUX_CHECK_TIMEOUT_S={SKIP_TIMEOUT_S:g}" in msg, msg
        # The check raises within FLUX_CHECK_TIMEOUT_S; a loose margin here (a loaded machine), which
        # the default bound (60 s) would still be far past.
        assert took < 10 * SKIP_TIMEOUT_S + 10, f"failed only after {took:.1f} s"
        return msg

    return fn


for _op in ("ag_gemm", "gemm_rs", "moe_dispatch"):
    case(f"skip-{_op}", worlds=WORLDS)(_skip_case(_op))


@case("skip-unplanned-cuda-group", worlds=(2,))
def _skip_unplanned_cuda_group(rank, world):
    """A CUDA group on which no call can be planned (no flux._C or no symmetric workspace), stood in
    for by a gloo group whose header path is the CUDA groups': a repeated call still exchanges the
    bounded header, so a rank that skips it makes its peer fail within FLUX_CHECK_TIMEOUT_S."""
    from flux.ops import _checks

    _checks._carries_header = lambda group: False  # as on an NCCL group
    assert _checks._header_every_call(dist.group.WORLD, _checks._no_symm(dist.group.WORLD))  # no flux._C here
    return _skip_case("ag_gemm")(rank, world)


@case("skip-peer-in-another-op", worlds=(2,))
def _peer_in_other_op(rank, world):
    """On CUDA groups a first call's store exchange and an MoE op's header all-gather cannot meet;
    both time out, post the op they are in, and read each other's. Here rank 1 posts as its
    timed-out check would (no CUDA group on this machine): rank 0's error names both ops."""
    from flux.ops import _checks

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    x, w = rand((16, 16), F32, 100 + rank), rand((12, 16), F32, 200)
    old = os.environ.get("FLUX_CHECK_TIMEOUT_S")
    os.environ["FLUX_CHECK_TIMEOUT_S"] = str(SKIP_TIMEOUT_S)
    try:
        if rank == 1:
            time.sleep(0.7 * SKIP_TIMEOUT_S)  # posted before rank 0 reads (from 0.8 of the bound on)
            ranks = tuple(dist.get_process_group_ranks(group))
            return _checks._timed_out("flux.moe_dispatch", _checks._group_key(group, ranks), ranks, 1, [0],
                                      SKIP_TIMEOUT_S, True)
        msg, _ = _expect_raise(lambda: flux.ag_gemm(x, w, group=group))
    finally:
        if old is None:
            del os.environ["FLUX_CHECK_TIMEOUT_S"]
        else:
            os.environ["FLUX_CHECK_TIMEOUT_S"] = old
    assert "rank 0 called flux.ag_gemm but rank 1 called flux.moe_dispatch" in msg, msg
    return msg


@case("mismatch-hint-kn-weight", worlds=(2,))
def _kn_hint(rank, world):
    """A [K, N] weight passed with the default layout 'nk': the message names weight_layout='kn'."""
    x, w = rand((4, 16), F32, 100 + rank), rand((16, 12), F32, 200)
    msg, _ = _expect_raise(lambda: flux.ag_gemm(x, w))
    assert "weight_layout='kn'" in msg, msg
    torch.testing.assert_close(flux.ag_gemm(x, w, weight_layout="kn"),
                               torch.cat([rand((4, 16), F32, 100 + r) for r in range(world)]) @ w)
    return msg


# --------------------------------------------------------------------------------------
# pytest side

@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    done = {}

    def get(world):
        if world not in done:
            names = [n for n in case_names(world) if n.startswith(("mismatch-", "skip-"))]
            done[world] = run_batch(__file__, world, names, str(tmp_path_factory.mktemp(f"mismatch{world}")),
                                    timeout_s=240, env={"FLUX_CHECK_TIMEOUT_S": "30"})
        return done[world]

    return get


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("pair", [f"{a}-vs-{b}" for a, b in PAIRS] + ["ag_gemm-vs-gemm_rs-after-checked-calls"])
def test_mismatched_ops(batch, world, pair):
    msgs = batch(world).assert_ok(f"mismatch-{pair}")
    assert all(m == msgs[0] for m in msgs), f"the ranks' messages differ: {msgs}"


def test_skipped_call_on_an_unplanned_cuda_group(batch):
    msgs = batch(2).assert_ok("skip-unplanned-cuda-group")
    assert msgs[1] is None and msgs[0]


def test_peer_in_another_op_is_named(batch):
    batch(2).assert_ok("skip-peer-in-another-op")  # rank 0's error names both ops (asserted in the case)


def test_wrong_layout_names_kn(batch):
    msgs = batch(2).assert_ok("mismatch-hint-kn-weight")
    assert all(m == msgs[0] for m in msgs), msgs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "moe_dispatch"])
def test_skipped_call(batch, world, op):
    msgs = batch(world).assert_ok(f"skip-{op}")
    assert msgs[1] is None and all(m for r, m in enumerate(msgs) if r != 1)


def test_gpu_mismatched_ops_shared(tmp_path_factory):
    """The pairs above with CUDA tensors, two ranks sharing the GPU over gloo (FLUX_GLOO_CUDA=1)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import json

    from _dist import run_torchrun

    out_dir = tmp_path_factory.mktemp("gpu-mismatch")
    rc, output = run_torchrun(os.path.join(os.path.dirname(__file__), "gpu_worker.py"), ["bad-ops-differ"], 2, out_dir,
                              300, "gpu-bad-ops-differ.log", FLUX_GLOO_CUDA="1", FLUX_CHECK_TIMEOUT_S="20")
    recs = {}
    for rank in range(2):
        path = out_dir / f"results.{rank}"
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                recs[rec["rank"]] = rec
    assert sorted(recs) == [0, 1], f"ranks {sorted(recs)} reported (exit {rc}):\n{output}"
    bad = {r: rec["error"] for r, rec in recs.items() if rec["status"] == "fail"}
    assert not bad, bad
    assert all(rec["status"] == "ok" for rec in recs.values()), recs
    assert recs[0]["value"] == recs[1]["value"] and len(recs[0]["value"]) == 3, recs
