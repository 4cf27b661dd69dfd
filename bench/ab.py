#!/usr/bin/python3
"""One switch of the trainer measured on and off: `trainer bench` with settings A and with settings B, in
alternating rounds (A B, then B A, ...), on the same job.

    ab.py --config FILE [--set key=value ...] --a key=value[,key=value] --b key=value[,key=value]
          [--name NAME] [--rounds 1] [--warmup 10] [--steps 20] [--trainer build/trainer]
          [--workdir DIR] [--out RESULT.json]

Per round it prints each side's samples/s by wall time over the timed steps (`samples_per_s_aggregate`:
the data wait and everything between the steps included) and speedup = B's / A's (above 1.0: B is faster),
the basis of every speed figure; the step-time ratio (A's median step time / B's, which leaves out what
happens between steps) is kept beside it as `speedup_b_step_p50`. At the end the medians over the rounds.
The result JSON (schema "trainer-bench-ab/2"; /1 had the step-time ratio as `speedup_b`) holds every
round's figures, the commands and the result files (in --workdir, kept). docs/BENCHMARKS.md, "Profiling
a step", lists the switches worth measuring. Needs only the standard library.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

SCHEMA = "trainer-bench-ab/2"
KEYS = ("step_time_s_p50", "step_time_s_p90", "step_time_s_min", "samples_per_s_median", "samples_per_s_aggregate",
        "tokens_per_s_median", "mfu", "mem_peak_bytes", "loss_first", "loss_last", "timed_steps")


def sets_of(text):
    out = []
    for kv in filter(None, (x.strip() for x in text.split(","))):
        if "=" not in kv:
            raise ValueError("--a/--b: expected key=value[,key=value], got '%s'" % kv)
        out += ["--set", kv]
    return out


def run(cmd, out_path):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        raise RuntimeError("trainer bench failed (exit %d): %s\n%s" % (p.returncode, " ".join(map(shlex.quote, cmd)), tail))
    with open(out_path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], help="key=value for both sides (repeatable)")
    ap.add_argument("--a", required=True, help="side A's settings: key=value[,key=value]")
    ap.add_argument("--b", required=True, help="side B's settings: key=value[,key=value]")
    ap.add_argument("--name", default="", help="what is measured (recorded)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trainer", default=os.environ.get("TRAINER_BIN", "build/trainer"))
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    try:
        side_sets = {"a": sets_of(args.a), "b": sets_of(args.b)}
    except ValueError as e:
        ap.error(str(e))
    workdir = args.workdir or tempfile.mkdtemp(prefix="trainer-ab-")
    os.makedirs(workdir, exist_ok=True)
    common = ["--config", args.config]
    for s in args.set:
        common += ["--set", s]
    common += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    rounds, commands = [], {}
    for r in range(1, args.rounds + 1):
        row = {"round": r, "order": "ab" if r % 2 else "ba"}
        for side in row["order"]:
            out = os.path.join(workdir, "round%d_%s.json" % (r, side))
            cmd = [args.trainer, "bench"] + common + side_sets[side] + ["--out", out]
            commands.setdefault(side, " ".join(map(shlex.quote, cmd)))
            res = run(cmd, out)
            row[side] = {k: res.get(k) for k in KEYS}
            row[side]["file"] = out
        row["speedup_b"] = row["b"]["samples_per_s_aggregate"] / row["a"]["samples_per_s_aggregate"]
        row["speedup_b_step_p50"] = row["a"]["step_time_s_p50"] / row["b"]["step_time_s_p50"]
        rounds.append(row)
        print("%sround %d (%s): A %.1f samples/s, B %.1f (wall time): B is %.3fx A's speed (step p50: %.3fx)"
              % (args.name + ": " if args.name else "", r, row["order"], row["a"]["samples_per_s_aggregate"],
                 row["b"]["samples_per_s_aggregate"], row["speedup_b"], row["speedup_b_step_p50"]), flush=True)
    summary = {"schema": SCHEMA, "name": args.name, "config_file": args.config, "overrides": args.set,
               "a": args.a, "b": args.b, "warmup": args.warmup, "steps": args.steps, "rounds": rounds,
               "median_speedup_b": statistics.median(x["speedup_b"] for x in rounds),
               "median_speedup_b_step_p50": statistics.median(x["speedup_b_step_p50"] for x in rounds),
               "basis": "wall time over the timed steps", "commands": commands,
               "workdir": workdir}
    first = json.load(open(rounds[0]["a"]["file"]))
    for k in ("model", "global_batch", "precision", "device", "device_name", "date", "versions"):
        summary[k] = first.get(k)
    print("%smedian over %d rounds: B is %.3fx A's speed (A: %s; B: %s)"
          % (args.name + ": " if args.name else "", len(rounds), summary["median_speedup_b"], args.a, args.b))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print("error: %s" % e, file=sys.stderr)
        sys.exit(1)
