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


@case("nn-init-shard-only", worlds=(2, 4))
def _init_shard_only(rank, world):
    """The constructors draw only this rank's shard, and for a seed the shards of any group size
    are slices of the same full layer (the full layer made here without a group); nn.Linear's
    bound; ``import flux`` alone reaches flux.nn."""
    import math

    import flux
    from flux.nn import uniform_lines

    h, f, seed = 12, 8 * 4, 1234
    col = flux.nn.ColumnParallelLinear(h, f, seed=seed)
    row = flux.nn.RowParallelLinear(f, h, seed=seed)
    assert col.weight.shape == (f // world, h) and row.weight.shape == (h, f // world)
    full_w1 = uniform_lines(seed, 0, f, h, 1 / math.sqrt(h))          # [f, h], line = output row
    full_w2 = uniform_lines(seed, 0, f, h, 1 / math.sqrt(f)).t()      # [h, f], line = input column
    full_b1 = uniform_lines(seed ^ 0x5BD1E995, 0, 1, f, 1 / math.sqrt(h))[0]
    full_b2 = uniform_lines(seed ^ 0x5BD1E995, 0, 1, h, 1 / math.sqrt(f))[0]
    assert torch.equal(col.weight.data, full_w1.chunk(world, 0)[rank])
    assert torch.equal(col.bias.data, full_b1.chunk(world, 0)[rank])
    assert torch.equal(row.weight.data, full_w2.chunk(world, 1)[rank])
    assert torch.equal(row.bias.data, full_b2)
    assert float(full_w1.abs().max()) <= 1 / math.sqrt(h) and float(full_w1.std()) > 0.5 / math.sqrt(3 * h)
    # No seed: only the group's first rank's generator decides (it draws the seed and broadcasts
    # it), so ranks seeded differently still build one layer, and the replicated bias agrees.
    torch.manual_seed(100 + rank)
    a = flux.nn.RowParallelLinear(f, h)
    torch.manual_seed(100 if rank == 0 else 999)
    b = flux.nn.RowParallelLinear(f, h)
    assert torch.equal(a.weight.data, b.weight.data) and torch.equal(a.bias.data, b.bias.data)
    biases = [torch.empty_like(a.bias.data) for _ in range(world)]
    dist.all_gather(biases, a.bias.data)
    assert all(torch.equal(x, biases[0]) for x in biases), "the replicated bias differs between ranks"
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


@pytest.mark.parametrize("world", [2, 4])
def test_layers_draw_only_their_shard_the_same_at_any_group_size(batch, world):
    batch(world).assert_ok("nn-init-shard-only")


def test_sizes_not_divisible_are_refused(batch):
    batch(2).assert_ok("nn-bad-size")
