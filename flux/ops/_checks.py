"""Input checking at the op boundary, identical on every rank.

Each op builds a *signature* of its arguments on every rank: the shapes, dtypes and
options that must agree across the group, plus a local verdict (an error message, or
none). Before any data moves the ranks exchange their signatures in one small
all-gather; if any rank found an error, or the signatures differ, every rank raises the
same FluxInputError naming the op and the offending ranks. So a bad input on one rank
can never leave the others waiting in a collective.

The exchange goes through the store of the default process group (the rendezvous key-value
store every rank already holds), so it never synchronises the GPU, creates no process group
(group creation is a world-wide collective that a tensor-parallel subgroup cannot make on
its own), and can never be matched against the op's own data movement. A signature that
passed is remembered per group, and later calls with the same signature skip the exchange:
the remembered set is the same on every rank (entries are added together, after an
exchange), so identical calls take the same path everywhere. Ranks that diverge after a
checked call are still caught: on gloo groups by a hash of the signature that every call
all-gathers first, on CUDA groups by the token that the entry barrier of every planned call
carries (csrc/runtime/signals.cu), which makes every rank fail at once. A rank whose
signature is new while its peers replay a planned call waits in the exchange and raises after
FLUX_CHECK_TIMEOUT_S seconds (default 60), its peers' bounded barrier after FLUX_TIMEOUT_MS.
Set FLUX_CHECK_EVERY_CALL=1 to exchange on every call (and make no plans), at the cost of a
few store round trips per call.
"""
import datetime
import os
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist


_SIG_LEN = 40  # int64 fields per signature; long enough for 16-D inputs
_validated: Dict[Tuple[int, ...], Set[Tuple[int, ...]]] = {}  # group ranks -> signatures


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


_CODE_NAMES = {v: str(k).replace("torch.", "") for k, v in _DTYPE_CODES.items()}


def describe(name: str, value: int) -> str:
    """A signature field's value as a person reads it."""
    if name.endswith("dtype"):
        return "None" if value == 0 else _CODE_NAMES.get(value, f"dtype #{value}")
    if name == "weight_layout":
        return {0: "'nk'", 1: "'kn'"}.get(value, "invalid")
    if name.endswith("is given") or name == "tunes now":
        return str(bool(value))
    if name == "strategy":
        return (f"candidate #{value} (the ranks' FLUX_STRATEGY_* settings or autotune caches differ; "
                "see docs/tuning.md)")
    return str(value)


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


_exchange_seq: Dict[Tuple[int, ...], int] = {}


def _exchange(ranks: Tuple[int, ...], me: int, payload) -> List:
    """All-gather of small picklable values among ``ranks`` through the default store."""
    import pickle

    store = dist.distributed_c10d._get_default_store()
    seq = _exchange_seq.get(ranks, 0)
    _exchange_seq[ranks] = seq + 1
    prefix = f"flux/check/{'-'.join(map(str, ranks))}/{seq}/"
    store.set(prefix + str(me), pickle.dumps(payload))
    keys = [prefix + str(r) for r in ranks]
    store.wait(keys, datetime.timedelta(seconds=float(os.environ.get("FLUX_CHECK_TIMEOUT_S", "60"))))
    values = [pickle.loads(store.get(k)) for k in keys]
    # Every rank has read every key once the next exchange of this group completes (each
    # rank sets its next key only after reading all of these), so the previous round's
    # own key can go.
    if seq > 0:
        try:
            store.delete_key(f"flux/check/{'-'.join(map(str, ranks))}/{seq - 1}/{me}")
        except Exception:  # stores without delete support
            pass
    return values


def _headers_agree(values: Tuple[int, ...], group: dist.ProcessGroup) -> bool:
    """All-gather a hash of each rank's signature through the group itself (gloo, on the CPU):
    True when every rank's is the same."""
    import zlib

    mine = torch.tensor([zlib.crc32(repr(values).encode())], dtype=torch.int64)
    headers = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(headers, mine, group=group)
    return all(int(h) == int(mine) for h in headers)


