#!/usr/bin/python3
"""Two profiles of the same training step side by side: `trainer bench --profile` against
`bench/reference.py --profile` (docs/BENCHMARKS.md, "Profiling a step").

    profile_table.py --trainer TRACE.json --python TRACE.json [--names trainer,python] [--title TEXT]
                     [--out-md TABLE.md] [--out-json TABLE.json]

Both traces are Chrome traces of a few optimizer steps, each step inside a "ProfilerStep#<n>" scope:
Kineto's format ({"traceEvents": [...]}: the pip wheels of either side, and the trainer's own writer where
LibTorch has no Kineto) or the list that torch 1.13's profiler writes without Kineto. Every figure is per
step (the sum over the profiled steps divided by their number).

With GPU activity in the traces (CUDA kernels, copies, sets; a "gpu" table):
  - GPU time by class: each kernel takes the class of the ATen op that launched it (the innermost CPU op
    around its launch, found through the correlation id), or "optimizer" when it was launched inside an
    "Optimizer.step#..." scope; a kernel whose op says nothing is classed by its own name; copies and
    sets are "copies and casts", and so are the NCHW <-> NHWC conversion kernels (also counted apart as
    "layout conversions");
  - GPU busy and idle: within the steps' scopes, the time some GPU activity runs and the rest, with the
    largest idle gaps and the op that launched the kernel after each;
  - host-device syncs: cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous
    cudaMemcpy and copies to pageable memory, with the time blocked in them and the op that called them;
  - the kernels one side runs and the other does not (names without their argument lists), and those
    both run a different number of times.
Without GPU activity (a "cpu" table): the same classes over the CPU ops' self time (an op's time less
its children's), the host time outside any op, and the ops one side runs and the other does not.
Both kinds count the ops every step runs (aten::convolution, aten::batch_norm, aten::linear, ...).
Both kinds list the trainer's own stages, the "trainer.<stage>" scopes of its loop (trainer/run/run.cpp:
fetch, poll, step, snapshot, record, agree): each one's calls and time, and its host time outside any op,
which is the bookkeeping a GPU waits for between two steps' kernels. A trace without them lists none.

The JSON (schema "trainer-profile-table/1") holds every figure; the markdown is the table for
docs/BENCHMARKS.md. Exit 2 with one "error: ..." line for a missing or unreadable trace or one without
step scopes. Needs only the standard library.
"""
import argparse
import json
import os
import re
import sys
from collections import defaultdict

SCHEMA = "trainer-profile-table/1"
CLASSES = ["convolution", "GEMM", "attention", "normalization", "elementwise", "optimizer", "copies and casts",
           "loss", "other"]
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
              "cudaMemcpyFromSymbol", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH",
              "cuMemcpyDtoH_v2"}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# The trainer's loop stages, in the order a step runs them (the scopes' names; others are listed after).
STAGES = ["trainer.fetch", "trainer.poll", "trainer.step", "trainer.snapshot", "trainer.record", "trainer.agree"]
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
# The host ops worth counting on every step, in the markdown's order (all ops are in the JSON).
KEY_OPS = ["aten::convolution", "aten::convolution_backward", "aten::batch_norm", "aten::layer_norm", "aten::linear",
           "aten::addmm", "aten::mm", "aten::bmm", "aten::scaled_dot_product_attention", "aten::cross_entropy_loss",
           "aten::_log_softmax", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::cat",
           "aten::_local_scalar_dense"]

