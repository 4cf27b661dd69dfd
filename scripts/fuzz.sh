#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, docs/FUZZING.md) into build-fuzz/ and runs each for
# SECONDS_PER_TARGET seconds (default 60), one after the other.
#
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET ...]     # targets: idx image_h5 tokens ...
#
# Exit 0: no finding in this project's code. Exit 1: a finding (crash, abort, undocumented exception,
# sanitizer report, leak, timeout, huge allocation) whose stack starts in this project's code; the input
# is under build-fuzz/crashes/<target>/. Exit 2: the build cannot be made.
# A finding whose stack starts inside a system library (libhdf5, LibTorch, ...) is listed and kept under
# build-fuzz/crashes/<target>/dependency/ but does not fail the run (this tree cannot fix it;
# docs/FUZZING.md lists the known ones); fuzzing then goes on for the rest of the target's time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(idx image_h5 tokens state_dict safetensors config control manifest jpeg)
[[ $secs =~ ^[0-9]+$ ]] || { echo "fuzz.sh: SECONDS_PER_TARGET must be a whole number, got '$secs'" >&2; exit 2; }

if ! command -v clang++-14 >/dev/null || [[ ! -e $(clang++-14 -print-resource-dir 2>/dev/null)/lib/linux/libclang_rt.fuzzer-x86_64.a ]]; then
  bash "$root/scripts/install-deps.sh" --fuzz >&2 ||
    { echo "fuzz.sh: clang++-14 with libFuzzer is missing: apt-get install clang-14 libclang-rt-14-dev (or run scripts/install-deps.sh --fuzz as root)" >&2; exit 2; }
fi

build="$root/build-fuzz"
CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" -G Ninja -DTRAINER_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null ||
  { echo "fuzz.sh: configuring $build failed" >&2; exit 2; }
nice -n 10 cmake --build "$build" -j"${FUZZ_JOBS:-2}" ||
  { echo "fuzz.sh: building $build failed" >&2; exit 2; }

# Prints "ours" or the library a finding's stack starts in: the first frame of the report that is not
# the sanitizers', libFuzzer's or the C/C++ runtime's (malloc hooks, intercepted memcpy, signal
# trampolines, abort). A library's frame is "(/path/libNAME.so...+0x...)"; anything else is ours.
where_found() {
  awk '/ERROR: |FINDING|Direct leak|ALARM/ {on = 1} on && /^ *#[0-9]+ 0x/ {
         if ($0 ~ / in (fuzzer::|__sanitizer|__asan|__lsan|__ubsan|__interceptor_|__GI_|__pthread_kill|__cxa_|__gnu_cxx::|std::terminate)/) next
         if ($0 ~ / in (malloc|calloc|realloc|free|operator new|operator delete|mem(cpy|move|set|cmp)|str[a-z]*|abort|raise)[ (]/) next
         if ($0 ~ /\((\/[^ )]*\/)?(libc\.so|libstdc\+\+\.so|libgcc_s\.so)/) next
         if (match($0, /\((\/[^ )]*\/)?lib[A-Za-z0-9_+.-]*\.so[.0-9]*/)) { lib = substr($0, RSTART + 1, RLENGTH - 1); sub(/.*\//, "", lib); print lib; exit }
         print "ours"; exit
       }
       END { if (!on) print "ours" }' "$1"
}

# Inputs a libFuzzer run executed (0 if it printed no statistics).
units() { local n; n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$1" | head -1); echo "${n:-0}"; }

failed=()
for t in "${targets[@]}"; do
  bin="$build/fuzz/fuzz_$t"
  [[ -x $bin ]] || { echo "fuzz.sh: no target '$t' ($bin)" >&2; exit 2; }
  # New inputs go to build-fuzz/corpus/<t> (the first folder); the seeds in the tree are only read.
  out="$build/crashes/$t"
  mkdir -p "$build/corpus/$t" "$out/dependency"
  dict=()
  [[ -f $root/fuzz/$t.dict ]] && dict=(-dict="$root/fuzz/$t.dict")
  echo "== fuzz_$t for ${secs}s"
  end=$((SECONDS + secs))
  runs=0 execs=0
  while ((SECONDS < end)); do
    runs=$((runs + 1))
    log="$out/run-$runs.log"
    # -timeout: an input that takes longer is a finding (a stall); -rss_limit_mb and its default
    # malloc limit: LibTorch and ASan use ~0.6 GB, an input may make the readers allocate the rest.
    if (cd "$out" && ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions="$root/fuzz/lsan.supp" \
        "$bin" -max_total_time=$((end - SECONDS)) -timeout=10 -rss_limit_mb=3072 -print_final_stats=1 \
        -artifact_prefix="$out/" "${dict[@]}" "$build/corpus/$t" "$root/fuzz/corpus/$t" > "$log" 2>&1); then
      execs=$((execs + $(units "$log")))
      break
    fi
    execs=$((execs + $(units "$log")))
    artifact=$(sed -n 's/.*Test unit written to //p' "$log" | tail -1)
    lib=$(where_found "$log")
    if [[ $lib == ours ]]; then
      failed+=("$t")
      echo "fuzz.sh: fuzz_$t: a finding in this project's code: $artifact (log $log)" >&2
      grep -E "==[0-9]+==ERROR|FINDING|^SUMMARY" "$log" | head -3 >&2 || true
      break
    fi
    kept="$out/dependency/$(basename "${artifact:-unknown}")"
    [[ -n $artifact && -f $artifact ]] && mv "$artifact" "$kept"
    cp "$log" "$kept.log"
    echo "fuzz.sh: fuzz_$t: a finding inside $lib (not this tree's code): $kept; $(grep -m1 -E '^SUMMARY' "$log" || true)"
  done
  echo "fuzz_$t: $execs inputs in $runs run(s), $((execs / (secs > 0 ? secs : 1))) per second"
done
if ((${#failed[@]})); then
  echo "fuzz.sh: findings in: ${failed[*]} (inputs under $build/crashes/; docs/FUZZING.md says what to do)" >&2
  exit 1
fi
echo "fuzz.sh: no finding in this project's code in ${targets[*]} (${secs}s each)"
