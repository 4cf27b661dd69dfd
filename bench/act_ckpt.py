#!/usr/bin/env python3
"""Peak activation memory and step time with and without activation checkpointing, same micro-batch.

Runs the trainer twice per workload (memory.activation_checkpointing none, then all), reads each run's
metrics.jsonl and reports, per workload: the activation peak (mem_peak_bytes - mem_start_bytes: what the
step allocated on top of weights, optimizer state and the batch), the median step time, and the ratios.
Targets (issue 4): activation peak cut by >= 40% at <= 35% extra step time.

    /usr/bin/python3 bench/act_ckpt.py --trainer build/trainer --out act_ckpt.json [--steps 6] [--threads 1]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

WORKLOADS = {
    # name: trainer arguments (synthetic data, so no dataset is needed)
    "resnet50_64px_b16": ["--config", "configs/resnet50.yaml", "--set", "data.shape=[3,64,64]",
                          "--set", "train.global_batch=16", "--set", "train.micro_batch=16",
                          "--set", "memory.limit=none", "--set", "data.synthetic_size=512"],
    "gpt_tiny_ctx128_b8": ["--config", "configs/gpt_tiny_fortunes.yaml", "--set", "train.global_batch=8",
                           "--set", "model.context=128", "--set", "train.eval_every=1000000",
                           "--set", "data.test="],
}


def run(trainer, args, policy, steps, workdir, threads):
    run_dir = os.path.join(workdir, policy)
    cmd = [trainer, "--run-dir", run_dir, *args, "--set", f"train.steps={steps}", "--set", "train.epochs=0",
           "--set", f"memory.activation_checkpointing={policy}", "--set", "checkpoint.every_steps=0",
           "--set", "checkpoint.every_seconds=0", "--set", "log.every=1000", "--set", f"train.threads={threads}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    steps_ = [l for l in lines if "event" not in l][1:]  # the first step allocates optimizer state
    return {
        "policy": policy,
        "step_time_s_median": statistics.median(l["step_time_s"] for l in steps_),
        "activation_peak_bytes": max(l["mem_peak_bytes"] - l["mem_start_bytes"] for l in steps_),
        "peak_bytes": max(l["mem_peak_bytes"] for l in steps_),
        "steps_timed": len(steps_),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--out", default="act_ckpt.json")
    ap.add_argument("--threads", type=int, default=0, help="train.threads (0 = the CPUs the process may use)")
    a = ap.parse_args()
    out = {"workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in WORKLOADS.items():
            if a.only and name not in a.only.split(","):
                continue
            plain = run(a.trainer, args, "none", a.steps, os.path.join(tmp, name), a.threads)
            ckpt = run(a.trainer, args, "all", a.steps, os.path.join(tmp, name), a.threads)
            cut = 1 - ckpt["activation_peak_bytes"] / plain["activation_peak_bytes"]
            slower = ckpt["step_time_s_median"] / plain["step_time_s_median"] - 1
            out["workloads"][name] = {"none": plain, "all": ckpt, "activation_peak_cut": cut,
                                      "extra_step_time": slower,
                                      "meets_target": cut >= 0.40 and slower <= 0.35}
            print(f"{name}: activation peak {plain['activation_peak_bytes']/2**20:.1f} -> "
                  f"{ckpt['activation_peak_bytes']/2**20:.1f} MiB ({100*cut:.0f}% less), step time "
                  f"{plain['step_time_s_median']:.3f} -> {ckpt['step_time_s_median']:.3f} s ({100*slower:+.0f}%)")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