def _carries_header(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def check_collectively(sig: Signature, group: dist.ProcessGroup) -> None:
    """Raise the same FluxInputError on every rank if any rank's signature has an error
    or the signatures differ; return normally on every rank otherwise.

    On gloo groups every call first all-gathers a hash of its signature through the group (a
    header before the data): a rank whose call differs from its peers' is found at once, on
    every rank, whether or not the peers' call was checked before; all ranks then make the full
    exchange, which names the field that differs. (On CUDA groups the entry barrier of every
    planned call carries the same check: flux/ops/_plans.py.)"""
    values = sig.values()
    ranks = tuple(dist.get_process_group_ranks(group))
    every = os.environ.get("FLUX_CHECK_EVERY_CALL", "0") == "1"
    known = values in _validated.get(ranks, ())
    if not every and _carries_header(group):
        if _headers_agree(values, group) and known:
            return
    elif not every and known:
        return
    try:
        reports = _exchange(ranks, dist.get_rank(), (values, sig.error, sig.fields))
    except RuntimeError as e:  # the store's wait timed out
        raise FluxInputError(
            f"{sig.op}: the argument check across ranks did not complete ({e}); some rank did not make "
            "this call, or made it with arguments that its peers had already used") from e
    if not any(err for _, err, _ in reports) and all(v == values for v, _, _ in reports):
        _validated.setdefault(ranks, set()).add(values)
        return
    raise FluxInputError(_compose(sig.op, [(err, fields) for _, err, fields in reports]))


def check_every_call(sig: Signature, group: dist.ProcessGroup, flag: Optional[torch.Tensor] = None,
                     flag_message=None) -> None:
    """The check of ops that exchange something on every call anyway (the MoE ops): one
    all-gather through the group of (error flag, hash of the fields that must agree), read on the
    host. ``flag``: a data verdict computed on the device (an int64 scalar, 0: valid), added to
    this rank's error flag when its arguments are otherwise valid; ``flag_message()``: this rank's
    error text when its flag was set. If any rank reports a problem or a different hash, the ranks
    exchange their messages through the store and every rank raises the same FluxInputError."""
    import zlib

    from flux.runtime import all_gather_dim0, group_device

    h = zlib.crc32(repr(sig.fields).encode())
    mine = torch.tensor([[1 if sig.error else 0, h]], dtype=torch.int64, device=group_device(group))
    if sig.error is None and flag is not None:
        mine[0, 0] += flag.to(mine.device)
    verdicts = all_gather_dim0(mine, group).tolist()
    if all(v[0] == 0 and v[1] == h for v in verdicts):
        return
    if sig.error is None and verdicts[dist.get_rank(group)][0]:
        sig.fail((flag_message() if flag_message is not None else None) or "invalid data")
    ranks = tuple(dist.get_process_group_ranks(group))
    reports = _exchange(ranks, dist.get_rank(), (sig.values(), sig.error, sig.fields))
    raise FluxInputError(_compose(sig.op, [(err, fields) for _, err, fields in reports]))


def skips_exchange_if_valid(sig: Signature, group: dist.ProcessGroup) -> bool:
    """Whether ``check_collectively`` would skip the exchange for this signature were it free of
    local errors: a CUDA group (no per-call header), the same fields validated before, and
    FLUX_CHECK_EVERY_CALL off. Then peers making the same call without an error skip it too, and a
    rank with a local error must report it some other way than the store exchange, which its
    peers would never join (flux/ops/moe.py's deferred verdict does)."""
    if os.environ.get("FLUX_CHECK_EVERY_CALL", "0") == "1" or _carries_header(group):
        return False
    values = (0,) + tuple(sig.values()[1:])
    return values in _validated.get(tuple(dist.get_process_group_ranks(group)), ())


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
                    va = describe(a[0], a[1]) if a[1] is not None else "absent"
                    vb = describe(b[0], b[1]) if b[1] is not None else "absent"
                    return (f"{op}: arguments differ between ranks: {name} is {va} on rank 0 "
                            f"but {vb} on rank {r} (every rank must pass the same shapes, dtypes and options)")
    return f"{op}: arguments differ between ranks"


def reset_cache() -> None:
    """Forget remembered signatures (tests; call it on every rank alike)."""
    _validated.clear()
