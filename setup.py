"""Build and install flux (distribution name: flux-overlap, import name: flux).

The CUDA extension ``flux._C`` is built from csrc/ whenever a CUDA build of torch
and nvcc are present; otherwise flux installs as pure Python and every op runs
through its reference (NCCL/gloo collective, then torch.matmul).

Environment:
  FLUX_BUILD_CUDA   "auto" (default), "1" (fail if the extension cannot be built), "0" (never build)
  FLUX_CUDA_ARCH    semicolon-separated sm targets, default "90a" (e.g. "90a;100a")
  FLUX_KERNELS      which fused GEMM instantiations to build: "default", "all", "minimal" or a
                    list such as "default,ag:*:fp16" (flux/fused_configs.py)
  FLUX_UNIT_KERNELS  CUTLASS GEMMs compiled together in one translation unit, default 5 (each unit's
                    front end costs about 45 s of one core, each GEMM in it about 6 s more)
  FLUX_BUILD_VERBOSE  "1": print every compiler command (default: one short line per file)
  CUDA_HOME         CUDA toolkit root; default /usr/local/cuda when its nvcc exists
  MAX_JOBS          parallel compile jobs; default: the CPUs, at most one per 9 GB of free memory

Install with ``pip install --no-build-isolation -e .`` after torch is installed:
an isolated build environment would download a second torch.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import time

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
GENERATED = os.path.join("build", "flux_generated")  # the fused GEMM instantiations (relative to ROOT)
_T0 = time.time()


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


def _fused_table():
    """flux/fused_configs.py, read by path: flux (and torch) are not imported."""
    scope = {"__name__": "flux_fused_configs"}
    path = os.path.join(ROOT, "flux", "fused_configs.py")
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return scope


_SCHEDULES = {
    "cooperative": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative",
                    "cutlass::epilogue::TmaWarpSpecializedCooperative"),
    "pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong", "cutlass::epilogue::TmaWarpSpecialized"),
}
_DTYPE_ENUM = {"bf16": "kBf16", "fp16": "kFp16", "bf16_fp32": "kBf16Fp32", "fp16_fp32": "kFp16Fp32"}
_OP_CXX = {  # op: (header, impl macro, args type, launch template, GEMM alias, dispatch function)
    "ag": ("ag_gemm/ag_gemm_fused.cuh", "FLUX_AG_FUSED_IMPL", "AgFusedArgs", "launch_ag_fused", "AgGemm",
           "ag_fused_dispatch"),
    "rs": ("gemm_rs/rs_fused.cuh", "FLUX_RS_FUSED_IMPL", "RsFusedArgs", "launch_rs_fused", "RsFoldGemm",
           "rs_fused_dispatch"),
}
# Split-K: (launch template, GEMM alias, the persistent alias whose fp32-output GEMM the split GEMM is, or
# None). AG's split GEMM is AgGemm with fp32 output (ag_gemm_fused.cuh AgSplitGemm): a configuration of the
# same tile, cluster and schedule built with fp32 output is the same CUTLASS kernel, compiled once where both
# share a unit (_write_units). RS's has no source (rs_fused.cuh RsSplitGemm): a kernel of its own.
_SPLIT_CXX = {"ag": ("launch_ag_split", "AgSplitGemm", "AgGemm"), "rs": ("launch_rs_split", "RsSplitGemm", None)}
_HEADER = "// Generated by setup.py from flux/fused_configs.py; edit that table, not this file.\n"


def _write_if_changed(path, text):
    """Unchanged files keep their time stamps, so that ninja recompiles only what changed."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(text)


# Warpgroup MMA widths CUTLASS's builder selects by default; for other tile widths a unit enables
# its extended MMA shapes (any multiple of 8 up to 256). Without them the builder picks the largest
# of these dividing the tile's N: a 160-wide tile ran five 32-wide MMAs per K step instead of one
# (1.4-4x cuBLAS's time for such tiles). Only in those units: the macro lengthens every unit's compilation
# (a 128x128 configuration: 48 -> 75 s), and tiles of these widths get the same MMA either way.
_DEFAULT_MMA_N = (8, 16, 32, 64, 96, 128, 192, 256)


def _kernel_fn(name, args_t, launch, extra=""):
    """``void name(const args_t& a<extra>) { launch(a<extra>); }`` (extra: further int parameters,
    e.g. ", int splits, int dtype")."""
    call = "".join(", " + p.split()[-1] for p in extra.split(",") if p.strip())
    return f"void {name}(const {args_t}& a{extra}) {{\n  {launch}(a{call});\n}}\n"


