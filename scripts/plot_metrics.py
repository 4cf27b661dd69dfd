#!/usr/bin/python3
"""Plot a trainer run's metrics.jsonl: loss, throughput, memory (peak and limit) and micro-batch over
optimizer steps, with OOM, backoff, probe, limit, checkpoint, resume and stop events as vertical lines.

    /usr/bin/python3 scripts/plot_metrics.py RUN_DIR_OR_METRICS_JSONL [--out plot.png] [--html page.html]

Writes a PNG (default: metrics.png next to metrics.jsonl) and, with --html, a self-contained HTML page
(the PNG embedded, plus the event list).

    /usr/bin/python3 scripts/plot_metrics.py RUN_A RUN_B [...] --out compare.png [--labels a,b,...]
                     [--smooth 50]

Two or more runs: their curves on one figure, to compare runs of one job (the training loss as a moving
average over --smooth steps, the evaluation loss, and the training loss relative to the first run's),
with each run's last evaluation printed. Labels default to the run folders' names.

Needs matplotlib (Debian: python3-matplotlib). Exit code 2 on bad input, with a message naming the file.
"""
import argparse
import base64
import html
import io
import json
import os
import sys

# Event kind -> (colour, line style, label). Order = legend order.
EVENT_STYLE = {
    "oom": ("#d62728", "-", "OOM"),
    "backoff": ("#ff7f0e", "--", "backoff"),
    "checkpointing_on": ("#ff7f0e", ":", "checkpointing on"),
    "probe": ("#2ca02c", "--", "grow probe"),
    "probe_failed": ("#2ca02c", ":", "probe failed"),
    "probe_skipped": ("#bcbd22", ":", "probe skipped"),
    "limit_changed": ("#8c564b", "-.", "limit changed"),
    "checkpoint": ("#7f7f7f", ":", "checkpoint"),
    "resume": ("#9467bd", "-", "resume"),
    "stop": ("#000000", "-", "stop"),
}


def fail(msg):
    print("error: " + msg, file=sys.stderr)
    sys.exit(2)


def read_metrics(path):
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"{path}: no such metrics file (give a run folder or its metrics.jsonl)")
    steps, evals, events = [], [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill mid-write
            if not isinstance(r, dict):
                continue
            if "event" in r:
                if r["event"] == "eval":
                    evals.append(r)
                elif r["event"] in EVENT_STYLE and isinstance(r.get("step"), (int, float)):
                    events.append(r)
            elif isinstance(r.get("step"), (int, float)):
                steps.append(r)
    if not steps:
        fail(f"{path}: no step lines (is it a trainer metrics.jsonl?)")
    return path, steps, evals, events


def column(rows, key):
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot(path, steps, evals, events, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True, constrained_layout=True)
    fig.suptitle(title, fontsize=12)

    ax = axes[0]
    x, y = column(steps, "loss")
    ax.plot(x, y, color="#1f77b4", lw=1, label="train loss")
    if evals:
        ex, ey = column(evals, "loss")
        ax.plot(ex, ey, "o-", color="#17becf", ms=4, lw=1, label="eval loss")
    ax.set_ylabel("loss")
    if evals and any(isinstance(e.get("top1"), (int, float)) for e in evals):
        ax2 = ax.twinx()
        tx, ty = column(evals, "top1")
        ax2.plot(tx, [100 * v for v in ty], "s--", color="#bcbd22", ms=4, lw=1, label="eval top-1")
        ax2.set_ylabel("top-1 (%)")
        ax2.legend(loc="upper center", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[1]
    x, y = column(steps, "samples_per_s")
    ax.plot(x, y, color="#1f77b4", lw=1)
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)

    ax = axes[2]
    x, y = column(steps, "mem_peak_bytes")
    lx, ly = column(steps, "mem_limit_bytes")
    top = max(y + ly + [1])
    unit, scale = next((u, s) for u, s in (("GiB", 1024.0 ** 3), ("MiB", 1024.0 ** 2), ("KiB", 1024.0), ("B", 1.0))
                       if top >= s)
    ax.plot(x, [v / scale for v in y], color="#1f77b4", lw=1, label="peak (step)")
    if any(v > 0 for v in ly):
        # 0 means "no limit": drawn as a gap, not as a limit of zero.
        ax.step(lx, [v / scale if v > 0 else float("nan") for v in ly], where="post", color="#d62728", lw=1.5,
                label="limit")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, 1.12 * top / scale)
    ax.legend(loc="lower right", fontsize=8)

    ax = axes[3]
    x, y = column(steps, "micro_batch")
    ax.step(x, y, where="post", color="#1f77b4", lw=1.5, label="micro-batch")
    ax.set_ylabel("micro-batch")
    ax.set_ylim(0, 1.15 * max(y + [1]))
    ax2 = ax.twinx()
    sx, sy = column(steps, "accum_steps")
    ax2.step(sx, sy, where="post", color="#9467bd", lw=1, ls="--", label="accumulation steps")
    ax2.set_ylabel("accumulation steps")
    ax2.set_ylim(0, 1.15 * max(sy + [1]))
    axes[3].legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    axes[3].set_xlabel("optimizer step")

    seen = set()
    for e in events:
        colour, style, label = EVENT_STYLE[e["event"]]
        for a in axes:
            a.axvline(e["step"], color=colour, ls=style, lw=1, alpha=0.8,
                      label=None if e["event"] in seen or a is not axes[1] else label)
        seen.add(e["event"])
    if seen:
        axes[1].legend(loc="lower right", fontsize=8, title="events", title_fontsize=8)
    for a in axes:
        a.grid(True, alpha=0.3)
    return fig


