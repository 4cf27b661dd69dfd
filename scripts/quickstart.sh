#!/usr/bin/env bash
# From a fresh Debian 12 machine to a trained model: installs the packages, builds the trainer,
# converts the real Fashion-MNIST to HDF5 and trains the built-in job (ResNet-20, configs/resnet20_fmnist.yaml).
# Extra arguments go to the trainer (e.g. --set train.epochs=1). BUILD_DIR (default build) picks the build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target trainer
[[ -f datasets/fmnist/train.h5 && -f datasets/fmnist/test.h5 ]] ||
  "$build/trainer" convert-idx --src /usr/share/datasets/fashion-mnist --out datasets/fmnist
exec "$build/trainer" --run-dir runs/resnet20_fmnist "$@"
