#!/usr/bin/env python3
"""What data parallelism costs on one host: the same job as one process and as N torchrun ranks.

In alternating rounds it runs (a) one process with N threads at the global batch, (b) N ranks of one thread
each at the same global batch (torchrun), and (c) one process with one thread at the per-rank batch: the
work one rank does, without communication. (b) / (c) is the price of the gradient exchange and the
agreements; (b) / (a) says whether ranks beat threads on this host. Writes one JSON file.

    /usr/bin/python3 bench/ddp_overhead.py --config configs/bench_resnet18_cpu.yaml --trainer build/trainer \
        --ranks 2 --rounds 3 --steps 25 --out ddp.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def step_times(run_dir, skip):
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    steps = [l for l in lines if "event" not in l]
    return [l["step_time_s"] + l["data_wait_s"] for l in steps][skip:], steps[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose torch provides torchrun")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--set", action="append", default=[], help="key=value, passed to every run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.ranks < 2 or a.steps <= a.warmup:
        sys.exit("error: ddp_overhead: need --ranks >= 2 and --steps > --warmup")
    common = ["--config", a.config, "--set", "train.steps=%d" % a.steps, "--set", "log.every=100000",
              "--set", "checkpoint.every_seconds=0"]
    for s in a.set:
        common += ["--set", s]
    trainer = os.path.abspath(a.trainer)
    # The global batch as the config resolves it (after --set).
    resolved = subprocess.run([trainer, "--dry-run"] + common, capture_output=True, text=True, check=True).stdout
    global_batch = None
    section = ""
    for line in resolved.splitlines():
        if line and not line.startswith(" "):
            section = line.rstrip(":")
        elif section == "train" and line.strip().startswith("global_batch:"):
            global_batch = int(line.split(":")[1])
    if global_batch is None or global_batch % a.ranks:
        sys.exit("error: ddp_overhead: train.global_batch (%s) must be divisible by --ranks %d" % (global_batch, a.ranks))

    work = tempfile.mkdtemp(prefix="ddp_overhead_")
    rounds = []
    for r in range(a.rounds):
        res = {}
        runs = {
            "threads": [trainer, "--run-dir", "%s/t%d" % (work, r)] + common + ["--set", "train.threads=%d" % a.ranks],
            "ranks": [a.python, "-m", "torch.distributed.run", "--nproc_per_node", str(a.ranks), "--redirects", "2",
                      "--tee", "2", "--no_python", trainer, "--run-dir", "%s/d%d" % (work, r)] + common +
                     ["--set", "train.threads=1"],
            "one_rank_alone": [trainer, "--run-dir", "%s/o%d" % (work, r)] + common +
                              ["--set", "train.threads=1", "--set", "train.global_batch=%d" % (global_batch // a.ranks)],
        }
        order = list(runs) if r % 2 == 0 else list(reversed(runs))  # neither goes first every time
        for name in order:
            p = subprocess.run(runs[name], capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit("error: ddp_overhead: the %s run failed (exit %d):\n%s" % (name, p.returncode, p.stderr[-2000:]))
            run_dir = runs[name][runs[name].index("--run-dir") + 1]
            times, last = step_times(run_dir, a.warmup)
            res[name] = {"step_time_s_p50": statistics.median(times), "loss_last": last["loss"]}
            if name == "ranks":
                res[name]["grad_buckets"] = last.get("grad_buckets")
                res[name]["grad_buckets_in_backward"] = last.get("grad_buckets_in_backward")
        res["ratio_ranks_over_one_rank_alone"] = res["ranks"]["step_time_s_p50"] / res["one_rank_alone"]["step_time_s_p50"]
        res["ratio_ranks_over_threads"] = res["ranks"]["step_time_s_p50"] / res["threads"]["step_time_s_p50"]
        rounds.append(res)
        print("round %d: ranks/one-rank-alone %.3f, ranks/threads %.3f" %
              (r + 1, res["ratio_ranks_over_one_rank_alone"], res["ratio_ranks_over_threads"]), file=sys.stderr)
    out = {
        "schema": "trainer-ddp-overhead/1",
        "config": a.config, "sets": a.set, "ranks": a.ranks, "global_batch": global_batch,
        "steps": a.steps, "warmup": a.warmup, "rounds": rounds,
        "median_ratio_ranks_over_one_rank_alone": statistics.median(r["ratio_ranks_over_one_rank_alone"] for r in rounds),
        "median_ratio_ranks_over_threads": statistics.median(r["ratio_ranks_over_threads"] for r in rounds),
        "work_dir": work,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps({k: out[k] for k in ("median_ratio_ranks_over_one_rank_alone", "median_ratio_ranks_over_threads")}))


if __name__ == "__main__":
    main()
