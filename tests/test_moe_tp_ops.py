"""The dispatcher ops of the tensor-parallel MoE functions (flux/ops/moe/tp.py):
``torch.ops.flux.ag_scatter_grouped_mm`` / ``grouped_mm_gather_rs`` and their backward ops pass
``torch.library.opcheck`` and agree with the eager path, forward and gradients, in-process on a
one-rank gloo group (CPU, float64). The multi-rank behaviour is tests/test_moe_tp.py's."""
import tempfile

import pytest
import torch
import torch.distributed as dist

import flux
from flux.ops import moe_tp  # noqa: F401  (imported on first use: it defines the ops)
from flux.runtime import group_name

F64 = torch.float64
T, H, E, K, N = 6, 8, 4, 2, 10


@pytest.fixture(scope="module")
def group():
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(tempfile.mktemp(prefix="flux-moe-tp-ops-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a one-rank process group")
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=gen, dtype=F64)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[1, 1] = -1  # an unused slot
    w1 = torch.randn((E, N, H), generator=gen, dtype=F64)
    w2 = torch.randn((E, H, N), generator=gen, dtype=F64)
    tw = torch.rand((T, K), generator=gen, dtype=F64)
    return x, idx, w1, w2, tw


def test_opcheck(group):
    x, idx, w1, w2, tw = _problem()
    gname = group_name(group)
    args1 = (x.requires_grad_(), idx, w1.requires_grad_(), gname, "nk")
    torch.library.opcheck(torch.ops.flux.ag_scatter_grouped_mm, args1,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))
    h, idx_g, pairs, sc = torch.ops.flux.ag_scatter_grouped_mm(*args1)
    assert sc.device.type == "cpu" and sc.tolist() == torch.bincount(idx[idx >= 0], minlength=E).tolist()
    args2 = (h.detach().requires_grad_(), w2.requires_grad_(), tw.requires_grad_(), idx_g, pairs, sc, gname, "nk")
    torch.library.opcheck(torch.ops.flux.grouped_mm_gather_rs, args2,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))
    g1 = torch.randn(h.shape, dtype=F64)
    torch.library.opcheck(torch.ops.flux.ag_scatter_grouped_mm_backward,
                          (g1, x.detach(), w1.detach(), idx_g, pairs, sc, gname, "nk", True, True),
                          test_utils=("test_schema", "test_faketensor"))
    g2 = torch.randn((T, H), dtype=F64)
    torch.library.opcheck(torch.ops.flux.grouped_mm_gather_rs_backward,
                          (g2, h.detach(), w2.detach(), tw.detach(), idx_g, pairs, sc, gname, "nk", True, True, True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_ops_match_eager(group, layout):
    """The whole MLP through the ops (forward and every gradient) equals the eager functions."""
    x, idx, w1, w2, tw = _problem(1)
    if layout == "kn":
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    gname = group_name(group)

    def run(use_ops):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, tw)]
        xx, a, b, w = leaves
        if use_ops:
            h, idx_g, pairs, sc = torch.ops.flux.ag_scatter_grouped_mm(xx, idx, a, gname, layout)
            out = torch.ops.flux.grouped_mm_gather_rs(torch.tanh(h), b, w, idx_g, pairs, sc, gname, layout)
        else:
            h, routing = flux.ag_scatter_grouped_mm(xx, idx, a, weight_layout=layout)
            out = flux.grouped_mm_gather_rs(torch.tanh(h), b, routing, w, weight_layout=layout)
        dout = torch.linspace(-1, 1, out.numel(), dtype=F64).view(out.shape)
        return [out.detach()] + list(torch.autograd.grad(out, leaves, dout))

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_public_functions_take_the_ops_under_a_mode(group):
    """Under a torch-function mode (as under torch.compile) the public functions call the ops and
    still return the routing object part 2 takes."""
    x, idx, w1, w2, tw = _problem(2)
    h_eager, r_eager = flux.ag_scatter_grouped_mm(x, idx, w1)
    out_eager = flux.grouped_mm_gather_rs(h_eager, w2, r_eager, tw)

    class Count(torch.overrides.TorchFunctionMode):
        calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Count():
        h, routing = flux.ag_scatter_grouped_mm(x, idx, w1)
        out = flux.grouped_mm_gather_rs(h, w2, routing, tw)
    assert torch.equal(h, h_eager) and torch.equal(out, out_eager)
    assert routing.counts_host == r_eager.counts_host and torch.equal(routing.pairs, r_eager.pairs)
