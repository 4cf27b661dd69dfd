#!/usr/bin/python3
"""The optimizer's update alone with each optim.state_dtype, against torchao's AdamW8bit on the same tensors.

    optim_state.py --config FILE [--set key=value ...] [--trainer build/trainer] [--python PYTHON]
                   [--rounds 3] [--warmup 3] [--steps 10] [--dtypes float32,bfloat16,int8] [--out summary.json]

Each round runs `trainer bench --optimizer` once per dtype (the job's model, random gradients; the update
alone, timed step by step), then, with --python (an interpreter with torchao: the 2.11 environment's,
scripts/install-torch.sh --python), torchao's AdamW8bit on tensors of the same shapes, with the same
threads, compiled (torchao's default: torch.compile) and eagerly. Every figure is the median step's wall
time over the timed steps, and ns per parameter; the summary gives each side's median over the rounds,
int8 and bfloat16 against our float32, and our int8 against torchao's.

    optim_state.py torchao SPEC.json OUT.json   (run in --python: the reference side)

Needs only the standard library; the reference side needs torch and torchao.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

SCHEMA = "trainer-bench-optim-state/1"


def ours(args, dtype, out):
    cmd = [args.trainer, "bench", "--optimizer", "--config", args.config, "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--out", out, "--set", f"optim.state_dtype={dtype}"]
    for s in args.set:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"optim_state.py: {shlex.join(cmd)} exited {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    with open(out) as f:
        return json.load(f), shlex.join(cmd)


def reference(args, result, out):
    spec = {"param_shapes": result["param_shapes"], "threads": result["threads"], "lr": 1e-3,
            "weight_decay": 0.1, "warmup": args.warmup, "steps": args.steps, "seed": 0}
    spec_path = out + ".spec.json"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [args.python, os.path.abspath(__file__), "torchao", spec_path, out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"optim_state.py: {shlex.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    with open(out) as f:
        return json.load(f), shlex.join(cmd)


def torchao_side(spec_path, out):
    import time

    import torch
    from torchao.optim import AdamW8bit

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    result = {"torch": torch.__version__}
    for mode in ("compiled", "eager"):
        torch.manual_seed(spec["seed"])
        params = [torch.nn.Parameter(torch.randn(t["shape"]) * 0.02) for t in spec["param_shapes"]]
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        groups = [{"params": [p for p, t in zip(params, spec["param_shapes"]) if t["decay"]],
                   "weight_decay": spec["weight_decay"]},
                  {"params": [p for p, t in zip(params, spec["param_shapes"]) if not t["decay"]], "weight_decay": 0.0}]
        compile_fn = torch.compile
        if mode == "eager":
            torch.compile = lambda fn, **kwargs: fn
        opt = AdamW8bit([g for g in groups if g["params"]], lr=spec["lr"])
        times = []
        for i in range(spec["warmup"] + spec["steps"]):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            t0 = time.perf_counter()
            opt.step()
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
        torch.compile = compile_fn
        n = sum(p.numel() for p in params)
        result[mode] = {"step_s": times, "step_s_median": statistics.median(times),
                        "ns_per_parameter": statistics.median(times) * 1e9 / n, "parameters": n}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "torchao":
        return torchao_side(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--python", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--out", default="")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="optim-state-")
    os.makedirs(work, exist_ok=True)
    dtypes = args.dtypes.split(",")
    rounds, commands = [], {}
    for r in range(args.rounds):
        row = {}
        for d in dtypes:
            res, commands[d] = ours(args, d, os.path.join(work, f"round{r}-{d}.json"))
            row[d] = {"step_s_median": res["step_s_median"], "ns_per_parameter": res["ns_per_parameter"],
                      "state_bytes_per_parameter": res["state_bytes_per_parameter"], "parameters": res["parameters"],
                      "threads": res["threads"]}
        if args.python:
            ref, commands["torchao"] = reference(args, res, os.path.join(work, f"round{r}-torchao.json"))
            for mode in ("compiled", "eager"):
                row["torchao_" + mode] = {k: ref[mode][k] for k in ("step_s_median", "ns_per_parameter")}
            row["torchao_torch"] = ref["torch"]
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['ns_per_parameter']:.2f} ns/param" for k, v in row.items()
                                            if isinstance(v, dict)), file=sys.stderr)
    sides = [k for k in rounds[0] if isinstance(rounds[0][k], dict)]
    median = {k: statistics.median(r[k]["ns_per_parameter"] for r in rounds) for k in sides}
    summary = {"schema": SCHEMA, "basis": "median step's wall time, ns per parameter", "rounds": rounds,
               "median_ns_per_parameter": median, "commands": commands, "workdir": work}
    for d in dtypes:
        if d != "float32" and "float32" in median:
            summary[f"{d}_over_float32"] = median[d] / median["float32"]
    for mode in ("compiled", "eager"):
        if "int8" in median and f"torchao_{mode}" in median:
            summary[f"int8_over_torchao_{mode}"] = median["int8"] / median[f"torchao_{mode}"]
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
