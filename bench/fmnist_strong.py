#!/usr/bin/env python3
"""The strong Fashion-MNIST recipe against the built-in job, written as JSON (docs/RESULTS.md).

  /usr/bin/python3 bench/fmnist_strong.py --out bench/results/fmnist-strong-DATE/fmnist_strong.json \
      [--trainer build/trainer] [--run-dir runs/r20_strong] [--record] [--baseline-run RUN_DIR]

1. Trains configs/resnet20_fmnist_strong.yaml (ResNet-20, 30 epochs, RandAugment, random erasing, label
   smoothing, an EMA of the weights) into --run-dir with --no-resume, timed; --record instead reads a run
   folder that has finished (its `end` event), trained by the same command by hand.
2. From its metrics.jsonl: the final evaluation of both sets of weights (`final.top1`, `final.ema_top1`, ...),
   each epoch's top-1 of both, the training time of the process that finished it (`training_s`, the end
   event's: evaluations and checkpoints included) and the processes the run took (`processes`: its start
   and resume events; 1 when it was never stopped and resumed: a resumed run's end event times its last
   process only, so its time is not recorded). `recipe`: the knobs that tell one recipe from another, as
   the run resolved them (its resolved_config.yaml), so that a record of a run with --set overrides says so.
3. The baseline: the built-in job's top-1 from the quickstart record (--baseline), and the gain of each
   set of weights over it in points (`gain_points.ema`, `gain_points.raw`); `target_met` when the better of
   the two beats the baseline by at least 1 point (the recipe's goal). `baseline.same_isa` says whether the
   baseline ran on a CPU with the same vector extensions (false: another machine's kernels, whose numbers
   differ from the second step on). --baseline-run instead compares with the built-in job trained on this
   machine: a finished run folder of configs/resnet20_fmnist.yaml (the runs/resnet20_fmnist that `bash
   scripts/quickstart.sh` leaves); the record keeps its fingerprint (`bench/quickstart.py --fingerprint`
   checks another run against it) and `baseline.same_machine`: true, which is the caller's word.
`machine` says what decides the arithmetic and the speed (bench/quickstart.py's). `commit` is the repository's
HEAD when the record is written (with --record, the build that trained the run may be older). Exit 0 when the record is
written (whatever the accuracy), 2 when the run fails or the folder holds no finished run.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import quickstart  # noqa: E402  (its machine record and fingerprint)

CONFIG = "configs/resnet20_fmnist_strong.yaml"
BASELINE_CONFIG = "configs/resnet20_fmnist.yaml"
BASELINE = "bench/results/quickstart-2026-11-27/quickstart.json"
# What tells one recipe from another (section, keys) in a run's resolved_config.yaml.
RECIPE = {
    "data": ("auto_augment", "randaugment_ops", "randaugment_magnitude", "random_erasing", "crop_padding", "hflip"),
    "optim": ("name", "lr", "momentum", "nesterov", "weight_decay"),
    "schedule": ("name", "warmup_steps"),
    "train": ("epochs", "global_batch", "label_smoothing", "loss", "mixup_alpha", "cutmix_alpha", "ema_decay",
              "ema_warmup"),
}


def recipe(run_dir):
    try:
        with open(os.path.join(run_dir, "resolved_config.yaml")) as f:
            cfg = yaml.safe_load(f)
        return {f"{sec}.{k}": cfg[sec][k] for sec, keys in RECIPE.items() for k in keys}
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        print(f"fmnist_strong: {run_dir}: cannot read the recipe from resolved_config.yaml ({e})", file=sys.stderr)
        sys.exit(2)


def finished_run(run_dir):
    """A run folder's metrics.jsonl lines; exit 2 when it cannot be read or the run has not finished."""
    try:
        lines = quickstart.run_lines(run_dir)
    except (OSError, ValueError) as e:
        print(f"fmnist_strong: {run_dir}: cannot read metrics.jsonl ({e})", file=sys.stderr)
        sys.exit(2)
    if not any(j.get("event") == "end" for j in lines):
        print(f"fmnist_strong: {run_dir} holds no finished run (no end event)", file=sys.stderr)
        sys.exit(2)
    return lines


