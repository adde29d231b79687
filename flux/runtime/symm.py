"""Symmetric workspaces: one buffer per process group that every rank can address on
every peer over NVLink, plus signal pads and a communication stream.

All use of ``torch.distributed._symmetric_memory`` (private PyTorch API) is in this
module. A workspace is allocated on first use, grown (never shrunk) when a call needs
more, and reused by every later call of every op on that group. Signals are the
self-resetting flags of csrc/runtime/signals.cu, so back-to-back calls, different shapes
in a row and CUDA-graph replays need no reset. Every wait is bounded by
``FLUX_TIMEOUT_MS`` (default 30000 ms): past it the waiting rank prints which peer it was
waiting for and the CUDA context fails, instead of hanging.

Signal pad channels (each channel holds one slot per source rank):
  0        call-entry barrier: every peer has finished its earlier work on the workspace
  1 .. 7   self-resetting data-ready signals (put: a stream write of 1; wait: a bounded
           kernel that consumes it, resetting it to 0)
  8        level flags read by fused kernels (many readers, so not self-resetting): the
           owner zeroes its own before the call's barrier, peers set them with
           ``set_flag`` (a stream memory operation: no SM, so it can run while a persistent
           kernel holds every SM), fused kernels spin until they are non-zero.
  9        "barrier started" (this rank's own slot only, self-resetting): set by the barrier
           kernel as soon as it runs when asked (``barrier(started=True)``), consumed by
           ``wait_started`` on another stream, so that work there can start once the
           barrier holds an SM instead of once every peer has arrived.
  10 ..    segment flags (level flags, like channel 8, but indexed by segment rather than by
           source rank: slot 10 * world + s): the fused GEMM+RS kernel waits on the flag of
           each segment of the peer's partial (``segment_flags``, ``set_segment_flag``).
"""
import os
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from flux.runtime.groups import cuda_group

BARRIER_CHANNEL = 0
DATA_CHANNEL = 1
FLAG_CHANNEL = 8
STARTED_CHANNEL = 9
SEGMENT_CHANNEL = 10
MAX_DATA_CHANNELS = FLAG_CHANNEL - DATA_CHANNEL  # sub-block signals of one call: channels 1..7


def timeout_ms() -> int:
    return int(os.environ.get("FLUX_TIMEOUT_MS", "30000"))


_error_record = None
# Fault injection for the GPU tests (tests/gpu_worker.py, timeout cases "...:drop"): while set,
# this process passes the entry barriers but sends its peers neither data nor the flags that
# announce it, so that their in-kernel waits (not the barrier's) are the ones that expire.
_drop_transfers = False


def drop_transfers(on: bool = True) -> None:
    global _drop_transfers
    _drop_transfers = on


def transfers_dropped() -> bool:
    return _drop_transfers


def error_record_ptr() -> int:
    """Address of a host-mapped pair of uint32 where fused kernels record a timeout (waiting
    rank + 1, missing rank) before they trap; readable after the CUDA context has failed."""
    global _error_record
    if _error_record is None:
        # Pinned host memory is mapped into the device's address space at the same address (UVA).
        _error_record = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    return _error_record.data_ptr()


