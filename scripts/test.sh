#!/usr/bin/env bash
# Builds the trainer and runs the whole test suite (GoogleTest through CTest) on both supported
# toolchains; this is what CI runs. Every leg must pass.
#
#   1. Debian's LibTorch 1.13 (CPU) into build/.
#   2. LibTorch 2.11.0 with CUDA 13.0 from PyTorch's wheel (scripts/install-torch.sh, a reused virtual
#      environment, downloaded while leg 1 compiles) into build-cuda/: every file compiled with
#      TRAINER_WITH_CUDA and NCCL, then every test that needs no GPU device (the CUDA-only tests skip
#      with their reason), with the wheel's Python as the reference interpreter. Needs the CUDA toolkit's
#      nvcc at configure time (/usr/local/cuda, or CUDACXX).
#   3. The libFuzzer targets of the readers of outside files (scripts/fuzz.sh, clang 14 with ASan and
#      UBSan, into build-fuzz/): each target for TRAINER_FUZZ_SECONDS (default 30) from the seed corpus
#      in fuzz/corpus/, one per core at a time. A finding in this project's code fails the leg
#      (docs/FUZZING.md).
#   Both run tests/test_mlflow.cpp against a real MLflow server (scripts/install-mlflow.sh, a reused virtual
#   environment made before leg 1). The suites of tests/one_toolchain.txt (the MLflow tracker, the run
#   folder's lock, the config parser's refusals...: code LibTorch's version does not touch) run on leg 1
#   only when both legs run.
#   4. The container (scripts/container-test.sh): deploy/Dockerfile built with buildah on a Debian base
#      image made here by debootstrap, a job in the image stopped with SIGTERM and resumed to the weights
#      of an uninterrupted run, the endpoint probed from the host, the Kubernetes manifests validated.
#      The base image and the image build run beside legs 1-3, from the start, at a lower priority (nice
#      10; log: build.container.log): most of a cold image build is apt, pip and layer commits, which
#      wait on the network and the disk while the other legs compile. The run and the manifests follow
#      the other legs.
#
# First, in under a second: scripts/check-docs.py (the figures README.md and docs/ cite against their
# JSON under bench/results/, and the docs' voice) and scripts/check-python.py (a name that bench/'s or
# scripts/' Python reads and nothing defines, which would fail only where that branch runs: on a GPU)
# and scripts/check-functions.sh (every product source file over 600 lines, then every product function
# over 80 lines, named by lizard). CTest runs one process per GoogleTest suite, each writing its XML
# report under <build>/tests/results/; after each toolchain's tests the slowest test cases are listed
# (scripts/test-times.py), and at the end each leg's time and the total. A total past
# TRAINER_TEST_WARN_MIN minutes (default 45) prints a warning naming the slowest tests (docs/TESTING.md).
#
# Usage: scripts/test.sh [extra ctest args]. TRAINER_LEGS="debian cuda fuzz container" (the default)
# picks the legs; BUILD_DIR (default build) and CUDA_BUILD_DIR (default build-cuda) the folders.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
legs=${TRAINER_LEGS:-debian cuda fuzz container}
for l in $legs; do
  case $l in
    debian | cuda | fuzz | container) ;;
    *) echo "error: TRAINER_LEGS: unknown leg '$l' (debian, cuda, fuzz, container)"; exit 2 ;;
  esac
done
want() { [[ " $legs " == *" $1 "* ]]; }
jobs=$(nproc)
ctest_args=("$@")
times=()      # "leg|what it took", printed at the end
test_dirs=()  # the build folders whose test reports the warning reads

t0=$SECONDS
extra=()
want fuzz && extra+=(--fuzz)
want container && extra+=(--container)
scripts/install-deps.sh "${extra[@]}"
times+=("Debian packages|$((SECONDS - t0)) s")
echo "== docs: figures against bench/results/, and the voice"
/usr/bin/python3 scripts/check-docs.py   # under a second; one line per problem
echo "== python: names bench/ and scripts/ read that nothing defines"
/usr/bin/python3 scripts/check-python.py || exit 1
echo "== sizes: no file over 600 lines, no function over 80 (lizard)"
scripts/check-functions.sh

# MLflow's server and client for tests/test_mlflow.cpp (scripts/install-mlflow.sh: a minute the first time,
# reused after). Its tests must run here: a missing MLflow fails them instead of skipping them.
if want debian || want cuda; then
  t0=$SECONDS
  mlflow_py=$(scripts/install-mlflow.sh)
  export TRAINER_REQUIRE_MLFLOW=1
  times+=("MLflow environment|$((SECONDS - t0)) s")
fi

# Work beside the legs, stopped with its children if the script ends early.
background=()
kill_tree() { local c; for c in $(pgrep -P "$1" || true); do kill_tree "$c"; done; kill "$1" 2>/dev/null || true; }
trap 'for p in "${background[@]}"; do kill_tree "$p"; done' EXIT
forget() { local keep=() p; for p in "${background[@]}"; do [[ $p == "$1" ]] || keep+=("$p"); done; background=("${keep[@]}"); }
# The 2.11 environment (3 GB of wheels the first time) is network and disk; it is fetched while the
# 1.13 leg compiles.
torch_log=${CUDA_BUILD_DIR:-build-cuda}.torch.log
if want cuda; then
  t_torch=$SECONDS
  scripts/install-torch.sh >"${torch_log%.log}-root.log" 2>"$torch_log" &
  torch_pid=$!
  background+=("$torch_pid")
