#!/usr/bin/env bash
# Packs the CUDA build (LibTorch 2.11.0 + CUDA 13.0, built here by scripts/test.sh or by hand) into one
# folder that runs on a GPU host with the same PyTorch (2.11.0+cu130) without building there:
#
#   bin/trainer, bin/trainer_tests   stripped
#   lib/                             every shared library they need except LibTorch (torch/lib), CUDA
#                                    (the wheel's nvidia-* libraries, the driver) and the C/C++ runtime
#                                    (glibc, libstdc++, libgcc_s: every host has them)
#   run                              sets LD_LIBRARY_PATH to lib/ and the host's torch/lib, then runs
#                                    bin/<first argument>
#   src/                             what the tests and jobs read at run time: configs/, tests/ref/,
#                                    tests/fixtures/, bench/
#   py/                              transformers (the version the tests compare against) and what its
#                                    import needs, as wheels for the host's Python 3.12: the window's
#                                    Llama-family row trains transformers' model, and the host has no
#                                    transformers and no registry. Left out: numpy (the host has it) and
#                                    what only the Hub's downloads, its command line or the tokenizers
#                                    use (hf_xet, tokenizers, pydantic, rich): 18 of 30 MB. The host
#                                    unpacks only those it lacks (scripts/py-wheels.py).
#                                    TRAINER_BUNDLE_WHEELS=0 leaves them out (the row then says why it is
#                                    missing); TRAINER_BUNDLE_PYTHON_VERSION=3.11 makes them for this
#                                    machine's Python, to rehearse the window here
#   STAMP                            the commit the bundle was made from (git describe --always --dirty),
#                                    what `trainer --version` says, and when: a stale bundle shows at once
#
# and OUT.tar.xz, the same in one archive: what travels to the host (a GPU host takes at most 64 MiB of
# working tree and carried paths a call; the folder is over 100 MB, ICU's data alone 30 MB, the archive
# about 40 MB). scripts/gpu-check.sh unpacks it there beside itself when the folder is missing or older.
#
# Usage: scripts/bundle-gpu.sh [BUILD_DIR (build-cuda)] [OUT (.gpu-run/bundle)]
# On the host:  OUT/run trainer --config OUT/src/configs/...   or   OUT/run trainer_tests --gtest_filter=...
# The host's torch is found with TRAINER_TORCH_LIB, else `python3 -c 'import torch'` (TRAINER_PYTHON, else
# /opt/torch/.venv/bin/python3, else python3 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cuda}
out=${2:-.gpu-run/bundle}
[[ -x $build/trainer ]] || { echo "error: $build/trainer is missing; build the CUDA leg first (TRAINER_LEGS=cuda scripts/test.sh)"; exit 2; }
grep -q 'TRAINER_WITH_CUDA' "$build/compile_commands.json" ||
  { echo "error: $build is not a CUDA build (no TRAINER_WITH_CUDA); configure it against the wheel's LibTorch"; exit 2; }
torch_root=$(grep -m1 '^Torch_DIR:' "$build/CMakeCache.txt" | cut -d= -f2)
torch_root=$(cd "$torch_root/../../.." && pwd)  # <root>/share/cmake/Torch -> <root>
site=$(dirname "$torch_root")

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/src"
for b in trainer tests/trainer_tests; do
  [[ -x $build/$b ]] && strip -o "$out/bin/$(basename "$b")" "$build/$b"
done

