#!/usr/bin/env python3
"""The built-in job as a new user runs it, from a fresh clone, written as JSON: the README's headline.

  /usr/bin/python3 bench/quickstart.py --out bench/results/quickstart-DATE/quickstart.json [--cold] [--repeat]
  /usr/bin/python3 bench/quickstart.py --fingerprint RUN_DIR [RUN_DIR ...]

1. `git clone` of this repository's HEAD (committed work only) into WORK/fresh, then `bash
   scripts/quickstart.sh` there, timed: the packages, the build, the dataset's conversion and the 6
   epochs of configs/resnet20_fmnist.yaml. --cold builds with ccache off (CCACHE_DISABLE=1), as on a new
   machine.
2. From the run's metrics.jsonl: the final evaluation (`final.top1`, `final.top5`, `final.loss`), each
   epoch's top-1, the training time (`training_s`, the end event's) and the time before the first step.
3. `fingerprint`: SHA-256 of every step's loss and gradient norm, as metrics.jsonl writes them (the
   shortest text that reads back as the same double). Two runs with the same fingerprint computed the
   same numbers bit for bit, step by step; a changed fingerprint at the same commit on the same machine
   is a defect. `machine` says what else decides the arithmetic: the CPU (its extensions, and LibTorch's
   CPU capability as `cpu_capability` where a Python torch shares the trainer's LibTorch), the threads,
   the BLAS.
   `first_steps` keeps the first 50 steps' losses and gradient norms: tests/test_quickstart.cpp trains
   them again with the current code and fails, on a machine like this one, when they are not the same
   bit for bit (then the figures here are stale: rerun this, and add a CHANGELOG.md entry).
4. --repeat trains the job a second time in the same clone (`--no-resume`, another run folder) and
   records whether its fingerprint and final figures are the same (`repeat.identical`).

--fingerprint prints the fingerprint of finished run folders and exits 0 when they all agree, 1 when not.
Exit 0 on success, 2 when a step fails (its output is printed).
"""
import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUN = "runs/resnet20_fmnist"
# The warmup's steps: their learning rate does not depend on the job's length, so a run of this many steps
# computes what the whole job's first steps do (tests/test_quickstart.cpp checks the current code's).
FIRST_STEPS = 50
ISA = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile"}


def run_lines(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def fingerprint(lines):
    steps = [j for j in lines if "event" not in j]
    h = hashlib.sha256()
    for j in steps:
        h.update(f"{j['step']} {j['loss']!r} {j['grad_norm']!r}\n".encode())
    return h.hexdigest(), len(steps)


def summary(run_dir):
    lines = run_lines(run_dir)
    evals = [j for j in lines if j.get("event") == "eval"]
    start = next(j for j in lines if j.get("event") == "start")
    end = next(j for j in reversed(lines) if j.get("event") == "end")
    digest, steps = fingerprint(lines)
    first = [j for j in lines if "event" not in j][:FIRST_STEPS]
    final = evals[-1]
    return {
        "final": {"top1": final["top1"], "top5": final["top5"], "loss": final["loss"], "step": final["step"]},
        "epochs_top1": [e["top1"] for e in evals],
        "steps": steps,
        "training_s": end["seconds"],
        "torch": start.get("torch"),
        "fingerprint": digest,
        "first_steps": {"loss": [j["loss"] for j in first], "grad_norm": [j["grad_norm"] for j in first]},
    }


def cpu_capability(binary):
    """LibTorch's CPU capability ("AVX2", "AVX512"...) as the trainer's LibTorch reports it, through a Python
    torch that has loaded the same libtorch_cpu (Debian's python3-torch, for the Debian build); None where
    there is none. tests/test_quickstart.cpp compares it with this machine's."""
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    ours = re.search(r"libtorch_cpu\.so\S* => (\S+)", ldd)
    probe = ("import os, re, torch\n"
             "print(re.search(r'CPU capability usage: (.*)', torch.__config__.show()).group(1))\n"
             "print(*{os.path.realpath(l.split()[-1]) for l in open('/proc/self/maps') if 'libtorch_cpu' in l})")
    try:
        shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = shown.stdout.splitlines()
    if shown.returncode != 0 or not ours or len(lines) != 2 or lines[1] != os.path.realpath(ours.group(1)):
        return None
    return lines[0].strip()


def machine(run_dir, binary):
    """What decides the arithmetic and the speed of the run in `run_dir`, trained by `binary`."""
    log = open(os.path.join(run_dir, "train.log")).read()
    threads = re.search(r"cpu: (\d+) threads", log)
    info = open("/proc/cpuinfo").read()
    cpu = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    blas = re.search(r"libblas\.so\.3 => (\S+)", ldd)
    return {
        "cpu": cpu.group(1) if cpu else "unknown",
        # The vector extensions LibTorch's and oneDNN's kernels are chosen by (one without AVX-512 differs
        # from the second step on).
        "isa": sorted(set(flags.group(1).split()) & ISA) if flags else [],
        "isa_checked": sorted(ISA),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "threads": int(threads.group(1)) if threads else None,
        "blas": os.path.realpath(blas.group(1)) if blas else "none",
        "cpu_capability": cpu_capability(binary),
    }


def first_step_time(clone):
    """The wall-clock time (epoch seconds) of the first step line in train.log."""
    for line in open(os.path.join(clone, RUN, "train.log")):
        m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] \[info\] step 1/", line)
        if m:
            return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return None


