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
    _register_fakes()
    return None


def _register_fakes():
    """Shapes of the C++ ops that return new tensors, for torch.compile's fake tensors."""
    if hasattr(torch.ops.flux, "grouped_mm_cutlass"):
        @torch.library.register_fake("flux::grouped_mm_cutlass")
        def _grouped_mm_cutlass(a, b, offs, kind, config, slab=0):
            if kind == 2:  # wgrad: [E, M, N]
                return a.new_empty((offs.shape[0], a.shape[1], b.shape[1]))
            return a.new_empty((a.shape[0], b.shape[1] if kind == 0 else b.shape[2]))


def cuda_kernels_available() -> bool:
    """True when flux's CUDA kernels can run here: flux._C is built and loaded and a CUDA device
    is visible. On a machine without a GPU it is False even where the extension was built
    (``extension_error()`` is None there)."""
    return _load() is None and torch.cuda.is_available()


def extension_error():
    """Why flux._C could not be loaded, or None when it was (built and importable, GPU or not)."""
    return _load()
