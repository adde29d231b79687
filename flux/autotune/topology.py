"""What the machine looks like to a process group: the autotuner's cache key.

Detected without communicating, from facts every rank of a homogeneous group shares (GPU
model and SM count, group size, ranks per node, the kind of link between the GPUs), so that
every rank derives the same key and makes the same choice.
"""
import dataclasses
import os
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Topology:
    device: str          # "NVIDIA H200", or "cpu"
    sm_count: int        # 0 on CPU
    world_size: int      # ranks in the group
    ranks_per_node: int
    nodes: int
    link: str            # "nvlink", "p2p" (PCIe peer access), "none" (no peer access), "cpu"
    numa_node: Optional[int] = None  # of this rank's GPU; informative, not part of the key

    def __post_init__(self):
        if self.world_size < 1 or self.ranks_per_node < 1 or self.nodes < 1:
            raise ValueError(f"Topology: bad sizes {self}")
        if self.link not in ("nvlink", "p2p", "none", "cpu"):
            raise ValueError(f"Topology: unknown link {self.link!r}")

    @property
    def key(self) -> str:
        """The cache key: everything that changes which strategy wins, nothing rank-local."""
        return f"{self.device}|sm{self.sm_count}|{self.world_size}r|{self.nodes}n|{self.link}"

    def __str__(self) -> str:
        numa = f", NUMA node {self.numa_node}" if self.numa_node is not None else ""
        return (f"{self.world_size} x {self.device} ({self.sm_count} SMs) on {self.nodes} node(s), "
                f"{self.ranks_per_node} per node, linked by {self.link}{numa}")


def _link(device_index: int, ranks_per_node: int) -> str:
    if ranks_per_node <= 1:
        return "none"
    try:  # NVML: is any NVLink of this GPU up?
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            for link in range(18):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                        return "nvlink"
                except pynvml.NVMLError:
                    break
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, or a driver without NVLink queries
        pass
    n = torch.cuda.device_count()
    peers = [p for p in range(n) if p != device_index]
    if peers and all(torch.cuda.can_device_access_peer(device_index, p) for p in peers):
        return "p2p"
    return "none"


def _numa_node(device_index: int) -> Optional[int]:
    try:
        bus = torch.cuda.get_device_properties(device_index).pci_bus_id.lower()
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            node = int(f.read().strip())
        return node if node >= 0 else None
    except Exception:
        return None


def detect(world_size: int, device: Optional[torch.device] = None) -> Topology:
    """The topology of a group of ``world_size`` ranks, seen from this process.

    Ranks per node come from torchrun's LOCAL_WORLD_SIZE (else all ranks on one node, capped by
    the visible GPUs for CUDA groups)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    local = max(1, min(local, world_size))
    nodes = max(1, world_size // local)
    if device is None or device.type != "cuda":
        return Topology("cpu", 0, world_size, local, nodes, "cpu")
    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    return Topology(props.name, props.multi_processor_count, world_size, local, nodes, _link(idx, local),
                    _numa_node(idx))