# ATen op (without "aten::", lower case) -> class; the first rule that matches wins. Autograd's backward
# nodes ("ConvolutionBackward0") match by their name without "Backward<n>".
OP_RULES = [
    ("optimizer", r"^_foreach_|^_fused_(adam|adamw|sgd)|^_amp_foreach|^_amp_update_scale"),
    ("loss", r"cross_entropy|nll_loss|log_?softmax"),
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|_cudnn_attention|_fused_sdp"),
    ("convolution", r"conv"),
    ("normalization", r"batch_?norm|layer_?norm|group_?norm|instance_?norm|rms_?norm"),
    ("GEMM", r"^(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|addmv|mv|dot|_scaled_mm)$"),
    ("copies and casts", r"^(copy_|_to_copy|to|tocopy|clone|contiguous|cat|stack|fill_|zero_|zeros|zeros_like|ones|"
                         r"ones_like|full|full_like|new_zeros|_copy_from|_copy_from_and_resize|slice_backward|"
                         r"select_backward|narrow_copy|unsafeview|expand|view|reshape)$"),
    ("elementwise", r"^(add|add_|sub|sub_|mul|mul_|div|div_|relu|relu_|gelu|gelu_backward|silu|sigmoid|tanh|threshold|"
                    r"threshold_backward|relu_backward|neg|exp|log|sqrt|rsqrt|pow|clamp|clamp_|clamp_min|clamp_max|"
                    r"maximum|minimum|where|masked_fill|masked_fill_|lerp|lerp_|addcmul|addcmul_|addcdiv|addcdiv_|abs|"
                    r"sign|reciprocal|dropout|native_dropout|native_dropout_backward|hardtanh|leaky_relu|eq|ne|lt|le|"
                    r"gt|ge|logical_not|isfinite|square)$"),
]
# A kernel's own name, when its op says nothing (no correlation, or an op the rules above do not know).
KERNEL_RULES = [
    ("optimizer", r"multi_tensor_apply|fused_adam|fused_sgd|fusedsgd|amp_update_scale|foreach"),
    ("loss", r"nll_loss|logsoftmax|log_softmax|cross_entropy"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("normalization", r"batch_?norm|bn_fw|bn_bw|layer_?norm|welford|group_?norm"),
    ("convolution", r"conv|fprop|dgrad|wgrad|implicit_gemm|implicit_convolve|winograd"),
    ("GEMM", r"gemm|nvjet|cublas|cutlass|xmma|splitk|gemv"),
    ("copies and casts", r"copy|cast|memcpy|memset|fill|catarray|cat_array"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]
LAYOUT = re.compile(r"nchwtonhwc|nhwctonchw|nchw_to_nhwc|nhwc_to_nchw", re.I)


class TraceError(Exception):
    pass


def classify_op(name):
    """The class of a host op by its name, or None."""
    n = name[6:] if name.startswith("aten::") else name
    m = re.match(r"^(.*?)Backward\d*$", n)
    if m:
        n = m.group(1)
    n = n.lower()
    for cls, rule in OP_RULES:
        if re.search(rule, n):
            return cls
    return None


def classify_kernel(name):
    n = name.lower()
    for cls, rule in KERNEL_RULES:
        if re.search(rule, n):
            return cls
    return "other"


def short_kernel(name):
    """A kernel's name without "void " and its argument list: "at::native::foo<float, 4>"."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    if n.endswith(")"):
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            if n[i] == ")":
                depth += 1
            elif n[i] == "(":
                depth -= 1
                if depth == 0:
                    if i > 0 and not n[:i].endswith("anonymous namespace"):
                        n = n[:i]
                    break
    return re.sub(r"\s+", " ", n).strip()


def load(path):
    """The complete events of a trace and its format: (events, "kineto" | "list")."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise TraceError("%s: cannot read the trace (%s)" % (path, e.strerror))
    except ValueError as e:
        raise TraceError("%s: not a JSON trace (%s)" % (path, e))
    if isinstance(data, list):
        events, fmt = data, "list"
    elif isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        events, fmt = data["traceEvents"], "kineto"
    else:
        raise TraceError("%s: not a Chrome trace (expected a list of events or {\"traceEvents\": [...]})" % path)
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e:
            continue
        try:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        except (TypeError, ValueError):
            continue
        out.append({"name": str(e.get("name", "")), "cat": e.get("cat"), "ts": ts, "dur": dur, "end": ts + dur,
                    "pid": e.get("pid"), "tid": e.get("tid"), "args": e.get("args") or {}})
    return out, fmt


def kind_of(e):
    """gpu (kernel, copy, set), runtime (CUDA API call), scope (user annotation), op (ATen op or autograd
    node), or None (Kineto's GPU copies of the annotations, Python functions, the trace's own events)."""
    cat = e["cat"]
    if cat in GPU_CATS:
        return "gpu"
    if cat in RUNTIME_CATS:
        return "runtime"
    if cat == "user_annotation":
        return "scope"
    if cat is None:  # torch 1.13's list: every event is a CPU op, user scopes among them
        return "scope" if e["name"].startswith(("ProfilerStep#", "Optimizer.", "trainer.")) else "op"
    if cat == "cpu_op":
        return "op"
    return None


def analyze(path):
    """Every per-step figure of one trace."""
    events, fmt = load(path)
    for e in events:
        e["kind"] = kind_of(e)
    steps = sorted((e for e in events if e["kind"] == "scope" and re.match(r"^ProfilerStep#\d+$", e["name"])),
                   key=lambda e: e["ts"])
    if not steps:
        raise TraceError("%s: no \"ProfilerStep#<n>\" scopes; profile with `trainer bench --profile` or "
                         "`bench/reference.py --profile`" % path)
    n = len(steps)
    w0, w1 = steps[0]["ts"], max(s["end"] for s in steps)
    inside = lambda e: e["ts"] >= w0 - 1e-3 and e["ts"] <= w1 + 1e-3  # noqa: E731

    # Host events per thread, nested by time: each op's self time, and for each runtime call its
    # innermost op and whether an "Optimizer.step#..." scope encloses it.
    host = defaultdict(list)
    for e in events:
        if e["kind"] in ("op", "scope", "runtime") and inside(e):
            host[(e["pid"], e["tid"])].append(e)
    launch = {}  # correlation id -> (innermost op name, under an optimizer scope)
    ops = []
    for evs in host.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["end"] <= e["ts"] + 1e-6:
                stack.pop()
            e["self"] = e["dur"]
            if stack:
                stack[-1]["self"] -= min(e["dur"], max(0.0, stack[-1]["end"] - e["ts"]))
            e["optimizer"] = any(s["kind"] == "scope" and s["name"].startswith("Optimizer.step") for s in stack) or (
                e["kind"] == "scope" and e["name"].startswith("Optimizer.step"))
            e["in_step"] = any(s["kind"] == "scope" and s["name"].startswith("ProfilerStep#") for s in stack)
            parent_op = next((s["name"] for s in reversed(stack) if s["kind"] == "op"), None)
            e["caller"] = parent_op or next((s["name"] for s in reversed(stack)), None)
            if e["kind"] == "runtime":
                corr = e["args"].get("correlation")
                if corr is not None:
                    launch[corr] = (parent_op, e["optimizer"])
            if e["kind"] == "op":
                ops.append(e)
            stack.append(e)

    res = {"trace": path, "format": fmt, "steps": n, "step_names": [s["name"] for s in steps],
           "step_ms": sum(s["dur"] for s in steps) / n / 1e3}
    res["stages_per_step"] = stages = host_stages(host, n)
    # Counts are summed as integers and divided once: adding 1/n thousands of times drifts off whole numbers.
    counts = defaultdict(int)
    for e in ops:
        counts[e["name"]] += 1
    res["op_counts_per_step"] = {k: v / n for k, v in sorted(counts.items())}

    gpu = [e for e in events if e["kind"] == "gpu" and e["end"] >= w0 and e["ts"] <= w1]
    res["kind"] = "gpu" if gpu else "cpu"
    per_class = defaultdict(float)
    launches = defaultdict(int)
    names = {}  # what the other side is compared by: kernels (GPU) or ops (CPU)
    if gpu:
        layout = 0
        for e in gpu:
            corr = e["args"].get("correlation")
            op, under_opt = launch.get(corr, (None, False))
            if e["cat"] != "kernel":
                cls = "copies and casts"
            elif LAYOUT.search(e["name"]):
                cls = "copies and casts"
                layout += 1
            elif under_opt:
                cls = "optimizer"
            else:
                cls = (classify_op(op) if op else None) or classify_kernel(e["name"])
            e["class"], e["op"] = cls, op
            per_class[cls] += e["dur"] / n / 1e3
            launches[cls] += 1
            key = short_kernel(e["name"]) if e["cat"] == "kernel" else e["name"]
            d = names.setdefault(key, {"count_per_step": 0, "ms_per_step": 0.0, "class": cls})
            d["count_per_step"] += 1
            d["ms_per_step"] += e["dur"] / n / 1e3
        res["layout_conversions_per_step"] = layout / n
        # Busy: the union of every activity's interval within the steps; idle: the rest of the steps' time.
        iv = sorted((max(e["ts"], w0), min(e["end"], w1), e) for e in gpu)
        merged = []  # [start, end, first event, last event]
        for s, t, e in iv:
            if merged and s <= merged[-1][1]:
                if t > merged[-1][1]:
                    merged[-1][1], merged[-1][3] = t, e
            else:
                merged.append([s, t, e, e])
        busy = sum(t - s for s, t, _, _ in merged)
        res["gpu_busy_ms_per_step"] = busy / n / 1e3
        res["gpu_idle_ms_per_step"] = ((w1 - w0) - busy) / n / 1e3
        res["gpu_time_ms_per_step"] = sum(e["dur"] for e in gpu) / n / 1e3
        res["gpu_utilization"] = busy / (w1 - w0) if w1 > w0 else None
        gaps = []  # (length, the activity before, the activity after)
        prev_end, prev = w0, None
        for s, t, first, last in merged:
            if s > prev_end:
                gaps.append((s - prev_end, prev, first))
            prev_end, prev = t, last
        if w1 > prev_end:
            gaps.append((w1 - prev_end, prev, None))
        gaps.sort(key=lambda g: -g[0])
        label = lambda e: (short_kernel(e["name"]) if e["cat"] == "kernel" else e["name"])[:100]  # noqa: E731
        res["largest_gaps"] = [{"ms": g / 1e3,
                                "after_kernel": label(a) if a else "(start of the steps)",
                                "before_kernel": label(b) if b else "(end of the steps)",
                                "next_launched_by": (b.get("op") or "") if b else ""} for g, a, b in gaps[:5]]
        # Host-device syncs.
        memcpy = {e["args"].get("correlation"): e["name"] for e in gpu if e["cat"] == "gpu_memcpy"}
        syncs = []
        for evs in host.values():
            for e in evs:
                if e["kind"] != "runtime":
                    continue
                pageable = e["name"].startswith("cudaMemcpy") and "Pageable" in memcpy.get(e["args"].get("correlation"), "")
                if e["name"] in SYNC_CALLS or pageable:
                    syncs.append(e)
        res["syncs_per_step"] = len(syncs) / n
        res["sync_wait_ms_per_step"] = sum(e["dur"] for e in syncs) / n / 1e3
        calls, callers = defaultdict(int), defaultdict(int)
        for e in syncs:
            calls[e["name"]] += 1
            callers[e["caller"] or "(no op)"] += 1
        res["sync_calls_per_step"] = {k: v / n for k, v in sorted(calls.items())}
        res["sync_callers_per_step"] = {k: v / n for k, v in sorted(callers.items(), key=lambda kv: -kv[1])}
        res["d2h_copies_per_step"] = sum(1 for e in gpu if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]) / n
    else:
        for e in ops:
            cls = "optimizer" if e["optimizer"] else (classify_op(e["name"]) or "other")
            per_class[cls] += e["self"] / n / 1e3
            launches[cls] += 1
            if e["name"].startswith("aten::"):
                d = names.setdefault(e["name"], {"count_per_step": 0, "ms_per_step": 0.0, "class": cls})
                d["count_per_step"] += 1
                d["ms_per_step"] += e["dur"] / n / 1e3
        # The steps' own host time, and their stages' (trainer.agree runs between two steps: not counted).
        step_ids = {id(s) for s in steps}
        own = [e for evs in host.values() for e in evs if id(e) in step_ids or (
            e["kind"] == "scope" and e["name"].startswith("trainer.") and e["in_step"])]
        res["host_outside_ops_ms_per_step"] = sum(e["self"] for e in own) / n / 1e3
    for d in names.values():
        d["count_per_step"] /= n
    res["time_ms_per_step"] = {c: per_class.get(c, 0.0) for c in CLASSES}
    res["launches_per_step"] = {c: launches.get(c, 0) / n for c in CLASSES}
    res["total_class_ms_per_step"] = sum(per_class.values())
    res["names"] = names
    return res


def host_stages(host, n):
    """The "trainer.<stage>" scopes on the host, per step: calls, time, and the time outside any op and any
    other scope within them (the stage's own bookkeeping). Their order: STAGES, then the others by name."""
    calls, total, own = defaultdict(int), defaultdict(float), defaultdict(float)
    for evs in host.values():
        for e in evs:
            if e["kind"] == "scope" and e["name"].startswith("trainer."):
                calls[e["name"]] += 1
                total[e["name"]] += e["dur"]
                own[e["name"]] += e["self"]
    order = [s for s in STAGES if s in calls] + sorted(s for s in calls if s not in STAGES)
    return {s: {"calls_per_step": calls[s] / n, "ms_per_step": total[s] / n / 1e3,
                "outside_ops_ms_per_step": own[s] / n / 1e3} for s in order}


def compare(a, b, names):
    """The table of two analyzed traces, labelled by `names`."""
    kind = "gpu" if "gpu" in (a["kind"], b["kind"]) else "cpu"
    na, nb = a["names"], b["names"]
    only = lambda x, y: sorted(({"name": k, **x[k]} for k in x if k not in y), key=lambda d: -d["ms_per_step"])  # noqa
    differ = []
    for k in set(na) & set(nb):
        if abs(na[k]["count_per_step"] - nb[k]["count_per_step"]) > 1e-9:
            differ.append({"name": k, "class": na[k]["class"], "count_per_step": [na[k]["count_per_step"], nb[k]["count_per_step"]],
                           "ms_per_step": [na[k]["ms_per_step"], nb[k]["ms_per_step"]]})
    differ.sort(key=lambda d: -abs(d["ms_per_step"][0] - d["ms_per_step"][1]))
    strip = lambda r: {k: v for k, v in r.items() if k != "names"}  # noqa: E731
    return {"schema": SCHEMA, "kind": kind, "names": list(names), "classes": CLASSES,
            "sides": {names[0]: strip(a), names[1]: strip(b)},
            "only_" + names[0]: only(na, nb), "only_" + names[1]: only(nb, na), "count_differs": differ}


def fmt(v, count=False, sign=""):
    """A count: whole numbers without decimals, else one; milliseconds: 3 decimals below 10, else 1."""
    if v is None:
        return "n/a"
    if count:
        return ("%" + sign + "d") % round(v) if abs(v - round(v)) < 1e-9 else ("%" + sign + ".1f") % v
    return ("%" + sign + (".3f" if abs(v) < 10 else ".1f")) % v


def delta(x, y, count=False):
    return "" if x is None or y is None else fmt(x - y, count, "+")


def markdown(t, title):
    a, b = t["names"]
    A, B = t["sides"][a], t["sides"][b]
    gpu = t["kind"] == "gpu"
    unit = "GPU" if gpu else "CPU self"
    lines = ["### " + title if title else "### Profile: %s against %s" % (a, b), ""]
    lines.append("%s; per step, averaged over %d (%s) and %d (%s) profiled steps. Traces: `%s`, `%s`."
                 % ("GPU kernels by the class of the op that launched them" if gpu else
                    "CPU ops by their self time (no GPU activity in the traces)", A["steps"], a, B["steps"], b,
                    os.path.basename(A["trace"]), os.path.basename(B["trace"])))
    lines += ["", "| per step | %s | %s | %s − %s |" % (a, b, a, b), "|---|---:|---:|---:|"]

    def row(label, x, y, count=False):
        lines.append("| %s | %s | %s | %s |" % (label, fmt(x, count), fmt(y, count), delta(x, y, count)))

    row("wall time of the step (ms)", A["step_ms"], B["step_ms"])
    if gpu:
        row("GPU busy (ms)", A.get("gpu_busy_ms_per_step"), B.get("gpu_busy_ms_per_step"))
        row("GPU idle between kernels (ms)", A.get("gpu_idle_ms_per_step"), B.get("gpu_idle_ms_per_step"))
    for c in CLASSES:
        row("%s: %s time (ms)" % (c, unit), A["time_ms_per_step"][c], B["time_ms_per_step"][c])
    if not gpu:
        row("host time outside any op (ms)", A.get("host_outside_ops_ms_per_step"), B.get("host_outside_ops_ms_per_step"))
    row("kernels launched" if gpu else "ops run", sum(A["launches_per_step"].values()),
        sum(B["launches_per_step"].values()), True)
    if gpu:
        row("host-device syncs", A.get("syncs_per_step"), B.get("syncs_per_step"), True)
        row("time blocked in syncs (ms)", A.get("sync_wait_ms_per_step"), B.get("sync_wait_ms_per_step"))
        row("device-to-host copies", A.get("d2h_copies_per_step"), B.get("d2h_copies_per_step"), True)
        row("NCHW/NHWC layout conversions", A.get("layout_conversions_per_step"), B.get("layout_conversions_per_step"), True)
    for op in KEY_OPS:
        x, y = A["op_counts_per_step"].get(op, 0.0), B["op_counts_per_step"].get(op, 0.0)
        if x or y:
            row("`%s` calls" % op, x, y, True)
    if gpu:
        for side, S in ((a, A), (b, B)):
            callers = ", ".join("`%s` %s" % (k, fmt(v, True)) for k, v in list(S.get("sync_callers_per_step", {}).items())[:4])
            lines += ["", "Syncs of %s by the op that called them (per step): %s." % (side, callers or "none")]
        for side, S in ((a, A), (b, B)):
            lines += ["", "Largest GPU idle gaps of %s (over all profiled steps):" % side, ""]
            for g in S.get("largest_gaps", []):
                lines.append("- %.3f ms after `%s`, before `%s`%s" % (
                    g["ms"], g["after_kernel"], g["before_kernel"],
                    " (launched by `%s`)" % g["next_launched_by"] if g["next_launched_by"] else ""))
    for side, S in ((a, A), (b, B)):
        stages = S.get("stages_per_step") or {}
        if stages:
            lines += ["", "Host stages of %s (per step: calls, ms, of which outside any op):" % side, ""]
            lines += ["- `%s`: %s, %s ms (%s)" % (k, fmt(d["calls_per_step"], True), fmt(d["ms_per_step"]),
                                                  fmt(d["outside_ops_ms_per_step"])) for k, d in stages.items()]
    what = "Kernels" if gpu else "Ops"
    for side in (a, b):
        rows = t["only_" + side][:12]
        lines += ["", "%s only %s runs (per step: count, ms):" % (what, side), ""]
        lines += ["- `%s` (%s): %s, %s ms" % (r["name"][:110], r["class"], fmt(r["count_per_step"], True),
                                              fmt(r["ms_per_step"])) for r in rows] or ["- none"]
    if t["count_differs"]:
        lines += ["", "%s both run, a different number of times (per step, %s / %s):" % (what, a, b), ""]
        for r in t["count_differs"][:10]:
            lines.append("- `%s` (%s): %s / %s calls, %s / %s ms" % (
                r["name"][:110], r["class"], fmt(r["count_per_step"][0], True), fmt(r["count_per_step"][1], True),
                fmt(r["ms_per_step"][0]), fmt(r["ms_per_step"][1])))
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", required=True, help="the first trace (`trainer bench --profile`)")
    ap.add_argument("--python", required=True, help="the second trace (`bench/reference.py --profile`)")
    ap.add_argument("--names", default="trainer,python", help="the two columns' names (default trainer,python)")
    ap.add_argument("--title", default="", help="the markdown table's heading")
    ap.add_argument("--out-md", default="", help="write the markdown here (default: stdout)")
    ap.add_argument("--out-json", default="", help="write the JSON here")
    args = ap.parse_args()
    names = [x.strip() for x in args.names.split(",")]
    if len(names) != 2 or not all(names) or names[0] == names[1]:
        raise TraceError("command line: --names takes two different names, e.g. trainer,python")
    t = compare(analyze(args.trainer), analyze(args.python), names)
    md = markdown(t, args.title)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(t, f, indent=1)
            f.write("\n")
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TraceError as e:
        print("error: %s" % e, file=sys.stderr)
        sys.exit(2)
