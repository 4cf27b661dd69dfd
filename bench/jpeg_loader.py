"""The input-pipeline benchmark of docs/BENCHMARKS.md ("Input pipeline: JPEG decoding"): the same JPEG
folder, the same cores, one run, three pipelines (and the trainer's two resize kernels), train and eval
transforms, JSON out.

    python3 bench/jpeg_loader.py --src DIR/train --out bench/results/jpeg_decode \
        [--trainer build/trainer] [--torch-python /usr/bin/python3] \
        [--dali-python ~/.cache/trainer/jpeg-bench-venv/bin/python] [--cores N] [--epochs 2]

- trainer:     `trainer bench --decode-only --src DIR --train|--eval --threads N` (data/pixels/jpeg.h): read,
               decode only the crop (DCT scaling, partial decoding), resize, flip; uint8 HWC out. The
               CPU's best resize kernel (data/pixels/resize.h: avx2 on x86-64 with AVX2).
- trainer_plain: the same with `--resize-kernel plain` (Pillow's loops; the same bytes), to measure the
               kernel's share.
- trainer_loader: the whole loader as training runs it, `trainer bench --loader-only` with
               configs/resnet50_imagefolder.yaml on the folder (data.kind image_folder, batch 64,
               data.workers N): workers decoding into uint8 NHWC batches, collation, the prefetch queue.
- torchvision: ImageFolder + DataLoader(num_workers=N, batch 64) with PIL: RandomResizedCrop(224) +
               RandomHorizontalFlip + ToTensor + Normalize (train), Resize(256) + CenterCrop(224) +
               ToTensor + Normalize (eval); float NCHW out.
- dali:        NVIDIA DALI with device="cpu" everywhere (device_id=None, num_threads=N, batch 64):
               readers.file, decoders.image_random_crop (train; decoders.image for eval), resize,
               crop_mirror_normalize; float NCHW out.
Each pipeline runs in its own process; the first epoch warms up (page cache, worker start-up) and the
next ones are timed, in wall-clock seconds and in CPU seconds of the process and its children (from
/proc; images per CPU second is the per-core speed even on a machine that other work shares). Memory is the peak over the run of the summed RSS of the process and its children
(DataLoader workers), sampled every 50 ms from /proc. The 1-minute load average before and after each
run is recorded: a load above the core count means other processes shared the cores. Writes <out>/<pipeline>_<transform>.json and
<out>/summary.json, and prints a table.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


# ---- the pipelines, each run as `jpeg_loader.py --run PIPELINE ...` in its own interpreter ------------------

def count_files(src):
    return sum(len(f) for _, _, f in os.walk(src))


def run_torchvision(src, transform, cores, epochs):
    import torch
    import torchvision
    import torchvision.transforms as T
    norm = [T.ToTensor(), T.Normalize(MEAN, STD)]
    if transform == "train":
        tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()] + norm)
    else:
        tf = T.Compose([T.Resize(256), T.CenterCrop(224)] + norm)
    ds = torchvision.datasets.ImageFolder(src, transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=transform == "train", num_workers=cores,
                                     persistent_workers=True, drop_last=False)
    times, cpu = [], 0.0
    for e in range(epochs + 1):
        c0 = tree_cpu_seconds(os.getpid())  # the persistent workers exist from the first epoch on
        t0 = time.perf_counter()
        n = 0
        for images, _ in dl:
            n += images.shape[0]
        if e > 0:
            times.append(time.perf_counter() - t0)
            cpu += tree_cpu_seconds(os.getpid()) - c0
    return {"images": n * epochs, "seconds": sum(times), "cpu_seconds": cpu, "versions": {"torch": torch.__version__,
            "torchvision": torchvision.__version__, "PIL": __import__("PIL").__version__}}


def run_dali(src, transform, cores, epochs):
    import nvidia.dali as dali
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    @dali.pipeline_def(batch_size=64, num_threads=cores, device_id=None, seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=src, random_shuffle=transform == "train", name="Reader")
        if transform == "train":
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_aspect_ratio=[3 / 4, 4 / 3], random_area=[0.08, 1.0],
                                                   num_attempts=10)
            images = fn.resize(images, device="cpu", resize_x=224, resize_y=224, antialias=True)
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.resize(images, device="cpu", resize_shorter=256, antialias=True)
            mirror = 0
        images = fn.crop_mirror_normalize(images, device="cpu", dtype=types.FLOAT, output_layout="CHW",
                                          crop=(224, 224), mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                          mirror=mirror)
        return images, labels

    p = pipe()
    p.build()
    size = p.epoch_size("Reader")
    iters = (size + 63) // 64
    times, cpu = [], 0.0
    for e in range(epochs + 1):
        c0 = tree_cpu_seconds(os.getpid())
        t0 = time.perf_counter()
        for _ in range(iters):
            p.run()
        if e > 0:
            times.append(time.perf_counter() - t0)
            cpu += tree_cpu_seconds(os.getpid()) - c0
    return {"images": iters * 64 * epochs, "seconds": sum(times), "cpu_seconds": cpu,
            "versions": {"dali": dali.__version__}}


# ---- the driver ------------------------------------------------------------------------------------------

def tree_cpu_seconds(pid):
    """User + system CPU seconds of pid's threads and its live descendants, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in [pid] + descendants(pid):
        try:
            with open("/proc/%d/stat" % p) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def descendants(pid):
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_rss(pid):
    """Summed RSS in bytes of pid and its descendants."""
    total = 0
    for p in [pid] + descendants(pid):
        try:
            with open("/proc/%d/statm" % p) as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
    return total


