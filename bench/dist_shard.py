#!/usr/bin/env python3
"""dist.shard on one host: sharded data parallel against plain data parallel (dist.shard none), as torchrun runs it.

Four parts, each a key of the one JSON file written (docs/DISTRIBUTED.md shows the figures):

  parity   ResNet-20 and llama_tiny (synthetic data), 2 and 3 ranks, --steps steps each with none, optimizer
           and gradients: each mode's largest loss difference and final-weight difference from none (and
           whether the weights are bit for bit none's), beside the spread of summation order (none with 2
           threads a rank instead of 1; for llama_tiny also one process); per rank the optimizer state's bytes, the tensors' peak and the
           process's peak resident memory.
  speed    2 ranks of configs/bench_gpt_tiny_cpu.yaml (synthetic tokens), alternating rounds of none,
           optimizer and gradients: the median step time of each, and the ratios to none.
  resume   llama_tiny on 2 ranks (gradients), one rank SIGKILLed mid-run, then resumed on 2 ranks
           (gradients), 3 ranks (optimizer) and 1 process: every step trained once, and the final weights
           against the same run never interrupted.
  cap      SmolLM2-135M's shape under one memory.limit per process: one process gives up (exit 3: its
           weights, gradients and AdamW state do not fit), 2 ranks with dist.shard gradients train.

    /usr/bin/python3 bench/dist_shard.py --trainer build/trainer --out shard.json [--parts parity,speed,resume,cap]

An existing --out file keeps the parts not run again.

The interpreter must have torch (torchrun, and reading the weights back): Debian's python3-torch, or the 2.11
environment's (scripts/install-torch.sh --python) with --trainer build-cuda/trainer.
"""
import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MODES = ["none", "optimizer", "gradients"]

JOBS = {
    # BatchNorm's statistics are each rank's own: the same in every mode, so the modes compare.
    "resnet20": ["model.name=resnet20", "data.kind=synthetic", "data.shape=[3,32,32]", "data.synthetic_size=2400",
                 "train.global_batch=24", "optim.name=adamw", "optim.lr=0.001", "optim.grad_clip=1.0"],
    "llama_tiny": ["model.name=llama_tiny", "data.kind=synthetic", "model.context=32", "data.synthetic_size=2400",
                   "train.global_batch=12", "optim.name=adamw", "optim.lr=0.003", "optim.grad_clip=1.0"],
}
COMMON = ["data.test=", "train.epochs=0", "schedule.warmup_steps=0", "schedule.name=constant", "log.every=100000",
          "checkpoint.every_seconds=0", "seed=5", "train.threads=1", "dist.timeout_s=120", "data.workers=1"]


def sets(items):
    out = []
    for s in items:
        out += ["--set", s]
    return out


def launch(a, ranks, run_dir, items, wrapper=None):
    """The command of one run: torchrun with `ranks` ranks, or the trainer alone for 1."""
    cmd = [os.path.abspath(a.trainer), "--run-dir", run_dir] + sets(COMMON + items)
    if ranks == 1:
        return cmd
    port = str(29000 + (os.getpid() + int(time.time() * 1000)) % 20000)
    head = [a.python, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", port,
            "--redirects", "2", "--tee", "2", "--no_python"]
    return head + ([wrapper] if wrapper else []) + cmd


def run(a, ranks, run_dir, items, ok=(0,)):
    p = subprocess.run(launch(a, ranks, run_dir, items), capture_output=True, text=True)
    if p.returncode not in ok:
        sys.exit("error: dist_shard: %s (%d ranks) exited %d:\n%s" % (run_dir, ranks, p.returncode, p.stderr[-3000:]))
    return p


def lines(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def steps(run_dir, rank=0):
    path = os.path.join(run_dir, "metrics.jsonl") if rank == 0 else os.path.join(run_dir, "rank%d" % rank, "metrics.jsonl")
    return [l for l in lines(path) if "event" not in l]


def weights(run_dir):
    ck = os.path.join(run_dir, "checkpoints", open(os.path.join(run_dir, "checkpoints", "latest")).read().strip())
    return torch.load(os.path.join(ck, "model.pt"))


def weight_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a), all(torch.equal(a[k], b[k]) for k in a)


