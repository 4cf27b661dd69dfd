#!/usr/bin/python3
"""The `cap` phase of scripts/gpu-check.sh: backoff, grow-back and `micro_batch: auto` under a real cap,
each cuDNN policy in a process of its own, within a time budget.

    cap_check.py --trainer EXE --config FILE [--set key=value ...] --workdir DIR --out cap.json
                 [--budget-s 200] [--policies start,always,pretune,off,settle,start+halvings]
                 [--warmup 5] [--low-steps 2] [--grow-after 6] [--compare 6]

Stages, in this order, each one or more trainer processes (docs/BENCHMARKS.md "The cap check"):

  calibrate      one run that grows h2 -> h1 -> G with no cap (cuDNN off): the step peaks that place the
                 caps (high = 1.25 p(G), cut between p(h2) and p(h1), mid between p(h1) and p(G)), and what
                 a new size costs with the heuristics (the grow-back steps against the steps after them).
                 On CUDA the peaks are the caching allocator's reserved bytes (memory reports asked for
                 with SIGUSR2 after every step), since that is what the cap binds; on the CPU, where
                 reserved = allocated, the step lines' allocated peaks (cap_basis in the JSON says which).
  cut:POLICY     a run at G under the high cap; control.yaml cuts the cap after --warmup steps (OOM,
                 backoff), raises it --low-steps steps after the OOM step (grow-back probes h2 -> h1 -> G).
                 From its metrics.jsonl: the recovery (the OOM step's recovery_s: from the first OOM to the
                 completed smaller step), the grow-back probe steps' times against the steady steps at their
                 size, the steps at G after it against those before the cut (throughput), what cuDNN timed.
  auto:METHOD:CAP  a 3-step run with train.micro_batch: auto under the cut (or mid) cap, memory.auto_search
                 the job's default (METHOD "default"), curve or doubling (doubling and bisecting): pick,
                 probes, time, and why the search chose its size (the auto_micro_batch event).
  verify:CAP     fresh 2-step runs pinned to the default search's pick + 1, + 2 (the doubling search's without
                 one): is it the largest that fits? (a size fits when its pinned run completes with no OOM).
                 Each search's fraction of it.

The job's defaults (memory.cudnn_policy, memory.auto_search, train.cuda_graph) are read from the trainer's
--dry-run: the default policy's cut runs first, then the default search under the cut cap and its check,
so that the figures of the defaults (recovery with CUDA graphs on where the default takes them) come first
within the budget; the other policies and searches after.

cuDNN chooses a convolution's algorithm once per shape and process (trainer/step/cudnn_policy.h), so
every policy's run is a fresh process. Before a stage starts, its time is estimated from the runs so far;
a stage that would end past --budget-s is skipped and listed, and each process is killed at the budget.
The JSON is rewritten after every stage, so whatever ran is in it even if the phase is killed. Exit 1 if
a stage failed (not if one was skipped for time). Needs only the standard library.
"""
import argparse
import glob
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

SCHEMA = "trainer-cap-check/1"
# Every run: no evaluation, no checkpoints (periodic or final: a ResNet-50's takes a second to write), its
# own steps.
COMMON = ["train.epochs=0", "data.test=", "checkpoint.every_steps=0", "checkpoint.every_seconds=0",
          "checkpoint.keep_last=1", "checkpoint.final=false"]


def median(v):
    return statistics.median(v) if v else None


