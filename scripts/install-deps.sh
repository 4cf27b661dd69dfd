#!/usr/bin/env bash
# Installs the Debian 12 packages the trainer builds and runs with (skips the apt call when all are
# present). Needs root or sudo. With --fuzz, also clang and its libFuzzer runtime (scripts/fuzz.sh).
set -euo pipefail
# libopenblas0-openmp: LibTorch's libblas.so.3 becomes OpenBLAS instead of the netlib reference BLAS.
# libgloo-dev: the headers of the Gloo library LibTorch's c10d uses (distributed training on the CPU).
pkgs=(cmake ninja-build g++ libtorch-dev libopenblas0-openmp libspdlog-dev libcxxopts-dev libyaml-cpp-dev libhdf5-dev
      zlib1g-dev libgtest-dev libgmock-dev libgloo-dev libcpp-httplib-dev nlohmann-json3-dev
      python3-torch python3-torchvision python3-matplotlib python3-protobuf
      dataset-fashion-mnist fortunes)
[[ ${1:-} == --fuzz ]] && pkgs+=(clang-14 libclang-rt-14-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
((${#missing[@]})) || exit 0
echo "installing: ${missing[*]}"
sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
