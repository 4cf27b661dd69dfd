#!/usr/bin/python3
"""Runs `trainer bench` and bench/reference.py on the same config in alternating rounds and compares them.

    compare.py --config FILE [--set key=value ...] [--rounds 3] [--warmup 5] [--steps 20] [--min-wall-s 3]
               [--trainer build/trainer] [--python /usr/bin/python3] [--out summary.json]
               [--workdir DIR] [--loader-steps 20 | --no-loader] [--peak-tflops X]
               [--trainer-b-set key=value ... [--trainer-b-name NAME]]

Every headline figure is by wall time over the timed steps, on both sides: samples/s and tokens/s
(samples_per_s_aggregate: steps x global batch / wall time, the time between steps included), MFU (the
model's FLOPs at that rate over the device's peak) and the speed ratio = trainer samples/s / python samples/s
(above 1.0: the trainer is faster), per round and as the median over the rounds. The median step's figures
stay beside them, named `..._median_step`, and the step-time ratios (trainer step_time_s_p50 / python's:
below 1.0 the trainer is faster; with the data wait; of the fastest steps) too. With --warmup 0 no step
starts the clock: a side then sums its step times, and the ratio by wall time is None.

The timed steps last at least --min-wall-s seconds of wall time on each side (default 3; 0: --steps as
given): one calibration run of each side (--warmup steps, then --calibration-steps timed) measures its
wall time per step, and every round then times max(--steps, ceil(1.2 x min-wall-s / the faster side's
time per step)) steps on both sides alike. Each round's JSON says whether each side reached it.

Each round runs the trainer, then Python (trainer, python, trainer, python, ...), so a change in the
machine's load touches both sides alike. With --trainer-b-set the trainer runs a second time in every
round with those settings on top (e.g. train.cuda_graph=off): its figures, the default's gain over it, and
whether the two runs' per-step losses (`losses`: every step, the warmup's included) are equal, or their
largest difference. A second arm the trainer refuses (exit 2, e.g. a key it does not know) is recorded as
skipped with the trainer's error line, once.

When the trainer chose its micro-batch itself (train.micro_batch: auto), Python is given the same one; for
a token job Python builds its GPT with the trainer's vocabulary (the token file's: --vocab-size).
Unless --no-loader, it then measures the loader alone (`trainer bench --loader-only`) and reports
loader_headroom = loader samples/s / the trainer's samples/s (the target is >= 3).

The summary JSON (schema "trainer-bench-compare/2") holds every round's figures, the medians, the
calibration, the exact commands and the result files' paths (in --workdir, kept). Needs only the
standard library.
"""
import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = "trainer-bench-compare/2"
BASIS = "wall time over the timed steps"
# The wall_source of a side that had no warmup step to start its clock at (both write the same words):
# its samples_per_s_aggregate is then the sum of its step times, not wall time.
SUMMED = "sum of step_time + data_wait"
MARGIN = 1.2  # the calibrated steps' wall time over --min-wall-s: a round a little faster still reaches it


class Refused(RuntimeError):
    """A run that exited 2: bad input (a key the trainer does not know)."""


def run_json(cmd, out_path, what):
    t = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        err = Refused if p.returncode == 2 else RuntimeError
        raise err("%s failed (exit %d): %s\n%s" % (what, p.returncode, " ".join(map(shlex.quote, cmd)), tail))
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


def wall_figure(res, key):
    """A figure taken at the wall-time rate (tokens_per_s_aggregate, mfu), None without a wall time."""
    return res.get(key) if wall_samples_per_s(res) is not None else None


