"""torchvision's automatic augmentations on uint8 tensors, for tests/test_augment.cpp.

  ops DIR        writes DIR/<image>.bin (uint8 (C, H, W) bytes) for a few images (1 and 3 channels, square and
                 not, low contrast so that AutoContrast and Equalize do something), and for every operation
                 and magnitude (negative ones too) DIR/<n>.bin, the image after
                 torchvision.transforms.autoaugment._apply_op(img, op, magnitude, NEAREST, fill=[0.0] * C),
                 the call RandAugment and TrivialAugmentWide make (fill=0 becomes that list). DIR/manifest.txt
                 has one line per case: "op magnitude(float.hex) image C H W n".
  tables H W     prints RandAugment()._augmentation_space(31, (H, W)) and TrivialAugmentWide()'s, one line
                 per op: "kind op signed v0 v1 ..." (float.hex of each float32 entry; "-" for the scalar 0)
  erase H W N    draws N times as RandomErasing(p=0.5) does (torch.rand(1) < p, then get_params with scale
                 (0.02, 0.33), ratio (0.3, 3.3), value [0]) on an H x W image and prints the mean height,
                 width, top and left of the boxes and the share of images left alone
  modules        exits 0 when torch and torchvision import, else prints the missing one
"""
import os
import sys


def images(torch):
    g = torch.Generator().manual_seed(0)

    def noise(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64)

    yy, xx = torch.meshgrid(torch.arange(23), torch.arange(37), indexing="ij")
    smooth = torch.stack([60 + 2 * xx + yy, 90 + 3 * yy, 170 - 2 * xx]) + noise(-4, 5, 3, 23, 37)
    gy, gx = torch.meshgrid(torch.arange(24), torch.arange(31), indexing="ij")
    gray = (40 + 3 * gx + 2 * gy + noise(-6, 7, 24, 31)).unsqueeze(0)
    out = {
        "g28": noise(20, 231, 1, 28, 28),
        "rgb32": torch.stack([noise(10, 240, 32, 32), noise(40, 200, 32, 32), noise(0, 256, 32, 32)]),
        "rgb23x37": smooth,
        "g24x31": gray,
    }
    return {k: v.clamp(0, 255).to(torch.uint8).contiguous() for k, v in out.items()}


MAGNITUDES = {
    "Identity": [0.0],
    "ShearX": [0.0, 0.03, -0.03, 0.15, -0.3, 0.3, 0.5, -0.99, 0.99],
    "ShearY": [0.0, 0.03, -0.03, 0.15, -0.3, 0.3, 0.5, -0.99, 0.99],
    "TranslateX": [0.0, 3.0, -3.0, 4.9, -14.5, 14.5, 13.6, 32.0, -32.0],
    "TranslateY": [0.0, 3.0, -3.0, 4.9, -14.5, 14.5, 13.6, 32.0, -32.0],
    "Rotate": [0.0, 1.0, -3.0, 15.5, 30.0, -30.0, 45.0, 90.0, -135.0, 135.0, 180.0],
    "Brightness": [-0.99, -0.9, -0.5, -0.09, 0.0, 0.09, 0.33, 0.9, 0.99],
    "Color": [-0.99, -0.9, -0.5, -0.09, 0.0, 0.09, 0.33, 0.9, 0.99],
    "Contrast": [-0.99, -0.9, -0.5, -0.09, 0.0, 0.09, 0.33, 0.9, 0.99],
    "Sharpness": [-0.99, -0.9, -0.5, -0.09, 0.0, 0.09, 0.33, 0.9, 0.99],
    "Posterize": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
    "Solarize": [0.0, 8.5, 100.0, 127.5, 128.0, 200.0, 246.5, 255.0],
    "AutoContrast": [0.0],
    "Equalize": [0.0],
}


def write_ops(out_dir):
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.autoaugment import _apply_op

    os.makedirs(out_dir, exist_ok=True)
    lines = []
    n = 0
    for name, img in images(torch).items():
        with open(os.path.join(out_dir, name + ".bin"), "wb") as f:
            f.write(img.numpy().tobytes())
        c, h, w = img.shape
        for op, mags in MAGNITUDES.items():
            for m in mags:
                m = torch.tensor(m, dtype=torch.float32).item()  # a float32 value, as the tables hold
                y = _apply_op(img.clone(), op, m, interpolation=InterpolationMode.NEAREST, fill=[0.0] * c)
                with open(os.path.join(out_dir, f"{n}.bin"), "wb") as f:
                    f.write(y.contiguous().numpy().tobytes())
                lines.append(f"{op} {float(m).hex()} {name} {c} {h} {w} {n}")
                n += 1
    with open(os.path.join(out_dir, "manifest.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"cases {n}")


def print_tables(h, w):
    from torchvision.transforms import RandAugment, TrivialAugmentWide

    for kind, space in (("RandAugment", RandAugment()._augmentation_space(31, (h, w))),
                        ("TrivialAugmentWide", TrivialAugmentWide()._augmentation_space(31))):
        for op, (mags, signed) in space.items():
            values = [float(v).hex() for v in mags.tolist()] if mags.ndim > 0 else ["-"]
            print(kind, op, int(signed), *values)


def erase_stats(h, w, n):
    import torch
    from torchvision.transforms import RandomErasing

    torch.manual_seed(0)
    img = torch.zeros(3, h, w)
    sums, boxes, untouched = [0, 0, 0, 0], 0, 0
    for _ in range(n):
        if not torch.rand(1) < 0.5:
            untouched += 1
            continue
        i, j, bh, bw, _ = RandomErasing.get_params(img, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=[0])
        if bh == h and bw == w:  # no try accepted: the image is returned as it is
            untouched += 1
            continue
        for k, v in enumerate((bh, bw, i, j)):
            sums[k] += v
        boxes += 1
    print(*[v / boxes for v in sums], untouched / n)


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "modules":
        for m in ("torch", "torchvision"):
            try:
                __import__(m)
            except ImportError:
                print(m)
                return 1
        return 0
    if cmd == "ops" and len(sys.argv) == 3:
        write_ops(sys.argv[2])
        return 0
    if cmd == "erase" and len(sys.argv) == 5:
        erase_stats(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    if cmd == "tables" and len(sys.argv) == 4:
        print_tables(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
