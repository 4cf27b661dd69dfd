#!/usr/bin/env bash
# Installs the Debian 12 packages the trainer builds and runs with (skips the apt call when all are
# present). Needs root or sudo. With --fuzz, also clang and its libFuzzer runtime (scripts/fuzz.sh); with
# --container, buildah, podman and debootstrap (scripts/container-test.sh); both flags may be given.
set -euo pipefail
# libopenblas0-openmp: LibTorch's libblas.so.3 becomes OpenBLAS instead of the netlib reference BLAS.
# libjpeg62-turbo-dev, libpng-dev: data/pixels/jpeg.cpp decodes JPEG (libjpeg-turbo) and PNG images.
# ccache: CMakeLists.txt compiles through it when it is installed (a rebuild of unchanged files is cheap).
# libpcre2-dev: PCRE2's Unicode property tables, which GPT-2's pre-tokenizer reads its letters and numbers
# from (data/text/pretokenize.cpp; convert-text --tokenizer).
# libcurl4-openssl-dev: the MLflow tracker speaks to its server through libcurl (trainer/track/).
# libgloo-dev: the headers of the Gloo library LibTorch's c10d uses (distributed training on the CPU).
# prometheus: `promtool` checks and unit-tests deploy/prometheus/'s alert rules, and the server scrapes a
# training run in tests/test_prometheus.cpp (the test starts its own on a free loopback port; on a machine
# with systemd the package also enables its own service on :9090, which the tests do not use).
pkgs=(cmake ninja-build g++ ccache libtorch-dev libopenblas0-openmp libspdlog-dev libcxxopts-dev libyaml-cpp-dev libhdf5-dev
      zlib1g-dev libjpeg62-turbo-dev libpng-dev libpcre2-dev libicu-dev libcurl4-openssl-dev libgtest-dev libgmock-dev libgloo-dev nlohmann-json3-dev
      python3-torch python3-torchvision python3-matplotlib python3-protobuf python3-venv
      dataset-fashion-mnist fortunes prometheus)
for flag in "$@"; do
  case $flag in
    --fuzz) pkgs+=(clang-14 libclang-rt-14-dev) ;;
    --container) pkgs+=(buildah podman debootstrap curl) ;;
    *) echo "usage: scripts/install-deps.sh [--fuzz] [--container]" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
((${#missing[@]})) || exit 0
echo "installing: ${missing[*]}"
sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
