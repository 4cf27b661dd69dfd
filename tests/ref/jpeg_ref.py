"""torchvision/Pillow references for tests/test_jpeg.cpp and tests/test_transforms.cpp.

  jpeg_ref.py eval DIR SIZE          for each DIR/*.jpg: torchvision Resize(round(SIZE / 0.875)) +
                                     CenterCrop(SIZE) of the PIL-decoded RGB image -> DIR/<name>.ref.rgb
  jpeg_ref.py resize PNG OUT W H X0 Y0 X1 Y1
                                     Pillow's Image.resize((W, H), BILINEAR, box=(X0, Y0, X1, Y1)) -> OUT (raw RGB)
  jpeg_ref.py rrc N SEED W,H ...     per image size, N boxes of RandomResizedCrop.get_params (default scale
                                     and ratio) for a W x H image: lines "i j h w"
  jpeg_ref.py evalbox SIZE W,H ...   per image size: torchvision's Resize(round(SIZE / 0.875)) output size and
                                     CenterCrop(SIZE)'s offsets in it: lines "new_w new_h top left"
"""
import glob
import os
import sys

from PIL import Image

# torch and torchvision are imported only by the commands that need them (seconds of start-up).


def main():
    cmd = sys.argv[1]
    if cmd != "resize":
        global torch, T, F
        import torch
        import torchvision.transforms as T
        import torchvision.transforms.functional as F
    if cmd == "eval":
        folder, size = sys.argv[2], int(sys.argv[3])
        tf = T.Compose([T.Resize(round(size / 0.875)), T.CenterCrop(size)])
        for path in sorted(glob.glob(os.path.join(folder, "*.jpg"))):
            img = tf(Image.open(path).convert("RGB"))
            with open(path[:-4] + ".ref.rgb", "wb") as f:
                f.write(img.tobytes())
    elif cmd == "resize":
        src, out = sys.argv[2], sys.argv[3]
        w, h = int(sys.argv[4]), int(sys.argv[5])
        box = tuple(float(v) for v in sys.argv[6:10])
        img = Image.open(src).convert("RGB").resize((w, h), Image.BILINEAR, box=box)
        with open(out, "wb") as f:
            f.write(img.tobytes())
    elif cmd == "rrc":
        n, seed = int(sys.argv[2]), int(sys.argv[3])
        torch.manual_seed(seed)
        lines = []
        for wh in sys.argv[4:]:
            w, h = (int(v) for v in wh.split(","))
            img = torch.empty(1, h, w)
            for _ in range(n):
                i, j, hh, ww = T.RandomResizedCrop.get_params(img, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0))
                lines.append("%d %d %d %d" % (i, j, hh, ww))
        print("\n".join(lines))
    elif cmd == "evalbox":
        size = int(sys.argv[2])
        for wh in sys.argv[3:]:
            w, h = (int(v) for v in wh.split(","))
            resized = T.Resize(round(size / 0.875))(Image.new("L", (w, h)))
            nw, nh = resized.size
            # The crop's offsets, read from a tensor whose values are their own coordinates.
            coords = torch.arange(nw * nh, dtype=torch.float64).reshape(1, nh, nw)
            first = int(F.center_crop(coords, [size, size])[0, 0, 0])
            print(nw, nh, first // nw, first % nw)
    else:
        sys.exit("jpeg_ref.py: unknown command " + cmd)


if __name__ == "__main__":
    main()
