"""Input checking at the op boundary, identical on every rank.

Each op builds a *signature* of its arguments on every rank: the op's identity (first field),
the shapes, dtypes and options that must agree across the group, and a local verdict (an error
message, or none). Before any data moves the ranks compare them; if any rank found an error, the
ops differ, or the signatures differ, every rank raises the same FluxInputError naming the op(s)
and the offending ranks ("rank 0 called flux.ag_gemm but rank 1 called flux.gemm_rs").

Every op's check starts with the same fixed-format *header* (op code, hash of the signature,
error flag), so any two flux ops meet in the same exchange. On gloo groups the header goes
through the default group's store on every call; on CUDA groups a signature's first call makes
the full store exchange, the MoE ops (check_every_call) all-gather the header through the group
and wait for it with a bound, and planned calls are checked by the token of their entry barrier
(csrc/runtime/signals.cu, bounded by FLUX_TIMEOUT_MS). Every host wait is bounded by
FLUX_CHECK_TIMEOUT_S (default 60): past it each waiting rank posts which op it is in, reads its
peers' posts, and raises naming the ranks that did not arrive and the ops they are in, if any.
The store never synchronises the GPU, creates no process group and can never be matched against
an op's own data movement. A signature that passed is remembered per group (the set is the same
on every rank), so a planning CUDA group's repeated calls make no store traffic; a CUDA group
that cannot plan (no flux._C, no symmetric memory) exchanges the bounded header on every call,
as gloo groups do. FLUX_CHECK_EVERY_CALL=1 exchanges the full signature on every call (and
makes no plans).
After a timeout the group's collectives may be out of step: recreate it.
"""
import datetime
import pickle
import time
import zlib
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from flux import envs
from flux.strategies import DTYPE_CODES


_SIG_LEN = 40  # int64 fields per signature; long enough for 16-D inputs
_validated: Dict[Tuple[int, ...], Set[Tuple[int, ...]]] = {}  # group ranks -> signatures
# Op codes of the header: fixed, so that a rank can name an op it has not called itself.
OP_CODES = {"flux.ag_gemm": 1, "flux.gemm_rs": 2, "flux.moe_dispatch": 3, "flux.moe_combine": 4,
            "flux.ag_scatter_grouped_mm": 5, "flux.grouped_mm_gather_rs": 6, "flux.gemm_ar": 7}
_OP_NAMES = {v: k for k, v in OP_CODES.items()}
_GRACE_S = 5.0  # at most this long (and a fifth of the bound) a timed-out rank reads its peers' posts


def op_code(op: str) -> int:
    """The header's code of ``op`` (ops outside the table: a 31-bit hash of the name, >= 64)."""
    return OP_CODES.get(op) or 64 + (zlib.crc32(op.encode()) & 0x3FFFFFFF)


def op_name(code: int) -> str:
    return _OP_NAMES.get(int(code), f"flux op #{int(code)}")


class FluxInputError(ValueError):
    """Raised, identically on every rank of the group, when an op's arguments are invalid
    on some rank or disagree between ranks."""


_CODE_NAMES = {v: str(k).replace("torch.", "") for k, v in DTYPE_CODES.items()}  # -1: "None"


def describe(name: str, value: int) -> str:
    """A signature field's value as a person reads it."""
    if name == "op":
        return op_name(value)
    if name.endswith("dtype"):
        return _CODE_NAMES.get(value, f"dtype #{value}")
    if name == "weight_layout":
        return {0: "'nk'", 1: "'kn'"}.get(value, "invalid")
    if name.endswith("is given") or name == "tunes now":
        return str(bool(value))
    if name == "strategy":
        return (f"candidate #{value} (the ranks' FLUX_STRATEGY_* settings or autotune caches differ; "
                "see docs/tuning.md)")
    return str(value)


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """The dtype's code in a signature: flux.strategies.DTYPE_CODES (c10::ScalarType; -1: None)."""
    return DTYPE_CODES.get(dtype, 99)


