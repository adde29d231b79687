"""flux.nn in gloo processes: a sequence-parallel MLP (Column -> GELU -> Row) sharded from
two full nn.Linear layers computes, in float64, the same output rows and the same weight
and bias gradients (sliced to the shard) as the unsharded MLP."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flux.nn as fnn
from _dist import batches, case


@case("nn-mlp", worlds=(2, 4))
def _mlp(rank, world):
    torch.manual_seed(0)  # the same full layers on every rank
    s, b, h, f = 4 * world, 3, 12, 8 * world
    fc1 = nn.Linear(h, f).double()
    fc2 = nn.Linear(f, h).double()
    x = torch.randn(s, b, h, dtype=torch.float64)
    g = torch.randn(s, b, h, dtype=torch.float64)  # d loss / d y

    # Unsharded reference.
    xr = x.clone().requires_grad_()
    y_ref = fc2(F.gelu(fc1(xr)))
    (y_ref * g).sum().backward()

    col = fnn.ColumnParallelLinear.from_linear(fc1)
    row = fnn.RowParallelLinear.from_linear(fc2)
    xs = x.chunk(world, 0)[rank].clone().requires_grad_()
    y = row(F.gelu(col(xs)))
    (y * g.chunk(world, 0)[rank]).sum().backward()

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")

    close(y, y_ref.chunk(world, 0)[rank], "output rows")
    close(xs.grad, xr.grad.chunk(world, 0)[rank], "input gradient")
    close(col.weight.grad, fc1.weight.grad.chunk(world, 0)[rank], "fc1 weight gradient")
    close(col.bias.grad, fc1.bias.grad.chunk(world, 0)[rank], "fc1 bias gradient")
    close(row.weight.grad, fc2.weight.grad.chunk(world, 1)[rank], "fc2 weight gradient")
    # The replicated bias gets this rank's rows' share; the sum over ranks is the full gradient.
    db = row.bias.grad.clone()
    dist.all_reduce(db)
    close(db, fc2.bias.grad, "fc2 bias gradient (summed over ranks)")
    assert "per rank" in repr(col) and "per rank" in repr(row)
    return True


@case("nn-bad-size", worlds=(2,))
def _bad_size(rank, world):
    with pytest.raises(ValueError, match="not divisible by the group size"):
        fnn.ColumnParallelLinear(4, 5)
    with pytest.raises(ValueError, match="not divisible by the group size"):
        fnn.RowParallelLinear(5, 4)
    return True


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    return batches(__file__, "nn-", tmp_path_factory)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_mlp_matches_the_unsharded_mlp(batch, world):
    batch(world).assert_ok("nn-mlp")


def test_sizes_not_divisible_are_refused(batch):
    batch(2).assert_ok("nn-bad-size")
