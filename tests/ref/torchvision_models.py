#!/usr/bin/python3
"""Reference facts about torchvision's ResNets, for tests/test_models.cpp.

Two modes (run with /usr/bin/python3, which has Debian's torch and torchvision):

  torchvision_models.py --json OUT.json [--models resnet18,...] [--sizes 45x37,resnet50:224x224]
      Writes {model: {"state": {key: shape}, "num_parameters": n,
                      "macs": {"HxW": conv+linear multiply-adds per sample}}}.
      --sizes lists input sizes: "HxW" for every model, "MODEL:HxW" for that model only.
      MACs are counted by forward hooks on every Conv2d (output elements x in_channels/groups x kh x kw)
      and Linear (out_features x in_features per sample); biases, BatchNorm, ReLU and pooling are not
      counted, which is the convention of models::ModelImpl::forward_flops (FLOPs = 2 x MACs).

  torchvision_models.py --weights OUT_DIR [--models resnet18,resnet50]
      For each model, with a fixed seed: random weights (BatchNorm affine parameters randomized and
      running statistics updated by two training-mode forwards, so eval-mode BatchNorm is not the
      identity), an input x of shape (2, 3, 64, 64) and the eval-mode output y. Writes
      OUT_DIR/MODEL.pt = torch.save({"x": x, "y": y, "state": {key: tensor}}), a plain dict of tensors
      that C++ reads with torch::pickle_load.

  torchvision_models.py --eval-reference IN.pt OUT_DIR [--models resnet18]
      IN.pt = {"images": uint8 (N, 3, H, W), "labels": int64 (N), "mean": (3), "std": (3)} (written by
      tests/test_eval.cpp). For each model: random weights as --weights makes them, with 10 classes;
      writes OUT_DIR/MODEL_weights.pt = torch.save(model.state_dict()), what model.init_from reads, and
      OUT_DIR/MODEL_eval.pt = {"logits": eval-mode logits (N, 10) of (images / 255 - mean) / std,
      "loss": mean cross-entropy, "top1", "top5": accuracies}, torchvision's own evaluation.
"""
import argparse
import json
import os

import torch
import torchvision


def count_macs(model, size):
    """Conv2d and Linear multiply-adds for one sample of shape (3, H, W)."""
    macs = [0]

    def conv_hook(m, inputs, out):
        kh, kw = m.kernel_size
        per_output = (m.in_channels // m.groups) * kh * kw
        macs[0] += (out.numel() // out.shape[0]) * per_output

    def linear_hook(m, inputs, out):
        macs[0] += (out.numel() // out.shape[0]) * m.in_features

    handles = []
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, size[0], size[1]))
    for h in handles:
        h.remove()
    return macs[0]


def parse_sizes(spec, name):
    """The (H, W) sizes of `spec` that apply to model `name`: "HxW" applies to all, "MODEL:HxW" to one."""
    sizes = []
    for item in spec.split(","):
        model, _, size = item.rpartition(":")
        if model in ("", name):
            sizes.append(tuple(int(v) for v in size.split("x")))
    return sizes


def describe(name, sizes):
    model = getattr(torchvision.models, name)(weights=None)
    return {
        "state": {k: list(v.shape) for k, v in model.state_dict().items()},
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "macs": {"%dx%d" % s: count_macs(model, s) for s in sizes},
    }


def random_model(name, **kwargs):
    """torchvision's `name` with random weights, BatchNorm randomized so that eval mode is not the identity."""
    torch.manual_seed(1234)
    model = getattr(torchvision.models, name)(weights=None, **kwargs)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
        model.train()
        for _ in range(2):
            model(torch.randn(4, 3, 64, 64))
        model.eval()
    return model


def write_weights(name, out_dir):
    model = random_model(name)
    with torch.no_grad():
        x = torch.randn(2, 3, 64, 64)
        y = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"x": x, "y": y, "state": state}, os.path.join(out_dir, name + ".pt"))


def write_eval_reference(name, in_path, out_dir):
    data = torch.load(in_path)
    model = random_model(name, num_classes=10)
    torch.save(model.state_dict(), os.path.join(out_dir, name + "_weights.pt"))
    x = (data["images"].float() / 255.0 - data["mean"].view(1, 3, 1, 1)) / data["std"].view(1, 3, 1, 1)
    y = data["labels"]
    with torch.no_grad():
        logits = model(x)
    top5 = logits.topk(5, dim=1).indices
    torch.save({"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, y),
                "top1": (top5[:, 0] == y).double().mean(), "top5": (top5 == y[:, None]).any(1).double().mean()},
               os.path.join(out_dir, name + "_eval.pt"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write names, shapes, counts and MACs here")
    ap.add_argument("--weights", help="write MODEL.pt files (weights, input, eval output) into this folder")
    ap.add_argument("--eval-reference", nargs=2, metavar=("IN_PT", "OUT_DIR"),
                    help="torchvision's evaluation of the images in IN_PT, and the weights, into OUT_DIR")
    ap.add_argument("--models", default="resnet18,resnet34,resnet50,resnet101,resnet152")
    ap.add_argument("--sizes", default="45x37,resnet50:224x224",
                    help="input sizes for the MAC counts: HxW for every model, MODEL:HxW for one")
    args = ap.parse_args()
    torch.set_num_threads(2)
    names = args.models.split(",")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: describe(n, parse_sizes(args.sizes, n)) for n in names}, f, indent=1)
    if args.weights:
        for n in names:
            write_weights(n, args.weights)
    if args.eval_reference:
        for n in names:
            write_eval_reference(n, *args.eval_reference)


if __name__ == "__main__":
    main()