class Signature:
    """Collects the fields that must agree between ranks, under readable names; the first is
    the op's code, so that signatures of different ops never compare equal."""

    def __init__(self, op: str):
        self.op = op
        self.fields: List[Tuple[str, int]] = [("op", op_code(op))]
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
            vals = [1, op_code(self.op)] + [0] * (_SIG_LEN - 2)
        return tuple(vals + [-7] * (_SIG_LEN - len(vals)))

    def header(self, flag: int = 0) -> Tuple[int, int, int]:
        """(op code, hash of the fields, error flag): the fixed-format start of every check."""
        return (op_code(self.op), zlib.crc32(repr(self.fields).encode()), 1 if (self.error or flag) else 0)


def check_timeout_s() -> float:
    return envs.CHECK_TIMEOUT_S.get()


def _wait_s(timeout: float) -> float:
    """How long a check waits for its peers: the bound less the time it then takes to read their
    posts (_timed_out), so that a failing check raises within FLUX_CHECK_TIMEOUT_S."""
    return timeout - _grace_s(timeout)


def _grace_s(timeout: float) -> float:
    return min(_GRACE_S, 0.2 * timeout)


# --------------------------------------------------------------------------------------
# The store exchange (bounded)

_exchange_seq: Dict[str, int] = {}


def _group_key(group: Optional[dist.ProcessGroup], ranks: Tuple[int, ...]) -> str:
    """The store prefix of a group: its name (the same on every member, distinct for two groups
    of the same ranks), else its ranks."""
    name = None
    if group is not None:
        try:
            name = dist.distributed_c10d._get_process_group_name(group)
        except Exception:  # torch versions without group names
            name = None
    return name or "-".join(map(str, ranks))


def _gather_store(ranks: Tuple[int, ...], me: int, payload, op: str, group=None) -> List:
    """All-gather of small picklable values among ``ranks`` through the default store, each wait
    bounded by FLUX_CHECK_TIMEOUT_S (past it: FluxInputError naming the ranks that did not come)."""
    store = dist.distributed_c10d._get_default_store()
    gkey = _group_key(group, ranks)
    seq = _exchange_seq.get(gkey, 0)
    _exchange_seq[gkey] = seq + 1
    prefix = f"flux/check/{gkey}/{seq}/"
    store.set(prefix + str(me), pickle.dumps(payload))
    keys = [prefix + str(r) for r in ranks]
    timeout = check_timeout_s()
    try:
        store.wait(keys, datetime.timedelta(seconds=_wait_s(timeout)))
    except RuntimeError:  # the store's wait timed out
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise FluxInputError(_timed_out(op, gkey, ranks, me, missing, timeout)) from None
    if hasattr(store, "multi_get"):
        raw = store.multi_get(keys)
    else:
        raw = [store.get(k) for k in keys]
    values = [pickle.loads(v) for v in raw]
    # Every rank has read every key once the next exchange of this group completes (each
    # rank sets its next key only after reading all of these), so the previous round's
    # own key can go.
    if seq > 0:
        try:
            store.delete_key(f"flux/check/{gkey}/{seq - 1}/{me}")
        except Exception:  # stores without delete support
            pass
    return values


def _exchange(ranks: Tuple[int, ...], me: int, payload, op: str = "flux", group=None) -> List:
    """The full exchange of (values, error, fields) that names what differs (tests count it)."""
    return _gather_store(ranks, me, payload, op, group)


def _timed_out(op: str, gkey: str, ranks: Sequence[int], me: int, missing: Sequence[int], timeout: float,
               peers_in_same_op: bool = False) -> str:
    """The message of a check that timed out, after posting which op this rank is in and reading
    the posts of the ``missing`` ranks (which time out in a check of their own, if they are in one)."""
    store = dist.distributed_c10d._get_default_store()
    now = time.time()
    store.set(f"flux/stuck/{gkey}/{me}", pickle.dumps((op, now)))
    where = {}
    deadline = time.monotonic() + _grace_s(timeout)
    for r in missing:
        key = f"flux/stuck/{gkey}/{r}"
        try:
            store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            other, at = pickle.loads(store.get(key))
            if abs(at - now) <= timeout + 2 * _GRACE_S:  # a post of this failure, not an old one
                where[r] = other
        except RuntimeError:
            pass
    group_rank = {g: i for i, g in enumerate(ranks)}
    parts = []
    for r in missing:
        gr = group_rank.get(r, r)
        if r in where and where[r] != op:
            parts.append(f"rank {group_rank.get(me, me)} called {op} but rank {gr} called {where[r]}")
        elif r in where and not peers_in_same_op:
            parts.append(f"rank {gr} is in another call of {op} (the ranks' calls are out of step: some rank "
                         "skipped or repeated a call)")
        elif r not in where:
            parts.append(f"rank {gr} did not reach a flux call's check on this group (it made no flux call "
                         "here, or one that exchanges no check, such as flux.moe_combine)")
    if not parts:  # every peer waits in this op's check too
        parts.append("every rank is in this check, so the group's collectives were out of step before it")
    return (f"{op}: the argument check across ranks did not complete within FLUX_CHECK_TIMEOUT_S={timeout:g} s: "
            + "; ".join(parts) + " (every rank of a group must make the same flux calls in the same order; the "
            "group's collectives may now be out of step: recreate the process group)")


