#!/usr/bin/python3
"""Runs `trainer bench` and bench/reference.py on the same config in alternating rounds and compares them.

    compare.py --config FILE [--set key=value ...] [--rounds 3] [--warmup 5] [--steps 20]
               [--trainer build/trainer] [--python /usr/bin/python3] [--out summary.json]
               [--workdir DIR] [--loader-steps 20 | --no-loader] [--peak-tflops X]

Each round runs the trainer, then Python (trainer, python, trainer, python, ...), so a change in the
machine's load touches both sides alike. Per round it prints ratio = trainer step_time_s_p50 / python
step_time_s_p50 (below 1.0: the trainer is faster), the same with the data wait included and of the
fastest steps (the least disturbed on a shared machine), and at the end the medians over the rounds. It
also reports ratio_samples_per_s = trainer samples/s / python samples/s, both by wall time over the timed
steps (samples_per_s_aggregate: the time between steps counts, which the step times leave out; above 1.0:
the trainer is faster), per round and as the median (None with --warmup 0: no step starts the clock).
When the trainer chose its micro-batch itself (train.micro_batch: auto), Python is given the same one; for
a token job Python builds its GPT with the trainer's vocabulary (the token file's: --vocab-size).
Unless --no-loader, it then measures the loader alone (`trainer bench --loader-only`) and reports
loader_headroom = loader samples/s / the trainer's median samples/s (the target is >= 3).

The summary JSON (schema "trainer-bench-compare/1") holds every round's figures, the medians, the exact
commands and the result files' paths (in --workdir, kept). Needs only the standard library.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = "trainer-bench-compare/1"
# The wall_source of a side that had no warmup step to start its clock at (both write the same words):
# its samples_per_s_aggregate is then the sum of its step times, not wall time.
SUMMED = "sum of step_time + data_wait"


def run_json(cmd, out_path, what):
    t = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        raise RuntimeError("%s failed (exit %d): %s\n%s" % (what, p.returncode, " ".join(map(shlex.quote, cmd)), tail))
    with open(out_path) as f:
        res = json.load(f)
    res["_seconds"] = time.time() - t
    return res


def wall_samples_per_s(res):
    """samples/s by wall time over the timed steps (steps x global batch / wall_s, the bench's and
    reference.py's samples_per_s_aggregate), or None where a side summed its step times instead."""
    if res.get("wall_source") in (None, SUMMED) or not res.get("samples_per_s_aggregate"):
        return None
    return res["samples_per_s_aggregate"]


def median_or_none(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def no_wall(*results):
    """Why a ratio by wall time is missing: each side's wall_source."""
    return ", ".join("%s: %s" % (r.get("implementation", "?"), r.get("wall_source")) for r in results)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the trainer's YAML config")
    ap.add_argument("--set", action="append", default=[], help="key=value for both sides (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trainer", default=os.environ.get("TRAINER_BIN", "build/trainer"), help="the trainer executable")
    ap.add_argument("--python", default="/usr/bin/python3", help="the interpreter with torch and torchvision")
    ap.add_argument("--out", default="", help="write the summary JSON here")
    ap.add_argument("--workdir", default="", help="where the per-run JSON files go (default: a new temp folder)")
    ap.add_argument("--loader-steps", type=int, default=20, help="batches timed by the loader-only run")
    ap.add_argument("--no-loader", action="store_true", help="skip the loader-only run")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="passed to both sides, for MFU")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    workdir = args.workdir or tempfile.mkdtemp(prefix="trainer-compare-")
    os.makedirs(workdir, exist_ok=True)
    sets = []
    for s in args.set:
        sets += ["--set", s]
    common = ["--config", args.config] + sets + ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.peak_tflops > 0:
        common += ["--peak-tflops", str(args.peak_tflops)]

    rounds, commands = [], []
    python_extra = []
    for r in range(1, args.rounds + 1):
        load = os.getloadavg()[0]
        t_out = os.path.join(workdir, "round%d_trainer.json" % r)
        t_cmd = [args.trainer, "bench"] + common + ["--out", t_out]
        tr = run_json(t_cmd, t_out, "trainer bench")
        if r == 1 and tr["micro_batch"] != tr["global_batch"]:
            python_extra = ["--set", "train.micro_batch=%d" % tr["micro_batch"]]
        if r == 1 and tr.get("vocab_size"):
            python_extra += ["--vocab-size", str(tr["vocab_size"])]
        p_out = os.path.join(workdir, "round%d_python.json" % r)
        p_cmd = [args.python, os.path.join(HERE, "reference.py")] + common + python_extra + ["--out", p_out]
        py = run_json(p_cmd, p_out, "bench/reference.py")
        if r == 1:
            commands = [" ".join(map(shlex.quote, t_cmd)), " ".join(map(shlex.quote, p_cmd))]
        ratio = tr["step_time_s_p50"] / py["step_time_s_p50"]
        ratio_total = tr["step_total_s_p50"] / py["step_total_s_p50"]
        # The fastest step of each side: the least disturbed by other processes on a shared machine.
        ratio_min = tr["step_time_s_min"] / py["step_time_s_min"]
        # Throughput by wall time: the step times leave out what happens between steps (the trainer's
        # metrics line, polling, the loader hand-off; Python's loop), which a user's job pays too.
        t_sps, p_sps = wall_samples_per_s(tr), wall_samples_per_s(py)
        ratio_sps = t_sps / p_sps if t_sps and p_sps else None
        keys = ("step_time_s_p50", "step_time_s_p90", "step_time_s_min", "step_total_s_p50", "data_wait_share",
                "samples_per_s_median", "samples_per_s_aggregate", "wall_s", "wall_source", "tokens_per_s_median",
                "mem_peak_bytes", "rss_peak_bytes", "micro_batch", "timed_steps")
        row = {
            "round": r, "load_avg_1m_before": load,
            "trainer": {k: tr.get(k) for k in keys},
            "python": {k: py.get(k) for k in keys},
            "ratio_step_time_p50": ratio,
            "ratio_step_total_p50": ratio_total,
            "ratio_step_time_min": ratio_min,
            "ratio_samples_per_s": ratio_sps,
            "trainer_file": t_out, "python_file": p_out,
        }
        rounds.append(row)
        print("round %d (load %.2f): trainer step p50 %.4f s (p90 %.4f, min %.4f), python %.4f s (p90 %.4f, min %.4f): "
              "ratio %.3f; with data wait %.3f; of the minima %.3f; samples/s by wall time trainer/python %s"
              % (r, load, tr["step_time_s_p50"], tr["step_time_s_p90"], tr["step_time_s_min"], py["step_time_s_p50"],
                 py["step_time_s_p90"], py["step_time_s_min"], ratio, ratio_total, ratio_min,
                 "%.3f" % ratio_sps if ratio_sps else "n/a (%s)" % no_wall(tr, py)), flush=True)

    summary = {
        "schema": SCHEMA,
        "config_file": args.config, "overrides": args.set, "warmup": args.warmup, "steps": args.steps,
        "rounds": rounds,
        "median_ratio_step_time_p50": statistics.median(r["ratio_step_time_p50"] for r in rounds),
        "median_ratio_step_total_p50": statistics.median(r["ratio_step_total_p50"] for r in rounds),
        "median_ratio_step_time_min": statistics.median(r["ratio_step_time_min"] for r in rounds),
        "trainer_samples_per_s_median": statistics.median(r["trainer"]["samples_per_s_median"] for r in rounds),
        "python_samples_per_s_median": statistics.median(r["python"]["samples_per_s_median"] for r in rounds),
        # Above 1.0 the trainer is faster (the step-time ratios are the other way round); None where a side
        # had no wall time (--warmup 0), the rounds without one left out.
        "median_ratio_samples_per_s": median_or_none(r["ratio_samples_per_s"] for r in rounds),
        "trainer_samples_per_s_wall_median": median_or_none(wall_samples_per_s(r["trainer"]) for r in rounds),
        "python_samples_per_s_wall_median": median_or_none(wall_samples_per_s(r["python"]) for r in rounds),
        "commands": commands,
        "workdir": workdir,
    }
    first_t = json.load(open(rounds[0]["trainer_file"]))
    first_p = json.load(open(rounds[0]["python_file"]))
    summary["model"] = first_t["model"]
    summary["global_batch"] = first_t["global_batch"]
    summary["precision"] = first_t["precision"]
    summary["device"] = first_t["device"]
    summary["device_name"] = first_t["device_name"]
    summary["host"] = first_t["host"]
    summary["versions"] = {"trainer": first_t["versions"], "python": first_p["versions"]}
    summary["date"] = first_t["date"]
    summary["threads"] = {"trainer": first_t["threads"], "python": first_p["threads"]}
    if first_t.get("tokens_per_s_median") is not None:
        summary["trainer_tokens_per_s_median"] = statistics.median(r["trainer"]["tokens_per_s_median"] for r in rounds)
        summary["python_tokens_per_s_median"] = statistics.median(r["python"]["tokens_per_s_median"] for r in rounds)
    print("median ratio trainer/python step time p50 over %d rounds: %.3f (with data wait %.3f; of the minima %.3f)"
          % (len(rounds), summary["median_ratio_step_time_p50"], summary["median_ratio_step_total_p50"],
             summary["median_ratio_step_time_min"]))
    if summary["median_ratio_samples_per_s"] is not None:
        print("median ratio trainer/python samples/s by wall time over the timed steps: %.3f (%.1f against %.1f)"
              % (summary["median_ratio_samples_per_s"], summary["trainer_samples_per_s_wall_median"],
                 summary["python_samples_per_s_wall_median"]))

    if not args.no_loader:
        l_out = os.path.join(workdir, "loader.json")
        l_cmd = [args.trainer, "bench", "--loader-only", "--config", args.config] + sets + \
                ["--warmup", "2", "--steps", str(args.loader_steps), "--out", l_out]
        lo = run_json(l_cmd, l_out, "trainer bench --loader-only")
        summary["loader"] = {"samples_per_s": lo["samples_per_s"], "workers": lo["workers"], "file": l_out,
                             "command": " ".join(map(shlex.quote, l_cmd))}
        summary["loader_headroom"] = lo["samples_per_s"] / summary["trainer_samples_per_s_median"]
        print("loader alone: %.1f samples/s with %d workers = %.1fx what the trainer consumes (%.1f samples/s)"
              % (lo["samples_per_s"], lo["workers"], summary["loader_headroom"], summary["trainer_samples_per_s_median"]))

    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print("summary -> %s (runs in %s)" % (args.out, workdir))
    else:
        print("runs in %s" % workdir)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print("error: %s" % e, file=sys.stderr)
        sys.exit(1)