def _unit_kernels():
    """FLUX_UNIT_KERNELS: the CUTLASS GEMMs compiled together in one translation unit (default 5)."""
    value = os.environ.get("FLUX_UNIT_KERNELS", "5")
    if not value.isdigit() or int(value) < 1:
        raise RuntimeError(f"flux: FLUX_UNIT_KERNELS={value!r}: expected a positive integer")
    return int(value)


def _write_units(kernels, per_unit):
    """The instantiations' translation units: ``kernels`` maps (file prefix, impl macro, header,
    extended MMA) to [(CUTLASS GEMM type, comment, function text)]; each such group's distinct GEMM
    types are cut into ceil(n / per_unit) units of near-equal counts, the launchers of one type
    (AG's split-K GEMM and the configuration of its tile with fp32 output) kept in one unit, where
    the type is compiled once. A unit's front end (CUTLASS's headers through cudafe++, cicc and
    the host compiler) costs about 45 s of one core and each GEMM in it about 6 s more,
    so that four in one unit compile in under half the time of four units. The extended
    MMA shapes (a macro that changes CUTLASS's builder for the whole unit) and the op's header
    are a unit's own, hence the grouping. Returns the units' paths (relative to ROOT)."""
    paths = []
    for (prefix, macro, header, extended_mma), items in kernels.items():
        bundles = {}
        for gemm, comment, fn in items:
            bundles.setdefault(gemm, []).append((comment, fn))
        bundles = list(bundles.values())
        count = -(-len(bundles) // per_unit)
        ext = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // the tiles' widths (setup.py, _DEFAULT_MMA_N)\n" \
            if extended_mma else ""
        for i in range(count):
            share = [item for bundle in bundles[i::count] for item in bundle]
            text = (f"{_HEADER}" + "".join(f"// {comment}\n" for comment, _ in share)
                    + f"#define FLUX_KERNEL_UNIT  // without ATen (csrc/common/check.h)\n"
                    f"{ext}#define {macro}\n#include \"{header}\"\n\nnamespace flux {{\n\n"
                    + "\n".join(fn for _, fn in share) + "\n}  // namespace flux\n")
            rel = os.path.join(GENERATED, f"{prefix}{'_x' if extended_mma else ''}_{i}.cu")
            _write_if_changed(os.path.join(ROOT, rel), text)
            paths.append(rel)
    return paths


def _dispatch_fn(fn, args_t, second, count, cases):
    """``bool fn(int config, int second, const args_t& a)``: a bounded switch on config * count +
    second over ``cases`` ("case N: launcher(a); return true;"), false for anything else."""
    text = (f"\nbool {fn}(int config, int {second}, const {args_t}& a) {{\n"
            f"  if (config < 0 || {second} < 0 || {second} >= {count}) return false;\n"
            f"  switch (config * {count} + {second}) {{\n" + "".join(c + "\n" for c in cases)
            + "    default: return false;\n  }\n}\n\n")
    return text if cases else text.replace(f"const {args_t}& a", f"const {args_t}&")  # no launch: `a` unused


def _generate_fused_sources(with_sm90):
    """The selected (op, config, dtype) instantiations as translation units of up to
    FLUX_UNIT_KERNELS each (_write_units), and the dispatch over them, into build/flux_generated/;
    returns their paths (relative to ROOT)."""
    table = _fused_table()
    spec = os.environ.get("FLUX_KERNELS", "default")
    chosen = table["select"](spec) if with_sm90 else []
    out_dir = os.path.join(ROOT, GENERATED)
    os.makedirs(out_dir, exist_ok=True)
    kernels, decls, cases, names = {}, {op: [] for op in _OP_CXX}, {op: [] for op in _OP_CXX}, []
    split_units = set()  # launcher names of the split-K GEMMs instantiated
    for op, cid, dtype in chosen:
        cfg = table["config"](op, cid)
        header, macro, args_t, launch, alias, _ = _OP_CXX[op]
        name = table["kernel_name"](op, cid, dtype)
        (tm, tn, tk), (cm, cn) = cfg.tile, cfg.cluster
        swapped = cfg.operands == "swapped"  # CUTLASS's problem is (N, M): its tile and cluster transposed
        if swapped:
            tm, tn, cm, cn = tn, tm, cn, cm
        # the template's trailing arguments: (StreamK mode,) Swapped (csrc/common/fused_gemm.cuh Sm90FusedGemm)
        sw_split = ", /*Swapped=*/true" if swapped else ""
        group = kernels.setdefault((f"{op}_fused", macro, header, tn not in _DEFAULT_MMA_N), [])
        kernel_sched, epi_sched = _SCHEDULES[cfg.schedule]
        if cfg.loads == "multicast-first":  # csrc/common/fused_gemm.cuh
            kernel_sched = f"flux::MulticastFirst<{kernel_sched}>"
        if cfg.source == "ahead":  # csrc/common/fused_gemm.cuh
            epi_sched = f"flux::SourceAhead<{epi_sched}>"
        src_in, src_out = table["DTYPE_IO"][dtype]
        shapes = (f"cute::Shape<cute::_{tm}, cute::_{tn}, cute::_{tk}>,\n"
                  f"      cute::Shape<cute::_{cm}, cute::_{cn}, cute::_1>, {kernel_sched}, {epi_sched}")
        dt_index = table["DTYPES"].index(dtype)
        if cfg.scheduler == "splitk":
            # One instantiation per (tile, cluster, schedule, input dtype): its fp32-output GEMM
            # and the reduction; the configurations' slice counts and output dtypes are arguments.
            split_launch, split_alias, same_as = _SPLIT_CXX[op]
            extra = ", int splits, int dtype"
            if name not in split_units:
                split_units.add(name)
                sw_same = ", /*StreamK=*/0, /*Swapped=*/true" if swapped else ""
                gemm = (f"{same_as}<{_DTYPE_ENUM[src_in + '_fp32']}, {shapes}{sw_same}>" if same_as
                        else f"{split_alias}<{_DTYPE_ENUM[src_in]}, {shapes}{sw_split}>")
                group.append((gemm, f"{op} split-K GEMM: {cfg.describe().replace(f', split-K into {cfg.splits}', '')}; {src_in} inputs, fp32 partials.",
                              _kernel_fn(name, args_t, f"{split_launch}<{split_alias}<{_DTYPE_ENUM[src_in]}, {shapes}{sw_split}>>",
                                         extra)))
                decls[op].append(f"void {name}(const {args_t}& a{extra});")
            cases[op].append(f"    case {cid * 4 + dt_index}: {name}(a, {cfg.splits}, {dt_index}); return true;")
            names.append(f"{op}:{cid}:{dtype}")
            continue
        # the alias's StreamK mode: 0 persistent (its default), 1 stream-K by CUTLASS's heuristic, 2 always
        stream_k = {"persistent": "", "streamk": ", /*StreamK=*/1", "streamk-all": ", /*StreamK=*/2"}[cfg.scheduler]
        if swapped:
            stream_k = ", /*StreamK=*/0, /*Swapped=*/true"
        gemm = f"{alias}<{_DTYPE_ENUM[dtype]}, {shapes}{stream_k}>"
        group.append((gemm, f"{op} configuration {cid}: {cfg.describe()}; {src_in} inputs, {src_out} output.",
                       _kernel_fn(name, args_t, f"{launch}<{gemm}>")))
        decls[op].append(f"void {name}(const {args_t}& a);")
        cases[op].append(f"    case {cid * 4 + dt_index}: {name}(a); return true;")
        names.append(f"{op}:{cid}:{dtype}")
    grouped = table["select_grouped"](spec) if with_sm90 else []
    g_decls, g_cases, g_names = [], [], []
    for cid, kind in grouped:
        cfg = table["grouped_config"](cid)
        name = table["grouped_kernel_name"](cid, kind)
        (tm, tn, tk), (cm, cn) = cfg.tile, cfg.cluster
        kind_id = table["GROUPED_KINDS"].index(kind)
        pingpong = str(cfg.schedule == "pingpong").lower()
        gemm = (f"GroupedGemm<cute::Shape<cute::_{tm}, cute::_{tn}, cute::_{tk}>,\n"
                f"      cute::Shape<cute::_{cm}, cute::_{cn}, cute::_1>, /*Pingpong=*/{pingpong}, {kind_id}>")
        kernels.setdefault(("gmm", "FLUX_GROUPED_IMPL", "moe/grouped_gemm.cuh", False), []).append((
            gemm, f"grouped GEMM configuration {cid}: {cfg.describe()}; kind {kind}.",
            _kernel_fn(name, "GroupedGemmArgs", f"launch_grouped<{gemm}>")))
        g_decls.append(f"void {name}(const GroupedGemmArgs& a);\n")
        g_cases.append(f"    case {cid * 3 + kind_id}: {name}(a); return true;")
        g_names.append(f"gmm:{cid}:{kind}")
    body = [_HEADER, "// The dispatch over the fused GEMM instantiations built (a bounded switch on\n"
            "// config * 4 + dtype variant) and over the grouped GEMMs (config * 3 + kind); anything\n"
            "// else returns false, and the op fails naming it.\n",
            '#include "ag_gemm/ag_gemm_fused.cuh"\n#include "gemm_rs/rs_fused.cuh"\n#include "moe/grouped_gemm.cuh"\n\n'
            'namespace flux {\n']
    for op, (_, _, args_t, _, _, fn) in _OP_CXX.items():
        body += [d + "\n" for d in decls[op]]
        body.append(_dispatch_fn(fn, args_t, "dtype", 4, cases[op]))
    body += g_decls
    body.append(_dispatch_fn("grouped_dispatch", "GroupedGemmArgs", "kind", 3, g_cases))
    body.append(f'std::string fused_kernels_built() {{ return "{" ".join(names)}"; }}\n')
    body.append(f'std::string grouped_kernels_built() {{ return "{" ".join(g_names)}"; }}\n\n}}  // namespace flux\n')
    rel = os.path.join(GENERATED, "fused_dispatch.cpp")
    _write_if_changed(os.path.join(ROOT, rel), "".join(body))
    sources = _write_units(kernels, _unit_kernels())
    for stale in glob.glob(os.path.join(out_dir, "*")):  # instantiations no longer selected
        if os.path.relpath(stale, ROOT) not in sources and not stale.endswith("fused_dispatch.cpp"):
            os.remove(stale)
    print(f"flux: {len(chosen)} fused GEMM and {len(grouped)} grouped GEMM instantiations in {len(sources)} units "
          f"(FLUX_KERNELS={spec}, FLUX_UNIT_KERNELS={_unit_kernels()})", file=sys.stderr)
    return [rel] + sources


HOST_UNITS = os.path.join("build", "flux_host")  # the host sources' combined units (relative to ROOT)
DEVICE_UNITS = os.path.join("build", "flux_device")  # the CUDA sources' combined units (relative to ROOT)


def _combined_units(files, units, directory, stem, suffix):
    """``files`` (paths relative to ROOT, under csrc/) as ``units`` translation units, each including a
    share of them, balanced by size (largest first, each to the least loaded unit), written into
    ``directory`` as <stem>_<i><suffix>. Their names at namespace scope must then stay distinct across the
    files of one unit (every file's anonymous namespace joins the unit's one; the build fails on a clash).
    Returns the units' paths (relative to ROOT)."""
    out_dir = os.path.join(ROOT, directory)
    os.makedirs(out_dir, exist_ok=True)
    sized = sorted(files, key=lambda f: -os.path.getsize(os.path.join(ROOT, f)))
    groups, loads = [[] for _ in range(units)], [0] * units
    for f in sized:
        i = loads.index(min(loads))
        groups[i].append(f)
        loads[i] += os.path.getsize(os.path.join(ROOT, f))
    paths = []
    for i, group in enumerate(groups):
        rel = os.path.join(directory, f"{stem}_{i}{suffix}")
        text = f"// Generated by setup.py (_combined_units): csrc's {stem} sources; edit those, not this file.\n" + \
            "".join(f'#include "{os.path.relpath(f, "csrc")}"\n' for f in sorted(group))
        _write_if_changed(os.path.join(ROOT, rel), text)
        paths.append(rel)
    return paths


def _host_units(cpp_files, units=2):
    """The host sources (csrc/**/*.cpp) as ``units`` translation units (_combined_units): every one of them
    parses ATen's headers, which is most of its compile time (about a minute of one core each, 11 files),
    so that two units cost about what two files did."""
    return _combined_units(cpp_files, units, HOST_UNITS, "host", ".cpp")


def _device_units(cu_files, units=2):
    """The CUDA sources (csrc/**/*.cu, the kernels beside the CUTLASS GEMMs) as ``units`` translation units
    (_combined_units): each file's front end (ATen's and CUDA's headers through cudafe++, cicc and the host
    compiler) is most of its compile time; on the 2-core build machine the seven files took 154 s of a core
    apart and 85 s as two units."""
    return _combined_units(cu_files, units, DEVICE_UNITS, "device", ".cu")


def _default_jobs():
    """One compiler per CPU, but no more than one per 9 GB of available memory (a unit of five
    CUTLASS instantiations, _write_units, takes up to about 8.3 GB in nvcc's front end)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(l.split()[1]) for l in f if l.startswith("MemAvailable:"))
        cpus = min(cpus, max(1, avail_kb // (9 * 1024 * 1024)))
    except (OSError, StopIteration, ValueError):
        pass
    return max(1, cpus)


def _loaded_libstdcxx():
    """The path of the libstdc++ shared library this process (torch imported) has loaded, or None.

    Some toolchains link libstdc++ statically into shared objects. flux._C then holds a second copy
    whose locale facets were never set up, and the first number formatted into an error message
    (TORCH_CHECK's text) crashes the process. Naming torch's own libstdc++ on the link line
    resolves every reference to it, so that one copy serves the process.
    """
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def _short_progress(cpp_extension):
    """torch runs ninja with -v: every progress line is a whole compiler command. Run it without
    -v and with a short description per file ("flux: [3/25, 95.2 s] nvcc ag_fused_c5_bf16.cu").
    ninja, writing into a pipe, prints a file's line when it finishes (a CUTLASS kernel takes a
    minute or more), so the count of files comes first."""
    if os.environ.get("FLUX_BUILD_VERBOSE", "0") == "1" or not hasattr(cpp_extension, "_run_ninja_build"):
        return

    def run_ninja(build_directory, verbose, error_prefix):
        path = os.path.join(build_directory, "build.ninja")
        with open(path) as f:
            lines = f.read().splitlines()
        out, edges = [], 0
        for line in lines:
            out.append(line)
            m = re.match(r"build (.+?): (cuda_compile|compile) (.+?)(\s*\|.*)?$", line)
            if m:
                edges += 1
                tool = "nvcc" if m.group(2) == "cuda_compile" else "c++"
                src = os.path.basename(m.group(3).replace("$ ", " ").strip())
                out.append(f"  description = {tool} {src}")
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")
        jobs = os.environ.get("MAX_JOBS")
        print(f"flux: compiling {edges} files, {jobs} at a time, {time.time() - _T0:.0f} s after setup.py "
              "started; a line per file as it finishes (FLUX_BUILD_VERBOSE=1 prints the commands)", flush=True)
        cmd = ["ninja"] + (["-j", jobs] if jobs else [])
        env = dict(os.environ, NINJA_STATUS="flux: [%f/%t, %e s] ")
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            subprocess.run(cmd, stdout=1, stderr=subprocess.STDOUT, cwd=build_directory, check=True, env=env)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{error_prefix}: ninja exited with {e.returncode} (the failing command and its "
                               "output are above)") from e

    cpp_extension._run_ninja_build = run_ninja


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
    with_sm90 = "90a" in archs
    if with_sm90:  # the CUTLASS sm90 kernels (wgmma, TMA) need the sm_90a target
        nvcc_flags.append("-DFLUX_WITH_SM90")
        # The CUTLASS sm90 kernels then execute griddepcontrol.wait before their first global
        # access and launch_dependents near their end: the fused GEMMs can be launched with
        # programmatic dependent launch (csrc/common/fused_gemm.cuh, fused_pdl).
        nvcc_flags.append("-DCUTLASS_ENABLE_GDC_FOR_SM90")
    # CUTLASS's headers as system headers: their own warnings are not ours to print.
    nvcc_flags += [f"-isystem={d}" for d in include_dirs]
    sources = _device_units(sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)))
    sources += _host_units(sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)))
    sources += _generate_fused_sources(with_sm90)
    if not os.environ.get("MAX_JOBS"):
        os.environ["MAX_JOBS"] = str(_default_jobs())
    _short_progress(cpp_extension)
    ext = cpp_extension.CUDAExtension(
        name="flux._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), *include_dirs],
        # Hidden visibility, as pybind11 expects of a module (else g++ warns on every py::class_);
        # the module's entry point is exported by PYBIND11_MODULE.
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DNDEBUG", "-fvisibility=hidden",
                                    *(["-DFLUX_WITH_SM90"] if with_sm90 else [])],
                            "nvcc": nvcc_flags},
        extra_link_args=[lib] if (lib := _loaded_libstdcxx()) else [],
        py_limited_api=False,
    )
    cmdclass = {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}
    print(f"flux: building the CUDA extension for {archs} with CUDA_HOME={cuda_home}, "
          f"MAX_JOBS={os.environ['MAX_JOBS']}", file=sys.stderr)
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
