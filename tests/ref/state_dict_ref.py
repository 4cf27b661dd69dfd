"""Python side of the StateDict* tests (tests/test_checkpoint.cpp): PyTorch reads what the C++ trainer
writes, and writes what it reads.

  state_dict_ref.py check FILE  torch.load FILE (written by trainer::save_state_dict) with weights_only=True,
                                load it strictly into Net, print every tensor and Net's eval output on the
                                fixed input.
  state_dict_ref.py dump FILE   torch.load FILE with weights_only=True and print every tensor.
  state_dict_ref.py write DIR   torch.save several files into DIR (see write()) and print the reference
                                tensors and output of the state dict in DIR/net.pt.

Printed lines: "T <name> <dtype> <shape, comma-separated, or - for 0-dim> <values>" with float values as
float.hex() (so C++ can compare bit for bit), and "OUT <values>" for the (2, 5) output.
"""
import collections
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """Mirror of the C++ test's TinyNet: the reference names of a torchvision ResNet stem."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 1))
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def fixed_input():
    # Same as the C++ test: arange(216) / 100 - 1, shape (2, 3, 6, 6).
    return torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).reshape(2, 3, 6, 6) / 100 - 1


def values(t):
    flat = t.detach().reshape(-1)
    if t.dtype.is_floating_point:
        return " ".join(float(v).hex() for v in flat.double().tolist())
    return " ".join(str(int(v)) for v in flat.tolist())


def dump(sd, model):
    for k, v in sd.items():
        shape = ",".join(str(s) for s in v.shape) or "-"  # "-" for a 0-dim tensor
        print("T", k, str(v.dtype).replace("torch.", ""), shape, values(v))
    model.eval()
    with torch.no_grad():
        print("OUT", values(model(fixed_input())))


def check(path):
    # weights_only=True is the default from PyTorch 2.6 on: the file must use only allowed globals.
    sd = torch.load(path, weights_only=True)
    assert isinstance(sd, collections.OrderedDict), type(sd)  # like model.state_dict()
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in sd.values())
    model = Net()
    model.load_state_dict(sd, strict=True)  # names and shapes must be PyTorch's
    dump(sd, model)


def dump_file(path):
    sd = torch.load(path, weights_only=True)
    assert isinstance(sd, collections.OrderedDict), type(sd)
    for k, v in sd.items():
        shape = ",".join(str(s) for s in v.shape) or "-"
        print("T", k, str(v.dtype).replace("torch.", ""), shape, values(v))


def write(out):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # no parameter at its default (BatchNorm's ones and zeros)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.train()
    for i in range(3):  # move the BatchNorm running statistics away from their defaults
        model(torch.randn(4, 3, 6, 6))
    sd = model.state_dict()  # an OrderedDict with _metadata, as everyone saves it
    torch.save(sd, os.path.join(out, "net.pt"))
    torch.save({k: v.double() for k, v in sd.items()}, os.path.join(out, "net_double.pt"))
    torch.save(dict(model.named_parameters()), os.path.join(out, "params_only.pt"))  # nn.Parameter values
    torch.save([v for v in sd.values()], os.path.join(out, "list.pt"))
    torch.save({"epoch": 3, "model": sd}, os.path.join(out, "training_ckpt.pt"))
    torch.save(sd, os.path.join(out, "legacy.pt"), _use_new_zipfile_serialization=False)
    dump(sd, model)


if __name__ == "__main__":
    {"check": check, "dump": dump_file, "write": write}[sys.argv[1]](sys.argv[2])
