"""torchvision resnet18 <-> the trainer, through state dict files (issue 5, weights in and out).

  write DIR : torch.save(model.state_dict(), DIR/tv.pt) (an OrderedDict, as users save them) with random
              BatchNorm statistics, and DIR/io.pt = {"x": input, "y": eval-mode output}
  check DIR : load DIR/exported.pt (written by the trainer) into torchvision's resnet18 with
              weights_only=True and strict=True; print the max |difference| of its eval-mode output on
              DIR/io.pt's input from DIR/io.pt's "y2" (the trainer's own output)
"""
import sys

import torch
import torchvision


def write(d):
    torch.manual_seed(0)
    m = torchvision.models.resnet18(num_classes=10)
    with torch.no_grad():  # BatchNorm in eval mode must not be the identity
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
                mod.running_mean.uniform_(-0.1, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    m.eval()
    x = torch.randn(2, 3, 64, 64)
    torch.save(m.state_dict(), f"{d}/tv.pt")
    torch.save({"x": x, "y": m(x).detach()}, f"{d}/io.pt")


def check(d):
    m = torchvision.models.resnet18(num_classes=10)
    sd = torch.load(f"{d}/exported.pt", weights_only=True) if "weights_only" in torch.load.__code__.co_varnames \
        else torch.load(f"{d}/exported.pt")
    m.load_state_dict(sd, strict=True)
    m.eval()
    io = torch.load(f"{d}/io2.pt")
    print(f"maxdiff {(m(io['x']) - io['y2']).abs().max().item():.3e}")


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](sys.argv[2])
