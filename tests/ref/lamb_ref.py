"""timm's Lamb on parameters and gradients written by tests/test_lamb.cpp (raw float32, little-endian).

  run DIR      reads DIR/spec.json:
                 {"shapes": [[4, 3], ...], "decay": [true, false, ...], "steps": 10, "lr": [per step],
                  "weight_decay": W, "betas": [B1, B2], "eps": E, "max_grad_norm": M (0 = None),
                  "trust_clip": bool, "always_adapt": bool, "no_grad": [[tensor, step], ...]}
               DIR/init.bin (every tensor, in order, flattened) and DIR/grads.bin (per step, every tensor);
               a tensor listed in no_grad for a step has no gradient then (its bytes in grads.bin unused).
               The param groups as timm's param_groups_weight_decay makes them: the tensors without
               decay (0), then the decaying ones (W); one group when W is 0. Runs the steps with timm.optim.Lamb(foreach=True) and again with
               foreach=False; writes DIR/foreach.bin and DIR/single.bin (the parameters after the last step).
  modules      exits 0 when timm imports, else prints "timm" (the 1.13 leg has no timm)
"""
import json
import os
import sys

import torch


def read_floats(path):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.float32)


def run_timm(spec, init, grads, foreach):
    from timm.optim import Lamb

    shapes = [tuple(s) for s in spec["shapes"]]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    params, offset = [], 0
    for shape, n in zip(shapes, sizes):
        params.append(torch.nn.Parameter(init[offset:offset + n].clone().reshape(shape)))
        offset += n
    decay = [p for p, d in zip(params, spec["decay"]) if d]
    no_decay = [p for p, d in zip(params, spec["decay"]) if not d]
    # As timm's param_groups_weight_decay: the tensors without decay first; one group without weight decay.
    groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": spec["weight_decay"]}]
    if not spec["weight_decay"]:
        groups = [{"params": params, "weight_decay": 0.0}]
    mgn = spec["max_grad_norm"]
    opt = Lamb(groups, lr=spec["lr"][0], betas=tuple(spec["betas"]), eps=spec["eps"],
               max_grad_norm=mgn if mgn > 0 else None, trust_clip=spec["trust_clip"],
               always_adapt=spec["always_adapt"], foreach=foreach)
    no_grad = {(t, s) for t, s in spec["no_grad"]}
    total = sum(sizes)
    for step in range(spec["steps"]):
        offset = step * total
        for i, (p, n) in enumerate(zip(params, sizes)):
            p.grad = None if (i, step) in no_grad else grads[offset:offset + n].clone().reshape(p.shape)
            offset += n
        for g in opt.param_groups:
            g["lr"] = spec["lr"][step]
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def run(d):
    with open(os.path.join(d, "spec.json")) as f:
        spec = json.load(f)
    init, grads = read_floats(os.path.join(d, "init.bin")), read_floats(os.path.join(d, "grads.bin"))
    for name, foreach in (("foreach.bin", True), ("single.bin", False)):
        out = run_timm(spec, init, grads, foreach)
        with open(os.path.join(d, name), "wb") as f:
            f.write(out.numpy().astype("<f4").tobytes())
    print("ok")


def modules():
    try:
        import timm.optim  # noqa: F401
    except ImportError:
        print("timm")
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1:] == ["modules"]:
        modules()
    elif len(sys.argv) == 3 and sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(__doc__)
