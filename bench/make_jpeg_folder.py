"""Writes an ImageNet-like JPEG folder for the input-pipeline benchmark (bench/jpeg_loader.py).

    python make_jpeg_folder.py --out DIR [--count 3000] [--classes 10] [--seed 0]

Where the pixels come from: the colour photographs bundled with scikit-image's `skimage.data`
(astronaut, chelsea, coffee, hubble_deep_field, ihc, motorcycle_left, motorcycle_right, retina, rocket;
public-domain or freely licensed photos, see skimage/data/README.txt). Each file is a random crop of one
of them (25-100% of its area, aspect 4:3 landscape for 3 files in 4, 3:4 portrait otherwise), randomly
flipped, with brightness and saturation jittered by up to 20%, resized with Lanczos to 500x375 (or
375x500) and saved as a baseline JPEG of quality 90 with 4:2:0 chroma subsampling (Pillow's defaults at
that quality), the size and quality of a typical ImageNet training image. Classes are the source photos
modulo --classes; the layout is torchvision's ImageFolder: DIR/train/<class>/<n>.jpg.
Needs numpy and Pillow; the photographs need scikit-image (pip install scikit-image). Without it, or with
--source synthetic, the sources are smooth random colour fields with fine noise instead (made from the
seed): JPEGs of about the same size and decoding cost, for the CPU-mode checks, not for figures.
"""
import argparse
import os
import random

import numpy as np
from PIL import Image, ImageEnhance

PHOTOS = ["astronaut", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry", "stereo_motorcycle", "retina",
          "rocket"]


def synthetic_sources(seed, count=9):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        coarse = rng.uniform(0, 255, size=(12, 16, 3)).astype(np.uint8)
        img = Image.fromarray(coarse).resize((1024, 768), Image.BICUBIC)
        a = np.asarray(img).astype(np.int16) + rng.integers(-12, 13, size=(768, 1024, 3))
        out.append(Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)))
    return out


def sources():
    import skimage.data
    out = []
    for name in PHOTOS:
        img = getattr(skimage.data, name)()
        if isinstance(img, tuple):  # stereo_motorcycle: (left, right, disparity)
            out += [np.asarray(img[0]), np.asarray(img[1])]
        else:
            out.append(np.asarray(img))
    return [Image.fromarray(a[..., :3].astype(np.uint8)).convert("RGB") for a in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", choices=["photos", "synthetic"], default="photos",
                    help="photos: scikit-image's sample photographs (synthetic where it is missing)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    if a.source == "photos":
        try:
            photos = sources()
        except ImportError:
            print("make_jpeg_folder: scikit-image is missing; using synthetic sources")
            a.source = "synthetic"
    if a.source == "synthetic":
        photos = synthetic_sources(a.seed)
    total = 0
    for n in range(a.count):
        k = rng.randrange(len(photos))
        src = photos[k]
        portrait = rng.random() < 0.25
        ratio = 3 / 4 if portrait else 4 / 3
        W, H = src.size
        area = W * H * rng.uniform(0.25, 1.0)
        w = min(W, int(round((area * ratio) ** 0.5)))
        h = min(H, int(round(w / ratio)))
        w = min(W, int(round(h * ratio)))
        x, y = rng.randint(0, W - w), rng.randint(0, H - h)
        img = src.crop((x, y, x + w, y + h))
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.8, 1.2))
        img = ImageEnhance.Color(img).enhance(rng.uniform(0.8, 1.2))
        img = img.resize((375, 500) if portrait else (500, 375), Image.LANCZOS)
        folder = os.path.join(a.out, "train", "class_%02d" % (k % a.classes))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "%05d.jpg" % n)
        img.save(path, quality=90)
        total += os.path.getsize(path)
    print("wrote %d JPEGs (%.1f MB, %.0f KB each on average) under %s/train" %
          (a.count, total / 1e6, total / a.count / 1e3, a.out))


if __name__ == "__main__":
    main()
