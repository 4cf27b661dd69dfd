"""Mixup and CutMix against timm's own Mixup (tests/test_mix.cpp).

  mix DIR SMOOTHING CLASSES
        For each line "K MODE" of DIR/cases.txt: DIR/inK.safetensors (written by the test) holds x (B, C, H, W) float32 images, target (B) int64 class ids, and
        the trainer's draw for them: drawn (B) float64 (the Beta variate, 1 where not mixed), cutmix (B) uint8,
        cy, cx (B) int64 (CutMix's box centres). timm.data.Mixup(mode=MODE, label_smoothing=SMOOTHING,
        num_classes=CLASSES, correct_lam=True) is called on (x, target) with its random draws replaced by the
        trainer's: _params_per_batch / _params_per_elem return the drawn lam and the CutMix flags, and
        np.random.randint the box centres in timm's order. Out: x (mixed by timm), target (its
        soft targets), written to DIR/outK.safetensors. One process for every case: timm imports slowly.
  modules  exits 0 when numpy, safetensors and timm import, else prints the first missing one
"""
import sys


def modules():
    for name in ("numpy", "safetensors", "timm"):
        try:
            __import__(name)
        except ImportError:
            print(name)
            return 1
    return 0


def mix_all(folder, smoothing, classes):
    with open(folder + "/cases.txt") as f:
        for line in f:
            k, mode = line.split()
            mix(f"{folder}/in{k}.safetensors", f"{folder}/out{k}.safetensors", mode, smoothing, classes)
    return 0


def mix(src, out, mode, smoothing, classes):
    import numpy as np
    from safetensors.torch import load_file, save_file
    from timm.data.mixup import Mixup

    d = load_file(src)
    drawn = d["drawn"].numpy()
    cutmix = d["cutmix"].numpy().astype(bool)
    cy, cx = d["cy"].numpy(), d["cx"].numpy()
    m = Mixup(mixup_alpha=1.0, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode=mode, correct_lam=True,
              label_smoothing=smoothing, num_classes=classes)
    rows = [0] if mode == "batch" else range(len(drawn))
    centres = []
    for k in rows:
        if cutmix[k] and drawn[k] != 1.0:
            centres += [int(cy[k]), int(cx[k])]
    it = iter(centres)
    randint = np.random.randint
    np.random.randint = lambda lo, hi=None, size=None: next(it)
    if mode == "batch":
        m._params_per_batch = lambda: (float(drawn[0]), bool(cutmix[0]))
    else:
        m._params_per_elem = lambda batch_size: (drawn.astype(np.float32), cutmix)
    x = d["x"].clone()
    x, target = m(x, d["target"])
    np.random.randint = randint
    assert next(it, None) is None, "timm used fewer box centres than the trainer drew"
    save_file({"x": x.contiguous(), "target": target.contiguous()}, out)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        sys.exit(modules())
    if sys.argv[1] == "mix":
        sys.exit(mix_all(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
    sys.exit("unknown command " + sys.argv[1])
