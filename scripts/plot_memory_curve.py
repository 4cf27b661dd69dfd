#!/usr/bin/python3
"""Plot a `trainer bench --memory-curve` result: the peak memory of a training step against the
micro-batch, without and with activation checkpointing, with the fitted lines, the limits and the
micro-batches predicted (and, after --check, found by exhaustive search) under them; the fit's residuals;
and the samples/s measured at every point.

    /usr/bin/python3 scripts/plot_memory_curve.py CURVE.json [--out curve.png]

Writes a PNG (default: CURVE.png next to the JSON). Needs matplotlib (Debian: python3-matplotlib); without
it, says so, writes nothing and exits 0 (the JSON is the result; the plot is a view of it). Exit code 2 on
bad input, with a message naming the file.
"""
import argparse
import json
import os
import sys

# Checkpointing setting -> (colour, marker, label).
SETTING_STYLE = {
    "none": ("#1f77b4", "o", "no checkpointing"),
    "all": ("#ff7f0e", "s", "checkpointing every block"),
}


def fail(msg):
    print("error: " + msg, file=sys.stderr)
    sys.exit(2)


def read_curve(path):
    if not os.path.isfile(path):
        fail(f"{path}: no such file (give the JSON of trainer bench --memory-curve)")
    try:
        with open(path) as f:
            j = json.load(f)
    except ValueError as e:
        fail(f"{path}: not JSON ({e})")
    if not isinstance(j, dict) or j.get("mode") != "memory_curve" or not isinstance(j.get("curves"), dict):
        fail(f"{path}: not a trainer bench --memory-curve result (its mode is {j.get('mode')!r})")
    return j


def byte_unit(top):
    return next((u, s) for u, s in (("GiB", 1024.0 ** 3), ("MiB", 1024.0 ** 2), ("KiB", 1024.0), ("B", 1.0))
                if top >= s)


def draw_limits(ax, j, scale, x_max):
    for k, pr in enumerate(j.get("predictions", [])):
        y = pr["limit_bytes"] / scale
        ax.axhline(y, color="#d62728", lw=1, ls="--", alpha=0.8, label="limit" if k == 0 else None)
        for setting, (colour, marker, _) in SETTING_STYLE.items():
            p = pr.get(setting)
            if p and p["micro_batch"] > 0:
                ax.plot([p["micro_batch"]], [y], marker="v", color=colour, ms=9, ls="none",
                        label="predicted largest" if k == 0 and setting == "none" else None)
            c = (pr.get("check") or {}).get(setting)
            if c and c.get("micro_batch", 0) > 0:
                ax.plot([c["micro_batch"]], [y], marker="x", color="k", ms=8, ls="none",
                        label="exhaustive search" if k == 0 and setting == "none" else None)
        ax.annotate(f"choose: {pr['choice']}", (x_max, y), textcoords="offset points", xytext=(-4, 3),
                    ha="right", fontsize=8, color="#d62728")


def plot(j, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 11), sharex=True, constrained_layout=True,
                             gridspec_kw={"height_ratios": [3, 1.2, 1.6]})
    fig.suptitle(title, fontsize=12)
    peaks = [p["peak_bytes"] for c in j["curves"].values() for p in c["points"]]
    peaks += [pr["limit_bytes"] for pr in j.get("predictions", [])]
    unit, scale = byte_unit(max(peaks + [1]))
    x_max = j["global_batch"]
    for setting, c in j["curves"].items():
        colour, marker, label = SETTING_STYLE.get(setting, ("#7f7f7f", "^", setting))
        xs = [p["micro_batch"] for p in c["points"]]
        fit = c.get("fit")
        axes[0].plot(xs, [p["peak_bytes"] / scale for p in c["points"]], marker, color=colour, ms=6,
                     label=f"{label} (measured)")
        if fit:
            fx = [0, x_max]
            axes[0].plot(fx, [(fit["fixed_bytes"] + fit["per_sample_bytes"] * x) / scale for x in fx], "-",
                         color=colour, lw=1,
                         label=f"fit: {fit['fixed_bytes'] / 2**20:.1f} MiB + {fit['per_sample_bytes'] / 2**20:.2f} "
                               f"MiB x micro-batch")
            axes[1].plot(xs, [r / 2**20 for r in fit["residuals_bytes"]], marker + "-", color=colour, ms=5, lw=1)
        axes[2].plot(xs, [p["samples_per_s"] for p in c["points"]], marker + "-", color=colour, ms=5, lw=1,
                     label=label)
    draw_limits(axes[0], j, scale, x_max)
    axes[0].set_ylabel(f"step peak ({unit})")
    axes[0].set_ylim(bottom=0)
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].axhline(0, color="k", lw=0.8)
    axes[1].set_ylabel("residual (MiB)")
    axes[2].set_ylabel("samples / s")
    axes[2].set_ylim(bottom=0)
    axes[2].legend(loc="lower right", fontsize=8)
    axes[2].set_xlabel("micro-batch")
    axes[2].set_xlim(0, 1.04 * x_max)
    for a in axes:
        a.grid(True, alpha=0.3)
    return fig


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("curve", help="the JSON of trainer bench --memory-curve")
    p.add_argument("--out", help="PNG to write (default: next to the JSON)")
    a = p.parse_args()
    j = read_curve(a.curve)
    out = a.out or os.path.splitext(a.curve)[0] + ".png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"skipped: matplotlib is not installed for {sys.executable} (Debian: apt-get install "
              f"python3-matplotlib); no plot of {a.curve} written", file=sys.stderr)
        return
    shape = "x".join(str(s) for s in j.get("sample_shape", []))
    title = (f"{j.get('model')} on {shape}, global batch {j.get('global_batch')}, {j.get('precision')}, "
             f"{j.get('device')}: peak tensor memory of a step")
    fig = plot(j, title)
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
