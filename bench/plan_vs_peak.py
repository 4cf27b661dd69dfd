#!/usr/bin/env python3
"""The memory plan (`trainer plan`) against the measured peak of the same job's steps.

Per workload: `trainer plan --json` under no cap at the workload's micro-batch, then a short run of the same
config and settings; the measured peak is the largest `mem_peak_bytes` of the steps after the first (the first
allocates the optimizer's state), the tensor memory the trainer's allocator counted. Writes a JSON file and
prints one row per workload: planned, measured, and (planned - measured) / measured.

With --caps, the plan's verdict against the run's own instead: per workload, three caps around what the plan
says it needs (0.8 x the peak of its smallest rung, where it should give up; 1.15 x that, where the ladder
should back off to a rung that fits; 1.15 x the peak at the workload's micro-batch, where it should fit as it
is), `trainer plan` (exit 0 fits, 3 does not) against a 2-step run under the same cap (exit 0 trained, 3 gave
up).

    /usr/bin/python3 bench/plan_vs_peak.py --trainer build/trainer --out plan_vs_peak.json [--only a,b]
    /usr/bin/python3 bench/plan_vs_peak.py --trainer build/trainer --caps --out plan_caps.json [--only a,b]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

QUIET = ["--set", "checkpoint.every_steps=0", "--set", "checkpoint.every_seconds=0", "--set", "checkpoint.final=false",
         "--set", "log.every=1", "--set", "train.eval_every=1000000"]

WORKLOADS = {
    # name: (config, settings); the micro-batch is fixed, so the plan and the run take the same rung
    "resnet20_fmnist_b128": ("configs/resnet20_fmnist.yaml", ["train.global_batch=128", "train.micro_batch=128"]),
    "resnet20_fmnist_b256x2": ("configs/resnet20_fmnist.yaml", ["train.global_batch=256", "train.micro_batch=128"]),
    "vit_fmnist_b128": ("configs/vit_fmnist.yaml", ["train.global_batch=128", "train.micro_batch=128"]),
    "gpt_tiny_fortunes_b16": ("configs/gpt_tiny_fortunes.yaml", ["train.global_batch=16", "train.micro_batch=16"]),
    "gpt_tiny_fortunes_b32x4": ("configs/gpt_tiny_fortunes.yaml", ["train.global_batch=32", "train.micro_batch=8"]),
    "llama_tiny_fortunes_b16": ("configs/llama_tiny_fortunes.yaml", ["train.global_batch=16", "train.micro_batch=16"]),
    "resnet50_224_b16x2": ("configs/resnet50.yaml", ["train.global_batch=32", "train.micro_batch=16",
                                                     "data.synthetic_size=64"]),
    "smollm2_135m_t256_b2": ("configs/bench_smollm2_135m_cpu.yaml", ["train.global_batch=2", "train.micro_batch=2"]),
    "smollm2_135m_t256_b2_int8": ("configs/bench_smollm2_135m_cpu.yaml", ["train.global_batch=2", "train.micro_batch=2",
                                                                          "optim.state_dtype=int8"]),
    "gpt2_t256_b2": ("configs/gpt2_small.yaml", ["model.context=256", "train.global_batch=2", "train.micro_batch=2",
                                                 "amp.enabled=false", "train.device=cpu", "data.kind=synthetic",
                                                 "data.synthetic_size=64", "data.test="]),
}


def sets(settings):
    out = []
    for s in settings:
        out += ["--set", s]
    return out


def plan(trainer, config, settings, tmp):
    path = os.path.join(tmp, "plan.json")
    r = subprocess.run([trainer, "plan", "--config", config, *sets(settings), "--set", "memory.limit=none",
                        "--json", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"trainer plan failed ({r.returncode}): {r.stdout}")
    return json.load(open(path))


def measure(trainer, config, settings, steps, tmp):
    run_dir = os.path.join(tmp, "run")
    t0 = time.time()
    subprocess.run([trainer, "--run-dir", run_dir, "--no-resume", "--config", config, *sets(settings),
                    "--set", "memory.limit=none", "--set", f"train.steps={steps}", "--set", "train.epochs=0", *QUIET],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    steps_ = [l for l in lines if "event" not in l and "mem_peak_bytes" in l]
    return {"peak_bytes": max(l["mem_peak_bytes"] for l in steps_[1:]),
            "first_step_peak_bytes": steps_[0]["mem_peak_bytes"], "steps": len(steps_), "seconds": time.time() - t0}


def verdicts(trainer, config, settings, tmp):
    """The plan's verdict and the run's under three caps around the plan's own figures."""
    floor = plan_under(trainer, config, settings, tmp, "1")["peak_bytes"]  # nothing fits: the smallest rung's
    start = plan(trainer, config, settings, tmp)["peak_bytes"]
    rows = []
    for name, cap in (("0.8 x smallest rung", int(0.8 * floor)), ("1.15 x smallest rung", int(1.15 * floor)),
                      ("1.15 x as configured", int(1.15 * start))):
        p = plan_under(trainer, config, settings, tmp, str(cap))
        run_dir = os.path.join(tmp, f"run{cap}")
        r = subprocess.run([trainer, "--run-dir", run_dir, "--no-resume", "--config", config, *sets(settings),
                            "--set", f"memory.limit={cap}", "--set", "train.steps=2", "--set", "train.epochs=0", *QUIET,
                            "--set", "data.test="],  # the training's verdict: no evaluation after it
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if r.returncode not in (0, 3):
            sys.exit(f"{config} under {cap}: the run exited {r.returncode}")
        rows.append({"cap": name, "cap_bytes": cap, "plan_fits": p["fits"], "plan_rung": p["rung"],
                     "plan_peak_bytes": p["peak_bytes"], "run_exit": r.returncode,
                     "agree": p["fits"] == (r.returncode == 0)})
    return rows


def plan_under(trainer, config, settings, tmp, limit):
    path = os.path.join(tmp, "plan_cap.json")
    r = subprocess.run([trainer, "plan", "--config", config, *sets(settings), "--set", f"memory.limit={limit}",
                        "--json", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode not in (0, 3):
        sys.exit(f"trainer plan failed ({r.returncode}): {r.stdout}")
    return json.load(open(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--out", default="plan_vs_peak.json")
    ap.add_argument("--caps", action="store_true", help="the plan's verdict against the run's under three caps")
    a = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%d"), "trainer": a.trainer, "workloads": {}}
    for name, (config, settings) in WORKLOADS.items():
        if a.only and name not in a.only.split(","):
            continue
        if a.caps:
            with tempfile.TemporaryDirectory() as tmp:
                rows = verdicts(a.trainer, config, settings, tmp)
            out["workloads"][name] = {"config": config, "settings": settings, "caps": rows}
            for row in rows:
                print(f"{name:32s} {row['cap']:22s} {row['cap_bytes'] / 2**20:10.1f} MiB  plan "
                      f"{'fits' if row['plan_fits'] else 'does not fit':13s} run exit {row['run_exit']}  "
                      f"{'agree' if row['agree'] else 'DISAGREE'}", flush=True)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=2)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            p = plan(a.trainer, config, settings, tmp)
            m = measure(a.trainer, config, settings, a.steps, tmp)
        err = (p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"]
        out["workloads"][name] = {"config": config, "settings": settings, "planned_peak_bytes": p["peak_bytes"],
                                  "measured_peak_bytes": m["peak_bytes"], "error": err, "plan": p, "run": m}
        print(f"{name:32s} planned {p['peak_bytes'] / 2**20:10.1f} MiB  measured {m['peak_bytes'] / 2**20:10.1f} MiB"
              f"  {100 * err:+6.1f}%  ({m['seconds']:.0f} s)", flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
