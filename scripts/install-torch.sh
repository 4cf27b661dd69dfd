#!/usr/bin/env bash
# The second toolchain: LibTorch 2.11.0 with CUDA 13.0, from PyTorch's pip wheel (the GPU hosts'
# version), in a virtual environment that is created once and reused. Never touches the system Python.
#
#   scripts/install-torch.sh            create or reuse the environment; print the LibTorch root
#   scripts/install-torch.sh --python   ... print the environment's python instead
#
# The LibTorch root is the wheel's `torch` folder (lib/, include/, share/cmake/Torch), the same layout
# as pytorch.org's LibTorch zip, so one CMake line serves both: -DCMAKE_PREFIX_PATH=<root>.
# TRAINER_TORCH_VENV picks the folder (default ~/.cache/trainer/torch-2.11.0-cu130). The first run
# downloads about 3 GB from PyPI; progress goes to stderr, the answer to stdout.
set -euo pipefail

# Pinned: the wheel the GPU hosts run (torch 2.11.0+cu130 is PyPI's default build of 2.11.0) and what
# the Python references import (bench/reference.py, tests/ref/, the TensorBoard and plot checks).
pins=(torch==2.11.0 torchvision==0.26.0 numpy==2.4.6 pyyaml==6.0.3 protobuf==7.36.2 matplotlib==3.11.2)
# The libraries the weight-file tests load and save with (tests/test_safetensors.cpp, tests/ref/):
# safetensors, transformers (GPT2LMHeadModel) and timm (ResNet, ViT); the tokenizer tests' references
# (tests/test_tokenizer.cpp): tiktoken, and tokenizers (transformers brings it); the 8-bit optimizer
# state's (tests/test_optim_state.cpp): torchao; the LoRA tests' (tests/test_lora.cpp): peft. Added to an existing
# environment without rebuilding it: a change here reinstalls only these (pip leaves the satisfied pins
# above alone).
extras=(safetensors==0.8.0 transformers==5.23.0 timm==1.0.31 tiktoken==0.14.0 torchao==0.18.0 peft==0.21.0)
# GPT-2's rank file, gpt2.tiktoken, without the internet: openai-whisper ships it in whisper/assets/.
# Installed without its dependencies (numba, its own torch pin): only the file is used.
no_deps=(openai-whisper==20250625)
venv=${TRAINER_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/trainer/torch-2.11.0-cu130}
stamp="$venv/.trainer-pins"
extras_stamp="$venv/.trainer-extras"

want=${1:-}
if [[ ! -f $stamp || $(cat "$stamp") != "${pins[*]}" ]]; then
  # Debian's interpreter (python3-venv); `python3` on PATH may be another one.
  py=/usr/bin/python3
  [[ -x $py ]] || py=$(command -v python3)
  echo "install-torch: creating $venv (${pins[*]})" >&2
  start=$SECONDS
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv" >&2 || { echo "install-torch: '$py -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
  "$venv/bin/pip" install --no-cache-dir --progress-bar off -q "${pins[@]}" >&2
  echo "${pins[*]}" > "$stamp"
  rm -f "$extras_stamp"
  echo "install-torch: done in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))" >&2
fi
if [[ ! -f $extras_stamp || $(cat "$extras_stamp") != "${extras[*]} ${no_deps[*]}" ]]; then
  echo "install-torch: adding ${extras[*]} ${no_deps[*]} to $venv" >&2
  start=$SECONDS
  # The pins again, so that pip keeps them (a newer dependency may not replace torch or numpy).
  "$venv/bin/pip" install --no-cache-dir --progress-bar off -q "${pins[@]}" "${extras[@]}" >&2
  "$venv/bin/pip" install --no-cache-dir --progress-bar off -q --no-deps "${no_deps[@]}" >&2
  echo "${extras[*]} ${no_deps[*]}" > "$extras_stamp"
  echo "install-torch: extras done in $((SECONDS - start)) s" >&2
fi

case $want in
  --python) echo "$venv/bin/python" ;;
  "") "$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' ;;
  *) echo "usage: scripts/install-torch.sh [--python]" >&2; exit 2 ;;
esac
