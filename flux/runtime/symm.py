"""Symmetric workspaces: one buffer per process group that every rank can address on
every peer over NVLink, plus signal pads.

All use of ``torch.distributed._symmetric_memory`` (private PyTorch API) is in this
module. A workspace is allocated on first use, grown (never shrunk) when a problem needs
more, and reused by every later call of every op on that group; flux.runtime.runtime hands
its addresses to the C++ runtime (csrc/runtime/runtime.h), which owns the streams, events
and signals of the per-call path. Signals are the self-resetting flags of
csrc/runtime/signals.cu, so back-to-back calls, different shapes in a row and CUDA-graph
replays need no reset. Every wait is bounded by ``FLUX_TIMEOUT_MS`` (default 30000 ms, read
when a group's runtime is made): past it the waiting rank prints which peer it was waiting
for and the CUDA context fails, instead of hanging. The signal pad's channels are listed
below, at ``SIGNAL_CHANNELS``.
"""
import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from flux.runtime.groups import cuda_group
from flux.strategies import MAX_CHUNKS as MAX_DATA_CHANNELS  # noqa: F401  sub-block signals: channels 1..7
from flux.strategies import SIGNAL_CHANNELS  # the C++ side's k<Name>Channel (generated header)

# Signal pad channels (each channel holds one slot per source rank):
#   0        call-entry barrier: every peer has finished its earlier work on the workspace; the
#            slot carries the call's token (a hash of the problem), which the receiver compares
#            with its own: ranks that make different calls fail at once
#   1 .. 7   self-resetting data-ready signals (put: a stream write of 1; wait: a bounded
#            kernel that consumes it, resetting it to 0)
#   8        level flags read by fused kernels (many readers, so not self-resetting): the
#            owner zeroes its own before the call's barrier, peers set them with a stream
#            write (cuStreamWriteValue32: no SM, so it can run while a persistent kernel holds
#            every SM), fused kernels spin until they are non-zero.
#   9        "barrier started" (this rank's own slot only, self-resetting): set by the barrier
#            kernel as soon as it runs when asked (``barrier(started=True)``), consumed by
#            a wait on another stream, so that work there can start once the barrier holds
#            an SM instead of once every peer has arrived.
#   10 ..    segment flags (level flags, like channel 8, but indexed by segment rather than by
#            source rank: slot 10 * world + s): the fused GEMM+RS kernel waits on the flag of
#            each segment of the peer's partial.
FLAG_CHANNEL = SIGNAL_CHANNELS["flag"]
SEGMENT_CHANNEL = SIGNAL_CHANNELS["segment"]


def timeout_ms() -> int:
    from flux import envs

    return envs.TIMEOUT_MS.get()


_error_record = None
ERROR_RECORD_WORDS = 8


def error_record_ptr() -> int:
    """Address of host-mapped uint32 words where kernels record why they trapped, readable
    after the CUDA context has failed: [0] waiting rank + 1, [1] the peer, [2] kind (0: a
    timeout, 1: the peer made another call), [3] the peer's token, [4] this rank's token."""
    global _error_record
    if _error_record is None:
        # Pinned host memory is mapped into the device's address space at the same address (UVA).
        _error_record = torch.zeros(ERROR_RECORD_WORDS, dtype=torch.int32, pin_memory=True)
    return _error_record.data_ptr()


_OP_OF_TOKEN = {1: "flux.ag_gemm", 2: "flux.gemm_rs", 3: "a flux MoE op"}  # csrc/runtime/signals.cu: op_of