def measured(cmd):
    """Runs cmd; returns (exit code, stdout, stderr, peak tree RSS)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.05)

    t = threading.Thread(target=sample)
    t.start()
    out, err = proc.communicate()
    done.set()
    t.join()
    return proc.returncode, out, err, peak[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="ImageFolder root (DIR/<class>/*.jpg)")
    ap.add_argument("--out", required=True, help="folder for the JSON results")
    ap.add_argument("--trainer", default=os.path.join(HERE, "..", "build", "trainer"))
    ap.add_argument("--torch-python", default="/usr/bin/python3")
    ap.add_argument("--dali-python", default=os.path.expanduser("~/.cache/trainer/jpeg-bench-venv/bin/python"))
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs after one warm-up epoch")
    ap.add_argument("--pipelines", default="trainer,trainer_plain,trainer_loader,torchvision,dali")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--transform", default="train", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.run:  # inside a child process
        fn = {"torchvision": run_torchvision, "dali": run_dali}[a.run]
        print(json.dumps(fn(a.src, a.transform, a.cores, a.epochs)))
        return

    os.makedirs(a.out, exist_ok=True)
    files = count_files(a.src)
    results = []
    for transform in ("train", "eval"):
        for name in a.pipelines.split(","):
            if name == "trainer_loader":
                classes = sum(1 for e in os.scandir(a.src) if e.is_dir())
                batch = 64
                cmd = [a.trainer, "bench", "--loader-only", "--config",
                       os.path.join(HERE, "..", "configs", "resnet50_imagefolder.yaml"),
                       "--set", "data.kind=image_folder", "--set", "data.train=" + a.src, "--set", "data.test=" + a.src,
                       "--set", "train.device=cpu", "--set", "train.global_batch=%d" % batch,
                       "--set", "train.micro_batch=%d" % batch, "--set", "model.num_classes=%d" % classes,
                       "--set", "data.workers=%d" % a.cores,
                       "--warmup", str(-(-files // batch)), "--steps", str(a.epochs * files // batch)]
            elif name in ("trainer", "trainer_plain"):
                cmd = [a.trainer, "bench", "--decode-only", "--src", a.src, "--" + transform, "--threads",
                       str(a.cores), "--passes", str(a.epochs), "--resize-kernel",
                       "plain" if name == "trainer_plain" else "auto"]
            else:
                py = a.torch_python if name == "torchvision" else a.dali_python
                cmd = [py, os.path.abspath(__file__), "--run", name, "--transform", transform, "--src", a.src,
                       "--out", a.out, "--cores", str(a.cores), "--epochs", str(a.epochs)]
            load_before = os.getloadavg()[0]
            rc, out, err, rss = measured(cmd)
            # The 1-minute load average around the run: above the core count, other work shared the cores.
            r = {"pipeline": name, "transform": transform, "cores": a.cores, "files": files, "command": " ".join(cmd),
                 "rss_peak_bytes_tree": rss, "load_avg_1min_before_after": [load_before, os.getloadavg()[0]]}
            if rc != 0:
                r["error"] = (err.strip().splitlines() or ["exit %d" % rc])[-1]
                r["stderr_tail"] = err[-4000:]
            else:
                ours = name.startswith("trainer")
                j = json.loads(out.strip().splitlines()[-1] if not ours else out)
                if name == "trainer_loader":
                    sps = j["samples_per_s"] if transform == "train" else j["eval_samples_per_s"]
                    images = j["batches"] * j["global_batch"]
                    j = {"images": images, "seconds": images / sps,
                         "cpu_seconds": j["cpu_seconds"] if transform == "train" else j["eval_cpu_seconds"],
                         "workers": j["workers"], "batch_dtype": j["batch_dtype"]}
                elif ours:
                    j = {"images": j["images"], "seconds": j["seconds"], "cpu_seconds": j["cpu_seconds"],
                         "decode_failures": j["decode_failures"], "rss_peak_bytes_self": j["rss_peak_bytes"],
                         "resize_kernel": j["resize_kernel"]}
                r.update(j)
                r["images_per_s"] = r["images"] / r["seconds"]
                r["images_per_s_per_core"] = r["images_per_s"] / a.cores
                # Images per CPU second: the per-core speed even when other processes share the cores.
                r["images_per_cpu_s"] = r["images"] / r["cpu_seconds"]
            with open(os.path.join(a.out, "%s_%s.json" % (name, transform)), "w") as f:
                json.dump(r, f, indent=2)
            results.append(r)
            print("%-14s %-5s %s" % (name, transform, "%.1f images/s, %.1f per core, %.1f per CPU second, peak RSS %.0f MiB"
                                     % (r["images_per_s"], r["images_per_s_per_core"], r["images_per_cpu_s"], rss / 2**20)
                                     if "error" not in r else "failed: " + r["error"]), flush=True)

    summary = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "host": platform.node(), "cores": a.cores,
               "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
               "files": files, "epochs_timed": a.epochs, "results": results, "ratios": {}}
    by = {(r["pipeline"], r["transform"]): r for r in results if "error" not in r}
    for t in ("train", "eval"):
        for ours, other in (("trainer", "torchvision"), ("trainer", "dali"), ("trainer", "trainer_plain"),
                            ("trainer_loader", "torchvision"), ("trainer_loader", "dali")):
            if (ours, t) in by and (other, t) in by:
                summary["ratios"]["%s_over_%s_%s" % (ours, other, t)] = (by[(ours, t)]["images_per_s"] /
                                                                         by[(other, t)]["images_per_s"])
                summary["ratios"]["%s_over_%s_%s_per_cpu_s" % (ours, other, t)] = (
                    by[(ours, t)]["images_per_cpu_s"] / by[(other, t)]["images_per_cpu_s"])
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for k, v in summary["ratios"].items():
        print("%s: %.2fx" % (k, v))


if __name__ == "__main__":
    main()
