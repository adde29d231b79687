"""Build and install flux (distribution name: flux-overlap, import name: flux).

The CUDA extension ``flux._C`` is built from csrc/ whenever a CUDA build of torch
and nvcc are present; otherwise flux installs as pure Python and every op runs
through its reference (NCCL/gloo collective, then torch.matmul).

Environment:
  FLUX_BUILD_CUDA   "auto" (default), "1" (fail if the extension cannot be built), "0" (never build)
  FLUX_CUDA_ARCH    semicolon-separated sm targets, default "90a" (e.g. "90a;100a")
  CUDA_HOME         CUDA toolkit root; default /usr/local/cuda when its nvcc exists
  MAX_JOBS          parallel compile jobs (ninja)

Install with ``pip install --no-build-isolation -e .`` after torch is installed:
an isolated build environment would download a second torch.
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _read_version():
    scope = {}
    with open(os.path.join(ROOT, "flux", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def _find_cuda_home():
    """torch's own detection settles on /usr/local when nvcc is a symlink there, which
    holds no libcudart: prefer an explicit CUDA_HOME, then /usr/local/cuda, then nvcc's parent."""
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return None


def _site_include_dirs(cuda_home):
    """Headers shipped in pip packages: CUTLASS (nvidia-cutlass), and, where the CUDA
    toolkit lacks them, the cuBLAS/cuSPARSE headers that torch's ATen CUDA headers include."""
    import importlib.util

    dirs = []
    # Locate nvidia-cutlass without importing it (its package imports optional extras).
    spec = importlib.util.find_spec("cutlass_library")
    have_cutlass = spec is not None and spec.submodule_search_locations
    if have_cutlass:
        src = os.path.join(list(spec.submodule_search_locations)[0], "source")
        for sub in ("include", os.path.join("tools", "util", "include")):
            if os.path.isdir(os.path.join(src, sub)):
                dirs.append(os.path.join(src, sub))
        have_cutlass = bool(dirs)
    if not os.path.exists(os.path.join(cuda_home, "include", "cublas_v2.h")):
        for path in sys.path:
            for pattern in ("nvidia/cu13/include", "nvidia/cublas/include", "nvidia/cusparse/include"):
                dirs.extend(d for d in glob.glob(os.path.join(path, pattern)) if os.path.isdir(d))
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out, bool(have_cutlass)


def _cuda_extension():
    mode = os.environ.get("FLUX_BUILD_CUDA", "auto").lower()
    if mode in ("0", "no", "false", "off"):
        return [], {}, "FLUX_BUILD_CUDA=0"

    def skip(reason):
        if mode in ("1", "yes", "true", "on"):
            raise RuntimeError(f"flux: FLUX_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
        print(f"flux: building without the CUDA extension ({reason}); ops run through their references",
              file=sys.stderr)
        return [], {}, reason

    try:
        import torch
    except ImportError:
        return skip("torch is not installed")
    if torch.version.cuda is None:
        return skip(f"torch {torch.__version__} is not a CUDA build")
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        return skip("nvcc not found (set CUDA_HOME)")
    os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = cuda_home
    include_dirs, have_cutlass = _site_include_dirs(cuda_home)
    if not have_cutlass:
        return skip("the nvidia-cutlass package is not installed")

    archs = [a.strip() for a in os.environ.get("FLUX_CUDA_ARCH", "90a").split(";") if a.strip()]
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    nvcc_flags = [
        "-O3", "-DNDEBUG", "-std=c++20", "--expt-relaxed-constexpr", "--expt-extended-lambda",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-lineinfo", *gencode,
    ]
    if "90a" in archs:  # the CUTLASS sm90 kernels (wgmma, TMA) need the sm_90a target
        nvcc_flags.append("-DFLUX_WITH_SM90")
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    sources += sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    ext = cpp_extension.CUDAExtension(
        name="flux._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), *include_dirs],
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DNDEBUG"], "nvcc": nvcc_flags},
        py_limited_api=False,
    )
    cmdclass = {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}
    print(f"flux: building the CUDA extension for {archs} with CUDA_HOME={cuda_home}", file=sys.stderr)
    return [ext], cmdclass, None


ext_modules, cmdclass, _ = _cuda_extension()

setup(
    name="flux-overlap",
    version=_read_version(),
    description="Fused compute-communication GPU kernels for tensor- and expert-parallel PyTorch layers",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["flux", "flux.*"]),
    package_data={"flux.autotune": ["shipped/*.json"]},  # tuned choices for measured topologies
    install_requires=["torch>=2.6", "numpy"],
    extras_require={"test": ["pytest>=7", "pytest-timeout"], "cuda": ["nvidia-cutlass>=3.5", "ninja"]},
    # vLLM loads every installed general plugin; flux's does nothing unless FLUX_VLLM=1
    # (flux/integrations/vllm.py).
    entry_points={"vllm.general_plugins": ["flux = flux.integrations.vllm:register"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
