#!/usr/bin/env python3
"""The strong Fashion-MNIST recipe against the built-in job, written as JSON (docs/RESULTS.md).

  /usr/bin/python3 bench/fmnist_strong.py --out bench/results/fmnist-strong-DATE/fmnist_strong.json \
      [--trainer build/trainer] [--run-dir runs/r20_strong] [--record]

1. Trains configs/resnet20_fmnist_strong.yaml (ResNet-20, 20 epochs, RandAugment, random erasing, label
   smoothing, an EMA of the weights) into --run-dir with --no-resume, timed; --record instead reads a run
   folder that has finished (its `end` event), trained by the same command by hand.
2. From its metrics.jsonl: the final evaluation of both sets of weights (`final.top1`, `final.ema_top1`, ...),
   each epoch's top-1 of both, the training time of the process that finished it (`training_s`, the end
   event's: evaluations and checkpoints included) and the processes the run took (`processes`: 1 when it
   was never stopped and resumed; a resumed run's time is its last process's only, and is not recorded).
3. The baseline: the built-in job's top-1 from the quickstart record (--baseline), and the gain of each
   set of weights over it in points (`gain_points.ema`, `gain_points.raw`); `target_met` when the better of
   the two beats the baseline by at least 1 point (the recipe's goal). `baseline.same_isa` says whether the
   baseline ran on a CPU with the same vector extensions (false: another machine's kernels, whose numbers
   differ from the second step on; compare with the built-in job trained on this machine instead).
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import quickstart  # noqa: E402  (its machine record and fingerprint)

CONFIG = "configs/resnet20_fmnist_strong.yaml"
BASELINE = "bench/results/quickstart-2026-11-27/quickstart.json"


def summary(run_dir):
    try:
        lines = quickstart.run_lines(run_dir)
    except (OSError, ValueError) as e:
        print(f"fmnist_strong: {run_dir}: cannot read metrics.jsonl ({e})", file=sys.stderr)
        sys.exit(2)
    starts = [j for j in lines if j.get("event") == "start"]
    ends = [j for j in lines if j.get("event") == "end"]
    if not ends:
        print(f"fmnist_strong: {run_dir} holds no finished run (no end event)", file=sys.stderr)
        sys.exit(2)
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
        "processes": len(starts),
        "torch": starts[-1].get("torch"),
        "fingerprint": digest,
    }
    if len(starts) == 1:
        out["training_s"] = ends[-1]["seconds"]
        out["samples_per_s"] = round(steps * batch / ends[-1]["seconds"], 1)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--trainer", default=os.path.join(ROOT, "build/trainer"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "runs/r20_strong"))
    p.add_argument("--record", action="store_true", help="record a finished run folder instead of training")
    p.add_argument("--baseline", default=os.path.join(ROOT, BASELINE), help="the built-in job's quickstart record")
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
    with open(args.baseline) as f:
        base = json.load(f)
    s = summary(args.run_dir)
    gain = {"ema": round(100 * (s["final"]["ema_top1"] - base["final"]["top1"]), 2),
            "raw": round(100 * (s["final"]["top1"] - base["final"]["top1"]), 2)}
    mach = quickstart.machine(args.run_dir, args.trainer)
    base_isa = base.get("machine", {}).get("isa")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {
        "mode": "fmnist_strong",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "command": command,
        "config": CONFIG,
        "machine": mach,
        **s,
        "baseline": {"config": "configs/resnet20_fmnist.yaml", "top1": base["final"]["top1"],
                     "record": os.path.relpath(os.path.abspath(args.baseline), ROOT),
                     "isa": base_isa, "same_isa": None if base_isa is None else base_isa == mach["isa"]},
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
