"""Loads flux._C, the CUDA extension, once. Without it every op runs its reference."""
import functools
import logging

import torch

log = logging.getLogger("flux")


@functools.lru_cache(maxsize=None)
def _load():
    try:
        import flux._C  # noqa: F401  (registers torch.ops.flux kernels)
    except ImportError as e:  # pure-Python install, or a build for another torch
        return str(e)
    return None


def cuda_kernels_available() -> bool:
    """True when flux's CUDA kernels can run here: flux._C is built and loaded and a CUDA device
    is visible. On a machine without a GPU it is False even where the extension was built
    (``extension_error()`` is None there)."""
    return _load() is None and torch.cuda.is_available()


def extension_error():
    """Why flux._C could not be loaded, or None when it was (built and importable, GPU or not)."""
    return _load()
