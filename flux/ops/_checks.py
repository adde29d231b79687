"""Input checking at the op boundary, identical on every rank.

Each op builds a *signature* of its arguments on every rank: the shapes, dtypes and
options that must agree across the group, plus a local verdict (an error message, or
none). Before any data moves the ranks exchange their signatures in one small
all-gather; if any rank found an error, or the signatures differ, every rank raises the
same FluxInputError naming the op and the offending ranks. So a bad input on one rank
can never leave the others waiting in a collective.

The exchange runs on a gloo group of the same ranks, created once per group on the
first call, so it never synchronises the GPU and can never be matched against the
op's own data movement. A signature that passed is remembered per group, and later
calls with the same signature skip the exchange: the remembered set is the same on every
rank (entries are added together, after an exchange), so identical calls take the same
path everywhere. A rank whose signature is new while its peers' are remembered waits in
the exchange alone and raises after FLUX_CHECK_TIMEOUT_S seconds (default 60); its peers
then fail in their own communication (a bounded wait naming the missing rank, or the NCCL
watchdog). Set FLUX_CHECK_EVERY_CALL=1 to exchange on every call, which catches such drift
immediately at the cost of one host-side all-gather per call.
"""
import datetime
import os
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist


_SIG_LEN = 40  # int64 fields per signature; long enough for 16-D inputs
_validated: Dict[Tuple[int, ...], Set[Tuple[int, ...]]] = {}  # group ranks -> signatures
_check_groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}


class FluxInputError(ValueError):
    """Raised, identically on every rank of the group, when an op's arguments are invalid
    on some rank or disagree between ranks."""


_DTYPE_CODES = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
    torch.int32: 5, torch.int64: 6, torch.int8: 7, torch.uint8: 8,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = 9 + len(_DTYPE_CODES)


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    if dtype is None:
        return 0
    return _DTYPE_CODES.get(dtype, 99)


class Signature:
    """Collects the fields that must agree between ranks, under readable names."""

    def __init__(self, op: str):
        self.op = op
        self.fields: List[Tuple[str, int]] = []
        self.error: Optional[str] = None

    def add(self, name: str, value: int) -> None:
        self.fields.append((name, int(value)))

    def add_shape(self, name: str, shape: Sequence[int]) -> None:
        self.add(f"{name}.dim()", len(shape))
        for i, s in enumerate(shape):
            self.add(f"{name}.shape[{i}]", s)

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message

    def values(self) -> Tuple[int, ...]:
        vals = [1 if self.error else 0] + [v for _, v in self.fields]
        if len(vals) > _SIG_LEN:
            self.fail(f"too many dimensions to check ({len(self.fields)} signature fields)")
            vals = [1] + [0] * (_SIG_LEN - 1)
        return tuple(vals + [-7] * (_SIG_LEN - len(vals)))


def _check_group(group: dist.ProcessGroup) -> Tuple[Tuple[int, ...], dist.ProcessGroup]:
    """The gloo group, of the same ranks as ``group``, on which signatures are exchanged."""
    ranks = tuple(dist.get_process_group_ranks(group))
    side = _check_groups.get(ranks)
    if side is None:
        timeout = datetime.timedelta(seconds=float(os.environ.get("FLUX_CHECK_TIMEOUT_S", "60")))
        # use_local_synchronization: only the members of ``group`` take part, so a
        # tensor-parallel subgroup can create it on its first call.
        side = dist.new_group(list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
        _check_groups[ranks] = side
    return ranks, side


def check_collectively(sig: Signature, group: dist.ProcessGroup) -> None:
    """Raise the same FluxInputError on every rank if any rank's signature has an error
    or the signatures differ; return normally on every rank otherwise."""
    values = sig.values()
    key, side = _check_group(group)
    if os.environ.get("FLUX_CHECK_EVERY_CALL", "0") != "1" and values in _validated.get(key, ()):
        return
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = torch.empty((world, _SIG_LEN), dtype=torch.int64)
    try:
        dist.all_gather(list(gathered.unbind(0)), mine, group=side)
    except RuntimeError as e:
        raise FluxInputError(
            f"{sig.op}: the argument check across ranks did not complete ({e}); some rank did not make "
            "this call, or made it with arguments that its peers had already used") from e
    rows = [tuple(r) for r in gathered.tolist()]
    if not any(r[0] != 0 for r in rows) and all(r == rows[0] for r in rows):
        _validated.setdefault(key, set()).add(values)
        return
    # Some rank failed: every rank got here, so a second exchange is safe.
    reports: List[Optional[Tuple[Optional[str], List[Tuple[str, int]]]]] = [None] * world
    dist.all_gather_object(reports, (sig.error, sig.fields), group=side)
    raise FluxInputError(_compose(sig.op, reports))


def _compose(op: str, reports) -> str:
    errs = [f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e]
    if errs:
        return f"{op}: invalid arguments on " + "; ".join(errs)
    # No local error, so the ranks disagree: name the first differing field.
    base = reports[0][1]
    for r, (_, fields) in enumerate(reports[1:], start=1):
        if fields != base:
            for i in range(max(len(base), len(fields))):
                a = base[i] if i < len(base) else ("<absent>", None)
                b = fields[i] if i < len(fields) else ("<absent>", None)
                if a != b:
                    name = a[0] if a[0] == b[0] else f"{a[0]} / {b[0]}"
                    return (f"{op}: arguments differ between ranks: {name} is {a[1]} on rank 0 "
                            f"but {b[1]} on rank {r} (every rank must pass the same shapes, dtypes and options)")
    return f"{op}: arguments differ between ranks"


def reset_cache() -> None:
    """Forget remembered signatures (tests)."""
    _validated.clear()
