"""The layers' weight initialisation: a seed shared by the group's ranks, and matrices whose every
line depends only on (seed, line), so that a shard of any group size is the same slice of the same
full matrix."""
from typing import Optional

import torch
import torch.distributed as dist


def _shared_seed(seed: Optional[int], group: dist.ProcessGroup) -> int:
    """``seed``, or the group's first rank's draw from its default generator (broadcast, so that
    the ranks need not share a seed)."""
    if seed is not None:
        return int(seed)
    box = [int(torch.randint(0, 2 ** 62, (1,)).item())]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def uniform_lines(seed: int, first: int, count: int, length: int, bound: float) -> torch.Tensor:
    """Lines ``first .. first + count`` of a [lines, length] matrix of U(-bound, bound) values in
    which line i depends only on (seed, i): a shard of any group size is the same slice of the
    same full matrix, made without making the rest of it (float32, CPU)."""
    out = torch.empty(count, length)
    gen = torch.Generator()
    for i in range(count):
        gen.manual_seed((seed * 1_000_003 + first + i) % (2 ** 63))
        out[i].uniform_(-bound, bound, generator=gen)
    return out