fi
container_log=build.container.log
if want container; then
  t_container=$SECONDS
  echo "== container: the base image and the image build start beside the other legs (log: $container_log)"
  nice -n 10 bash scripts/container-test.sh base build >"$container_log" 2>&1 &
  container_pid=$!
  background+=("$container_pid")
fi

leg() {  # name, build folder, extra cmake args... (extra ctest args: the array leg_ctest)
  local name=$1 dir=$2
  shift 2
  local t0=$SECONDS
  mkdir -p "$dir"
  echo "== $name: configure and build in $dir"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRAINER_MLFLOW_PYTHON="$mlflow_py" "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; echo "== $name: configure failed"; return 1; }
  grep 'trainer:' "$dir.configure.log" || true
  cmake --build "$dir" -j "$jobs"
  local t1=$SECONDS
  echo "== $name: ctest"
  rm -rf "$dir/tests/results"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "${leg_ctest[@]}" "${ctest_args[@]}")
  /usr/bin/python3 scripts/test-times.py "$dir" --top 10 || true
  echo "== $name: passed (build $((t1 - t0)) s, tests $((SECONDS - t1)) s)"
  times+=("$name: build, tests|$((t1 - t0)) s, $((SECONDS - t1)) s")
  test_dirs+=("$dir")
}

leg_ctest=()
if want debian; then
  leg "LibTorch 1.13 (Debian, CPU)" "${BUILD_DIR:-build}"
  # The suites of tests/one_toolchain.txt (code LibTorch's version does not touch) have run: once is enough.
  leg_ctest=(-LE one_toolchain)
fi
if want cuda; then
  t0=$SECONDS
  wait "$torch_pid" || { cat "$torch_log"; echo "error: the LibTorch 2.11 environment could not be made"; exit 1; }
  forget "$torch_pid"
  root=$(cat "${torch_log%.log}-root.log")
  py=$(scripts/install-torch.sh --python)
  echo "== LibTorch 2.11 environment ready: $root ($((SECONDS - t_torch)) s, $((SECONDS - t0)) s of it waited for)"
  times+=("LibTorch 2.11 environment (beside the 1.13 leg), waited for|$((SECONDS - t_torch)) s, $((SECONDS - t0)) s")
  nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  [[ -x $nvcc ]] || { echo "error: the CUDA leg needs nvcc (the CUDA 13.0 toolkit in /usr/local/cuda, or CUDACXX)"; exit 1; }
  # TORCH_CUDA_ARCH_LIST: no GPU to detect here; 9.0 is the H100/H200 hosts'. Nothing of the trainer
  # is compiled for the device, the list only silences LibTorch's detection.
  CUDACXX=$nvcc TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
    leg "LibTorch 2.11 (wheel, CUDA 13.0)" "${CUDA_BUILD_DIR:-build-cuda}" \
    -DCMAKE_PREFIX_PATH="$root" -DTRAINER_REFERENCE_PYTHON="$py"
fi
if want fuzz; then
  t0=$SECONDS
  echo "== libFuzzer targets (clang 14, ASan + UBSan): ${TRAINER_FUZZ_SECONDS:-30} s each, $jobs at a time"
  bash scripts/fuzz.sh "${TRAINER_FUZZ_SECONDS:-30}"
  echo "== libFuzzer targets: passed ($((SECONDS - t0)) s)"
  times+=("fuzzing (build, then the targets)|$((SECONDS - t0)) s")
fi
if want container; then
  t0=$SECONDS
  echo "== container: waiting for the image build (scripts/container-test.sh base build)"
  wait "$container_pid" || { tail -n 40 "$container_log"; echo "== container: the image build failed (log: $container_log)"; exit 1; }
  forget "$container_pid"
  grep -E '^(base|build|== container)' "$container_log" || true
  t1=$SECONDS
  echo "== container: the image's job and the manifests (scripts/container-test.sh run k8s)"
  bash scripts/container-test.sh run k8s
  echo "== container: passed (base and build $((t1 - t_container)) s beside the other legs, $((t1 - t0)) s of it waited for; run and manifests $((SECONDS - t1)) s)"
  times+=("container: base and build (beside the other legs), waited for|$((t1 - t_container)) s, $((t1 - t0)) s")
  times+=("container: run, manifests|$((SECONDS - t1)) s")
fi

total=$((SECONDS - start))
echo "== every leg passed: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%Y-%m-%d)"
for t in "${times[@]}"; do printf '   %-60s %s\n' "${t%%|*}" "${t#*|}"; done
printf '   %-60s %d min %d s\n' "total" $((total / 60)) $((total % 60))
warn=${TRAINER_TEST_WARN_MIN:-45}
if ((total > warn * 60)); then
  echo "warning: the test command took $((total / 60)) min, past $warn min (CI's limit is 90); its slowest tests:"
  ((${#test_dirs[@]})) && /usr/bin/python3 scripts/test-times.py "${test_dirs[@]}" --top 10 | sed 's/^/warning: /'
  echo "warning: shorten them, or share their fixtures (docs/TESTING.md, \"Keeping it fast\")"
fi
