#!/usr/bin/python3
"""Two training jobs sharing one device (two containers on one GPU): job A trains alone, job B starts
while A runs, both go on to their last step.

    share_gpu.py --trainer EXE --config FILE [--set key=value ...] [--a-set key=value ...]
                 [--b-set key=value ...] --a-steps N --b-steps M --b-after K
                 --workdir DIR --out RESULT.json [--timeout-s 300]

The promise measured: with `memory.limit: auto` each job caps itself at what the device has free when it
resolves the cap (on CUDA: what the process already holds + a share of the free memory, re-read between
steps; docs/MEMORY.md, "Two jobs on one GPU"), so B starts with what A leaves it, and whatever A needs beyond what it holds once B took
the rest ends in an OOM backoff (a smaller micro-batch, the global batch kept), never in a crash. So the
check is: both jobs exit 0 and every optimizer step 1..N of each job is in its metrics.jsonl ("no lost
step"). Beside that it records what the sharing cost: each job's micro-batch over time, its memory events
(OOMs, backoffs, limit changes, grow-back probes, recomputed activations on/off), the cap over time, and
samples/s measured by wall time between step lines in three windows: A alone before B started, both
running, and a job alone after the other finished.

  1. A: `EXE --config FILE --set memory.limit=auto --set checkpoint.every_steps=0 [--set ...] [--a-set ...]
     --set train.steps=N --run-dir DIR/a`, its console in DIR/a.out.
  2. When DIR/a/metrics.jsonl has the line of step K, B the same way (train.steps=M, DIR/b, DIR/b.out).
  3. Both are killed at --timeout-s (from A's start; a failure). The JSON (schema "trainer-share-gpu/1")
     has per job the exit code, the steps seen and missing, the micro-batch, the cap, the memory events
     and the windows' samples/s; at the top "crashed", "lost_steps", "passed", the commands, wall_s.

A step line carries durations (step_time_s) but no time of day, so the wall time of each step is when this
script first saw its line (polled every POLL_S seconds): a window's samples/s is the samples between its
first and last step line over the seconds between them. Exit 0 if passed, 1 if not, 2 on a usage error.
Needs only the standard library; --trainer is split like a shell would (`.gpu-run/bundle/run trainer`).
"""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cap_check import fmt, read_jsonl  # noqa: E402  (the house's metrics.jsonl reader and number format)

SCHEMA = "trainer-share-gpu/1"
# Every job: the cap from what the device has free, and no periodic checkpoint (a save mid-way would be a
# pause in one job's step times that the other's windows do not see). The user's --set come after these.
COMMON = ["memory.limit=auto", "checkpoint.every_steps=0"]
POLL_S = 0.02
# The metrics.jsonl events about memory: the OOM ladder's (trainer/memory/oom.cpp: an OOM is written as
# "oom" with the ladder's answer as "kind"; the transitions without an OOM as their own event name, the kind
# repeated), the give-up, the auto search's pick and the evaluation's own backoff.
MEMORY_EVENTS = ("oom", "backoff", "checkpointing_on", "give_up", "probe", "probe_failed", "probe_succeeded",
                 "probe_skipped", "limit_changed", "oom_gave_up", "auto_micro_batch", "eval_backoff")
# What is kept of each memory event.
EVENT_FIELDS = ("old_micro_batch", "new_micro_batch", "old_checkpointing", "new_checkpointing", "limit_bytes",
                "peak_bytes", "reason", "message", "error")
# Events that say why a run ended badly: their messages go into the job's "errors".
ERROR_EVENTS = ("error", "oom_gave_up", "checkpoint_gave_up", "stop")


class StepClock:
    """When each step line of a metrics.jsonl first appeared, in seconds since the measurement began."""

    def __init__(self, path, t0):
        self.path = path
        self.t0 = t0
        self.offset = 0
        self.partial = b""  # a line the trainer is still writing
        self.seen = {}  # step -> seconds (the first line of that step)
        self.last_step = 0

    def poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return  # the trainer has not opened it yet
        now = time.time() - self.t0
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for raw in lines:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if is_step_line(line):
                self.seen.setdefault(line["step"], now)
                self.last_step = max(self.last_step, line["step"])


