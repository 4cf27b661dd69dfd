"""Weights in and out through safetensors, against the libraries themselves (tests/test_safetensors.cpp).

Each model is made small and random by its own library, saved by that library, and its eval-mode outputs on
a fixed input saved beside it; the trainer loads the file and must give the same outputs. The way back: the
trainer's export is loaded by the library with no code of ours and run on the trainer's input.

  gpt-write DIR    transformers GPT2LMHeadModel (vocab 64, context 16, 2 layers, 4 heads, 32 wide), random
                   weights (LayerNorms and biases too):
                     DIR/hf/           save_pretrained: model.safetensors (fp32) + config.json
                     DIR/hf_bf16/      the same model in bfloat16, save_pretrained
                     DIR/hub.safetensors  the Hub's openai-community/gpt2 layout: GPT2Model names (no
                                       "transformer."), h.N.attn.bias / attn.masked_bias buffers, and a tied
                                       lm_head.weight, written with safetensors.torch.save_file
                     DIR/io.safetensors   x (2, 12) int64 tokens; logits (fp32 model); logits_bf16 (the bf16
                                       model computing in bf16); logits_bf16_weights (the bf16 weights in fp32)
  gpt-check DIR    GPT2LMHeadModel.from_pretrained(DIR/hf) (the trainer's export: model.safetensors +
                   config.json); prints "loading missing=[...] unexpected=[...] mismatched=[...]" and
                   "maxdiff D" against DIR/ours.safetensors's y (logits) on its x
  resnet-write DIR timm resnet18 (10 classes) with random BatchNorm statistics:
                     DIR/timm/         timm's save_for_hf: model.safetensors + config.json
                     DIR/tv.safetensors   torchvision resnet18 (the same weights), without num_batches_tracked
                                       (as torchvision's published weights)
                     DIR/io.safetensors   x (2, 3, 64, 64), y (eval-mode logits)
  vit-write DIR    timm VisionTransformer in this project's ViT structure (32x32 RGB, patch 8, 2 blocks, 2
                   heads, 32 wide, 5 classes, tanh GELU, LayerNorm eps 1e-5):
                     DIR/timm.safetensors (its state dict), DIR/io.safetensors (x, y); also
                     DIR/timm_default.safetensors and y_default: the same weights in timm's own numerics
                     (exact GELU, eps 1e-6), the documented difference
  check-line DIR LINE  evaluates LINE, the Python that `trainer export` printed to load its file (with
                   torch, functools, safetensors, transformers and timm imported), runs the model in eval mode
                   on DIR/ours.safetensors's x and prints "maxdiff D" against its y (logits for a GPT)
  dtypes-write DIR DIR/dtypes.safetensors: one tensor of every dtype the trainer reads, written by
                   safetensors.torch.save_file, and DIR/dtypes.pt with the same tensors (torch.save)
  dtypes-check DIR loads DIR/ours_dtypes.safetensors (written by the trainer) and prints "same" when every
                   tensor equals DIR/dtypes.pt's, bit for bit, with the same dtype and shape
  modules          exits 0 when safetensors, transformers and timm import, else prints the first missing one
"""
import functools
import sys

import torch


