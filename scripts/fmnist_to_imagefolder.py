#!/usr/bin/env python3
"""Writes Fashion-MNIST (the IDX files of Debian's dataset-fashion-mnist) as a JPEG ImageFolder tree:
OUT/train/<class>/<index>.jpg (60000) and OUT/val/<class>/<index>.jpg (10000), grayscale JPEGs of 28x28
at quality 95, class folders named by their number with the class name ("0_T-shirt_top", ...), so that
the sorted folder names keep Fashion-MNIST's label order. `trainer convert-images` turns them into RGB.

Usage: scripts/fmnist_to_imagefolder.py [--src /usr/share/datasets/fashion-mnist] --out DIR [--limit N]
Needs numpy and Pillow (Debian: python3-numpy python3-pil).
"""
import argparse
import gzip
import os
import struct

import numpy as np
from PIL import Image

NAMES = ["T-shirt_top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle_boot"]


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    dims = magic & 0xFF
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def find(src, stem):
    for name in (stem + ".gz", stem):
        if os.path.exists(os.path.join(src, name)):
            return os.path.join(src, name)
    raise SystemExit(f"error: {stem}(.gz) not found in {src}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=0, help="first N images of each split only (0 = all)")
    a = p.parse_args()
    for split, stem in (("train", "train"), ("val", "t10k")):
        images = read_idx(find(a.src, f"{stem}-images-idx3-ubyte"))
        labels = read_idx(find(a.src, f"{stem}-labels-idx1-ubyte"))
        n = len(labels) if a.limit <= 0 else min(a.limit, len(labels))
        for k, name in enumerate(NAMES):
            os.makedirs(os.path.join(a.out, split, f"{k}_{name}"), exist_ok=True)
        for i in range(n):
            k = int(labels[i])
            Image.fromarray(images[i]).save(os.path.join(a.out, split, f"{k}_{NAMES[k]}", f"{i:05d}.jpg"), quality=95)
        print(f"{split}: {n} images")


if __name__ == "__main__":
    main()
