#!/usr/bin/env bash
# One call on a fresh GPU machine: install carried wheels, build flux._C (or reuse a build
# carried in .ext/ when csrc/ and setup.py are unchanged), run the GPU tests and the main
# benchmark, and leave logs and JSON in OUTDIR.
#
#   bench/run_gpu.sh OUTDIR [--quick] [--skip-tests] [--tests EXPR] [--skip-bench] [--tune] [--matrix] [--layers] [--moe]
#                    [--moe-tp] [--host-profile] [--fused] [--shared W[,W...]] [-- extra bench_ops.py args]
#
# --tests EXPR: only the GPU tests that pytest -k EXPR selects (default: "gpu and not shared"), bounded by
# $TESTS_TIMEOUT s (default 900; set it below the machine's per-call limit less the build).
#
# --tune: before the benchmark, tune the public suite (torchrun -m flux.autotune --suite) into
# OUTDIR/cache and let the benchmark's flux:auto use that cache (FLUX_CACHE_DIR).
# --matrix: after the benchmark, bench_ops.py --matrix (every documented argument against NCCL then
# cuBLAS doing the same) into OUTDIR/matrix.json. --layers: bench/bench_layers.py (the sequence-parallel
# MLP block and a Megatron layer, flux against NCCL + cuBLAS and async-TP; arguments in $LAYERS_ARGS) into
# OUTDIR/layers.json. --moe: bench/bench_moe.py (MoE dispatch/combine and layer against an all-to-all
# dispatcher; arguments in $MOE_ARGS) into OUTDIR/moe.json. --moe-tp: bench/bench_moe_tp.py (the
# tensor-parallel MoE MLP against its unfused references; arguments in $MOE_TP_ARGS) into
# OUTDIR/moe_tp.json. --fused: bench/bench_fused_gemm.py on one GPU (each fused kernel alone, every flag
# set, against torch.mm: the library's own choice over the model grid, docs/performance.md §9; arguments in
# $FUSED_ARGS, default "--grid models --configs 999 --swizzles 1") into OUTDIR/fused_gemm.json.
# --host-profile: bench/profile_host.py (the CUDA API calls and ATen ops of one call, per strategy) into
# OUTDIR/host.json. Their output goes to bench.log too. The fused and MoE benchmarks run before the layers
# one; STEP_TIMEOUT (s, default 600) bounds each of them.
# --shared 4,8: also run the GPU cases with 4, then 8 ranks sharing this machine's GPUs
# (tests/test_ops.py::test_gpu_shared: gloo, FLUX_GLOO_CUDA=1; correctness only), into
# OUTDIR/tests-shared-W.log, and the MoE GPU cases with W ranks (tests/test_moe_symm.py) into
# OUTDIR/tests-shared-moe-W.log.
#
# On a machine without network, carry the nvidia-cutlass wheel in .whl/ (git-ignored), made here with:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl nvidia-cutlass==4.2.0.0
# A build made elsewhere for the same torch and Python can be carried as .ext/flux_C.so with
# .ext/flux_C.hash (this script's hash of setup.py, csrc/, flux/fused_configs.py and FLUX_KERNELS) to skip the build (~70 s on 32 cores);
# where a machine's outputs are size-limited, the stripped copy below is the one to carry.
#
# Writes: build.log (the machine and versions first), tests.log, bench.log,
# bench_ops.json, with --tune autotune.log and cache/tune-<topology>.json, with --fused fused_gemm.json, with
# --matrix matrix.json, with --layers layers.json, with --moe moe.json, with --moe-tp moe_tp.json, with --host-profile
# host.json; after a fresh build, flux_C.so and flux_C.hash.
set -uo pipefail
OUTDIR=${1:?usage: bench/run_gpu.sh OUTDIR [--quick] [--skip-tests] [--skip-bench] [-- bench args]}
shift
QUICK=0; TESTS=1; TEST_EXPR="gpu and not shared"; BENCH=1; TUNE=0; MATRIX=0; LAYERS=0; MOE=0; MOETP=0; HOSTPROF=0; FUSED=0; SHARED=""; BENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --skip-tests) TESTS=0 ;;
    --tests) shift; TEST_EXPR=${1:?--tests needs a pytest -k expression} ;;
    --skip-bench) BENCH=0 ;;
    --tune) TUNE=1 ;;
    --matrix) MATRIX=1 ;;
    --layers) LAYERS=1 ;;
    --moe) MOE=1 ;;
    --moe-tp) MOETP=1 ;;
    --host-profile) HOSTPROF=1 ;;
    --fused) FUSED=1 ;;
    --shared) shift; SHARED=${1:?--shared needs world sizes, e.g. 4,8} ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
mkdir -p "$OUTDIR"
# NVLink multicast stays off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  nvidia-smi topo -m
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} > "$OUTDIR/build.log" 2>&1

# The build's inputs: setup.py, csrc/, the fused GEMM table it generates kernels from, and the
# FLUX_KERNELS selection (C locale: the same file order everywhere).
hash=$( (cat setup.py flux/fused_configs.py $(find csrc -type f | LC_ALL=C sort); echo "FLUX_KERNELS=${FLUX_KERNELS:-default}") | sha256sum | cut -c1-16)
if [ -f .ext/flux_C.so ] && [ "$(cat .ext/flux_C.hash 2>/dev/null)" = "$hash" ]; then
  echo "reusing carried build $hash" | tee -a "$OUTDIR/build.log"
  cp .ext/flux_C.so "flux/_C$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  REUSED=1
