"""Fault injection and test-only modes, for tests: the one module they use for them.

- Ranks sharing a GPU (``FLUX_GLOO_CUDA=1``, flux.envs): gloo groups carry CUDA tensors and may
  use symmetric memory (with PyTorch's ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), so that a
  world size larger than the machine's GPU count runs every kernel and signal path for
  correctness (``bench/run_gpu.sh --shared W``). Ranks on one GPU take turns on it: timings mean
  nothing. The runtime reads the flag in one place, flux.runtime.groups.gloo_carries_cuda, for
  which groups carry CUDA tensors and a new runtime's push order (flux/runtime/runtime.py); a call's
  Problem marks ranks sharing a GPU, where the strategy table excludes 'fused' above two ranks.
- Dropped transfers (``drop_transfers``): a rank passes the entry barriers but sends its peers
  neither data nor flags, so that their in-kernel waits expire (the timeout tests).
- A delayed communication stream (``comm_stream``): ``torch.cuda._sleep`` there makes the
  peers' waits really wait.

This module sits above flux.runtime and nothing in flux imports it.
"""
import torch
import torch.distributed as dist

from flux.runtime import runtime
from flux.runtime.groups import gloo_carries_cuda as ranks_share_gpu  # noqa: F401  (FLUX_GLOO_CUDA=1)


def drop_transfers(group: dist.ProcessGroup, on: bool = True) -> None:
    """While on, this rank passes the entry barriers of ``group`` but sends its peers neither
    data nor the flags announcing it, so that their in-kernel waits expire."""
    runtime.get(group).set_drop_transfers(on)


def comm_stream(group: dist.ProcessGroup) -> torch.cuda.ExternalStream:
    """The communication stream (copy-engine pushes and their signals) of ``group``'s runtime on
    the current device, for tests that delay it."""
    rt = runtime.get(group)
    return torch.cuda.ExternalStream(rt.comm_stream, device=torch.device("cuda", rt.device))
