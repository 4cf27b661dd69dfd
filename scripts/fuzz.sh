#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, docs/FUZZING.md) into build-fuzz/ and runs each for
# SECONDS_PER_TARGET seconds (default 60), one per core at a time (FUZZ_PARALLEL sets how many).
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
((${#targets[@]})) || targets=(idx image_h5 tokens tokenizer text state_dict safetensors config control manifest jpeg)
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

# One target: fuzzes it for $secs seconds, restarting after a finding inside a system library; prints
# what it found and its rate. Writes $out/finding when a finding is in this project's code.
fuzz_target() {
  local t=$1
  local bin="$build/fuzz/fuzz_$t"
  # New inputs go to build-fuzz/corpus/<t> (the first folder); the seeds in the tree are only read.
  local out="$build/crashes/$t"
  rm -f "$out/finding"
  mkdir -p "$build/corpus/$t" "$out/dependency"
  local dict=()
  [[ -f $root/fuzz/$t.dict ]] && dict=(-dict="$root/fuzz/$t.dict")
  echo "== fuzz_$t for ${secs}s"
  local end=$((SECONDS + secs)) runs=0 execs=0 log artifact lib kept
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
      touch "$out/finding"
      echo "fuzz.sh: fuzz_$t: a finding in this project's code: $artifact (log $log)"
      grep -E "==[0-9]+==ERROR|FINDING|^SUMMARY" "$log" | head -3 || true
      break
    fi
    kept="$out/dependency/$(basename "${artifact:-unknown}")"
    [[ -n $artifact && -f $artifact ]] && mv "$artifact" "$kept"
    cp "$log" "$kept.log"
    echo "fuzz.sh: fuzz_$t: a finding inside $lib (not this tree's code): $kept; $(grep -m1 -E '^SUMMARY' "$log" || true)"
  done
  echo "fuzz_$t: $execs inputs in $runs run(s), $((execs / (secs > 0 ? secs : 1))) per second"
}

# The targets side by side, one per core (FUZZ_PARALLEL, default: the cores), each for the same time:
# on 2 cores the 11 targets at 30 s take 6 rounds of 30 s instead of 11. Each target's report is printed
# whole when it ends.
parallel=${FUZZ_PARALLEL:-$(nproc)}
[[ $parallel =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: FUZZ_PARALLEL must be a positive number, got '$parallel'" >&2; exit 2; }
for t in "${targets[@]}"; do
  [[ -x $build/fuzz/fuzz_$t ]] || { echo "fuzz.sh: no target '$t' ($build/fuzz/fuzz_$t)" >&2; exit 2; }
done
running=0
for t in "${targets[@]}"; do
  if ((running >= parallel)); then wait -n || true; running=$((running - 1)); fi
  mkdir -p "$build/crashes/$t"
  { fuzz_target "$t" > "$build/crashes/$t/report.txt" 2>&1; cat "$build/crashes/$t/report.txt"; } &
  running=$((running + 1))
done
wait
failed=()
for t in "${targets[@]}"; do
  if [[ -f $build/crashes/$t/finding ]]; then failed+=("$t"); fi
done
if ((${#failed[@]})); then
  echo "fuzz.sh: findings in: ${failed[*]} (inputs under $build/crashes/; docs/FUZZING.md says what to do)" >&2
  exit 1
fi
echo "fuzz.sh: no finding in this project's code in ${targets[*]} (${secs}s each)"