def summary(run_dir):
    lines = finished_run(run_dir)
    starts = [j for j in lines if j.get("event") == "start"]
    resumes = [j for j in lines if j.get("event") == "resume"]
    ends = [j for j in lines if j.get("event") == "end"]
    evals = [j for j in lines if j.get("event") == "eval"]
    if not evals or "ema_top1" not in evals[-1]:
        print(f"fmnist_strong: {run_dir}: no evaluation of the average (train.ema_decay off?)", file=sys.stderr)
        sys.exit(2)
    final = evals[-1]
    digest, steps = quickstart.fingerprint(lines)
    batch = starts[-1]["global_batch"]
    out = {
        "final": {k: final[k] for k in ("step", "top1", "top5", "loss", "ema_top1", "ema_top5", "ema_loss")},
        "epochs_top1": [e["top1"] for e in evals],
        "epochs_ema_top1": [e["ema_top1"] for e in evals],
        "eval_steps": [e["step"] for e in evals],
        "steps": steps,
        "global_batch": batch,
        "processes": len(starts) + len(resumes),
        "torch": starts[-1].get("torch"),
        "fingerprint": digest,
    }
    if out["processes"] == 1:
        out["training_s"] = ends[-1]["seconds"]
        out["samples_per_s"] = round(steps * batch / ends[-1]["seconds"], 1)
    return out


def baseline_of_record(path, mach):
    """The built-in job's figures from bench/quickstart.py's record, made on this machine or another."""
    with open(path) as f:
        base = json.load(f)
    isa = base.get("machine", {}).get("isa")
    return {"config": BASELINE_CONFIG, "top1": base["final"]["top1"], "record": os.path.relpath(os.path.abspath(path), ROOT),
            "isa": isa, "same_isa": None if isa is None else isa == mach["isa"]}


def baseline_of_run(run_dir):
    """The built-in job's figures from a finished run folder that the caller trained on this machine."""
    lines = finished_run(run_dir)
    evals = [j for j in lines if j.get("event") == "eval"]
    if not evals:
        print(f"fmnist_strong: {run_dir}: no evaluation", file=sys.stderr)
        sys.exit(2)
    digest, steps = quickstart.fingerprint(lines)
    return {"config": BASELINE_CONFIG, "top1": evals[-1]["top1"], "run_dir": os.path.abspath(run_dir),
            "recipe": recipe(run_dir), "epochs_top1": [e["top1"] for e in evals], "steps": steps, "fingerprint": digest,
            "same_machine": True}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--trainer", default=os.path.join(ROOT, "build/trainer"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "runs/r20_strong"))
    p.add_argument("--record", action="store_true", help="record a finished run folder instead of training")
    p.add_argument("--baseline", default=os.path.join(ROOT, BASELINE), help="the built-in job's quickstart record")
    p.add_argument("--baseline-run", metavar="RUN_DIR",
                   help="instead, a finished run folder of the built-in job trained on this machine")
    args = p.parse_args()
    args.run_dir, args.trainer = os.path.abspath(args.run_dir), os.path.abspath(args.trainer)
    command = f"trainer --config {CONFIG} --run-dir RUN" + ("" if args.record else " --no-resume")
    if not args.record:
        t0 = time.time()
        r = subprocess.run([args.trainer, "--config", CONFIG, "--run-dir", args.run_dir, "--no-resume"], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.stdout.write(r.stdout[-4000:] + r.stderr[-4000:])
            print(f"fmnist_strong: the run failed with exit {r.returncode}", file=sys.stderr)
            return 2
        whole = time.time() - t0
    s = summary(args.run_dir)
    mach = quickstart.machine(args.run_dir, args.trainer)
    baseline = baseline_of_run(args.baseline_run) if args.baseline_run else baseline_of_record(args.baseline, mach)
    gain = {"ema": round(100 * (s["final"]["ema_top1"] - baseline["top1"]), 2),
            "raw": round(100 * (s["final"]["top1"] - baseline["top1"]), 2)}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {
        "mode": "fmnist_strong",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "command": command,
        "config": CONFIG,
        "machine": mach,
        "recipe": recipe(args.run_dir),
        **s,
        "baseline": baseline,
        "gain_points": gain,
        "target_points": 1.0,
        "target_met": max(gain.values()) >= 1.0,
    }
    if not args.record:
        out["whole_command_s"] = round(whole, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps({k: out[k] for k in ("final", "gain_points", "target_met", "processes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