def moving_average(xs, ys, window):
    """The mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return xs, out


def compare(runs, labels, smooth, title):
    """runs: [(path, steps, evals)]; one figure with every run's losses."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True, constrained_layout=True)
    fig.suptitle(title, fontsize=12)
    base = dict(zip(*moving_average(*column(runs[0][1], "loss"), smooth)))
    for (path, steps, evals), label in zip(runs, labels):
        x, y = moving_average(*column(steps, "loss"), smooth)
        line, = axes[0].plot(x, y, lw=1, label=label)
        ex, ey = column(evals, "loss")
        if ex:
            axes[1].plot(ex, ey, "o-", ms=4, lw=1, color=line.get_color(), label=f"{label}: {ey[-1]:.4f}")
        rx = [s for s in x if s in base and base[s] > 0]
        ry = [100.0 * (v / base[s] - 1.0) for s, v in zip(x, y) if s in base and base[s] > 0]
        axes[2].plot(rx, ry, lw=1, color=line.get_color(), label=label)
    axes[0].set_ylabel(f"train loss (mean of {smooth} steps)")
    axes[1].set_ylabel("eval loss")
    axes[2].set_ylabel(f"train loss vs {labels[0]} (%)")
    axes[2].axhline(0.0, color="#000000", lw=0.8)
    axes[2].set_xlabel("optimizer step")
    for a in axes:
        a.grid(True, alpha=0.3)
        a.legend(loc="upper right", fontsize=8)
    return fig


def main_compare(a):
    runs = []
    for m in a.metrics:
        path, steps, evals, _ = read_metrics(m)
        runs.append((path, steps, evals))
    names = [os.path.basename(os.path.dirname(os.path.abspath(path))) for path, _, _ in runs]
    labels = a.labels.split(",") if a.labels else names
    if len(labels) != len(runs):
        fail(f"--labels: {len(labels)} labels for {len(runs)} runs")
    if a.smooth < 1:
        fail(f"--smooth: {a.smooth}; expected a number of steps >= 1")
    if not a.out:
        fail("--out: give the PNG to write when comparing runs")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("matplotlib is not installed for " + sys.executable + " (Debian: apt-get install python3-matplotlib)")
    fig = compare(runs, labels, a.smooth, a.title or " vs ".join(labels))
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}: {len(runs)} runs")
    for (path, steps, evals), label in zip(runs, labels):
        last = f"eval loss {evals[-1]['loss']:.6g} at step {evals[-1]['step']}" if evals and isinstance(
            evals[-1].get("loss"), (int, float)) else "no evaluation"
        print(f"{label}: {len(steps)} steps, {last}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", help="run folder or metrics.jsonl (two or more: compare them)")
    p.add_argument("--out", help="PNG to write (default: metrics.png beside metrics.jsonl)")
    p.add_argument("--html", help="also write a self-contained HTML page (one run)")
    p.add_argument("--title", help="figure title (default: the run folder's name)")
    p.add_argument("--labels", help="comparing: the runs' names, comma separated (default: their folders' names)")
    p.add_argument("--smooth", type=int, default=50, help="comparing: the training loss's moving average, in steps")
    a = p.parse_args()
    if len(a.metrics) > 1:
        if a.html:
            fail("--html: one run only")
        return main_compare(a)
    a.metrics = a.metrics[0]
    path, steps, evals, events = read_metrics(a.metrics)
    run_dir = os.path.dirname(os.path.abspath(path))
    title = a.title or f"{os.path.basename(run_dir)}: {len(steps)} steps"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("matplotlib is not installed for " + sys.executable + " (Debian: apt-get install python3-matplotlib)")
    fig = plot(path, steps, evals, events, title)
    out = a.out or os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    counts = {}
    for e in events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "none"
    print(f"wrote {out}: {len(steps)} steps, {len(evals)} evaluations; events marked: {summary}")
    if a.html:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        img = base64.b64encode(buf.getvalue()).decode("ascii")
        rows = "".join(
            f"<tr><td>{e['step']}</td><td>{html.escape(e['event'])}</td>"
            f"<td>{html.escape(str(e.get('reason', e.get('kind', ''))))}</td></tr>" for e in events)
        page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
                f"<body style='font-family:sans-serif'><h2>{html.escape(title)}</h2>"
                f"<p>{html.escape(path)}</p><img alt='metrics' src='data:image/png;base64,{img}'>"
                f"<h3>events</h3><table border='1' cellpadding='3'><tr><th>step</th><th>event</th><th>detail</th></tr>"
                f"{rows}</table></body></html>\n")
        with open(a.html, "w") as f:
            f.write(page)
        print(f"wrote {a.html}")


if __name__ == "__main__":
    main()