def per_rank(run_dir, ranks):
    out = []
    for r in range(ranks):
        s = steps(run_dir, r)
        out.append({"optimizer_state_bytes": s[-1]["optimizer_state_bytes"],
                    "mem_start_bytes": s[-1]["mem_start_bytes"],
                    "mem_peak_bytes": max(l["mem_peak_bytes"] for l in s),
                    "rss_peak_bytes": max(l["rss_peak_bytes"] for l in s)})
    return out


def parity(a, work):
    res = {}
    for job, items in JOBS.items():
        for ranks in (2, 3):
            key = "%s_%d_ranks" % (job, ranks)
            res[key] = {}
            base = None
            # The spread to compare with: plain data parallel with 2 threads a rank instead of 1, the same
            # arithmetic summed in other orders inside the kernels.
            # And one process at the same global batch (for llama_tiny; ResNet-20's BatchNorm statistics
            # are per rank, so one process is another computation).
            for mode in MODES + ["none_2_threads", "one_process"]:
                d = os.path.join(work, "parity", key, mode)
                extra = ["dist.shard=none", "train.threads=2"] if mode == "none_2_threads" else ["dist.shard=" + mode]
                if mode == "one_process":
                    extra = []
                    if job == "resnet20":
                        continue
                run(a, 1 if mode == "one_process" else ranks, d, items + ["train.steps=%d" % a.steps] + extra)
                s = steps(d)
                entry = {"per_rank": per_rank(d, 1 if mode == "one_process" else ranks), "final_loss": s[-1]["loss"],
                         "step_time_s_p50": statistics.median(l["step_time_s"] for l in s[5:])}
                if base is None:
                    base = (s, weights(d))
                else:
                    diff, bitwise = weight_diff(base[1], weights(d))
                    entry["max_loss_diff"] = max(abs(x["loss"] - y["loss"]) for x, y in zip(base[0], s))
                    entry["max_weight_diff"] = diff
                    entry["weights_bitwise_equal"] = bitwise
                res[key][mode] = entry
                print("parity %s %s: %s" % (key, mode, {k: v for k, v in entry.items() if k != "per_rank"}), file=sys.stderr)
            none_state = res[key]["none"]["per_rank"][0]["optimizer_state_bytes"]
            for mode in ("optimizer", "gradients"):
                worst = max(r["optimizer_state_bytes"] for r in res[key][mode]["per_rank"])
                res[key][mode]["state_over_none_share"] = worst / (none_state / ranks)
    return res


def speed(a, work):
    items = ["model.name=gpt_tiny", "model.context=128", "data.kind=synthetic", "data.synthetic_size=4096",
             "train.global_batch=16", "optim.name=adamw", "optim.lr=0.002", "optim.grad_clip=1.0",
             "train.steps=%d" % a.speed_steps]
    rounds = []
    for r in range(a.rounds):
        order = MODES if r % 2 == 0 else list(reversed(MODES))
        times = {}
        for mode in order:
            d = os.path.join(work, "speed", "r%d_%s" % (r, mode))
            run(a, 2, d, items + ["dist.shard=" + mode])
            times[mode] = statistics.median(l["step_time_s"] for l in steps(d)[5:])
        rounds.append({"step_time_s_p50": times, "optimizer_over_none": times["optimizer"] / times["none"],
                       "gradients_over_none": times["gradients"] / times["none"]})
        print("speed round %d: %s" % (r + 1, rounds[-1]), file=sys.stderr)
    return {"job": "gpt_tiny, context 128, 16 sequences a step, AdamW, synthetic tokens, 2 ranks x 1 thread",
            "rounds": rounds,
            "median_optimizer_over_none": statistics.median(x["optimizer_over_none"] for x in rounds),
            "median_gradients_over_none": statistics.median(x["gradients_over_none"] for x in rounds)}


