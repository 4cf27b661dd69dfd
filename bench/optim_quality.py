#!/usr/bin/python3
"""What the state in fewer bytes costs in quality: one job trained with each precision, final losses compared.

    optim_quality.py --config configs/llama_tiny_fortunes.yaml [--trainer build/trainer] [--runs DIR]
                     [--variants float32,int8,bfloat16,bf16_weights_sr] [--jobs 2] [--threads 1]
                     [--set key=value ...] [--out summary.json] [--plot curves.png] [--reuse]

Trains the config once per variant, in DIR/VARIANT (default DIR: runs/optim_quality), --jobs at a time,
each on --threads intra-op threads. The variants:

    float32               the reference: AdamW's moments in float32
    bfloat16              optim.state_dtype=bfloat16
    int8                  optim.state_dtype=int8 (blockwise, 256 values a block)
    bf16_weights_sr       model.param_dtype=bfloat16, optim.stochastic_rounding=true (float32 moments)
    bf16_weights_sr_int8  the same with int8 moments: the last rung memory.state: auto reaches
    bf16_weights_nearest  bfloat16 weights rounded to nearest: what stochastic rounding is for
    float32_seed1         float32 with another seed: how far two seeds of one recipe end apart

Each variant's final validation loss (the last `eval` line of its metrics.jsonl) is compared with
float32's: within 1% for the state dtypes, 2% for bfloat16 weights. The summary (JSON) gives the losses,
the ratios, the bounds, whether each is met, each run's wall time and command; --plot draws the curves
(scripts/plot_metrics.py's comparison). Exit 0 when every bound is met, 1 when one is not, 2 on bad
input or a failed run. --reuse keeps a variant whose folder already holds a finished run.

Needs only the standard library (and matplotlib for --plot).
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import shlex
import subprocess
import sys
import time

from hostinfo import cpu_model

SCHEMA = "trainer-bench-optim-quality/1"
HERE = os.path.dirname(os.path.abspath(__file__))

# variant -> (--set overrides, bound on the final validation loss relative to float32's)
VARIANTS = {
    "float32": (["optim.state_dtype=float32"], None),
    "bfloat16": (["optim.state_dtype=bfloat16"], 0.01),
    "int8": (["optim.state_dtype=int8"], 0.01),
    "bf16_weights_sr": (["model.param_dtype=bfloat16", "optim.stochastic_rounding=true",
                         "optim.state_dtype=float32"], 0.02),
    "bf16_weights_sr_int8": (["model.param_dtype=bfloat16", "optim.stochastic_rounding=true",
                              "optim.state_dtype=int8"], 0.02),
    "bf16_weights_nearest": (["model.param_dtype=bfloat16", "optim.stochastic_rounding=false",
                              "optim.state_dtype=float32"], None),
    "float32_seed1": (["optim.state_dtype=float32", "seed=1"], None),
}


def fail(msg):
    print("optim_quality.py: " + msg, file=sys.stderr)
    sys.exit(2)


def read_run(run_dir):
    """(step lines, eval lines, finished) of a run folder's metrics.jsonl."""
    steps, evals, finished = [], [], False
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return steps, evals, finished
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if not isinstance(r, dict):
                continue
            if r.get("event") == "eval":
                evals.append(r)
            elif r.get("event") == "end":
                finished = True
            elif "event" not in r and isinstance(r.get("step"), int):
                steps.append(r)
    return steps, evals, finished


def command(args, variant):
    cmd = [args.trainer, "--config", args.config, "--run-dir", os.path.join(args.runs, variant),
           "--set", f"train.threads={args.threads}"]
    for s in VARIANTS[variant][0] + args.set:
        cmd += ["--set", s]
    return cmd


def train(args, variant):
    cmd = command(args, variant)
    run_dir = os.path.join(args.runs, variant)
    if args.reuse and read_run(run_dir)[2]:
        return variant, cmd, None
    os.makedirs(run_dir, exist_ok=True)
    t0 = time.monotonic()
    with open(os.path.join(args.runs, variant + ".log"), "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        fail(f"{shlex.join(cmd)} exited {r.returncode} (its output: {args.runs}/{variant}.log)")
    return variant, cmd, wall


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--trainer", default="build/trainer")
    p.add_argument("--runs", default="runs/optim_quality", help="folder of the runs, one per variant")
    p.add_argument("--variants", default="float32,int8,bfloat16,bf16_weights_sr")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="train.threads of each run")
    p.add_argument("--set", action="append", default=[], help="key=value for every run")
    p.add_argument("--out", help="summary JSON to write")
    p.add_argument("--plot", help="PNG of the curves to write")
    p.add_argument("--reuse", action="store_true", help="keep a variant whose folder holds a finished run")
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        fail(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    if variants[0] != "float32":
        fail("--variants: the first must be float32, the reference the others are compared with")
    if not os.path.isfile(args.config):
        fail(f"--config: {args.config}: no such file")
    if not os.access(args.trainer, os.X_OK):
        fail(f"--trainer: {args.trainer}: not an executable (build it first)")
    if args.jobs < 1 or args.threads < 1:
        fail("--jobs and --threads take a number >= 1")

    walls, cmds = {}, {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for variant, cmd, wall in pool.map(lambda v: train(args, v), variants):
            walls[variant], cmds[variant] = wall, shlex.join(cmd)

    results, ok = {}, True
    for variant in variants:
        steps, evals, finished = read_run(os.path.join(args.runs, variant))
        if not finished or not evals or not isinstance(evals[-1].get("loss"), (int, float)):
            fail(f"{args.runs}/{variant}: no finished run with a final evaluation in its metrics.jsonl")
        results[variant] = {"final_val_loss": evals[-1]["loss"], "final_step": evals[-1]["step"],
                            "steps": len(steps), "wall_s": walls[variant], "command": cmds[variant],
                            "set": VARIANTS[variant][0]}
    ref = results["float32"]["final_val_loss"]
    for variant in variants:
        r, bound = results[variant], VARIANTS[variant][1]
        r["vs_float32"] = r["final_val_loss"] / ref - 1.0
        r["bound"] = bound
        r["within_bound"] = None if bound is None else abs(r["vs_float32"]) <= bound
        if r["within_bound"] is False:
            ok = False
        mark = "" if bound is None else (" within " if r["within_bound"] else " NOT within ") + f"{100 * bound:g}%"
        print(f"{variant:22s} val loss {r['final_val_loss']:.5f}  {100 * r['vs_float32']:+.2f}% vs float32{mark}")

    version = subprocess.run([args.trainer, "--version"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    summary = {"schema": SCHEMA, "date": datetime.date.today().isoformat(), "config": args.config,
               "trainer": version, "commit": commit.stdout.strip() if commit.returncode == 0 else "unknown",
               "set": args.set, "threads": args.threads, "jobs": args.jobs, "cpu": cpu_model(),
               "cores": os.cpu_count(), "runs": args.runs, "variants": results, "all_within_bounds": ok}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")
    if args.plot:
        cmd = [sys.executable, os.path.join(HERE, "..", "scripts", "plot_metrics.py")]
        cmd += [os.path.join(args.runs, v) for v in variants]
        cmd += ["--out", args.plot, "--labels", ",".join(variants),
                "--title", f"{os.path.basename(args.config)}: validation and training loss by precision"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{shlex.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
        print(r.stdout.strip())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