def read_jsonl(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
    return out


def at_size(points, m):
    """The value at micro-batch m of sorted (size, bytes) points: measured, or on the line between the two
    measured sizes around it (the nearest measured one outside them)."""
    d = dict(points)
    if m in d:
        return d[m]
    lo = max((p for p in points if p[0] < m), default=points[0])
    hi = min((p for p in points if p[0] > m), default=points[-1])
    if hi[0] == lo[0]:
        return lo[1]
    return int(lo[1] + (hi[1] - lo[1]) * (m - lo[0]) / (hi[0] - lo[0]))


def process_executable(pid):
    """The executable a process runs (/proc/PID/exe: a script's interpreter, not the script), or None."""
    try:
        return os.readlink("/proc/%d/exe" % pid)
    except OSError:
        return None


def write_control(run_dir, limit):
    tmp = os.path.join(run_dir, "control.yaml.tmp")
    with open(tmp, "w") as f:
        f.write("memory:\n  limit: %d\n" % limit)
    os.rename(tmp, os.path.join(run_dir, "control.yaml"))


class BudgetKilled(Exception):
    """A run was killed at the time budget: the stage is listed as skipped, not as failed."""


class Budget:
    def __init__(self, seconds):
        self.t0 = time.time()
        self.seconds = seconds

    def elapsed(self):
        return time.time() - self.t0

    def left(self):
        return self.seconds - self.elapsed()


class Run:
    """One trainer process: its folder, exit code, metrics lines and wall time.

    report_until: after every step line before step report_until, SIGUSR2 (the trainer writes
    memory_report_<step>.json after the step it is in: the allocator's reserved bytes, which no metrics
    line has). None after the last step: no step would write its report, and a process that puts back
    the default actions as it ends would die of it. Sent only to a process
    whose executable is named trainer: a wrapper that runs the trainer without exec (a shell, Python)
    would die of it (its default action); `reports_refused` then names that executable, and no report is
    asked for."""

    def __init__(self, check, name, sets, hook=None, report_until=0):
        self.name = name
        self.dir = os.path.join(check.workdir, name.replace(":", "_").replace("+", "_"))
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.cmd = check.trainer + ["--config", check.config, "--run-dir", self.dir]
        for s in check.sets + COMMON + sets:
            self.cmd += ["--set", s]
        self.timed_out = False
        self.reports_refused = None
        t0 = time.time()
        limit = max(1.0, check.budget.left())
        with open(os.path.join(self.dir, "console.log"), "w") as log:
            p = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            seen = 0
            metrics = os.path.join(self.dir, "metrics.jsonl")
            while p.poll() is None:
                if time.time() - t0 > limit:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    self.timed_out = True
                    break
                if hook or report_until:
                    lines = read_jsonl(metrics)
                    new = lines[seen:]
                    for l in new:
                        if hook:
                            hook(l)
                    seen = len(lines)
                    if report_until and any("event" not in l and l.get("step", 0) < report_until for l in new):
                        # A step line: the trainer has installed its handlers (before its first step).
                        # None: it has just ended (a zombie has no exe), or /proc cannot be read: no signal.
                        exe = process_executable(p.pid)
                        if exe is not None and os.path.basename(exe) != "trainer":
                            self.reports_refused = exe
                            report_until = 0
                        elif exe is not None:
                            p.send_signal(signal.SIGUSR2)  # not reaped yet: the pid is still the trainer's
                time.sleep(0.01)
        self.rc = p.returncode
        self.wall_s = time.time() - t0
        self.lines = read_jsonl(os.path.join(self.dir, "metrics.jsonl"))
        check.wall[name] = self.wall_s

    def steps(self):
        return [l for l in self.lines if "event" not in l]

    def events(self, kind):
        return [l for l in self.lines if l.get("event") == kind]

    def memory_reports(self):
        """The memory reports in the run folder (oldest first by step), each as its JSON."""
        out = []
        for path in glob.glob(os.path.join(self.dir, "memory_report_*.json")):
            try:
                with open(path) as f:
                    out.append(json.load(f))
            except ValueError:
                pass  # written aside and renamed over: not expected, but one bad file costs only itself
        return sorted(out, key=lambda j: j.get("step", 0))

    def error(self, what):
        """The exception for a run that did not end as it should: BudgetKilled if the budget ended it."""
        tail = ""
        path = os.path.join(self.dir, "console.log")
        if os.path.exists(path):
            tail = " | ".join(open(path, errors="replace").read().strip().splitlines()[-3:])
        if self.timed_out:
            return BudgetKilled("%s: killed at the time budget after %.0f s" % (self.name, self.wall_s))
        return RuntimeError("%s: %s (exit %s); %s" % (self.name, what, self.rc, tail))


class Check:
    def __init__(self, args):
        self.args = args
        self.trainer = shlex.split(args.trainer)
        self.config = args.config
        self.sets = args.set
        self.workdir = os.path.abspath(args.workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.budget = Budget(args.budget_s)
        self.wall = {}
        self.result = {"schema": SCHEMA, "mode": args.mode, "config": args.config, "sets": args.set,
                       "budget_s": args.budget_s, "command": " ".join(map(shlex.quote, sys.argv)),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stages": {},
                       "skipped": [], "failed": [], "policies": {}, "auto": {}}
        self.cal = None

    def save(self):
        self.result["wall_s"] = self.budget.elapsed()
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1)
        os.rename(tmp, self.args.out)

    # ---- the time each stage needs ----------------------------------------------------------------------

    def estimate(self, stage):
        """Seconds the stage should take, from the runs so far (the start-up, a step, a timing)."""
        a = self.args
        start = self.result.get("estimates", {}).get("startup_s", 15.0 if a.mode == "cuda" else 3.0)
        step = self.result.get("estimates", {}).get("step_s", 0.1 if a.mode == "cuda" else 0.05)
        timing = self.result.get("estimates", {}).get("timing_s", 6.0 if a.mode == "cuda" else 0.0)
        if stage == "calibrate":
            return start + 8 * step
        if stage.startswith("cut:"):
            policy = stage[4:]
            timings = {"always": 4, "pretune": 4, "start": 1, "start+halvings": 1}.get(policy, 0)
            return start + self.cut_steps() * step + timings * timing
        if stage.startswith("auto:"):
            probes = 5 if ":curve:" in stage else 18
            return start + 2 * probes * step + (2 * timing if ":curve:" in stage else 0) + 3 * step
        if stage.startswith("verify:"):
            return 2 * (start + 2 * step)
        return start

    def stage(self, name, fn):
        est = self.estimate(name)
        if est > self.budget.left():
            self.result["skipped"].append({"stage": name, "estimated_s": round(est, 1),
                                           "left_s": round(self.budget.left(), 1)})
            print("cap check: skip %s (about %.0f s, %.0f s left)" % (name, est, self.budget.left()), flush=True)
            self.save()
            return None
        t = time.time()
        try:
            out = fn()
        except BudgetKilled as e:
            out = None
            self.result["skipped"].append({"stage": name, "estimated_s": round(est, 1), "killed": str(e)})
            print("cap check: %s" % e, flush=True)
        except Exception as e:  # one stage failing must not cost the others their figures
            out = None
            self.result["failed"].append({"stage": name, "error": str(e)})
            print("cap check: %s failed: %s" % (name, e), flush=True)
        self.result["stages"][name] = {"wall_s": round(time.time() - t, 2), "estimated_s": round(est, 1),
                                       "ok": out is not None}
        self.save()
        return out

    def cut_steps(self):
        a = self.args
        # warmup, the cut read up to 3 steps late, the OOM step, low steps, the raise read late, a probe to
        # h1, grow_after clean steps, the probe to G, the compared steps, and a few to spare
        return a.warmup + 3 + 1 + a.low_steps + 2 + 1 + a.grow_after + 1 + a.compare + 2

    # ---- stages -------------------------------------------------------------------------------------------

    def calibrate(self):
        a = self.args
        G = self.result["global_batch"]
        h1 = (G + 1) // 2
        h2 = (h1 + 1) // 2
        cuda, n = a.mode == "cuda", 8
        r = Run(self, "calibrate", ["train.micro_batch=%d" % h2, "memory.limit=none", "memory.grow_after=2",
                                    "memory.headroom=0", "memory.cudnn_policy=off", "train.steps=%d" % n],
                report_until=n if cuda else 0)
        if r.rc != 0:
            raise r.error("the uncapped run failed")
        steps = r.steps()
        peaks, times = {}, {}
        for l in steps:
            m = l["micro_batch"]
            times.setdefault(m, []).append(l["step_time_s"])
            if l["step"] >= 2:  # step 1 carries no optimizer state
                peaks[m] = max(peaks.get(m, 0), l["mem_peak_bytes"])
        pts = sorted(peaks.items())
        if len(pts) < 2:
            raise RuntimeError("calibrate: the run did not grow past micro-batch %d: %s" % (h2, sorted(times)))

        p = {m: at_size(pts, m) for m in (h2, h1, G)}
        if not p[h2] < p[h1] < p[G]:
            raise RuntimeError("calibrate: the peak does not grow with the micro-batch: %s" % p)
        # What the caps are placed from. CUDA enforces the cap on the caching allocator's reserved memory
        # (a memory fraction, checked when it reserves a segment), and reserved exceeds allocated by the
        # segments' rounding, fragmentation and cuDNN's workspaces: caps placed from allocated peaks can
        # run out of memory at a size the check expects to fit, which is not the logic under test. On
        # the CPU reserved = allocated (the capped allocator caches nothing): the step lines' peaks.
        rpts, rp = None, None
        basis, why = "allocated_peak", "--mode cpu: reserved = allocated (the capped allocator caches nothing)"
        if cuda:
            rpts, device = self.reserved_peaks(r)
            if r.reports_refused is not None:
                why = ("no memory report asked for: the trainer command's process runs %r, not the trainer "
                       "(a wrapper must exec it), and SIGUSR2 would end it" % r.reports_refused)
            elif device is not None and not device.startswith("cuda"):
                why = "the run's device is %s: reserved = allocated" % device
                rpts = None
            elif len(rpts) < 2:
                why = "memory reports at %d micro-batch size(s) (%s): too few for the caps" % (len(rpts), rpts)
            else:
                rp = {m: at_size(rpts, m) for m in (h2, h1, G)}
                if rp[h2] < rp[h1] < rp[G]:
                    basis, why = "reserved_peak", "cuda: the cap binds the caching allocator's reserved memory"
                else:
                    why = "the reserved peak does not grow with the micro-batch: %s" % rp
            if basis != "reserved_peak":
                print("cap check: caps from the ALLOCATED peaks on a GPU (%s): an OOM under them may be the "
                      "allocator's reserve, not the logic under test" % why, flush=True)
        b = rp if basis == "reserved_peak" else p
        # A new size with the heuristics: its first step (the grow-back probe) against the steps after it.
        first_use = []
        for m, ts in sorted(times.items()):
            if m != h2 and len(ts) >= 2:
                first_use.append({"micro_batch": m, "first_step_s": ts[0], "steady_step_s": median(ts[1:])})
        steady_G = median(times.get(G, [])[1:]) or median(times.get(G, []))
        first_line = r.lines[0] if r.lines else {}
        self.cal = {"G": G, "h1": h1, "h2": h2, "peak": b, "basis": basis,
                    "high": b[G] + b[G] // 4, "cut": (b[h2] + b[h1]) // 2, "mid": (b[h1] + b[G]) // 2}
        self.result["calibration"] = {
            # peak_bytes and measured_peak_bytes are allocated peaks (their meaning before cap_basis);
            # cap_peak_bytes are the ones the limits were placed from.
            "cap_basis": basis, "cap_basis_why": why,
            "cap_peak_bytes": {str(m): v for m, v in b.items()},
            "peak_bytes": {str(m): v for m, v in p.items()}, "measured_peak_bytes": {str(m): v for m, v in pts},
            "reserved_peak_bytes": {str(m): v for m, v in rp.items()} if rp else None,
            "measured_reserved_peak_bytes": {str(m): v for m, v in rpts} if rpts else None,
            "limits_bytes": {"high": self.cal["high"], "cut": self.cal["cut"], "mid": self.cal["mid"]},
            "heuristics_first_use": first_use, "steady_step_s_at_global_batch": steady_G, "wall_s": r.wall_s,
            "run_dir": r.dir}
        startup = r.wall_s - sum(l["step_time_s"] for l in steps)
        self.result["estimates"] = {"startup_s": max(1.0, startup), "step_s": max(0.005, steady_G or 0.05),
                                    "timing_s": 6.0 if self.args.mode == "cuda" else 0.0}
        if first_line.get("device"):
            self.result["device"] = first_line["device"]
        return self.result["calibration"]

    def reserved_peaks(self, r):
        """The calibration run's reserved peak per micro-batch, from the memory reports SIGUSR2 asked for:
        sorted (size, bytes) points, and the reports' device (None without reports).

        A report has the reserved bytes at the end of a step, not a peak; in this run they are one: with no
        cap and no OOM nothing empties the allocator's cache, so what it reserved only grows, and the
        reserved bytes after step s are the highest since the start. A size's value is its last reported
        step's (from step 2: step 1 carries no optimizer state), so it also holds what the smaller sizes
        before it left reserved: for h1 and G at most what a fresh process at that size would reserve
        plus the earlier sizes' segments it could not reuse."""
        sizes = {l["step"]: l["micro_batch"] for l in r.steps()}
        peaks, device = {}, None
        for rep in r.memory_reports():
            s, reserved = rep.get("step"), rep.get("reserved_bytes")
            device = rep.get("device", device)
            if s is None or s < 2 or s not in sizes or not isinstance(reserved, int):
                continue
            m = sizes[s]
            peaks[m] = max(peaks.get(m, 0), reserved)
        return sorted(peaks.items()), device

    def cut(self, policy):
        a, c = self.args, self.cal
        sets = ["memory.cudnn_policy=%s" % policy.split("+")[0]]
        if policy.endswith("+halvings"):
            sets.append("memory.ladder_sizes=halvings")
        st = {"cut": False, "oom_step": 0, "raised": False, "raise_after": 0}

        def hook(l):
            run_dir = run_dirs[0]
            if l.get("event") == "oom" and st["cut"] and not st["oom_step"]:
                st["oom_step"] = l["step"]
            if "event" in l:
                return
            s = l["step"]
            if not st["cut"] and s >= a.warmup:
                write_control(run_dir, c["cut"])
                st["cut"] = True
            elif st["oom_step"] and not st["raised"] and s >= st["oom_step"] + a.low_steps:
                write_control(run_dir, c["high"])
                st["raised"] = True
                st["raise_after"] = s

        name = "cut:" + policy
        run_dirs = [os.path.join(self.workdir, name.replace(":", "_").replace("+", "_"))]
        r = Run(self, name, sets + ["train.micro_batch=0", "memory.limit=%d" % c["high"],
                                    "memory.grow_after=%d" % a.grow_after, "memory.headroom=0.1",
                                    "train.steps=%d" % self.cut_steps()], hook=hook)
        if r.rc != 0:
            raise r.error("the run failed")
        if not st["oom_step"] or not st["raised"]:
            raise RuntimeError("%s: %s; give it more steps" % (name, "the cut caused no OOM" if not st["oom_step"]
                                                               else "the cap was never raised again"))
        steps = {l["step"]: l for l in r.steps()}
        G = c["G"]
        oom = steps[st["oom_step"]]
        low = oom["micro_batch"]
        low_times = [l["step_time_s"] for s, l in steps.items()
                     if st["oom_step"] < s <= st["raise_after"] and l["micro_batch"] == low and not l["oom_retries"]]
        before = [steps[s]["step_time_s"] for s in range(2, a.warmup + 1) if s in steps]
        probes = []
        for s, l in sorted(steps.items()):
            if s > st["raise_after"] and l.get("probe") == "grow":
                after = [x["step_time_s"] for t, x in sorted(steps.items())
                         if t > s and x["micro_batch"] == l["micro_batch"] and not x.get("probe")
                         and not x["oom_retries"]]
                steady = median(after[:3])
                probes.append({"step": s, "micro_batch": l["micro_batch"], "step_time_s": l["step_time_s"],
                               "steady_step_s": steady,
                               "over_steady": l["step_time_s"] / steady if steady else None,
                               "new_sizes": l.get("new_sizes", []), "tuned_sizes": l.get("tuned_sizes", []),
                               "oom_retries": l["oom_retries"]})
        # The compared steps: the last `compare` at G, against those before the cut (the same process, the
        # same size: a fresh run's steps).
        tail = [l for s, l in sorted(steps.items()) if s > st["raise_after"] and l["micro_batch"] == G
                and not l.get("probe") and not l["oom_retries"]][-a.compare:]

        def sps(ls):
            return median([G / (l["step_time_s"] + l.get("data_wait_s", 0.0)) for l in ls])

        before_lines = [steps[s] for s in range(2, a.warmup + 1) if s in steps]
        tuned = sorted({t for l in r.events("cudnn") for t in l.get("tuned_sizes", [])})
        first_uses = [{"step": l["step"], "attempt": l["attempt"], "new_sizes": l["new_sizes"],
                       "benchmark": l["benchmark"], "retry": l.get("retry", False)} for l in r.events("cudnn")]
        out = {
            "policy": policy, "run_dir": r.dir, "wall_s": r.wall_s,
            "first_step_s": steps[1]["step_time_s"] if 1 in steps else None,
            "step_before_cut_s": median(before),
            "oom_step": st["oom_step"], "ooms_in_step": sum(1 for e in r.events("oom") if e["step"] == st["oom_step"]),
            "micro_batch_after": low, "recovery_s": oom.get("recovery_s"), "oom_step_time_s": oom["step_time_s"],
            "recovery_new_sizes": oom.get("new_sizes", []), "recovery_tuned_sizes": oom.get("tuned_sizes", []),
            "normal_step_s": median(low_times), "normal_steps": len(low_times),
            "raised_after_step": st["raise_after"], "grow_back": probes,
            "grow_back_step_s_max": max((p["step_time_s"] for p in probes), default=None),
            "final_micro_batch": r.steps()[-1]["micro_batch"] if r.steps() else None,
            "compared_steps": len(tail),
            "throughput_ratio": (sps(tail) / sps(before_lines)) if tail and before_lines else None,
            "tuned_sizes": tuned, "cudnn_first_uses": first_uses,
            "pretune": (r.events("cudnn_pretune") or [None])[0],
            # train.cuda_graph as configured (the job's default unless --set), and what the run's start
            # event says it resolved to where it says so
            "cuda_graph": self.result.get("defaults", {}).get("cuda_graph"),
            "cuda_graph_start": (r.events("start") or [{}])[0].get("cuda_graph"),
        }
        if out["recovery_s"] is not None and out["normal_step_s"]:
            out["recovery_over_normal"] = out["recovery_s"] / out["normal_step_s"]
        self.result["policies"][policy] = out
        if policy == "start":
            # a timing's cost: the first step (timed at G) against the steady steps at G
            est = self.result.setdefault("estimates", {})
            if out["first_step_s"] and out["step_before_cut_s"]:
                est["timing_s"] = max(0.0, out["first_step_s"] - out["step_before_cut_s"])
            self.result["report"] = self.read_report(r.dir, st["oom_step"])
        return out

    def read_report(self, run_dir, step):
        """The OOM's memory report, read back as a user would: it must name the phase that failed."""
        reports = sorted(glob.glob(os.path.join(run_dir, "memory_report_%d*.json" % step)))
        if not reports:
            raise RuntimeError("no memory report for step %d under %s" % (step, run_dir))
        rep = json.load(open(reports[0]))
        failed = [p.get("failed_in") for p in rep.get("phase_peaks", []) if p.get("failed_in")]
        if not failed:
            raise RuntimeError(reports[0] + ": no attempt names the phase it failed in")
        return {"report": reports[0], "reports": len(reports), "step": rep["step"], "failed_in": failed,
                "limit_bytes": rep["limit_bytes"], "peak_bytes": rep["peak_bytes"],
                "reserved_bytes": rep.get("reserved_bytes"), "device": rep["device"],
                "error": rep["error"]}

    def auto(self, method, cap_name):
        cap = self.cal[cap_name]
        name = "auto:%s:%s" % (method, cap_name)
        search = [] if method == "default" else ["memory.auto_search=%s" % method]
        r = Run(self, name, ["train.micro_batch=auto", "memory.limit=%d" % cap, "train.steps=3"] + search)
        if r.rc != 0:
            raise r.error("the run failed")
        ev = r.events("auto_micro_batch")
        if not ev:
            raise RuntimeError(name + ": no auto_micro_batch event")
        e = ev[0]
        out = {k: e.get(k) for k in ("micro_batch", "probes", "search_s", "method", "ended", "tuned_sizes", "trace")}
        # Why the search chose its size (the event's other fields: a faster size than the largest, say).
        out["event"] = {k: v for k, v in e.items() if k not in ("trace", "event")}
        # memory.auto_search: auto writes the speed choice as speed.{micro_batch, largest, table, reason}
        # (trainer/step/search_choice.h); a start below the largest that fits is the speed choice's.
        speed = e.get("speed") or {}
        why = speed.get("reason") if isinstance(speed, dict) else None
        out["why"] = why
        out["faster"] = bool(isinstance(speed, dict) and speed.get("micro_batch") and speed.get("largest")
                             and speed["micro_batch"] < speed["largest"])
        if method == "default":
            out["auto_search"] = self.result.get("defaults", {}).get("auto_search")
        out.update({"limit_bytes": cap, "wall_s": r.wall_s, "run_dir": r.dir,
                    "ooms_in_3_steps": len(r.events("oom")),
                    "micro_batch_after_3_steps": r.steps()[-1]["micro_batch"] if r.steps() else None})
        self.result["auto"].setdefault(cap_name, {})[method] = out
        return out

    def fits(self, m, cap, name):
        r = Run(self, name, ["train.micro_batch=%d" % m, "memory.min_micro_batch=%d" % m,
                             "memory.ladder_checkpointing=false", "memory.limit=%d" % cap, "train.steps=2",
                             "memory.cudnn_policy=off", "memory.grow_after=1000000"])
        if r.rc not in (0, 3):
            raise r.error("the pinned run at micro-batch %d failed" % m)
        return r.rc == 0 and not r.events("oom")

    def verify(self, cap_name):
        a = self.result["auto"].get(cap_name, {})
        base = "default" if "default" in a else "doubling"
        if base not in a:
            raise RuntimeError("verify: no default or doubling search under the %s cap to verify" % cap_name)
        cap = self.cal[cap_name]
        d = a[base]["micro_batch"]
        G = self.cal["G"]
        tried = []
        largest = d
        # The doubling search is exact if fitting is monotone: d + 1 must fail. If it fits, go on up.
        m = d + 1
        while m <= G and len(tried) < 3:
            ok = self.fits(m, cap, "verify_%s_mb%d" % (cap_name, m))
            tried.append({"micro_batch": m, "fits": ok})
            if not ok:
                break
            largest = m
            m += 1
        out = {"largest_fitting_micro_batch": largest, "exact": bool(tried) and not tried[-1]["fits"],
               "tried": tried, "from": base}
        for method in ("default", "curve", "doubling"):
            if method in a:
                out[method + "_fraction"] = a[method]["micro_batch"] / largest
        a["verify"] = out
        return out

    def targets(self):
        """The targets, measured here (None where not measured): the job's defaults (cuDNN policy, CUDA
        graphs, the auto search)."""
        for a in self.result["auto"].values():  # each search's fraction, those run after the check too
            v = a.get("verify")
            for method in ("default", "curve", "doubling"):
                if v and method in a and v["largest_fitting_micro_batch"]:
                    v[method + "_fraction"] = a[method]["micro_batch"] / v["largest_fitting_micro_batch"]
        pol = self.result["policies"]
        policy = self.result.get("defaults", {}).get("cudnn_policy") or "start"
        s = pol.get(policy, {})
        cut_auto = self.result["auto"].get("cut", {})
        auto = cut_auto.get("default", {})
        frac = cut_auto.get("verify", {}).get("default_fraction")
        t = {
            "recovery_s <= 1, goal 0.3 (policy %s, CUDA graphs as the default)" % policy: s.get("recovery_s"),
            "grow-back step <= 1 s (policy %s)" % policy: s.get("grow_back_step_s_max"),
            "throughput after backoff and grow-back >= 0.98 (policy %s)" % policy: s.get("throughput_ratio"),
            "auto search <= 8 s (the default search, cut cap)": auto.get("search_s"),
            "auto picks the largest that fits (the default search, cut cap), or a faster one": frac,
        }
        limits = [1.0, 1.0, 0.98, 8.0, 1.0]
        greater = [False, False, True, False, True]
        out = {}
        for (k, v), lim, g in zip(t.items(), limits, greater):
            met = None if v is None or self.args.mode != "cuda" else (v >= lim if g else v <= lim)
            out[k] = {"value": v, "met": met}
        self.result["targets"] = out


def job_settings(args):
    """The job's global batch and its defaults of memory.cudnn_policy, memory.auto_search and
    train.cuda_graph (None for a key this trainer does not have), as the trainer resolves them (its
    --dry-run prints the resolved YAML; each key's name is unique in it)."""
    cmd = shlex.split(args.trainer) + ["--config", args.config, "--dry-run"]
    for s in args.set:
        cmd += ["--set", s]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = {}
    for line in p.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        if key in ("global_batch", "cudnn_policy", "auto_search", "cuda_graph") and key not in found:
            found[key] = value.strip().strip('"\'')  # the YAML writer quotes strings
    if "global_batch" not in found:
        raise RuntimeError("cannot read train.global_batch from %s (exit %d): %s" % (" ".join(cmd), p.returncode,
                                                                                      p.stdout[-500:]))
    return int(found["global_batch"]), {k: found.get(k) for k in ("cudnn_policy", "auto_search", "cuda_graph")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", required=True, help="the trainer command (split like a shell would)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], help="key=value for every run (repeatable)")
    ap.add_argument("--workdir", required=True, help="the runs' folders go here (kept)")
    ap.add_argument("--out", required=True, help="the JSON result")
    ap.add_argument("--mode", choices=["cuda", "cpu"], default="cpu", help="targets are judged in cuda mode only")
    ap.add_argument("--budget-s", type=float, default=200.0, help="end every stage by then")
    ap.add_argument("--policies", default="start,always,pretune,off,settle,start+halvings",
                    help="memory.cudnn_policy values to run the cut with, most important first")
    ap.add_argument("--warmup", type=int, default=5, help="steps at G before the cut")
    ap.add_argument("--low-steps", type=int, default=2, help="steps after the OOM step before the raise")
    ap.add_argument("--grow-after", type=int, default=6, help="memory.grow_after of the cut runs")
    ap.add_argument("--compare", type=int, default=6, help="steps at G after the grow-back that are compared")
    args = ap.parse_args()
    # The OOM step is a clean step for the ladder's count, and the raise may be read a step or two late:
    # no grow-back probe may start under the cut before it.
    if args.low_steps + 3 > args.grow_after:
        ap.error("--grow-after must be at least --low-steps + 3 (no grow-back probe under the cut before the raise)")
    check = Check(args)
    check.result["global_batch"], check.result["defaults"] = job_settings(args)
    if args.mode == "cuda":
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.strip().splitlines()
            check.result["device_name"] = names[0] if names else None
        except (OSError, subprocess.SubprocessError):
            check.result["device_name"] = None
    policies = [p for p in args.policies.split(",") if p]
    default_policy = check.result["defaults"]["cudnn_policy"]
    if default_policy in policies:  # the default's figures first
        policies.remove(default_policy)
        policies.insert(0, default_policy)
    if not check.stage("calibrate", check.calibrate):
        check.targets()
        check.save()
        return 1
    # The side by side that matters most first: the default policy and LibTorch's always-on, then the
    # search, then the other policies and the mid cap, as far as the budget goes.
    order = [("cut:" + policies[0], lambda: check.cut(policies[0])),
             ("auto:default:cut", lambda: check.auto("default", "cut")),
             ("verify:cut", lambda: check.verify("cut"))]
    order += [("cut:" + p, (lambda p=p: check.cut(p))) for p in policies[1:2]]
    order += [("auto:curve:cut", lambda: check.auto("curve", "cut")),
              ("auto:doubling:cut", lambda: check.auto("doubling", "cut"))]
    order += [("cut:" + p, (lambda p=p: check.cut(p))) for p in policies[2:]]
    order += [("auto:curve:mid", lambda: check.auto("curve", "mid")),
              ("auto:doubling:mid", lambda: check.auto("doubling", "mid"))]
    for name, fn in order:
        check.stage(name, fn)
    check.targets()
    check.save()
    res = check.result
    for p, v in res["policies"].items():
        print("cap check: %-16s recovery %s s (normal step %s s), grow-back step max %s s, throughput %s, timed %s"
              % (p, fmt(v.get("recovery_s")), fmt(v.get("normal_step_s")), fmt(v.get("grow_back_step_s_max")),
                 fmt(v.get("throughput_ratio")), v.get("tuned_sizes")))
    for cap, a in res["auto"].items():
        for m in ("default", "curve", "doubling"):
            if m in a:
                print("cap check: auto %-8s under %-3s: %s in %s probes, %s s" % (
                    m, cap, a[m]["micro_batch"], a[m]["probes"], fmt(a[m]["search_s"])))
        if "verify" in a:
            print("cap check: largest that fits under %s: %s (%s)" % (
                cap, a["verify"]["largest_fitting_micro_batch"], "exact" if a["verify"]["exact"] else "a lower bound"))
    print("cap check: %d stages, %d skipped, %d failed, %.0f s -> %s" % (
        len(res["stages"]), len(res["skipped"]), len(res["failed"]), res["wall_s"], args.out))
    return 1 if res["failed"] else 0


def fmt(v):
    return "-" if v is None else ("%.3g" % v if isinstance(v, float) else str(v))


if __name__ == "__main__":
    sys.exit(main())
