#!/usr/bin/python3
"""Peak RSS of a whole trainer process against the container limit it was given (docs/MEMORY.md "RSS
against the container's limit").

    /usr/bin/python3 bench/rss_vs_cap.py --trainer build/trainer --config configs/bench_oom_resnet20.yaml \\
        --limit 400MiB --limit 600MiB --steps 80 [--margin 0 --reserve 0] [--set key=value ...] --out rss.json

For every --limit: a fake cgroup v2 tree whose memory.max is that limit (TRAINER_CGROUP_ROOT points the
trainer at it; nothing limits the process for real), one training run with memory.limit: auto (and the
given memory.auto_margin / memory.auto_reserve, default: the trainer's defaults), and the process's peak
resident set from the kernel (os.wait4's ru_maxrss) against the limit. Also from metrics.jsonl: the
tensor cap auto resolved, the RSS when it was resolved, the largest step peak of tensor memory, the
largest per-step RSS, OOMs, the micro-batches. Derived:

    other_at_limit = limit - reserve - cap / (1 - margin)   (non-tensor memory when the cap was resolved)
    unaccounted    = peak RSS - other_at_limit - tensor peak (what grew outside the formula: non-tensor
                     growth after the cap was resolved, plus freed tensor memory that glibc keeps)

Writes one JSON (the runs and the command lines); exit code 1 if a run failed, 2 on bad input.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "kb": 1000, "mb": 1000 ** 2,
         "gb": 1000 ** 3, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"'{text}' is not a byte size (400MiB, 1GB, 123)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def fake_container(limit_bytes):
    """A cgroup v2 tree with memory.max = limit_bytes; the caller removes it."""
    root = tempfile.mkdtemp(prefix="trainer-fake-cgroup-")
    os.makedirs(os.path.join(root, "proc", "self"))
    os.makedirs(os.path.join(root, "sys", "fs", "cgroup"))
    files = {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cgroup.controllers": "memory\n",
             "sys/fs/cgroup/memory.max": f"{limit_bytes}\n"}
    for rel, text in files.items():
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    return root


def read_lines(path):
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
    return out


def summarize(lines, limit, margin, reserve):
    steps = [l for l in lines if "event" not in l]
    start = next(l for l in lines if l.get("event") == "start")
    cap = start["limit"]
    other = limit - reserve - cap / (1 - margin)
    tensor_peak = max(s["mem_peak_bytes"] for s in steps)
    rss_steps = max(s.get("rss_bytes", 0) for s in steps)
    autos = [l["micro_batch"] for l in lines if l.get("event") == "auto_micro_batch"]
    return {"cap_bytes": cap, "rss_at_limit_bytes": start.get("rss_at_limit"), "other_at_limit_bytes": other,
            "tensor_peak_bytes": tensor_peak, "rss_max_of_steps_bytes": rss_steps,
            "rss_peak_trainer_bytes": max(s.get("rss_peak_bytes", 0) for s in steps),
            "steps": len(steps), "ooms": sum(1 for l in lines if l.get("event") == "oom"),
            "probes": sum(1 for l in lines if l.get("event") == "probe"),
            "auto_micro_batch": autos[0] if autos else None,
            "micro_batches": sorted({s["micro_batch"] for s in steps}),
            "final_micro_batch": steps[-1]["micro_batch"]}


def run_one(a, limit):
    root = fake_container(limit)
    tmp = tempfile.mkdtemp(prefix="trainer-rss-run-")
    run_dir = os.path.join(tmp, "run")  # new: the trainer's --no-resume wants an empty or new folder
    log_path = os.path.join(tmp, "stdout.log")
    try:
        cmd = [a.trainer, "--run-dir", run_dir, "--no-resume", "--config", a.config, "--set", "memory.limit=auto",
               "--set", f"train.steps={a.steps}", "--set", "checkpoint.every_steps=0",
               "--set", "checkpoint.every_seconds=0", "--set", "data.test=", "--set", "log.level=warn"]
        if a.margin is not None:
            cmd += ["--set", f"memory.auto_margin={a.margin}"]
        if a.reserve is not None:
            cmd += ["--set", f"memory.auto_reserve={a.reserve}"]
        for s in a.set:
            cmd += ["--set", s]
        env = dict(os.environ, TRAINER_CGROUP_ROOT=root)
        t0 = time.time()
        with open(log_path, "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            _, status, ru = os.wait4(p.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0:
            with open(log_path) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"run under {limit} bytes failed (exit {rc}):\n{tail}")
        lines = read_lines(os.path.join(run_dir, "metrics.jsonl"))
        margin = a.margin if a.margin is not None else 0.1
        reserve = parse_bytes(a.reserve) if a.reserve is not None else None
        if reserve is None:  # the trainer's default, from the resolved config
            with open(os.path.join(run_dir, "resolved_config.yaml")) as f:
                text = f.read()
            reserve = parse_bytes(re.search(r"auto_reserve:\s*(\S+)", text).group(1).strip("'\""))
            margin = float(re.search(r"auto_margin:\s*(\S+)", text).group(1))
            if margin < 0:  # -1: the device's default; these runs are on the CPU (from_config.h)
                margin = 0.3
        r = {"limit_bytes": limit, "margin": margin, "reserve_bytes": reserve, "wall_s": time.time() - t0,
             "command": " ".join(cmd), "rss_peak_bytes": ru.ru_maxrss * 1024}
        r.update(summarize(lines, limit, margin, reserve))
        r["rss_peak_over_limit"] = r["rss_peak_bytes"] / limit
        r["headroom_bytes"] = limit - r["rss_peak_bytes"]
        r["unaccounted_bytes"] = r["rss_peak_bytes"] - r["other_at_limit_bytes"] - r["tensor_peak_bytes"]
        return r
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", default="build/trainer")
    p.add_argument("--config", required=True)
    p.add_argument("--limit", action="append", required=True, help="container limit (repeatable): 400MiB")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--margin", type=float, default=None, help="memory.auto_margin (default: the trainer's)")
    p.add_argument("--reserve", default=None, help="memory.auto_reserve (default: the trainer's)")
    p.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    try:
        limits = [parse_bytes(l) for l in a.limit]
    except ValueError as e:
        print(f"error: --limit: {e}", file=sys.stderr)
        sys.exit(2)
    runs = []
    for limit in limits:
        try:
            r = run_one(a, limit)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        runs.append(r)
        print(f"limit {limit / 2**20:.0f} MiB: cap {r['cap_bytes'] / 2**20:.1f} MiB, other at limit "
              f"{r['other_at_limit_bytes'] / 2**20:.1f} MiB, tensor peak {r['tensor_peak_bytes'] / 2**20:.1f} MiB, "
              f"peak RSS {r['rss_peak_bytes'] / 2**20:.1f} MiB ({100 * r['rss_peak_over_limit']:.1f}% of the limit), "
              f"unaccounted {r['unaccounted_bytes'] / 2**20:.1f} MiB, OOMs {r['ooms']}, micro-batches "
              f"{r['micro_batches']}", file=sys.stderr)
    out = {"mode": "rss_vs_cap", "config": a.config, "overrides": a.set, "steps": a.steps,
           "command_line": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_avg": list(os.getloadavg()), "runs": runs}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