def timeout_report():
    """'rank R timed out waiting for rank P' if a fused kernel of this process timed out, else None."""
    if _error_record is None or int(_error_record[0]) == 0:
        return None
    return (f"flux: rank {int(_error_record[0]) - 1} timed out in a fused kernel waiting for rank "
            f"{int(_error_record[1])}; that rank did not make the same flux call")


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def available(group: dist.ProcessGroup) -> bool:
    """Whether symmetric workspaces can be made for this group here (CUDA, NCCL group,
    flux._C loaded, PyTorch's symmetric memory importable)."""
    from flux.runtime.extension import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        return False
    if not cuda_group(group):  # NCCL groups (gloo ones only under FLUX_GLOO_CUDA=1, tests)
        return False
    try:
        _symm_mem()
    except ImportError:
        return False
    return True


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
        self.channels = pad_words // self.world
        self.pads = [self.handle.get_signal_pad(p, [pad_words], dtype=torch.int32) for p in range(self.world)]
        # The same pads as uint32, the dtype PyTorch's stream memory operations take.
        self._pads_u32 = [self.handle.get_signal_pad(p, [pad_words], dtype=torch.uint32) for p in range(self.world)]
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

    # Signals, enqueued on the current stream.
    def barrier(self, channel: int = BARRIER_CHANNEL, started: bool = False) -> None:
        """Hold this stream until every peer has reached its barrier of ``channel`` (after all
        of its stream's earlier work). ``started``: also raise this rank's "barrier started"
        slot as soon as the kernel runs; exactly one ``wait_started`` must consume it."""
        torch.ops.flux.signal_barrier_(self.pads[self.rank], self.pads_dev, channel, self.rank, self.world,
                                       timeout_ms(), STARTED_CHANNEL if started else -1)

    def barrier_on(self, stream: torch.cuda.Stream, started: bool = False) -> torch.cuda.Event:
        """Enqueue the barrier on ``stream`` (the communication stream), after the current
        stream's work so far; return an event recorded right after it. ``started`` as in
        ``barrier``: the current stream then calls ``wait_started``."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.barrier(started=started)
            passed = torch.cuda.Event()
            passed.record()
        return passed

    def wait_started(self) -> None:
        """Hold this stream until a ``barrier(started=True)`` enqueued on another stream is
        running (it holds an SM), not until it has passed. Work queued after this cannot
        take every SM before the barrier kernel got one."""
        self.wait(self.rank, STARTED_CHANNEL)

    def put(self, peer: int, channel: int = DATA_CHANNEL, kernel: bool = False) -> None:
        """Tell ``peer`` that this rank's data for it is in place (after this stream's earlier work).

        A stream write of 1 into our slot on the peer's pad (``set_flag``'s mechanism: no SM,
        so it is not held back while a GEMM occupies every SM); the peer's ``wait`` consumes
        it (resets it to 0). No put waits for the slot to be 0 first: every put of a call
        follows that call's entry barrier, which the peer reaches only after its stream ran
        the ``wait`` that consumed the previous call's signal. ``kernel``: the former put, a
        one-thread kernel that first checks the slot is 0 (kept for the ablation,
        ``decomposed(kernel_put=1)``)."""
        if kernel:
            torch.ops.flux.signal_put_(self.pads[peer], channel, self.rank, peer, self.world, timeout_ms())
        else:
            self._write_slot(peer, channel * self.world + self.rank, 1)

    def flags(self, channel: int = FLAG_CHANNEL) -> torch.Tensor:
        """This rank's level flags of ``channel``, one int32 per source rank."""
        return self.pads[self.rank][channel * self.world:(channel + 1) * self.world]

    def set_flag(self, peer: int, channel: int = FLAG_CHANNEL, value: int = 1) -> None:
        """Set this rank's flag on ``peer``'s pad after this stream's earlier work, without an
        SM: cuStreamWriteValue32 (with its memory fence); during CUDA graph capture a memset
        node, as PyTorch's own async-TP does."""
        self._write_slot(peer, channel * self.world + self.rank, value)

    def max_segments(self) -> int:
        return len(self.pads[self.rank]) - SEGMENT_CHANNEL * self.world

    def segment_flags(self, count: int) -> torch.Tensor:
        """This rank's first ``count`` segment flags (int32), set by the peer that fills them."""
        if not 1 <= count <= self.max_segments():
            raise ValueError(f"flux workspace: {count} segment flags asked, 1..{self.max_segments()} available")
        first = SEGMENT_CHANNEL * self.world
        return self.pads[self.rank][first:first + count]

    def set_segment_flag(self, peer: int, segment: int, value: int = 1) -> None:
        """Set segment flag ``segment`` on ``peer``'s pad after this stream's earlier work (no SM)."""
        self._write_slot(peer, SEGMENT_CHANNEL * self.world + segment, value)

    def _write_slot(self, peer: int, offset: int, value: int) -> None:
        if torch.cuda.is_current_stream_capturing():
            torch.ops.symm_mem.memset32_(self._pads_u32[peer], offset, value, 1)
        else:
            torch.ops.symm_mem.stream_write_value32_(self._pads_u32[peer], offset, value)

    def wait(self, peer: int, channel: int = DATA_CHANNEL) -> None:
        """Hold this stream until ``peer`` has signalled this rank on ``channel``."""
        torch.ops.flux.signal_wait_(self.pads[self.rank], channel, self.rank, peer, self.world, timeout_ms())


_workspaces: Dict[Tuple[str, int], Workspace] = {}
# Workspaces replaced by a larger one stay allocated: a CUDA graph captured earlier still
# holds their addresses (buffers, signal pads) and may be replayed.
_retired = []
_comm_streams: Dict[int, torch.cuda.Stream] = {}
_signal_streams: Dict[int, torch.cuda.Stream] = {}


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


def signal_stream() -> torch.cuda.Stream:
    """The stream on which the decomposed strategies wait for their peers' data (one per
    device): a wait kernel there is one warp, which fits on an SM beside a GEMM's CTA (where the
    GEMM leaves the registers), so it sees the signal while the GEMM runs, and the current
    stream moves on through an event instead of launching a wait kernel after its GEMM."""
    return _device_stream(_signal_streams)


def waits_on_side(ws: "Workspace", sources, after: torch.cuda.Event, channels=(DATA_CHANNEL,)):
    """Enqueue on the signal stream, once ``after`` (recorded on the communication stream) has
    passed, one bounded wait per (source, channel), in order; return an event per source,
    recorded once all of its channels were waited for. The current stream waits for those
    events before it reads a source's data (``torch.cuda.current_stream().wait_event``)."""
    side = signal_stream()
    side.wait_event(after)
    events = []
    with torch.cuda.stream(side):
        for src in sources:
            for ch in channels:
                ws.wait(src, ch)
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
    return events


def comm_stream() -> torch.cuda.Stream:
    """The stream on which copy-engine transfers and their signals run (one per device)."""
    return _device_stream(_comm_streams)


def _device_stream(streams: Dict[int, torch.cuda.Stream]) -> torch.cuda.Stream:
    """The current device's stream of ``streams``, made on first use with high priority."""
    idx = torch.cuda.current_device()
    s = streams.get(idx)
    if s is None:
        s = torch.cuda.Stream(device=idx, priority=-1)
        streams[idx] = s
    return s
