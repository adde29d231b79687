"""The checks of flux.moe_dispatch / moe_combine (docs/api.md, MoE: checks): the signature whose
fields must agree across ranks, the data verdict (ids, duplicates, T > C), and its two paths:
read on the host, or deferred (bounded on CUDA groups: exchanged on the device, reported by
``MoeHandle.check()``).
"""
import logging
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from flux.ops._checks import (FluxInputError, Signature, check_collectively, check_every_call, dtype_code,
                               skips_exchange_if_valid)
from flux.ops._common import SUPPORTED_DTYPES
from flux.ops.moe.fp8 import _FP8_INPUT_DTYPES, FP8_BLOCK
from flux.ops.moe.handle import (_BAD_ID, _DUPLICATE, _INDEX_DTYPES, _LOCAL_ARGS, _OVER_CAPACITY, OP, OP_COMBINE,
                                 MoeHandle, _all_gather_small)
from flux.runtime import group_device

_log = logging.getLogger("flux")


def _signature(x, topk_idx, topk_weights, num_experts, group, capacity, fp8=False) -> Signature:
    """The fields that must agree between ranks (not T), and the local, host-known verdict."""
    sig = Signature(OP)
    world = dist.get_world_size(group)
    ok_int = isinstance(num_experts, int) and not isinstance(num_experts, bool)
    ok_cap = capacity is None or (isinstance(capacity, int) and not isinstance(capacity, bool))
    sig.add("num_experts", num_experts if ok_int else -1)
    sig.add("max_tokens_per_rank (-1: None)", -1 if capacity is None or not ok_cap else capacity)
    sig.add("fp8", 1 if fp8 else 0)
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            sig.fail(f"{name} must be a tensor, got {type(t).__name__}")
            return sig
    sig.add("x.dim()", x.dim())
    sig.add("H (x.shape[-1])", x.shape[-1] if x.dim() >= 1 else -1)
    sig.add("x.dtype", dtype_code(x.dtype))
    sig.add("topk_idx.dim()", topk_idx.dim())
    sig.add("K (topk_idx.shape[-1])", topk_idx.shape[-1] if topk_idx.dim() >= 1 else -1)
    sig.add("topk_idx.dtype", dtype_code(topk_idx.dtype))
    sig.add("topk_weights.dtype", dtype_code(topk_weights.dtype))
    if not ok_int or num_experts <= 0:
        sig.fail(f"num_experts must be a positive int, got {num_experts!r}")
    elif num_experts % world != 0:
        sig.fail(f"num_experts = {num_experts} is not divisible by the group size {world}")
    if not ok_cap or (capacity is not None and capacity < 1):
        sig.fail(f"max_tokens_per_rank must be None or a positive int, got {capacity!r}")
    if x.dim() != 2:
        sig.fail(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        sig.fail(f"x dtype {x.dtype} is not supported (use one of {[str(d) for d in SUPPORTED_DTYPES]})")
    elif fp8 and x.dtype not in _FP8_INPUT_DTYPES:
        sig.fail(f"fp8=True quantises bf16, fp16 or fp32 x, got {x.dtype}")
    if fp8 and x.dim() >= 1 and (x.shape[-1] % FP8_BLOCK or x.shape[-1] == 0):
        sig.fail(f"fp8=True needs H (x.shape[-1]) a positive multiple of {FP8_BLOCK} (one scale per block), "
                 f"got {x.shape[-1]}")
    if topk_idx.dim() != 2 or topk_idx.shape[-1] < 1:
        sig.fail(f"topk_idx must be 2-D [T, K] with K >= 1, got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in _INDEX_DTYPES:
        sig.fail(f"topk_idx dtype {topk_idx.dtype} is not supported (int64 or int32)")
    if not topk_weights.is_floating_point():
        sig.fail(f"topk_weights must be floating, got {topk_weights.dtype}")
    if topk_weights.shape != topk_idx.shape:
        sig.fail(f"topk_weights has shape {tuple(topk_weights.shape)} but topk_idx has {tuple(topk_idx.shape)}")
    if x.dim() >= 1 and topk_idx.dim() >= 1 and topk_idx.shape[0] != x.shape[0]:
        sig.fail(f"topk_idx has {topk_idx.shape[0]} rows but x has {x.shape[0]} tokens")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != x.device:
            sig.fail(f"{name} is on {t.device} but x is on {x.device}")
    dev = group_device(group)
    if x.device.type != dev.type:
        sig.fail(f"x is on {x.device} but the process group communicates on {dev.type} "
                 "(NCCL groups take CUDA tensors, gloo groups CPU tensors)")
    elif x.device.type == "cuda" and x.device.index != torch.cuda.current_device():
        sig.fail(f"x is on {x.device} but the current CUDA device is {torch.cuda.current_device()}")
    return sig


def _data_code(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The data-dependent verdict as an int64 scalar on topk_idx's device (no host read)."""
    idx = topk_idx.to(torch.int64)
    bad = ((idx < -1) | (idx >= num_experts)).any()
    s = idx.sort(dim=1).values
    dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()
    return bad.to(torch.int64) * _BAD_ID + dup.to(torch.int64) * _DUPLICATE


def _data_message(topk_idx: torch.Tensor, num_experts: int) -> Optional[str]:
    """A readable description of the first problem in topk_idx (host read; failing calls only)."""
    idx = topk_idx.to(torch.int64).cpu()
    bad = ((idx < -1) | (idx >= num_experts)).nonzero()
    if len(bad):
        t, k = bad[0].tolist()
        return (f"topk_idx[{t}, {k}] = {int(idx[t, k])} is outside [-1, {num_experts}) "
                f"({len(bad)} such entries)")
    for t, row in enumerate(idx.tolist()):
        seen = set()
        for e in row:
            if e >= 0 and e in seen:
                return f"topk_idx row {t} lists expert {e} twice (a token may list an expert at most once)"
            seen.add(e)
    return None


def _check_host(sig: Signature, topk_idx, num_experts, group) -> None:
    """The host-read verdict: check_every_call with the data verdict of topk_idx as the flag."""
    check_every_call(sig, group, flag=None if sig.error else _data_code(topk_idx, num_experts),
                     flag_message=lambda: _data_message(topk_idx, num_experts) or "invalid topk_idx")


def _deferred_host_code(sig: Signature, x, group, capacity) -> Tuple[int, Optional[str]]:
    """The bounded variant's checks without a host read: the fields that must agree (and
    host-known local errors) through check_collectively. Returns (this rank's host-known code:
    _LOCAL_ARGS, _OVER_CAPACITY or 0; its local error, deferred, or None): a local error whose
    peers skip the exchange (their signature was checked before) travels as the code _LOCAL_ARGS
    rather than in an exchange nobody else joins."""
    if sig.error is not None and skips_exchange_if_valid(sig, group):
        # The peers' identical, valid calls skip the store exchange (their signature was checked
        # before): this rank's local error goes into the device verdict instead, with stand-ins
        # of no tokens so that nothing it sends is read (every rank then gets zeros, and
        # handle.check() raises on every rank).
        _log.warning("%s: rank %d: %s", OP, dist.get_rank(group), sig.error)
        return _LOCAL_ARGS, sig.error
    check_collectively(sig, group)
    return (_OVER_CAPACITY if x.shape[0] > capacity else 0), None


def _check_deferred(sig: Signature, x, topk_idx, num_experts, group, capacity):
    """_deferred_host_code, then the data verdict (_data_code) all-gathered through the group.
    Returns (every rank's code, ``[W]`` int64 on x's device; this rank's local error or None)."""
    host_code, local = _deferred_host_code(sig, x, group, capacity)
    code = torch.tensor(host_code, dtype=torch.int64, device=x.device)
    if local is None:
        code = code + _data_code(topk_idx, num_experts)
    return _all_gather_small(code.reshape(1), group).reshape(-1), local


def _check_combine(y, handle) -> None:
    """Local checks of combine's input (no communication happens before them)."""
    if not isinstance(handle, MoeHandle):
        raise FluxInputError(f"{OP_COMBINE}: handle must be the MoeHandle returned by flux.moe_dispatch, "
                             f"got {type(handle).__name__}")
    if not isinstance(y, torch.Tensor):
        raise FluxInputError(f"{OP_COMBINE}: y must be a tensor, got {type(y).__name__}")
    if tuple(y.shape) != tuple(handle.recv_shape):
        raise FluxInputError(f"{OP_COMBINE}: y has shape {tuple(y.shape)} but the dispatch's recv_x had "
                             f"{tuple(handle.recv_shape)} (y must be in recv_x's layout)")
    if not y.is_floating_point():
        raise FluxInputError(f"{OP_COMBINE}: y must be floating, got {y.dtype}")
    if y.device != handle.send_pairs.device:
        raise FluxInputError(f"{OP_COMBINE}: y is on {y.device} but the dispatch ran on {handle.send_pairs.device}")
