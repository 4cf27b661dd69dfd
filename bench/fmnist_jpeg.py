#!/usr/bin/env python3
"""Fashion-MNIST as JPEGs against the HDF5 path: the same recipe, trained one after the other, JSON out.

  /usr/bin/python3 bench/fmnist_jpeg.py --trainer build/trainer --work datasets --out RESULT.json

1. The HDF5 path: `trainer convert-idx` of the IDX files (Debian's dataset-fashion-mnist) into
   WORK/fmnist/{train,test}.h5, the files configs/resnet20_fmnist.yaml reads.
2. The JPEG path: scripts/fmnist_to_imagefolder.py writes the same IDX files as a JPEG ImageFolder
   (grayscale, quality 95) under WORK/fmnist_jpeg/, and `trainer convert-images` packs it into
   WORK/fmnist_packed/{train,val}.h5 (RGB JPEGs, their mean and std).
3. Both train configs/resnet20_fmnist.yaml's recipe (ResNet-20, SGD with Nesterov, cosine, 6 epochs,
   pad 2 + random crop + flip, seed 0). The packed run decodes each image at its own 28 x 28
   (data.size 28, data.crop_pct 1: the eval view is the whole image) and draws the same crop and flip as
   the HDF5 run for the same sample (data.crop_padding on an encoded kind, docs/DATA.md).

The result holds both runs' final evaluation on the 10,000 test images, the gap in points, and whether
it is within --target points (1 by default). Exit 0 when it is, 1 when not, 2 for a failed step. The
datasets are reused when present; the run folders are made anew under WORK/runs_fmnist_jpeg/.
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def step(cmd, log):
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        with open(log) as f:
            tail = f.read()[-2000:]
        sys.exit(f"error: exit {r.returncode} from {' '.join(cmd)} (log {log}):\n{tail}")
    return time.time() - t0


def final_eval(run_dir):
    last = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if j.get("event") == "eval" and j.get("final"):
                last = j
    if last is None:
        sys.exit(f"error: {run_dir}/metrics.jsonl has no final evaluation")
    return {k: last[k] for k in ("step", "loss", "top1", "top5", "samples")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    p.add_argument("--work", default=os.path.join(ROOT, "datasets"), help="datasets and run folders go here")
    p.add_argument("--src", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--out", required=True, help="the JSON result")
    p.add_argument("--epochs", type=float, default=6, help="train.epochs of both runs (the recipe's: 6)")
    p.add_argument("--target", type=float, default=1.0, help="largest gap in top-1 points that passes")
    p.add_argument("--set", action="append", default=[], help="more --set KEY=VALUE for both runs")
    a = p.parse_args()
    trainer = os.path.abspath(a.trainer)
    work = os.path.abspath(a.work)
    logs = os.path.join(work, "runs_fmnist_jpeg")
    shutil.rmtree(logs, ignore_errors=True)
    os.makedirs(logs)
    h5, folder, packed = (os.path.join(work, d) for d in ("fmnist", "fmnist_jpeg", "fmnist_packed"))
    prep = {}
    if not all(os.path.exists(os.path.join(h5, f)) for f in ("train.h5", "test.h5")):
        prep["convert_idx_s"] = step([trainer, "convert-idx", "--src", a.src, "--out", h5], f"{logs}/convert-idx.log")
    if not all(os.path.exists(os.path.join(packed, f)) for f in ("train.h5", "val.h5")):
        shutil.rmtree(folder, ignore_errors=True)
        prep["jpeg_folder_s"] = step([sys.executable, os.path.join(ROOT, "scripts", "fmnist_to_imagefolder.py"),
                                      "--src", a.src, "--out", folder], f"{logs}/jpeg-folder.log")
        prep["convert_images_s"] = step([trainer, "convert-images", "--src", folder, "--out", packed],
                                        f"{logs}/convert-images.log")

    common = ["--config", os.path.join(ROOT, "configs", "resnet20_fmnist.yaml"), "--set", f"train.epochs={a.epochs}",
              "--set", "checkpoint.every_seconds=0"]
    for kv in a.set:
        common += ["--set", kv]
    paths = {
        "hdf5": ["--set", f"data.train={h5}/train.h5", "--set", f"data.test={h5}/test.h5"],
        "packed_jpeg": ["--set", "data.kind=packed_images", "--set", f"data.train={packed}/train.h5",
                        "--set", f"data.test={packed}/val.h5", "--set", "data.size=28", "--set", "data.crop_pct=1.0"],
    }
    result = {"date": datetime.date.today().isoformat(), "epochs": a.epochs, "target_points": a.target,
              "prep_seconds": prep, "runs": {}}
    for name, extra in paths.items():
        run_dir = os.path.join(logs, name)
        cmd = [trainer, "--run-dir", run_dir] + common + extra
        seconds = step(cmd, f"{logs}/{name}.log")
        result["runs"][name] = dict(final_eval(run_dir), seconds=round(seconds, 1),
                                    command=" ".join(cmd).replace(work, "WORK").replace(ROOT + "/", ""))
        print(f"{name}: top-1 {100 * result['runs'][name]['top1']:.2f}% in {seconds:.0f} s", flush=True)
    gap = 100 * (result["runs"]["hdf5"]["top1"] - result["runs"]["packed_jpeg"]["top1"])
    result["gap_points"] = round(gap, 3)
    result["within_target"] = abs(gap) <= a.target
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"gap {gap:+.2f} points (HDF5 minus packed JPEG), target |gap| <= {a.target}: "
          f"{'met' if result['within_target'] else 'MISSED'}; {a.out}")
    return 0 if result["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