# The closure of every binary's and library's needs, resolved as on the host: the wheel's libraries
# first. What resolves into the wheel, or is the C/C++ runtime or the CUDA driver, stays behind.
wheel_path="$torch_root/lib$(for d in "$site"/nvidia/*/lib; do [[ -d $d ]] && printf ':%s' "$d"; done)"
skip_re='^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcuda|libnvidia-ml)\.so'
declare -A seen=()
queue=("$out/bin/trainer")
[[ -x $out/bin/trainer_tests ]] && queue+=("$out/bin/trainer_tests")
while ((${#queue[@]})); do
  f=${queue[0]}
  queue=("${queue[@]:1}")
  while read -r name path; do
    [[ -n $name ]] || continue
    [[ $name =~ $skip_re ]] && continue
    [[ -n ${seen[$name]:-} ]] && continue
    seen[$name]=1
    if [[ $path == "not found" ]]; then echo "error: $f needs $name, which is not found here"; exit 1; fi
    case $path in "$site"/*) continue ;; esac  # LibTorch and CUDA from the wheel: the host has its own
    cp -L "$path" "$out/lib/$name"
    queue+=("$out/lib/$name")
  done < <(LD_LIBRARY_PATH="$out/lib:$wheel_path" ldd "$f" | awk '/=>/ {print $1, ($3 == "not" ? "not found" : $3)}')
done
strip --strip-unneeded "$out"/lib/*.so* 2>/dev/null || true

cp -r configs bench "$out/src/"
mkdir -p "$out/src/tests" && cp -r tests/ref tests/fixtures "$out/src/tests/"
rm -rf "$out/src/bench/results"

if [[ ${TRAINER_BUNDLE_WHEELS:-1} != 0 ]]; then
  py=$(scripts/install-torch.sh --python)
  version=$("$py" -c 'import transformers; print(transformers.__version__)') ||
    { echo "error: the 2.11 environment has no transformers (scripts/install-torch.sh installs it)"; exit 2; }
  mkdir -p "$out/py"
  "$py" -m pip download -q -d "$out/py" --only-binary=:all: --python-version "${TRAINER_BUNDLE_PYTHON_VERSION:-3.12}" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "transformers==$version" ||
    { echo "error: could not download transformers $version's wheels (PyPI unreachable?); TRAINER_BUNDLE_WHEELS=0 bundles without them"; exit 2; }
  # Not imported by `transformers.LlamaForCausalLM(config)` (checked beside torch 2.11 without them).
  for w in numpy hf_xet tokenizers pydantic pydantic_core annotated_types typing_inspection rich pygments \
    markdown_it_py mdurl; do rm -f "$out/py/$w"-[0-9]*.whl; done
fi

cat >"$out/run" <<'RUN'
#!/usr/bin/env bash
# Runs bin/<program> with this bundle's libraries and the host's LibTorch (scripts/bundle-gpu.sh).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prog=${1:?usage: run trainer|trainer_tests [args...]}
shift
if [[ -z ${TRAINER_TORCH_LIB:-} ]]; then
  py=${TRAINER_PYTHON:-}
  [[ -z $py && -x /opt/torch/.venv/bin/python3 ]] && py=/opt/torch/.venv/bin/python3
  py=${py:-python3}
  TRAINER_TORCH_LIB=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export TRAINER_PYTHON=$py
fi
# The CUDA runtime the executable links directly (libcudart.so.13) comes from the same wheel's nvidia-*
# packages, next to torch/.
cuda_libs=$(for d in "$TRAINER_TORCH_LIB"/../../nvidia/*/lib; do [[ -d $d ]] && printf ':%s' "$(cd "$d" && pwd)"; done)
export LD_LIBRARY_PATH="$here/lib:$TRAINER_TORCH_LIB$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The tests find the executable, the sources and the reference Python here, not where they were built.
export TRAINER_TEST_BIN="$here/bin/trainer" TRAINER_TEST_SOURCE_DIR="$here/src"
[[ -n ${TRAINER_PYTHON:-} ]] && export TRAINER_TEST_PYTHON=$TRAINER_PYTHON
exec "$here/bin/$prog" "$@"
RUN
chmod +x "$out/run"
{
  echo "source: $(git describe --always --dirty 2>/dev/null || echo unknown)"
  echo "binary: $(LD_LIBRARY_PATH="$out/lib:$wheel_path" "$out/bin/trainer" --version 2>/dev/null | head -n 1)"
  echo "bundled: $(date -u +%Y-%m-%dT%H:%M:%SZ) from $build"
} >"$out/STAMP"
cat "$out/STAMP"
tar -C "$out" -cf - . | xz -T0 -6 >"$out.tar.xz"
du -sh "$out" | awk '{print "bundle: " $2 ", " $1}'
ls -1 "$out/lib" | tr '\n' ' '; echo
# What a call to a GPU host carries: the archive and the working tree (tracked and untracked files git
# does not ignore).
tree=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{n += $1} END {print n + 0}')
archive=$(stat -c %s "$out.tar.xz")
awk -v a="$archive" -v t="$tree" -v f="$out.tar.xz" 'BEGIN {
  printf "carry: %s, %.1f MiB; with the working tree %.1f MiB (a GPU host takes 64 MiB)\n", f, a / 2^20, (a + t) / 2^20
  if (a + t > 64 * 2^20) { print "warning: over 64 MiB: the call would be refused"; exit 1 } }'
