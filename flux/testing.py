"""Fault injection and test-only modes, for tests: the one module they use for them.

- Ranks sharing a GPU (``FLUX_GLOO_CUDA=1``, flux.envs): gloo groups carry CUDA tensors and may
  use symmetric memory (with PyTorch's ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), so that a
  world size larger than the machine's GPU count runs every kernel and signal path for
  correctness (``bench/run_gpu.sh --shared W``). Ranks on one GPU take turns on it: timings mean
  nothing. The runtime reads the flag in two places only: which groups carry CUDA tensors
  (flux/runtime/groups.py) and a new runtime's push order (flux/runtime/runtime.py); a call's
  Problem marks ranks sharing a GPU, where the strategy table excludes 'fused' above two ranks.
- Dropped transfers (``drop_transfers``): a rank passes the entry barriers but sends its peers
  neither data nor flags, so that their in-kernel waits expire (the timeout tests).

This module sits above flux.runtime and nothing in flux imports it.
"""
import torch.distributed as dist

from flux import envs
from flux.runtime import runtime


def ranks_share_gpu() -> bool:
    """Whether gloo groups carry CUDA tensors (``FLUX_GLOO_CUDA=1``; tests only)."""
    return envs.GLOO_CUDA.get()


def drop_transfers(group: dist.ProcessGroup, on: bool = True) -> None:
    """While on, this rank passes the entry barriers of ``group`` but sends its peers neither
    data nor the flags announcing it, so that their in-kernel waits expire."""
    runtime.get(group).set_drop_transfers(on)
