"""Fault injection and test-only modes, in one place (never switched on by a production path).

- Ranks sharing a GPU (``FLUX_GLOO_CUDA=1``, flux.envs): gloo groups carry CUDA tensors and may
  use symmetric memory (with PyTorch's ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), so that a
  world size larger than the machine's GPU count runs every kernel and signal path for
  correctness (``bench/run_gpu.sh --shared W``). Ranks on one GPU take turns on it: timings mean
  nothing.
- Dropped transfers (``drop_transfers``): a rank passes the entry barriers but sends its peers
  neither data nor flags, so that their in-kernel waits expire (the timeout tests).
"""
import torch.distributed as dist

from flux import envs


def ranks_share_gpu() -> bool:
    """Whether gloo groups carry CUDA tensors (``FLUX_GLOO_CUDA=1``; tests only)."""
    return envs.GLOO_CUDA.get()


def configure_runtime(rt) -> None:
    """Apply the test modes to a new flux._C.Runtime. Ranks sharing one GPU: a same-GPU copy
    needs SMs, which the fused AG and RS kernels would hold while they wait for the other rank
    on that GPU, so the pushes go before the fused kernel."""
    if ranks_share_gpu():
        rt.set_push_before_fused(True)


def drop_transfers(group: dist.ProcessGroup, on: bool = True) -> None:
    """While on, this rank passes the entry barriers of ``group`` but sends its peers neither
    data nor the flags announcing it, so that their in-kernel waits expire."""
    from flux.runtime import runtime

    runtime.get(group).set_drop_transfers(on)
