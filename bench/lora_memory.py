#!/usr/bin/python3
"""LoRA against a full fine-tune of one job: trainable parameters, peak resident memory and step time.

    lora_memory.py --config FILE [--set key=value ...] [--trainer build/trainer] [--steps 3]
                   [--arm NAME:key=value,key=value ...] [--out summary.json] [--workdir DIR]

Each arm trains the job for --steps steps (global batch and everything else as the config says, with the
arm's settings on top) under /usr/bin/time -v, one after the other on the same machine. Per arm: the
trainer's own count of trainable parameters (its `lora:` log line, or every parameter without LoRA), the
process's peak resident set (time -v's maximum, which holds the float32 initialization of the weights
before they move to bfloat16), the resident set and the tensor peak at the last step (metrics.jsonl:
rss_bytes, mem_peak_bytes), the median step time, the losses, and the exit status (an arm that does not fit
under its memory.limit exits 3: its line says so). The default arms are LoRA rank 16 on q, k, v and o with
bfloat16 base weights under memory.limit 8GiB, the same with float32 base weights, and the full fine-tune
in the fewest bytes this trainer has (bfloat16 weights, int8 AdamW moments).

Needs only the standard library and GNU time (/usr/bin/time, Debian's `time` package).
"""
import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hostinfo import cpu_model  # noqa: E402

SCHEMA = "trainer-bench-lora-memory/1"
LORA = "model.lora.rank=16,model.lora.alpha=32,model.lora.targets=[q_proj,k_proj,v_proj,o_proj]"
ARMS = [
    "lora_bf16:" + LORA + ",model.param_dtype=bfloat16,memory.limit=8GiB",
    "lora_fp32:" + LORA + ",memory.limit=20GiB",
    "full_bf16_int8:model.param_dtype=bfloat16,optim.state_dtype=int8,optim.stochastic_rounding=true,memory.limit=20GiB",
]


def parse_arm(text):
    name, _, sets = text.partition(":")
    # Split on commas outside brackets: a list value ([q_proj,k_proj]) keeps its commas.
    parts, depth, cur = [], 0, ""
    for ch in sets:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return name, parts


def run_arm(args, name, sets, workdir):
    run_dir = os.path.join(workdir, name)
    cmd = ["/usr/bin/time", "-v", args.trainer, "--config", args.config, "--run-dir", run_dir,
           "--set", "train.steps=%d" % args.steps, "--set", "checkpoint.final=false"]
    for s in args.set + sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = r.stdout + r.stderr
    res = {"command": shlex.join(cmd[2:]), "exit_status": r.returncode}
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out)
    res["max_rss_bytes_time_v"] = int(m.group(1)) * 1024 if m else None
    m = re.search(r"lora: .*?: (\d+) trainable parameters of (\d+)", out)
    m_all = re.search(r"model: \S+ with (\d+) parameters", out)
    res["parameters"] = int(m.group(2)) if m else int(m_all.group(1)) if m_all else None
    res["trainable_parameters"] = int(m.group(1)) if m else res["parameters"]
    steps = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            steps = [e for e in map(json.loads, f) if "step_time_s" in e and e.get("updated", True)]
    res["losses"] = [e["loss"] for e in steps]
    res["step_time_s"] = [e["step_time_s"] for e in steps]
    res["step_time_s_median"] = statistics.median(res["step_time_s"]) if steps else None
    res["rss_bytes_last_step"] = steps[-1]["rss_bytes"] if steps else None
    res["mem_peak_bytes"] = max(e["mem_peak_bytes"] for e in steps) if steps else None
    res["mem_limit_bytes"] = steps[-1]["mem_limit_bytes"] if steps else None
    if r.returncode != 0:
        lines = [l for l in out.splitlines() if "error" in l or "gave up" in l]
        res["error"] = lines[-1] if lines else out.strip().splitlines()[-1]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], help="key=value for every arm (repeatable)")
    ap.add_argument("--trainer", default=os.environ.get("TRAINER_BIN", "build/trainer"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--arm", action="append", default=[], help="NAME:key=value,... (repeatable; default: " +
                    "lora_bf16, lora_fp32, full_bf16_int8)")
    ap.add_argument("--out", default="")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="lora_memory_")
    summary = {"schema": SCHEMA, "machine": cpu_model(), "config": args.config, "set": args.set, "steps": args.steps,
               "workdir": workdir, "arms": {}}
    for text in args.arm or ARMS:
        name, sets = parse_arm(text)
        res = run_arm(args, name, sets, workdir)
        summary["arms"][name] = res
        gib = lambda b: "%.2f GiB" % (b / 2**30) if b else "-"  # noqa: E731
        print("%-16s exit %d  trainable %s of %s  max RSS %s  RSS at the last step %s  tensor peak %s  step %s s%s" % (
            name, res["exit_status"], res["trainable_parameters"], res["parameters"], gib(res["max_rss_bytes_time_v"]),
            gib(res["rss_bytes_last_step"]), gib(res["mem_peak_bytes"]),
            "%.2f" % res["step_time_s_median"] if res["step_time_s_median"] else "-",
            "  (" + res["error"] + ")" if "error" in res else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