def median_or_none(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def no_wall(*results):
    """Why a ratio by wall time is missing: each side's wall_source."""
    return ", ".join("%s: %s" % (r.get("implementation", "?"), r.get("wall_source")) for r in results)


def losses_compared(a, b):
    """Two runs' per-step losses: equal (bit for bit, as JSON keeps them), else their largest difference."""
    la, lb = a.get("losses"), b.get("losses")
    if not la or not lb or len(la) != len(lb):
        return {"equal": None, "why": "the runs' losses are missing or of different lengths"}
    diff = max(abs(x - y) for x, y in zip(la, lb))
    return {"equal": la == lb, "max_abs_diff": diff, "steps": len(la)}


KEYS = ("step_time_s_p50", "step_time_s_p90", "step_time_s_min", "step_total_s_p50", "data_wait_share",
        "samples_per_s_median", "samples_per_s_aggregate", "wall_s", "wall_source", "tokens_per_s_median",
        "tokens_per_s_aggregate", "mfu", "mfu_median_step", "achieved_tflops", "mem_peak_bytes", "rss_peak_bytes",
        "micro_batch", "timed_steps", "since_model_built_s", "first_step_time_s")


class Compare:
    def __init__(self, args):
        self.args = args
        self.workdir = args.workdir or tempfile.mkdtemp(prefix="trainer-compare-")
        os.makedirs(self.workdir, exist_ok=True)
        self.sets = []
        for s in args.set:
            self.sets += ["--set", s]
        self.b_sets = []
        for s in args.trainer_b_set:
            self.b_sets += ["--set", s]
        self.b_skipped = None
        self.python_extra = []
        self.commands = {}

    def common(self, steps):
        c = ["--config", self.args.config] + self.sets + ["--warmup", str(self.args.warmup), "--steps", str(steps)]
        if self.args.peak_tflops > 0:
            c += ["--peak-tflops", str(self.args.peak_tflops)]
        return c

    def trainer(self, name, steps, extra=()):
        out = os.path.join(self.workdir, name + ".json")
        cmd = [self.args.trainer, "bench"] + self.common(steps) + list(extra) + ["--out", out]
        self.commands[name.split("_", 1)[-1]] = " ".join(map(shlex.quote, cmd))  # the last round's
        return run_json(cmd, out, "trainer bench"), out

    def python(self, name, steps):
        out = os.path.join(self.workdir, name + ".json")
        cmd = [self.args.python, os.path.join(HERE, "reference.py")] + self.common(steps) + self.python_extra + \
            ["--out", out]
        self.commands[name.split("_", 1)[-1]] = " ".join(map(shlex.quote, cmd))
        return run_json(cmd, out, "bench/reference.py"), out

    def learn_from(self, tr):
        """Python takes the trainer's micro-batch (auto) and vocabulary (a token file's)."""
        if self.python_extra:
            return
        if tr["micro_batch"] != tr["global_batch"]:
            self.python_extra = ["--set", "train.micro_batch=%d" % tr["micro_batch"]]
        if tr.get("vocab_size"):
            self.python_extra += ["--vocab-size", str(tr["vocab_size"])]

    def calibrate(self):
        """The steps every round times: at least --min-wall-s of wall time on the faster side."""
        a = self.args
        if a.min_wall_s <= 0 or a.warmup <= 0:
            return a.steps, None
        tr, _ = self.trainer("calibration_trainer", a.calibration_steps)
        self.learn_from(tr)
        py, _ = self.python("calibration_python", a.calibration_steps)
        per_step = {"trainer": tr["wall_s"] / tr["timed_steps"], "python": py["wall_s"] / py["timed_steps"]}
        fastest = min(per_step.values())
        steps = max(a.steps, int(math.ceil(MARGIN * a.min_wall_s / fastest)))
        cal = {"timed_steps": a.calibration_steps, "warmup": a.warmup, "trainer_step_wall_s": per_step["trainer"],
               "python_step_wall_s": per_step["python"], "min_wall_s": a.min_wall_s, "margin": MARGIN,
               "steps": steps, "trainer_run_s": tr["_seconds"], "python_run_s": py["_seconds"]}
        print("calibration: %.4f s a step (trainer), %.4f s (python) by wall time: %d timed steps a round for %.1f s"
              % (per_step["trainer"], per_step["python"], steps, a.min_wall_s), flush=True)
        return steps, cal

    def trainer_b(self, r, steps, tr):
        """The trainer's second arm in round r, or None (none asked for, or refused once)."""
        if not self.b_sets or self.b_skipped:
            return None, None
        try:
            return self.trainer("round%d_trainer_b" % r, steps, self.b_sets)
        except Refused as e:
            self.b_skipped = str(e).strip().splitlines()[-1]
            print("trainer b (%s) skipped: %s" % (" ".join(self.args.trainer_b_set), self.b_skipped), flush=True)
            return None, None

    def round(self, r, steps):
        a = self.args
        load = os.getloadavg()[0]
        tr, t_out = self.trainer("round%d_trainer" % r, steps)
        self.learn_from(tr)
        py, p_out = self.python("round%d_python" % r, steps)
        tb, b_out = self.trainer_b(r, steps, tr)
        t_sps, p_sps = wall_samples_per_s(tr), wall_samples_per_s(py)
        row = {
            "round": r, "load_avg_1m_before": load,
            "trainer": {k: tr.get(k) for k in KEYS},
            "python": {k: py.get(k) for k in KEYS},
            # The headline: samples/s by wall time (the time between steps counts: the trainer's metrics line,
            # polling, the loader hand-off; Python's loop), which a user's job pays too.
            "ratio_samples_per_s": t_sps / p_sps if t_sps and p_sps else None,
            # Secondary: the step times (below 1.0 the trainer is faster), with the data wait, of the fastest
            # steps (the least disturbed on a shared machine).
            "ratio_step_time_p50": tr["step_time_s_p50"] / py["step_time_s_p50"],
            "ratio_step_total_p50": tr["step_total_s_p50"] / py["step_total_s_p50"],
            "ratio_step_time_min": tr["step_time_s_min"] / py["step_time_s_min"],
            "min_wall_met": {"trainer": tr["wall_s"] >= a.min_wall_s, "python": py["wall_s"] >= a.min_wall_s},
            "trainer_file": t_out, "python_file": p_out,
        }
        if tb is not None:
            b_sps = wall_samples_per_s(tb)
            row["trainer_b"] = {k: tb.get(k) for k in KEYS}
            row["trainer_b_file"] = b_out
            row["min_wall_met"]["trainer_b"] = tb["wall_s"] >= a.min_wall_s
            row["gain_over_b"] = t_sps / b_sps if t_sps and b_sps else None
            row["losses_against_b"] = losses_compared(tr, tb)
        print("round %d (load %.2f): samples/s by wall time trainer/python %s (%s against %s over %.2f and %.2f s); "
              "step p50 trainer %.4f s, python %.4f s: ratio %.3f (with data wait %.3f; of the minima %.3f)%s"
              % (r, load, "%.3f" % row["ratio_samples_per_s"] if row["ratio_samples_per_s"] else "n/a (%s)" % no_wall(tr, py),
                 fmt(t_sps), fmt(p_sps), tr["wall_s"], py["wall_s"], tr["step_time_s_p50"], py["step_time_s_p50"],
                 row["ratio_step_time_p50"], row["ratio_step_total_p50"], row["ratio_step_time_min"],
                 "; trainer %s: %s samples/s, the default's gain %s, losses %s" % (
                     " ".join(a.trainer_b_set), fmt(wall_samples_per_s(tb)), fmt(row["gain_over_b"]),
                     "equal" if row["losses_against_b"]["equal"] else "max diff %s" % fmt(
                         row["losses_against_b"].get("max_abs_diff"))) if tb is not None else ""), flush=True)
        return row, tr, py

    def summary(self, rounds, steps, cal, first_t, first_p):
        a = self.args
        med = lambda side, key: median_or_none(x[side].get(key) for x in rounds)  # noqa: E731
        wall_med = lambda side, key: median_or_none(  # noqa: E731
            x[side].get(key) if x[side].get("wall_source") not in (None, SUMMED) else None for x in rounds)
        s = {
            "schema": SCHEMA, "basis": BASIS,
            "config_file": a.config, "overrides": a.set, "warmup": a.warmup, "steps": steps,
            "steps_asked": a.steps, "min_wall_s": a.min_wall_s, "calibration": cal,
            "rounds": rounds,
            # Headline: by wall time over the timed steps (None where a side had none: --warmup 0).
            "speed_ratio": median_or_none(r["ratio_samples_per_s"] for r in rounds),
            "median_ratio_samples_per_s": median_or_none(r["ratio_samples_per_s"] for r in rounds),
            "trainer_samples_per_s": wall_med("trainer", "samples_per_s_aggregate"),
            "python_samples_per_s": wall_med("python", "samples_per_s_aggregate"),
            "trainer_mfu": wall_med("trainer", "mfu"),
            "python_mfu": wall_med("python", "mfu"),
            # Secondary: the step times and the median step's figures.
            "median_ratio_step_time_p50": statistics.median(r["ratio_step_time_p50"] for r in rounds),
            "median_ratio_step_total_p50": statistics.median(r["ratio_step_total_p50"] for r in rounds),
            "median_ratio_step_time_min": statistics.median(r["ratio_step_time_min"] for r in rounds),
            "trainer_samples_per_s_median_step": med("trainer", "samples_per_s_median"),
            "python_samples_per_s_median_step": med("python", "samples_per_s_median"),
            "trainer_mfu_median_step": med("trainer", "mfu_median_step"),
            "python_mfu_median_step": med("python", "mfu_median_step"),
            "min_wall_met": all(all(r["min_wall_met"].values()) for r in rounds),
            "first_step": {"since_model_built_s": med("trainer", "since_model_built_s"),
                           "first_step_time_s": med("trainer", "first_step_time_s")},
            "commands": self.commands,
            "workdir": self.workdir,
        }
        if first_t.get("tokens_per_s_median") is not None:
            s["trainer_tokens_per_s"] = wall_med("trainer", "tokens_per_s_aggregate")
            s["python_tokens_per_s"] = wall_med("python", "tokens_per_s_aggregate")
            s["trainer_tokens_per_s_median_step"] = med("trainer", "tokens_per_s_median")
            s["python_tokens_per_s_median_step"] = med("python", "tokens_per_s_median")
        if a.trainer_b_set:
            b = {"sets": a.trainer_b_set, "name": a.trainer_b_name or " ".join(a.trainer_b_set)}
            with_b = [r for r in rounds if "trainer_b" in r]
            if with_b:
                cmp = [r["losses_against_b"] for r in with_b]
                diffs = [c.get("max_abs_diff") for c in cmp if c.get("max_abs_diff") is not None]
                b.update({
                    "samples_per_s": median_or_none(wall_samples_per_s(r["trainer_b"]) for r in with_b),
                    "mfu": median_or_none(wall_figure(r["trainer_b"], "mfu") for r in with_b),
                    "step_time_s_p50": median_or_none(r["trainer_b"]["step_time_s_p50"] for r in with_b),
                    "gain": median_or_none(r["gain_over_b"] for r in with_b),
                    "losses_equal": all(c.get("equal") for c in cmp) if all(c.get("equal") is not None for c in cmp)
                    else None,
                    "losses_max_abs_diff": max(diffs) if diffs else None,
                })
                if first_t.get("tokens_per_s_median") is not None:
                    b["tokens_per_s"] = median_or_none(wall_figure(r["trainer_b"], "tokens_per_s_aggregate")
                                                       for r in with_b)
            else:
                b["skipped"] = self.b_skipped
            s["trainer_b"] = b
        s.update({"model": first_t["model"], "global_batch": first_t["global_batch"], "precision": first_t["precision"],
                  "device": first_t["device"], "device_name": first_t["device_name"], "host": first_t["host"],
                  "versions": {"trainer": first_t["versions"], "python": first_p["versions"]},
                  "date": first_t["date"], "threads": {"trainer": first_t["threads"], "python": first_p["threads"]},
                  "padded_loss": first_p.get("padded_loss")})
        if first_p.get("driver"):
            s["driver"] = first_p["driver"]
        return s


def fmt(v):
    return "-" if v is None else "%.4g" % v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the trainer's YAML config")
    ap.add_argument("--set", action="append", default=[], help="key=value for both sides (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps a round, at least (see --min-wall-s)")
    ap.add_argument("--min-wall-s", type=float, default=3.0,
                    help="time enough steps for this much wall time on each side (0: --steps as given)")
    ap.add_argument("--calibration-steps", type=int, default=10, help="timed steps of the calibration runs")
    ap.add_argument("--trainer", default=os.environ.get("TRAINER_BIN", "build/trainer"), help="the trainer executable")
    ap.add_argument("--python", default="/usr/bin/python3", help="the interpreter with torch and torchvision")
    ap.add_argument("--out", default="", help="write the summary JSON here")
    ap.add_argument("--workdir", default="", help="where the per-run JSON files go (default: a new temp folder)")
    ap.add_argument("--loader-steps", type=int, default=20, help="batches timed by the loader-only run")
    ap.add_argument("--no-loader", action="store_true", help="skip the loader-only run")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="passed to both sides, for MFU")
    ap.add_argument("--trainer-b-set", action="append", default=[],
                    help="key=value: run the trainer again each round with these on top (repeatable)")
    ap.add_argument("--trainer-b-name", default="", help="what the second arm is called in the output")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.calibration_steps < 1:
        ap.error("--calibration-steps must be >= 1")
    c = Compare(args)
    steps, cal = c.calibrate()
    rounds, first_t, first_p = [], None, None
    for r in range(1, args.rounds + 1):
        row, tr, py = c.round(r, steps)
        rounds.append(row)
        if r == 1:
            first_t, first_p = tr, py
    summary = c.summary(rounds, steps, cal, first_t, first_p)
    if summary["speed_ratio"] is not None:
        print("median over %d rounds, by wall time over the timed steps: trainer/python samples/s %.3f (%.1f against "
              "%.1f)%s" % (len(rounds), summary["speed_ratio"], summary["trainer_samples_per_s"],
                           summary["python_samples_per_s"],
                           ", MFU %.1f%% against %.1f%%" % (100 * summary["trainer_mfu"], 100 * summary["python_mfu"])
                           if summary["trainer_mfu"] is not None and summary["python_mfu"] is not None else ""))
    print("median ratio trainer/python step time p50 over %d rounds: %.3f (with data wait %.3f; of the minima %.3f)"
          % (len(rounds), summary["median_ratio_step_time_p50"], summary["median_ratio_step_total_p50"],
             summary["median_ratio_step_time_min"]))
    if "trainer_b" in summary and "gain" in summary["trainer_b"]:
        b = summary["trainer_b"]
        print("trainer with %s: %s samples/s; the default %sx of it; losses %s" % (
            " ".join(b["sets"]), fmt(b["samples_per_s"]), fmt(b["gain"]),
            "equal" if b["losses_equal"] else "max diff %s" % fmt(b["losses_max_abs_diff"])))

    if not args.no_loader:
        l_out = os.path.join(c.workdir, "loader.json")
        l_cmd = [args.trainer, "bench", "--loader-only", "--config", args.config] + c.sets + \
                ["--warmup", "2", "--steps", str(args.loader_steps), "--out", l_out]
        lo = run_json(l_cmd, l_out, "trainer bench --loader-only")
        consumed = summary["trainer_samples_per_s"] or summary["trainer_samples_per_s_median_step"]
        summary["loader"] = {"samples_per_s": lo["samples_per_s"], "workers": lo["workers"], "file": l_out,
                             "command": " ".join(map(shlex.quote, l_cmd))}
        summary["loader_headroom"] = lo["samples_per_s"] / consumed
        print("loader alone: %.1f samples/s with %d workers = %.1fx what the trainer consumes (%.1f samples/s)"
              % (lo["samples_per_s"], lo["workers"], summary["loader_headroom"], consumed))

    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print("summary -> %s (runs in %s)" % (args.out, c.workdir))
    else:
        print("runs in %s" % c.workdir)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print("error: %s" % e, file=sys.stderr)
        sys.exit(1)