class Job:
    """One trainer process: its command, run folder, console file, exit code and step clock."""

    def __init__(self, name, cmd, workdir, steps):
        self.name = name
        self.run_dir = os.path.join(workdir, name)
        self.console = os.path.join(workdir, name + ".out")
        self.cmd = cmd + ["--run-dir", self.run_dir]
        self.steps = steps
        self.proc = None
        self.clock = None
        self.rc = None
        self.started_s = None
        self.exit_s = None
        self.killed = False
        # A run folder with a checkpoint would resume (or report the run complete), and old metrics lines
        # would be read as this run's: every job starts from nothing.
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if os.path.exists(self.console):
            os.remove(self.console)

    def start(self, t0):
        self.clock = StepClock(os.path.join(self.run_dir, "metrics.jsonl"), t0)
        self.started_s = time.time() - t0
        with open(self.console, "w") as out:
            # A session of its own, so that a kill reaches a wrapper's children (the GPU bundle's `run`).
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def running(self):
        return self.proc is not None and self.rc is None

    def poll(self):
        if not self.running():
            return
        rc = self.proc.poll()
        self.clock.poll()
        if rc is not None:
            self.rc = rc
            self.exit_s = time.time() - self.clock.t0
            self.clock.poll()  # the lines written between the last poll and the exit

    def kill(self):
        if self.running():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.killed = True
            self.poll()


def is_step_line(line):
    return isinstance(line, dict) and "event" not in line and isinstance(line.get("step"), int)


def sets_to_args(sets):
    out = []
    for s in sets:
        out += ["--set", s]
    return out


def quote(cmd):
    return " ".join(map(shlex.quote, cmd))


def run_pair(a, b, b_after, timeout_s):
    """Starts A, B once A's step b_after is written, waits for both. Returns (timed_out, wall_s)."""
    t0 = time.time()
    a.start(t0)
    try:
        while a.running() or b.running():
            a.poll()
            b.poll()
            if b.proc is None and a.clock.last_step >= b_after:
                b.start(t0)
                print("share: B started at A's step %d, %.1f s after A" % (a.clock.last_step, b.started_s),
                      flush=True)
                continue
            if b.proc is None and not a.running():
                break  # A ended before step b_after: B never starts
            if time.time() - t0 > timeout_s:
                a.kill()
                b.kill()
                return True, time.time() - t0
            time.sleep(POLL_S)
    finally:
        # Never leave a trainer holding the device behind, whatever stopped this script.
        a.kill()
        b.kill()
    return False, time.time() - t0


def ranges(numbers):
    """[1, 2, 3, 7, 9, 10] -> ["1-3", "7", "9-10"]: the step numbers, short."""
    out = []
    for n in sorted(set(numbers)):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ["%d" % lo if lo == hi else "%d-%d" % (lo, hi) for lo, hi in out]


def over_time(steps, key):
    """A step-line field over the run: first, last, min, max, and the steps where it changed."""
    values = [(l["step"], l[key]) for l in steps if key in l]
    if not values:
        return None
    changes = []
    for step, v in values:
        if not changes or changes[-1][1] != v:
            changes.append([step, v])
    vs = [v for _, v in values]
    return {"first": vs[0], "last": vs[-1], "min": min(vs), "max": max(vs), "changes": changes}


def memory_events(lines):
    out = []
    for l in lines:
        if l.get("event") not in MEMORY_EVENTS:
            continue
        e = {"step": l.get("step"), "event": l["event"], "kind": l.get("kind", l["event"])}
        e.update({k: l[k] for k in EVENT_FIELDS if k in l})
        if l["event"] == "auto_micro_batch":
            e["micro_batch"] = l.get("micro_batch")
        out.append(e)
    return out


def event_counts(events):
    counts = {}
    for e in events:
        name = e["event"] if e["kind"] == e["event"] else "%s/%s" % (e["event"], e["kind"])
        counts[name] = counts.get(name, 0) + 1
    return counts


def window(job, steps, t_from, t_to):
    """samples/s from the step lines first seen within [t_from, t_to]: the samples trained between the
    first and the last of them over the wall time between them (at least two lines)."""
    if t_from is None or t_to is None:
        return None
    samples = {l["step"]: l["samples_seen"] for l in steps if "samples_seen" in l}
    inside = sorted((t, s) for s, t in job.clock.seen.items() if t_from <= t <= t_to and s in samples)
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t1, s1), (t2, s2) = inside[0], inside[-1]
    return {"from_step": s1, "to_step": s2, "step_lines": len(inside), "seconds": round(t2 - t1, 3),
            "samples_per_s": (samples[s2] - samples[s1]) / (t2 - t1)}


