"""Helpers shared by the CPU tests (tests/test_*.py) and the GPU worker (tests/gpu_worker.py):
deterministic inputs, the tolerance rule, the check of a FluxInputError's message, and the count
of a GEMM op's slow-path calls.

Tolerance: an op's output is compared with a float64 reference by relative norm error, and
must be within twice the error of the same-precision unfused baseline (the result computed
the plain way in the op's dtype) plus a small floor per dtype.
"""
import contextlib

import torch

# Floor of the relative error allowed above 2x the same-precision baseline, by output dtype.
EPS = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 5e-4}


def rand(shape, dtype, seed, device="cpu"):
    """Deterministic random values (never zeros), the same on every rank for a seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32).to(dtype)


def w_nk(w, layout):
    """The weight as [N, K] whatever its layout."""
    return w if layout == "nk" else w.t()


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def check_against(out, ref, base, what):
    """``out`` and ``base`` (the same-precision unfused result) against the float64 ``ref``;
    returns (error, baseline error)."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert not torch.isnan(out).any().item(), f"{what}: NaN in the output"
    err, berr = rel_err(out, ref), rel_err(base, ref)
    eps = EPS[out.dtype]
    assert err <= 2 * berr + eps, f"{what}: relative error {err:.3g} > 2 * baseline {berr:.3g} + {eps:g}"
    return err, berr


def expect_flux_error(fn, op, *fragments):
    """Call ``fn``, which must raise flux.FluxInputError with a message that starts with
    ``op + ":"`` and contains every fragment; return the message."""
    import flux

    try:
        fn()
    except flux.FluxInputError as err:
        msg = str(err)
    else:
        raise AssertionError("no FluxInputError was raised")
    assert msg.startswith(op + ":"), f"message does not start with the op name: {msg!r}"
    for f in fragments:
        assert f in msg, f"expected {f!r} in {msg!r}"
    return msg


@contextlib.contextmanager
def slow_path_calls(op: str):
    """A list that gets one entry per call of ``op``'s ("ag" / "rs") slow path (its GemmOp's
    ``slow``, flux/ops/_gemm_op.py) while the block runs."""
    import flux.ops.ag_gemm
    import flux.ops.gemm_rs

    gemm_op = flux.ops.ag_gemm._AG if op == "ag" else flux.ops.gemm_rs._RS
    seen = []
    orig = gemm_op.slow
    gemm_op.slow = lambda *a, **k: (seen.append(1), orig(*a, **k))[1]
    try:
        yield seen
    finally:
        del gemm_op.slow
