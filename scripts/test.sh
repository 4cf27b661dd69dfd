#!/usr/bin/env bash
# Builds the trainer and runs the whole test suite (GoogleTest through CTest).
# Usage: scripts/test.sh [extra ctest args]. BUILD_DIR (default build) picks the build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)"
cd "$build" && ctest --output-on-failure -j "$(nproc)" "$@"