def step_check(steps, configured):
    """No lost step: every step 1..configured has a line, and the last one is the configured count."""
    seen = [l["step"] for l in steps]
    missing = sorted(set(range(1, configured + 1)) - set(seen))
    last = seen[-1] if seen else None
    dup = sorted({s for s in seen if seen.count(s) > 1})
    return {"steps_seen": ranges(seen), "step_lines": len(seen), "last_step": last,
            "missing_steps": ranges(missing), "missing_count": len(missing), "duplicate_steps": ranges(dup),
            "no_lost_step": not missing and last == configured}


def analyse(job, other, timeline):
    """One job's figures from its metrics.jsonl (read whole, as written) and its step clock."""
    out = {"command": quote(job.cmd), "run_dir": job.run_dir, "console": job.console,
           "steps_configured": job.steps, "started": job.proc is not None, "exit_code": job.rc,
           "killed_at_timeout": job.killed, "started_s": job.started_s, "exit_s": job.exit_s}
    lines = read_jsonl(os.path.join(job.run_dir, "metrics.jsonl"))
    steps = [l for l in lines if is_step_line(l)]
    out.update(step_check(steps, job.steps))
    start = next((l for l in lines if l.get("event") == "start"), {})
    out["start"] = {k: start.get(k) for k in ("device", "limit", "limit_source", "container_limit", "host_limit",
                                               "global_batch")}
    seen = job.clock.seen if job.clock else {}
    out["first_step_s"] = min(seen.values()) if seen else None
    out["last_step_s"] = seen.get(out["last_step"]) if seen else None
    out["micro_batch"] = over_time(steps, "micro_batch")
    out["cap_bytes"] = over_time(steps, "mem_limit_bytes")
    out["mem_peak_bytes_max"] = max((l["mem_peak_bytes"] for l in steps if "mem_peak_bytes" in l), default=None)
    out["memory_events"] = memory_events(lines)
    out["memory_event_counts"] = event_counts(out["memory_events"])
    out["steps_with_oom_retries"] = sum(1 for l in steps if l.get("oom_retries"))
    out["errors"] = [{"event": l["event"], "step": l.get("step"),
                      "message": l.get("message") or l.get("error") or l.get("signal")}
                     for l in lines if l.get("event") in ERROR_EVENTS]
    if job.proc is not None and job.rc != 0 and os.path.exists(job.console):
        out["console_tail"] = open(job.console, errors="replace").read().strip().splitlines()[-5:]
    if job.clock is None:
        out["samples_per_s"] = {"alone_before": None, "overlap": None, "alone_after": None}
        out["ratio_overlap_over_alone"] = None
        return out
    # A alone: its step lines up to B's launch (B's start-up already competes for the device). Both: from
    # B's first step line to the first of the two last step lines. Alone after: from the other's exit.
    before = None
    if job.name == "a":
        before = window(job, steps, 0.0, other.started_s if other.proc is not None else float("inf"))
    overlap = window(job, steps, timeline["b_first_step_s"], timeline["overlap_end_s"])
    after = window(job, steps, other.exit_s, float("inf")) if other.proc is not None else None
    out["samples_per_s"] = {"alone_before": before, "overlap": overlap, "alone_after": after}
    # The job's own pace on the device alone: before B for A (after B it may still run at the micro-batch
    # the sharing left it), after A for B.
    alone, which = (before, "before") if before else (after, "after")
    out["alone_reference"] = which if alone else None
    out["ratio_overlap_over_alone"] = (overlap["samples_per_s"] / alone["samples_per_s"]
                                       if overlap and alone else None)
    return out


def timeline_of(a, b):
    b_first = min(b.clock.seen.values()) if b.clock and b.clock.seen else None
    lasts = [max(j.clock.seen.values()) for j in (a, b) if j.clock and j.clock.seen]
    return {"b_started_s": b.started_s, "b_first_step_s": b_first,
            "overlap_end_s": min(lasts) if b_first is not None and len(lasts) == 2 else None,
            "a_exit_s": a.exit_s, "b_exit_s": b.exit_s}


def summary_line(name, j):
    mb = j["micro_batch"] or {}
    sps = j["samples_per_s"]
    counts = ", ".join("%s %d" % kv for kv in sorted(j["memory_event_counts"].items())) or "none"
    lost = "none lost" if j["no_lost_step"] else "%d missing: %s" % (j["missing_count"], ",".join(j["missing_steps"][:5]))
    return ("share: %s exit %s, steps %s/%d (%s), micro-batch %s -> %s (min %s, max %s), memory events: %s; "
            "samples/s alone before %s, overlap %s, alone after %s, overlap/alone %s"
            % (name.upper(), j["exit_code"] if j["started"] else "- (not started)", fmt(j["last_step"]),
               j["steps_configured"], lost, fmt(mb.get("first")), fmt(mb.get("last")), fmt(mb.get("min")),
               fmt(mb.get("max")), counts,
               *[rate((sps[w] or {}).get("samples_per_s")) for w in ("alone_before", "overlap", "alone_after")],
               fmt(j["ratio_overlap_over_alone"])))


