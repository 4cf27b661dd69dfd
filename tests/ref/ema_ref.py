"""timm's ModelEmaV3 on a sequence of weights the test wrote (tests/test_ema.cpp).

  timm DIR DECAY WARMUP STEPS   a small Conv2d + BatchNorm2d + Linear model (the test's, by name) loaded with
                                DIR/w0.pt; ModelEmaV3(model, decay=DECAY, use_warmup=WARMUP (0 or 1)), the
                                rest of its arguments at their defaults (buffers averaged, foreach lerp);
                                then for s = 1..STEPS: model.load_state_dict(DIR/w<s>.pt) and
                                ema.update(model, step=s). Writes ema.module's state dict to DIR/ema.pt
  modules                       exits 0 when timm imports, else prints "timm" (the 1.13 leg has no timm)
"""
import sys

import torch
from torch import nn


class Small(nn.Module):
    """tests/test_ema.cpp's Small: the same names, in the same order."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3, 4)


def run_timm(folder, decay, warmup, steps):
    from timm.utils.model_ema import ModelEmaV3

    model = Small()
    model.load_state_dict(torch.load(folder + "/w0.pt"))
    ema = ModelEmaV3(model, decay=float(decay), use_warmup=warmup == "1")
    for s in range(1, int(steps) + 1):
        model.load_state_dict(torch.load(folder + "/w%d.pt" % s))
        ema.update(model, step=s)
    torch.save(ema.module.state_dict(), folder + "/ema.pt")


def modules():
    try:
        import timm  # noqa: F401
    except ImportError:
        print("timm")
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        modules()
    elif sys.argv[1] == "timm":
        run_timm(*sys.argv[2:6])
    else:
        sys.exit("unknown command " + sys.argv[1])
