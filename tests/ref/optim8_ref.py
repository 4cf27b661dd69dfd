"""torchao's 8-bit optimizer state, as the reference of tests/test_optim_state.cpp (raw float32 and uint8 files,
little-endian). The 2.11 leg's environment has torchao (scripts/install-torch.sh); the 1.13 leg's has not.

  maps DIR       writes DIR/signed.bin and DIR/unsigned.bin: the 256 float32 entries of torchao's dynamic
                 maps (torchao.optim.subclass_8bit's qmaps)
  quantize DIR   reads DIR/x.bin (float32, whole blocks of 256) and DIR/spec.json {"signed": bool}; writes
                 DIR/codes.bin (uint8) and DIR/scale.bin (float32) as OptimState8bit.copy_ stores them
  adamw DIR      reads DIR/spec.json {"shapes", "decay", "steps", "lr": [per step], "weight_decay",
                 "betas", "eps", "state": "int8" | "bfloat16", "compile": bool}, DIR/init.bin and
                 DIR/grads.bin (per step, every tensor); runs torchao's AdamW8bit (state int8), or its
                 single_param_adam on bfloat16 moments (state bfloat16: what torchao's _AdamW runs on
                 bfloat16 parameters); the tensors without decay in a group of their own with weight decay 0.
                 compile false replaces torch.compile by the eager function. With "param_dtype": "bfloat16"
                 the parameters and gradients are bfloat16 (rounded to nearest from the files), and
                 "stochastic": true rounds the updated ones stochastically (bf16_stochastic_round).
                 "small_state": "float32" keeps the moments of tensors torchao does not quantize (under 4,096
                 values) in float32 whatever the parameters' dtype (bitsandbytes' rule, and the trainer's);
                 torchao's own is zeros_like(p), bfloat16 moments for bfloat16 parameters.
                 Writes DIR/out.bin (the parameters after the last step, as float32).
  modules        exits 0 when torchao imports, else prints "torchao"
"""
import json
import os
import sys

import torch


def read(path, dtype):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype)


def write(path, t):
    with open(path, "wb") as f:
        f.write(t.contiguous().numpy().tobytes())


def maps(d):
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    write(os.path.join(d, "signed.bin"), torch.tensor(get_qmap_signed(), dtype=torch.float32))
    write(os.path.join(d, "unsigned.bin"), torch.tensor(get_qmap_unsigned(), dtype=torch.float32))
    print("ok")


def quantize(d):
    from torchao.optim.subclass_8bit import OptimState8bit

    with open(os.path.join(d, "spec.json")) as f:
        spec = json.load(f)
    x = read(os.path.join(d, "x.bin"), torch.float32)
    state = OptimState8bit.zeros(x.shape, signed=spec["signed"], block_size=256)
    state.copy_(x)
    write(os.path.join(d, "codes.bin"), state.codes)
    write(os.path.join(d, "scale.bin"), state.scale)
    print("ok")


def params_of(spec, init):
    shapes = [tuple(s) for s in spec["shapes"]]
    params, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        params.append(torch.nn.Parameter(init[offset:offset + n].clone().reshape(shape)))
        offset += n
    return params


def set_grads(params, grads, step):
    total = sum(p.numel() for p in params)
    offset = step * total
    for p in params:
        p.grad = grads[offset:offset + p.numel()].clone().reshape(p.shape)
        offset += p.numel()


def adamw_int8(spec, params):
    from torchao.optim import AdamW8bit

    if spec.get("small_state") == "float32":
        quantized = AdamW8bit._new_buffer

        def new_buffer(self, p, signed):
            if p.numel() >= 4096 and p.numel() % self.block_size == 0:
                return quantized(self, p, signed)
            return torch.zeros_like(p, dtype=torch.float32)

        AdamW8bit._new_buffer = new_buffer

    groups = [{"params": [p for p, d in zip(params, spec["decay"]) if d], "weight_decay": spec["weight_decay"]},
              {"params": [p for p, d in zip(params, spec["decay"]) if not d], "weight_decay": 0.0}]
    return AdamW8bit([g for g in groups if g["params"]], lr=spec["lr"][0], betas=tuple(spec["betas"]),
                     eps=spec["eps"], bf16_stochastic_round=spec.get("stochastic", False))


def adamw_bf16_steps(spec, params, grads):
    from torchao.optim.adam import single_param_adam

    stochastic = spec.get("stochastic", False)
    m = [torch.zeros_like(p, dtype=torch.bfloat16) for p in params]
    v = [torch.zeros_like(p, dtype=torch.bfloat16) for p in params]
    for step in range(spec["steps"]):
        set_grads(params, grads, step)
        lr = torch.tensor(spec["lr"][step], dtype=torch.float32)
        count = torch.tensor(float(step + 1))
        with torch.no_grad():
            for p, d, mi, vi in zip(params, spec["decay"], m, v):
                wd = spec["weight_decay"] if d else 0.0
                single_param_adam(p.detach(), p.grad, count, mi, vi, None, lr, spec["betas"][0], spec["betas"][1], wd,
                                  spec["eps"], True, stochastic)


def ieee_sqrt(t):
    """Tensor.sqrt correctly rounded, as IEEE 754 (and the trainer's std::sqrt) has it: LibTorch's CPU sqrt
    runs through MKL's vector math, whose last bit depends on the CPU (56 of 8,192 random values differ
    from IEEE's on one x86 machine, 1,285 on another)."""
    import numpy as np
    return torch.from_numpy(np.asarray(np.sqrt(t.detach().numpy()))).to(t.dtype)


def adamw(d):
    with open(os.path.join(d, "spec.json")) as f:
        spec = json.load(f)
    if not spec["compile"]:
        torch.compile = lambda fn, **kwargs: fn
        torch.Tensor.sqrt = ieee_sqrt  # eager: the reference's arithmetic, not its CPU's vector library
    init, grads = read(os.path.join(d, "init.bin"), torch.float32), read(os.path.join(d, "grads.bin"), torch.float32)
    params = params_of(spec, init)
    if spec.get("param_dtype", "float32") == "bfloat16":  # the weights and gradients rounded to nearest
        params = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
        grads = grads.bfloat16()
    if spec["state"] == "bfloat16":
        adamw_bf16_steps(spec, params, grads)
    else:
        opt = adamw_int8(spec, params)
        for step in range(spec["steps"]):
            set_grads(params, grads, step)
            for g in opt.param_groups:
                g["lr"].fill_(spec["lr"][step])
            opt.step()
    write(os.path.join(d, "out.bin"), torch.cat([p.detach().float().reshape(-1) for p in params]))
    print("ok")


def modules():
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        print("torchao")
        sys.exit(1)


if __name__ == "__main__":
    commands = {"maps": maps, "quantize": quantize, "adamw": adamw}
    if sys.argv[1:] == ["modules"]:
        modules()
    elif len(sys.argv) == 3 and sys.argv[1] in commands:
        commands[sys.argv[1]](sys.argv[2])
    else:
        sys.exit(__doc__)