def rate(v):
    return "-" if v is None else "%.1f" % v


def write_json(path, result):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.rename(tmp, path)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", required=True, help="the trainer command (split like a shell would)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], help="key=value for both jobs (repeatable)")
    ap.add_argument("--a-set", action="append", default=[], help="key=value for job A only (repeatable)")
    ap.add_argument("--b-set", action="append", default=[], help="key=value for job B only (repeatable)")
    ap.add_argument("--a-steps", type=int, required=True, help="job A's train.steps")
    ap.add_argument("--b-steps", type=int, required=True, help="job B's train.steps")
    ap.add_argument("--b-after", type=int, required=True, help="start B once A's step K is in its metrics.jsonl")
    ap.add_argument("--workdir", required=True, help="the jobs' folders a/, b/ and consoles a.out, b.out (kept)")
    ap.add_argument("--out", required=True, help="the JSON result")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="kill both jobs this long after A started")
    args = ap.parse_args(argv)
    if args.a_steps < 1 or args.b_steps < 1:
        ap.error("--a-steps and --b-steps must be >= 1")
    if not 0 <= args.b_after < args.a_steps:
        ap.error("--b-after must be in [0, --a-steps): B starts while A still trains")
    if args.timeout_s <= 0:
        ap.error("--timeout-s must be > 0")
    for s in args.set + args.a_set + args.b_set:
        if "=" not in s:
            ap.error("--set/--a-set/--b-set: expected key=value, got '%s'" % s)
        if s.split("=", 1)[0].strip() == "train.steps":
            ap.error("train.steps is set by --a-steps / --b-steps (the steps the no-lost-step check counts)")
    if not os.path.isfile(args.config):
        ap.error("--config %s: no such file" % args.config)
    exe = (shlex.split(args.trainer) or [""])[0]
    if not shutil.which(exe):
        ap.error("--trainer %s: not an executable" % exe)
    return args


def main(argv):
    args = parse_args(argv)
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    base = shlex.split(args.trainer) + ["--config", args.config] + sets_to_args(COMMON + args.set)
    a = Job("a", base + sets_to_args(args.a_set + ["train.steps=%d" % args.a_steps]), workdir, args.a_steps)
    b = Job("b", base + sets_to_args(args.b_set + ["train.steps=%d" % args.b_steps]), workdir, args.b_steps)
    timed_out, wall_s = run_pair(a, b, args.b_after, args.timeout_s)
    timeline = timeline_of(a, b)
    jobs = {"a": analyse(a, b, timeline), "b": analyse(b, a, timeline)}
    crashed = timed_out or any(j["exit_code"] != 0 for j in jobs.values())  # B never started: exit None
    lost = any(not j["no_lost_step"] for j in jobs.values())
    result = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": quote([sys.executable] + sys.argv), "config": args.config, "sets": args.set,
              "a_sets": args.a_set, "b_sets": args.b_set, "b_after": args.b_after, "timeout_s": args.timeout_s,
              "commands": {"a": jobs["a"]["command"], "b": jobs["b"]["command"]}, "workdir": workdir,
              "timed_out": timed_out, "wall_s": round(wall_s, 3), "timeline_s": timeline,
              "overlap_measured": bool(jobs["a"]["samples_per_s"]["overlap"] and jobs["b"]["samples_per_s"]["overlap"]),
              "crashed": crashed, "lost_steps": lost, "passed": not crashed and not lost, "jobs": jobs}
    write_json(args.out, result)
    for name in ("a", "b"):
        print(summary_line(name, jobs[name]))
    print("share: %s (%s%s), %.1f s%s -> %s" % (
        "PASSED" if result["passed"] else "FAILED",
        "timed out at %g s, " % args.timeout_s if timed_out else "", "crashed" if crashed else "no crash",
        wall_s, ", lost steps" if lost else ", no lost step", args.out))
    if not crashed and not result["overlap_measured"]:
        print("share: warning: the two jobs' steps did not overlap (raise --a-steps or lower --b-after)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