def timeout_report():
    """Why a flux kernel of this process trapped, as recorded before it did (None if none did):
    a timeout waiting for a peer, or a peer that made a different call."""
    if _error_record is None or int(_error_record[0]) == 0:
        return None
    rec = [int(v) & 0xFFFFFFFF for v in _error_record.tolist()]
    me, peer = rec[0] - 1, rec[1]
    if rec[2] == 1:
        return (f"flux: rank {me} and rank {peer} made different flux calls ({_OP_OF_TOKEN.get(rec[4] >> 30, '?')}, "
                f"problem {rec[4]:08x} on rank {me}; {_OP_OF_TOKEN.get(rec[3] >> 30, '?')}, problem {rec[3]:08x} "
                f"on rank {peer})")
    return (f"flux: rank {me} timed out in a fused kernel waiting for rank "
            f"{peer}; that rank did not make the same flux call")


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def spans_nodes(group_ranks, world_size: int, local_world_size: int) -> bool:
    """Whether a group of these global ranks spans hosts, under torchrun's layout (``world_size``
    processes, ``local_world_size`` per host, global ranks numbered host by host). Symmetric
    memory maps peers' GPU memory, which needs every rank of the group on one host."""
    if local_world_size <= 0 or world_size <= local_world_size:
        return False
    return len({r // local_world_size for r in group_ranks}) > 1


def why_unavailable(group: dist.ProcessGroup) -> Optional[str]:
    """None where symmetric workspaces can be made for this group here (CUDA, NCCL group, flux._C
    loaded, PyTorch's symmetric memory importable, every rank on this host), else why not; the
    same on every rank."""
    from flux.runtime.extension import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        return "symmetric memory is unavailable (needs CUDA and flux._C)"
    world, local = int(os.environ.get("WORLD_SIZE", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if spans_nodes(dist.get_process_group_ranks(group), world, local):
        return (f"the group spans hosts (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}); symmetric memory "
                "needs every rank of the group on one host")
    if not cuda_group(group):  # NCCL groups (gloo ones only under FLUX_GLOO_CUDA=1, tests)
        return "symmetric memory is unavailable (needs an NCCL group)"
    try:
        _symm_mem()
    except ImportError:
        return "symmetric memory is unavailable (this PyTorch lacks torch.distributed._symmetric_memory)"
    return None


def available(group: dist.ProcessGroup) -> bool:
    """Whether symmetric workspaces can be made for this group here (why_unavailable)."""
    return why_unavailable(group) is None


def unusable(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
    """None where an op can move ``device``'s tensors through ``group``'s symmetric workspace,
    else why not (the same on every rank: it depends on the group and the device type only)."""
    if device.type != "cuda":
        return "the tensors are not on a GPU"
    if dist.get_world_size(group) < 2:
        return "a group of one rank"
    return why_unavailable(group)


class Workspace:
    """A symmetric buffer of ``nbytes`` on every rank of ``group``, with signal pads."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        symm_mem = _symm_mem()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.nbytes = nbytes
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        pad_words = symm_mem.get_signal_pad_size() // 4 if hasattr(symm_mem, "get_signal_pad_size") else 2304
        self.pad_words = pad_words
        self.pads = [self.handle.get_signal_pad(p, [pad_words], dtype=torch.int32) for p in range(self.world)]
        self.pads_dev = self.handle.signal_pad_ptrs_dev
        # Where our tensor starts inside the symmetric allocation (0 unless PyTorch pools
        # several tensors in one allocation); the same on every rank.
        self.base_offset = self.buffer.data_ptr() - self.handle.buffer_ptrs[self.rank]
        self._peer_bytes = [self.handle.get_buffer(p, [nbytes], torch.uint8, self.base_offset)
                            for p in range(self.world)]
        self.buffer_ptrs_dev = self.handle.buffer_ptrs_dev  # device array of every rank's allocation base
        self._views: Dict[tuple, torch.Tensor] = {}

    def view(self, peer: int, shape, dtype: torch.dtype, offset_bytes: int = 0) -> torch.Tensor:
        """Rank ``peer``'s buffer (this rank's own when peer == rank), as a tensor on this device."""
        key = (peer, tuple(shape), dtype, offset_bytes)
        v = self._views.get(key)
        if v is not None:
            return v
        if len(self._views) > 4096:  # many shapes in one process: start over rather than grow
            self._views.clear()
        numel = 1
        for s in shape:
            numel *= s
        size = numel * torch.empty((), dtype=dtype).element_size()
        if offset_bytes + size > self.nbytes:
            raise RuntimeError(f"flux workspace: view of {size} B at {offset_bytes} exceeds {self.nbytes} B")
        v = self._peer_bytes[peer][offset_bytes:offset_bytes + size].view(dtype).view(shape)
        self._views[key] = v
        return v


_workspaces: Dict[Tuple[str, int], Workspace] = {}
# Workspaces replaced by a larger one stay allocated: a CUDA graph captured earlier still
# holds their addresses (buffers, signal pads) and may be replayed.
_retired = []


def _round_up_pow2(n: int) -> int:
    return 1 << max(20, (n - 1).bit_length())  # at least 1 MiB


def get_workspace(group: dist.ProcessGroup, nbytes: int) -> Workspace:
    """The workspace of ``group`` on the current device, at least ``nbytes`` large.

    Collective when it allocates: every rank must ask for the same size at the same call,
    which holds because arguments are checked to agree across ranks first.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    key = (group.group_name, device.index)
    ws = _workspaces.get(key)
    if ws is None or ws.nbytes < nbytes:
        if ws is not None:
            # Growing: no kernel of this rank may still use the old buffer, and no peer may
            # still write into it; the rendezvous of the new buffer is a host-side collective,
            # reached by each rank only after its own synchronize.
            torch.cuda.synchronize(device)
            _retired.append(ws)
        ws = Workspace(group, _round_up_pow2(nbytes), device)
        _workspaces[key] = ws
    return ws
