"""The C++ runtime of a process group (``flux._C.Runtime``, csrc/runtime/runtime.h): one per
(group, device), owning the communication and signal streams, a pool of events and the plans
of the per-call path, and addressing the group's symmetric workspace (flux.runtime.symm).

Made and grown only on the slow path (flux/ops/_plans.py), where every rank of the group is
at the same call: making a workspace, or growing it, is collective.
"""
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from flux.runtime import symm
from flux.runtime.groups import gloo_carries_cuda

_runtimes: Dict[Tuple[str, int], object] = {}
_workspace_of: Dict[int, object] = {}  # id(runtime) -> the Workspace it was last given


def _runtime(group: dist.ProcessGroup):
    """The runtime of ``group`` on the current device, made on first use (no workspace yet)."""
    import flux._C as _C

    device = torch.cuda.current_device()
    key = (group.group_name, device)
    rt = _runtimes.get(key)
    if rt is None:
        backend = str(dist.get_backend(group)).lower()
        rt = _C.Runtime(group.group_name, dist.get_rank(group), dist.get_world_size(group), device,
                        "nccl" in backend, symm.timeout_ms(), symm.error_record_ptr())
        # Ranks sharing one GPU (tests only, flux.testing): a same-GPU copy needs SMs, which the
        # fused AG and RS kernels would hold while they wait for the other rank on that GPU.
        rt.set_push_before_fused(gloo_carries_cuda())
        _runtimes[key] = rt
    return rt


def _with_workspace(rt, group: dist.ProcessGroup, nbytes: int):
    """``rt`` addressing ``group``'s workspace, at least ``nbytes`` large (collective when it makes
    or grows the workspace; see flux.runtime.symm.get_workspace)."""
    ws = symm.get_workspace(group, max(nbytes, 1))
    if _workspace_of.get(id(rt)) is not ws:
        rt.set_workspace(ws._peer_bytes, [p.data_ptr() for p in ws.pads], ws.pads_dev, ws.buffer_ptrs_dev,
                         ws.base_offset, ws.pad_words)
        _workspace_of[id(rt)] = ws
    return rt


def get(group: dist.ProcessGroup, nbytes: int = 0):
    """The runtime of ``group`` on the current device, its workspace at least ``nbytes`` large
    (collective when it makes or grows the workspace; see flux.runtime.symm.get_workspace)."""
    return _with_workspace(_runtime(group), group, nbytes)


def make_plan(group: dist.ProcessGroup, *args) -> Tuple[object, object]:
    """(runtime, plan): ``Runtime.make_plan(*args)`` of ``group``'s runtime, whose workspace then
    grows to what the plan needs (collective, as ``get``). A plan is made from the shapes alone,
    so the workspace is made or grown once, to its size."""
    rt = _runtime(group)
    plan = rt.make_plan(*args)
    return _with_workspace(rt, group, plan.workspace_bytes), plan


def made() -> Tuple[object, ...]:
    """Every runtime made in this process (each group and device)."""
    return tuple(_runtimes.values())


def existing(group: dist.ProcessGroup) -> Optional[object]:
    """The runtime of ``group`` on the current device if one was made, else None."""
    return _runtimes.get((group.group_name, torch.cuda.current_device()))