def randomize(model, scale=0.05):
    """Every parameter and float buffer random: a default 1/0 LayerNorm or a zero bias would hide a mix-up.
    scale=None keeps the library's own initialization of the matrices and convolutions (a ResNet's
    activations would grow with depth under a fixed scale)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and ("ln" in name or "norm" in name or "bn" in name):
                p.uniform_(0.5, 1.5)
            elif p.dim() <= 1:
                p.normal_(0.0, 0.1)
            elif scale is not None:
                p.normal_(0.0, scale)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.uniform_(-0.1, 0.1)
            elif name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
    return model.eval()


def save(path, tensors):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def load(path):
    from safetensors.torch import load_file
    return load_file(path)


# ---- GPT-2 -----------------------------------------------------------------------------------------------

def gpt_config():
    from transformers import GPT2Config
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=None,
                      eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt_write(d):
    from transformers import GPT2LMHeadModel
    model = randomize(GPT2LMHeadModel(gpt_config()))
    model.save_pretrained(f"{d}/hf")
    torch.manual_seed(1)
    x = torch.randint(64, (2, 12))
    with torch.no_grad():
        logits = model(x).logits
    # The Hub's GPT-2 file: GPT2Model's names, the causal-mask buffers, the tied head written out too.
    hub = {k[len("transformer."):]: v.clone() for k, v in model.state_dict().items() if k.startswith("transformer.")}
    for i in range(2):
        hub[f"h.{i}.attn.bias"] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
        hub[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    hub["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save(f"{d}/hub.safetensors", hub)
    bf16 = GPT2LMHeadModel(gpt_config())
    bf16.load_state_dict(model.state_dict())
    bf16 = bf16.to(torch.bfloat16).eval()
    bf16.save_pretrained(f"{d}/hf_bf16")
    with torch.no_grad():
        logits_bf16 = bf16(x).logits.float()
        logits_bf16_weights = bf16.float()(x).logits
    save(f"{d}/io.safetensors", {"x": x, "logits": logits, "logits_bf16": logits_bf16,
                                 "logits_bf16_weights": logits_bf16_weights})


def gpt_check(d):
    from transformers import GPT2LMHeadModel
    model, info = GPT2LMHeadModel.from_pretrained(f"{d}/hf", output_loading_info=True)
    model.eval()
    print(f"loading missing={sorted(info['missing_keys'])} unexpected={sorted(info['unexpected_keys'])} "
          f"mismatched={sorted(str(m) for m in info['mismatched_keys'])}")
    ours = load(f"{d}/ours.safetensors")
    with torch.no_grad():
        logits = model(ours["x"]).logits
    print(f"maxdiff {(logits - ours['y']).abs().max().item():.3e}")


# ---- ResNet ----------------------------------------------------------------------------------------------

def resnet_write(d):
    import timm
    import torchvision
    from timm.models import save_for_hf
    model = randomize(timm.create_model("resnet18", num_classes=10), scale=None)
    save_for_hf(model, f"{d}/timm", safe_serialization=True)
    tv = torchvision.models.resnet18(num_classes=10)
    tv.load_state_dict(model.state_dict())
    save(f"{d}/tv.safetensors", {k: v for k, v in tv.state_dict().items() if not k.endswith("num_batches_tracked")})
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        save(f"{d}/io.safetensors", {"x": x, "y": model(x)})


# ---- ViT -------------------------------------------------------------------------------------------------

def vit(ours_numerics=True, **kwargs):
    import timm
    extra = dict(act_layer="gelu_tanh", norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-5)) if ours_numerics else {}
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, in_chans=3, embed_dim=32, depth=2,
                             num_heads=2, num_classes=5, **extra, **kwargs)


def vit_write(d):
    model = randomize(vit())
    # timm's save_for_hf cannot record a LayerNorm eps in its config.json; the weights are timm's state dict.
    save(f"{d}/timm.safetensors", model.state_dict())
    default = vit(ours_numerics=False)
    default.load_state_dict(model.state_dict())
    default.eval()
    save(f"{d}/timm_default.safetensors", default.state_dict())
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        save(f"{d}/io.safetensors", {"x": x, "y": model(x), "y_default": default(x)})


def check_line(d, line):
    import timm  # noqa: F401  (for the line)
    import safetensors.torch  # noqa: F401
    import transformers  # noqa: F401
    model = eval(line).eval()
    ours = load(f"{d}/ours.safetensors")
    with torch.no_grad():
        y = model(ours["x"])
    y = getattr(y, "logits", y)
    print(f"maxdiff {(y - ours['y']).abs().max().item():.3e} scale {ours['y'].abs().max().item():.3e}")


def dtype_tensors():
    torch.manual_seed(0)
    t = {
        "f64": torch.randn(3, 2, dtype=torch.float64),
        "f32": torch.tensor([1.5, -0.0, float("inf"), float("nan")]),
        "f16": torch.randn(5).half(),
        "bf16": torch.randn(2, 2, 2).bfloat16(),
        "i64": torch.tensor([-(2 ** 63), 2 ** 63 - 1, 0]),
        "i32": torch.tensor([-(2 ** 31), 2 ** 31 - 1], dtype=torch.int32),
        "i16": torch.tensor([-32768, 32767], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 3),
    }
    return t


def dtypes_write(d):
    t = dtype_tensors()
    save(f"{d}/dtypes.safetensors", t)
    torch.save(t, f"{d}/dtypes.pt")


def dtypes_check(d):
    want = torch.load(f"{d}/dtypes.pt")
    got = load(f"{d}/ours_dtypes.safetensors")
    def raw(t):  # the bytes, so that NaN and -0.0 compare exactly
        return t.contiguous().reshape(-1).view(torch.uint8).tolist() if t.dtype != torch.bool else t.tolist()
    bad = [k for k in want if k not in got or got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
           or raw(got[k]) != raw(want[k])]
    print("same" if not bad and set(got) == set(want) else f"differ: {bad} {sorted(set(got) ^ set(want))}")


def modules(_):
    for name in ("safetensors", "transformers", "timm"):
        try:
            __import__(name)
        except ImportError:
            print(name)
            sys.exit(1)


if __name__ == "__main__":
    {"gpt-write": gpt_write, "gpt-check": gpt_check, "resnet-write": resnet_write, "vit-write": vit_write,
     "modules": modules, "dtypes-write": dtypes_write,
     "dtypes-check": dtypes_check, "check-line": lambda d: check_line(d, sys.argv[3])}[sys.argv[1]](
        sys.argv[2] if len(sys.argv) > 2 else "")
