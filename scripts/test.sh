#!/usr/bin/env bash
# Builds the trainer and runs the whole test suite (GoogleTest through CTest) on both supported
# toolchains; this is what CI runs. Both legs must pass.
#
#   1. Debian's LibTorch 1.13 (CPU) into build/.
#   2. LibTorch 2.11.0 with CUDA 13.0 from PyTorch's wheel (scripts/install-torch.sh, a reused virtual
#      environment) into build-cuda/: every file compiled with TRAINER_WITH_CUDA and NCCL, then every
#      test that needs no GPU device (the CUDA-only tests skip with their reason), with the wheel's
#      Python as the reference interpreter. Needs the CUDA toolkit's nvcc at configure time
#      (/usr/local/cuda, or CUDACXX).
#
#   3. The libFuzzer targets of the readers of outside files (scripts/fuzz.sh, clang 14 with ASan and
#      UBSan, into build-fuzz/): each target for TRAINER_FUZZ_SECONDS (default 30) from the seed corpus
#      in fuzz/corpus/. A finding in this project's code fails the leg (docs/FUZZING.md).
#   4. The container (scripts/container-test.sh): deploy/Dockerfile built with buildah on a Debian base
#      image made here by debootstrap, a job in the image stopped with SIGTERM and resumed to the weights
#      of an uninterrupted run, the endpoint probed from the host, the Kubernetes manifests validated.
#      About 7 min with its caches warm (the base image, the Dockerfile's wheelhouse and ccache mounts
#      under ~/.cache/trainer/container); about 12 min cold.
#
# First, in under a second: scripts/check-docs.py (the figures README.md and docs/ cite against their
# JSON under bench/results/, and the docs' voice).
#
# Usage: scripts/test.sh [extra ctest args]. TRAINER_LEGS="debian cuda fuzz container" (the default)
# picks the legs; BUILD_DIR (default build) and CUDA_BUILD_DIR (default build-cuda) the folders.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
echo "== docs: figures against bench/results/, and the voice"
/usr/bin/python3 scripts/check-docs.py   # under a second; one line per problem
legs=${TRAINER_LEGS:-debian cuda fuzz container}
jobs=$(nproc)

leg() {  # name, build folder, extra cmake args...
  local name=$1 dir=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: configure and build in $dir"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; echo "== $name: configure failed"; return 1; }
  grep 'trainer:' "$dir.configure.log" || true
  cmake --build "$dir" -j "$jobs"
  local t1=$SECONDS
  echo "== $name: ctest"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "${ctest_args[@]}")
  echo "== $name: passed (build $((t1 - t0)) s, tests $((SECONDS - t1)) s)"
}

ctest_args=("$@")
for l in $legs; do
  case $l in
    debian)
      mkdir -p "${BUILD_DIR:-build}"
      leg "LibTorch 1.13 (Debian, CPU)" "${BUILD_DIR:-build}" ;;
    cuda)
      t0=$SECONDS
      root=$(scripts/install-torch.sh)
      py=$(scripts/install-torch.sh --python)
      echo "== LibTorch 2.11 environment ready in $((SECONDS - t0)) s: $root"
      nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
      [[ -x $nvcc ]] || { echo "error: the CUDA leg needs nvcc (the CUDA 13.0 toolkit in /usr/local/cuda, or CUDACXX)"; exit 1; }
      mkdir -p "${CUDA_BUILD_DIR:-build-cuda}"
      # TORCH_CUDA_ARCH_LIST: no GPU to detect here; 9.0 is the H100/H200 hosts'. Nothing of the trainer
      # is compiled for the device, the list only silences LibTorch's detection.
      CUDACXX=$nvcc TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
        leg "LibTorch 2.11 (wheel, CUDA 13.0)" "${CUDA_BUILD_DIR:-build-cuda}" \
        -DCMAKE_PREFIX_PATH="$root" -DTRAINER_REFERENCE_PYTHON="$py" ;;
    fuzz)
      t0=$SECONDS
      echo "== libFuzzer targets (clang 14, ASan + UBSan): ${TRAINER_FUZZ_SECONDS:-30} s each"
      bash scripts/fuzz.sh "${TRAINER_FUZZ_SECONDS:-30}"
      echo "== libFuzzer targets: passed ($((SECONDS - t0)) s)" ;;
    container)
      t0=$SECONDS
      echo "== container: deploy/Dockerfile with buildah (scripts/container-test.sh)"
      scripts/install-deps.sh --container
      bash scripts/container-test.sh
      echo "== container: passed ($((SECONDS - t0)) s)" ;;
    *) echo "error: TRAINER_LEGS: unknown leg '$l' (debian, cuda, fuzz, container)"; exit 2 ;;
  esac
done