def _ops_differ(headers) -> Optional[str]:
    """The message naming the differing ops when the headers' op codes differ, else None."""
    codes = [int(h[0]) for h in headers]
    if all(c == codes[0] for c in codes):
        return None
    diff = [r for r, c in enumerate(codes) if c != codes[0]]
    calls = ", ".join(f"rank {r} called {op_name(c)}" for r, c in enumerate(codes)) + "; " if len(codes) > 2 else ""
    return (f"{op_name(codes[0])}: rank 0 called {op_name(codes[0])} but rank {diff[0]} called "
            f"{op_name(codes[diff[0]])} ({calls}every rank of a group must make the same flux calls in the "
            "same order)")


def _carries_header(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def _header_every_call(group: dist.ProcessGroup, no_symm: Optional[str]) -> bool:
    """Whether check_collectively exchanges the bounded header on every call, not only a problem's
    first: on gloo groups, and on CUDA groups where no call can be planned (no flux._C, or no
    symmetric workspace for the group: ``no_symm``, flux.runtime.symm.why_unavailable). A call
    skips its check only where a plan serves it, whose entry barrier (FLUX_TIMEOUT_MS) then bounds
    a peer that skipped the call."""
    return _carries_header(group) or no_symm is not None


def _no_symm(group: dist.ProcessGroup) -> Optional[str]:
    from flux.runtime import symm

    return symm.why_unavailable(group)


def _headers_agree(values: Tuple[int, ...], group: dist.ProcessGroup, sig: Optional["Signature"] = None) -> bool:
    """Exchange every rank's header through the store (bounded): True when every rank's is the
    same and none reports an error; raises when the ops differ."""
    sig = sig or Signature("flux")
    ranks = tuple(dist.get_process_group_ranks(group))
    mine = (op_code(sig.op), zlib.crc32(repr(values).encode()), 1 if sig.error else 0)
    headers = _gather_store(ranks, dist.get_rank(), mine, sig.op, group)
    msg = _ops_differ(headers)
    if msg:
        raise FluxInputError(msg)
    return all(tuple(h) == mine for h in headers) and not mine[2]


def check_collectively(sig: Signature, group: dist.ProcessGroup) -> None:
    """Raise the same FluxInputError on every rank if any rank's signature has an error, the
    ranks called different ops, or the signatures differ; return normally on every rank otherwise.

    On gloo groups, and on CUDA groups that cannot plan (``_header_every_call``), every call first
    exchanges its header through the store (bounded): a rank whose call differs from its peers' is
    found at once, on every rank, whether or not the peers' call was checked before; all ranks then
    make the full exchange, which names the field that differs. (On CUDA groups that plan, the
    entry barrier of every planned call carries the same check: flux/ops/_plans.py.)"""
    check_collectively_given(sig, group, _no_symm(group))


def check_collectively_given(sig: Signature, group: dist.ProcessGroup, no_symm: Optional[str]) -> None:
    """check_collectively for a caller that has asked flux.runtime.symm.why_unavailable(group)
    already (``no_symm``), and carries the answer on to its plan."""
    values = sig.values()
    ranks = tuple(dist.get_process_group_ranks(group))
    every = envs.CHECK_EVERY_CALL.get()
    known = values in _validated.get(ranks, ())
    if not every and _header_every_call(group, no_symm):
        if _headers_agree(values, group, sig) and known:
            return
    elif not every and known:
        return
    reports = _exchange(ranks, dist.get_rank(), (values, sig.error, sig.fields), sig.op, group)
    msg = _ops_differ([(f[0][1] if f else 0,) for _, _, f in reports])
    if msg:
        raise FluxInputError(msg)
    if not any(err for _, err, _ in reports) and all(v == values for v, _, _ in reports):
        _validated.setdefault(ranks, set()).add(values)
        return
    raise FluxInputError(_compose(sig.op, [(err, fields) for _, err, fields in reports]))


def _gather_bounded(mine: torch.Tensor, group: dist.ProcessGroup, op: str) -> List[List[int]]:
    """All-gather of a small int64 row through a CUDA group, read on the host; the wait is bounded
    by FLUX_CHECK_TIMEOUT_S (a rank in another op, or in none, never completes it)."""
    world = dist.get_world_size(group)
    if not mine.is_cuda or "gloo" in str(dist.get_backend(group)).lower():  # only where tests force this path
        from flux.runtime import all_gather_dim0

        return all_gather_dim0(mine, group).tolist()
    out = mine.new_empty((world, mine.shape[1]))
    work = dist.all_gather_into_tensor(out, mine, group=group, async_op=True)
    work.wait()  # the current stream waits for it (NCCL: no host block)
    done = torch.cuda.Event()
    done.record()
    timeout = check_timeout_s()
    deadline = time.monotonic() + _wait_s(timeout)
    spins = 0
    while not done.query():
        if time.monotonic() > deadline:
            ranks = tuple(dist.get_process_group_ranks(group))
            raise FluxInputError(_timed_out(op, _group_key(group, ranks), ranks, dist.get_rank(),
                                            [r for r in ranks if r != dist.get_rank()], timeout, True))
        spins += 1
        if spins > 1000:
            time.sleep(1e-4)
    return out.tolist()


def check_every_call(sig: Signature, group: dist.ProcessGroup, flag: Optional[torch.Tensor] = None,
                     flag_message=None) -> None:
    """The check of ops that exchange something on every call anyway (the MoE ops): every rank's
    header (op code, hash of the fields that must agree, error flag), gathered on the host, on gloo
    through the store, on CUDA groups through the group (a bounded wait). ``flag``: a data verdict
    computed on the device (an int64 scalar, 0: valid), added to this rank's error flag when its
    arguments are otherwise valid; ``flag_message()``: this rank's error text when its flag was set.
    If the ops differ every rank raises naming them; if any rank reports a problem or a different
    hash, the ranks exchange their messages through the store and raise the same FluxInputError."""
    from flux.runtime import group_device

    code, h, err = sig.header()
    ranks = tuple(dist.get_process_group_ranks(group))
    if _carries_header(group):
        bad = err or (flag is not None and sig.error is None and int(flag) != 0)
        verdicts = [(c, hh, e) for c, hh, e in _gather_store(ranks, dist.get_rank(), (code, h, int(bool(bad))),
                                                              sig.op, group)]
    else:
        mine = torch.tensor([[code, h, err]], dtype=torch.int64, device=group_device(group))
        if sig.error is None and flag is not None:
            mine[0, 2] += flag.to(mine.device)
        verdicts = [(c, hh, e) for c, hh, e in _gather_bounded(mine, group, sig.op)]
    msg = _ops_differ(verdicts)
    if msg:
        raise FluxInputError(msg)
    if all(e == 0 and hh == h for _, hh, e in verdicts):
        return
    if sig.error is None and verdicts[dist.get_rank(group)][2]:
        sig.fail((flag_message() if flag_message is not None else None) or "invalid data")
    reports = _exchange(ranks, dist.get_rank(), (sig.values(), sig.error, sig.fields), sig.op, group)
    raise FluxInputError(_compose(sig.op, [(err, fields) for _, err, fields in reports]))


def skips_exchange_if_valid(sig: Signature, group: dist.ProcessGroup) -> bool:
    """Whether ``check_collectively`` would skip the exchange for this signature were it free of
    local errors: a CUDA group (no per-call header), the same fields validated before, and
    FLUX_CHECK_EVERY_CALL off. Then peers making the same call without an error skip it too, and a
    rank with a local error must report it some other way than the store exchange, which its
    peers would never join (flux/ops/moe.py's deferred verdict does)."""
    if envs.CHECK_EVERY_CALL.get() or _header_every_call(group, _no_symm(group)):
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
