#!/usr/bin/env bash
# How soon a SIGTERM ends `micro_batch: auto`'s search: starts a run, sends SIGTERM as soon as the log
# shows probe N done (so that probe N+1, usually the large one, is in progress), and writes one JSON with
# the seconds from the signal to the exit, the exit code, the stop event and what auto_search.json kept.
# docs/RESULTS.md "A stop during the search".
#
# usage: bench/stop_in_search.sh TRAINER RUN_DIR OUT.json PROBE [trainer args...]
#   e.g. bench/stop_in_search.sh build/trainer /tmp/stop runs.json 2 --config configs/resnet50.yaml --set train.steps=1
set -euo pipefail
(($# >= 4)) || { echo "usage: bench/stop_in_search.sh TRAINER RUN_DIR OUT.json PROBE [trainer args...]" >&2; exit 2; }
bin=$1 run=$2 out=$3 probe=$4
shift 4
[[ -e $run ]] && { echo "error: $run exists: give a new run folder" >&2; exit 2; }
mkdir -p "$run"
log=$run/stdout.log
"$bin" --run-dir "$run" "$@" > "$log" 2>&1 &
pid=$!
t0=$(date +%s.%N)
until grep -q "probe $probe:" "$log"; do
  kill -0 "$pid" 2>/dev/null || { echo "error: the trainer ended before probe $probe (see $log)" >&2; exit 1; }
  sleep 0.02
done
t1=$(date +%s.%N)
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
t2=$(date +%s.%N)
python3 - "$run" "$out" "$rc" "$t0" "$t1" "$t2" "$*" <<'PY'
import json, sys
run, out, rc, t0, t1, t2, args = sys.argv[1:]
stop = [e for e in map(json.loads, open(run + "/metrics.jsonl")) if e.get("event") == "stop"]
try:
    kept = [p for s in json.load(open(run + "/auto_search.json"))["searches"] for p in s["probes"]]
except FileNotFoundError:
    kept = []
json.dump({"args": args, "exit_code": int(rc), "search_before_signal_s": float(t1) - float(t0),
           "signal_to_exit_s": float(t2) - float(t1), "stop": stop[0] if stop else None,
           "kept_probes": kept}, open(out, "w"), indent=1)
print(open(out).read())
PY
