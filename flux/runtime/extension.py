"""Loads flux._C, the CUDA extension, once. Without it every op runs its reference."""
import functools
import logging

log = logging.getLogger("flux")


@functools.lru_cache(maxsize=None)
def _load():
    try:
        import flux._C  # noqa: F401  (registers torch.ops.flux kernels)
    except ImportError as e:  # pure-Python install, or a build for another torch
        return str(e)
    return None


def cuda_kernels_available() -> bool:
    """True when flux._C is built and loaded (torch.ops.flux.reduce_chunks_ and friends exist)."""
    return _load() is None


def extension_error():
    """Why flux._C could not be loaded, or None when it was."""
    return _load()