def resume(a, work):
    items = JOBS["llama_tiny"] + ["checkpoint.every_steps=10"]
    total = 100
    plain = os.path.join(work, "resume", "plain")
    run(a, 2, plain, items + ["train.steps=%d" % total, "dist.shard=gradients"])
    d = os.path.join(work, "resume", "chain")
    pids = os.path.join(work, "resume", "pids")
    os.makedirs(pids, exist_ok=True)
    wrapper = os.path.join(work, "resume", "rank.sh")
    with open(wrapper, "w") as f:
        f.write('#!/bin/sh\necho $$ > "%s/pid.$RANK"\nexec "$@"\n' % pids)
    os.chmod(wrapper, 0o755)
    agent = subprocess.Popen(launch(a, 2, d, items + ["train.steps=%d" % total, "dist.shard=gradients"], wrapper),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        s = steps(d) if os.path.exists(os.path.join(d, "metrics.jsonl")) else []
        if s and s[-1]["step"] >= 35:
            break
        time.sleep(0.2)
    killed_at = steps(d)[-1]["step"]
    os.kill(int(open(os.path.join(pids, "pid.1")).read()), signal.SIGKILL)
    agent.wait()
    stages = [(2, "gradients", 60), (3, "optimizer", 80), (1, "none", total)]
    for ranks, mode, upto in stages:
        run(a, ranks, d, items + ["train.steps=%d" % upto, "dist.shard=" + mode])
    resumes = [l for l in lines(os.path.join(d, "metrics.jsonl")) if l.get("event") == "resume"]
    # Every step once: after each resume the steps go on from the checkpoint's step, so the lineage of the
    # final weights is the last line of each step number; it must be steps 1..total, each once.
    lineage = {}
    for l in steps(d):
        lineage[l["step"]] = l
    diff, bitwise = weight_diff(weights(plain), weights(d))
    return {"job": "llama_tiny, 2 ranks (gradients), checkpoint every 10 steps", "killed_rank": 1,
            "killed_after_step": killed_at, "resumed_at": [r["step"] for r in resumes],
            "stages": [{"ranks": r, "dist.shard": m, "until_step": u} for r, m, u in stages],
            "steps_in_lineage": sorted(lineage) == list(range(1, total + 1)),
            "samples_seen_last": lineage[total]["samples_seen"],
            "samples_seen_uninterrupted": steps(plain)[-1]["samples_seen"],
            "max_weight_diff_vs_uninterrupted": diff, "weights_bitwise_equal": bitwise}


def cap(a, work):
    items = ["model.name=smollm2_135m", "model.context=32", "data.kind=synthetic", "data.synthetic_size=64",
             "train.global_batch=4", "optim.name=adamw", "optim.lr=0.0003", "train.steps=3",
             "memory.limit=" + a.cap, "dist.bucket_mb=25"]
    out = {"job": "SmolLM2-135M's shape, context 32, 4 sequences a step, AdamW float32", "memory.limit": a.cap}
    for name, ranks, mode in (("one_process", 1, "none"), ("two_ranks_none", 2, "none"),
                              ("two_ranks_optimizer", 2, "optimizer"), ("two_ranks_gradients", 2, "gradients")):
        d = os.path.join(work, "cap", name)
        p = run(a, ranks, d, items + ["dist.shard=" + mode], ok=(0, 1, 3))
        s = steps(d) if os.path.exists(os.path.join(d, "metrics.jsonl")) else []
        out[name] = {"exit": p.returncode, "steps_trained": len(s), "trained": p.returncode == 0 and len(s) == 3,
                     "per_rank": per_rank(d, ranks) if p.returncode == 0 else None}
        if p.returncode != 0:
            out[name]["error"] = [l for l in p.stderr.splitlines() if "error:" in l][:1]
        print("cap %s: %s" % (name, out[name]), file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose torch provides torchrun")
    ap.add_argument("--parts", default="parity,speed,resume,cap")
    ap.add_argument("--steps", type=int, default=100, help="parity: steps of each run")
    ap.add_argument("--speed-steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cap", default="1900MiB", help="cap: memory.limit of every process")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="dist_shard_")
    out = {}
    if os.path.exists(a.out):  # a part run again replaces its key; the others stay
        out = json.load(open(a.out))
    out.update({"schema": "trainer-dist-shard/1", "trainer": a.trainer, "torch": torch.__version__, "work_dir": work,
                "date": time.strftime("%Y-%m-%d")})
    parts = {"parity": parity, "speed": speed, "resume": resume, "cap": cap}
    for name in a.parts.split(","):
        if name not in parts:
            sys.exit("error: dist_shard: unknown part '%s' (parity, speed, resume, cap)" % name)
        t = time.time()
        out[name] = parts[name](a, work)
        out[name]["wall_s"] = time.time() - t
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps({k: v for k, v in out.items() if k in ("speed",)}, indent=1)[:2000])


if __name__ == "__main__":
    main()