def step(cmd, cwd, env=None):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stdout.write(r.stdout + r.stderr)
        print(f"quickstart: `{' '.join(cmd)}` failed with exit {r.returncode}", file=sys.stderr)
        sys.exit(2)
    return r.stdout


def record(args):
    clone = os.path.join(os.path.abspath(args.work), "fresh")
    shutil.rmtree(clone, ignore_errors=True)
    step(["git", "clone", "-q", ROOT, clone], cwd=ROOT)
    commit = step(["git", "rev-parse", "HEAD"], cwd=clone).strip()
    env = dict(os.environ, CCACHE_DISABLE="1") if args.cold else None
    t0 = time.time()
    step(["bash", "scripts/quickstart.sh"], cwd=clone, env=env)
    whole_s = time.time() - t0
    out = {
        "mode": "quickstart",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "command": "git clone <repo> fresh && cd fresh && bash scripts/quickstart.sh",
        "cold_compiler_cache": args.cold,
        "whole_command_s": round(whole_s, 1),
        "before_first_step_s": round(first_step_time(clone) - t0, 1),
        "machine": machine(os.path.join(clone, RUN), os.path.join(clone, "build/trainer")),
        **summary(os.path.join(clone, RUN)),
    }
    if args.repeat:
        step(["build/trainer", "--config", "configs/resnet20_fmnist.yaml", "--run-dir", RUN + "_repeat", "--no-resume"],
             cwd=clone)
        again = summary(os.path.join(clone, RUN + "_repeat"))
        same = again["fingerprint"] == out["fingerprint"] and again["final"] == out["final"]
        out["repeat"] = {"identical": same, "fingerprint": again["fingerprint"], "final": again["final"],
                         "training_s": again["training_s"]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps({k: out[k] for k in ("commit", "final", "training_s", "whole_command_s", "fingerprint")}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="the JSON to write")
    p.add_argument("--work", default="/tmp/trainer-quickstart", help="where the fresh clone goes")
    p.add_argument("--cold", action="store_true", help="build with ccache off")
    p.add_argument("--repeat", action="store_true", help="train a second time and compare bit for bit")
    p.add_argument("--fingerprint", nargs="+", metavar="RUN_DIR", help="print finished runs' fingerprints")
    args = p.parse_args()
    if args.fingerprint:
        prints = []
        for d in args.fingerprint:
            digest, steps = fingerprint(run_lines(d))
            prints.append(digest)
            print(f"{digest}  {steps} steps  {d}")
        return 0 if len(set(prints)) == 1 else 1
    if not args.out:
        p.error("give --out FILE.json (or --fingerprint RUN_DIR ...)")
    record(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