else
  start=$(date +%s)
  FLUX_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-32} $PY setup.py build_ext --inplace >> "$OUTDIR/build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUTDIR/build.log"
  grep -E "error|warning.*C7510" "$OUTDIR/build.log" | head -20
  [ $rc -eq 0 ] || exit $rc
  # A stripped copy (about 5 MB): put it in .ext/ and carry .ext to skip the next build.
  strip --strip-unneeded -o "$OUTDIR/flux_C.so" flux/_C*.so && echo "$hash" > "$OUTDIR/flux_C.hash"
fi
# The fused GEMMs must use Hopper's warpgroup MMA (HGMMA in SASS), not a fallback path.
echo "HGMMA instructions in flux._C: $(cuobjdump --dump-sass flux/_C*.so 2>/dev/null | grep -c HGMMA)" | tee -a "$OUTDIR/build.log"

rc_tests=0
if [ $TESTS -eq 1 ]; then
  # The workers' own logs (gpu-worker-w*.log: every case's error text) land in OUTDIR as each
  # worker ends, so a run cut short by the machine's time limit still shows why a case failed.
  FLUX_TEST_LOG_DIR=$OUTDIR timeout ${TESTS_TIMEOUT:-900} $PY -m pytest -v -rs tests -k "$TEST_EXPR" 2>&1 | tee "$OUTDIR/tests.log"
  rc_tests=${PIPESTATUS[0]}
fi
for w in ${SHARED//,/ }; do
  FLUX_TEST_SHARED_WORLD=$w FLUX_TEST_LOG_DIR=$OUTDIR timeout 600 $PY -m pytest -q -rs tests -k gpu_shared 2>&1 | tee "$OUTDIR/tests-shared-$w.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_tests=$rc
  FLUX_TEST_MOE_WORLD=$w FLUX_TEST_LOG_DIR=$OUTDIR timeout 660 $PY -m pytest -q -rs tests/test_moe_symm.py -k gpu_moe_symm 2>&1 | tee "$OUTDIR/tests-shared-moe-$w.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_tests=$rc
done
NPROC=${NGPUS:-$($PY -c 'import torch; print(torch.cuda.device_count())')}
rc_tune=0
if [ $TUNE -eq 1 ]; then
  mkdir -p "$OUTDIR/cache"
  export FLUX_CACHE_DIR="$OUTDIR/cache"
  timeout 600 torchrun --nproc_per_node="$NPROC" -m flux.autotune --suite 2>&1 | tee "$OUTDIR/autotune.log"
  rc_tune=${PIPESTATUS[0]}
fi
rc_bench=0
if [ $BENCH -eq 1 ]; then
  args=(--out "$OUTDIR/bench_ops.json")
  [ $QUICK -eq 1 ] && args+=(--quick)
  timeout 1200 torchrun --nproc_per_node="$NPROC" \
    bench/bench_ops.py "${args[@]}" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUTDIR/bench.log"
  rc_bench=${PIPESTATUS[0]}
fi
if [ $HOSTPROF -eq 1 ]; then
  timeout 300 torchrun --nproc_per_node="$NPROC" bench/profile_host.py --out "$OUTDIR/host.json" 2>&1 | tee -a "$OUTDIR/bench.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_bench=$rc
fi
if [ $FUSED -eq 1 ]; then
  timeout ${STEP_TIMEOUT:-600} $PY bench/bench_fused_gemm.py ${FUSED_ARGS:---grid models --configs 999 --swizzles 1} \
    --out "$OUTDIR/fused_gemm.json" 2>&1 | tee -a "$OUTDIR/bench.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_bench=$rc
fi
if [ $MOE -eq 1 ]; then
  timeout ${STEP_TIMEOUT:-600} torchrun --nproc_per_node="$NPROC" bench/bench_moe.py --out "$OUTDIR/moe.json" ${MOE_ARGS:-} 2>&1 | tee -a "$OUTDIR/bench.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_bench=$rc
fi
if [ $MOETP -eq 1 ]; then
  timeout ${STEP_TIMEOUT:-600} torchrun --nproc_per_node="$NPROC" bench/bench_moe_tp.py --out "$OUTDIR/moe_tp.json" ${MOE_TP_ARGS:-} 2>&1 | tee -a "$OUTDIR/bench.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_bench=$rc
fi
if [ $LAYERS -eq 1 ]; then
  timeout ${STEP_TIMEOUT:-600} torchrun --nproc_per_node="$NPROC" bench/bench_layers.py --out "$OUTDIR/layers.json" ${LAYERS_ARGS:-} 2>&1 | tee -a "$OUTDIR/bench.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_bench=$rc
fi
if [ $MATRIX -eq 1 ]; then
  args=(--matrix --out "$OUTDIR/matrix.json")
  [ $QUICK -eq 1 ] && args+=(--quick)
  timeout 600 torchrun --nproc_per_node="$NPROC" bench/bench_ops.py "${args[@]}" 2>&1 | tee -a "$OUTDIR/bench.log"
  rc=${PIPESTATUS[0]}; [ $rc -eq 0 ] || rc_bench=$rc
fi
echo "run_gpu: tests rc=$rc_tests tune rc=$rc_tune bench rc=$rc_bench"
[ $rc_tests -eq 0 ] && [ $rc_tune -eq 0 ] && [ $rc_bench -eq 0 ]
