#!/usr/bin/python3
"""Reference GPT in plain PyTorch (1.13: no scaled_dot_product_attention), for tests/test_transformer.cpp.

The architecture of models/gpt.h written the nanoGPT way (Karpathy, model.py): the same module names
(transformer.wte, transformer.wpe, transformer.h.N.ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
mlp.c_proj, transformer.ln_f, lm_head tied to wte), pre-LayerNorm blocks, causal attention written out
(matmul, -inf mask, softmax, matmul), GELU with the tanh approximation, biases everywhere.

Two modes (run with /usr/bin/python3, which has Debian's torch):

  gpt_ref.py --json OUT.json [--configs gpt_tiny,gpt2] [--flops-T 1024]
      Writes {config: {"num_parameters": n (each tied tensor once), "state": {key: shape},
                        "macs": multiply-adds of one sequence of T tokens}} where the MACs are counted by
      forward hooks on every Linear (lm_head included) plus the attention matmuls q k^T and att v
      (2 * n_layer * T^2 * n_embd, the causal half not subtracted): the convention of
      models::GPTImpl::forward_flops (FLOPs = 2 x MACs). gpt2 is built on the meta device (no memory).

  gpt_ref.py --weights OUT.pt
      gpt_tiny with torch.manual_seed(0) weights, LayerNorm affine parameters randomized (so they are not
      1 and 0), tokens x (2, 37) with a fixed seed, and the eval-mode logits (2, 37, 256). Writes
      torch.save({"x": x, "logits": logits, "state": dict(model.state_dict())}): a plain dict, which C++
      reads with torch::pickle_load (a top-level OrderedDict from state_dict() does not load there).
      The state includes lm_head.weight, the same tensor as transformer.wte.weight.
"""
import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {
    "gpt2": dict(vocab_size=50257, context=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt_tiny": dict(vocab_size=256, context=128, n_layer=4, n_head=4, n_embd=128),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.n_head = c["n_head"]
        self.c_attn = nn.Linear(c["n_embd"], 3 * c["n_embd"], device=device)
        self.c_proj = nn.Linear(c["n_embd"], c["n_embd"], device=device)
        self.macs = 0  # attention matmul multiply-adds of the last forward, per sample

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, nh, T, hs)
        self.macs = 2 * self.n_head * T * T * hs
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"], device=device)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"], device=device)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"], device=device)
        self.attn = CausalSelfAttention(c, device)
        self.ln_2 = nn.LayerNorm(c["n_embd"], device=device)
        self.mlp = MLP(c, device)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c["vocab_size"], c["n_embd"], device=device),
            wpe=nn.Embedding(c["context"], c["n_embd"], device=device),
            h=nn.ModuleList([Block(c, device) for _ in range(c["n_layer"])]),
            ln_f=nn.LayerNorm(c["n_embd"], device=device),
        ))
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False, device=device)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one parameter

    def forward(self, idx):
        B, T = idx.size()
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)


def linear_macs(model, T):
    """Linear multiply-adds per sample for a sequence of T tokens, plus the attention matmuls."""
    macs = [0]

    def hook(m, inputs, out):
        macs[0] += (out.numel() // out.shape[0]) * m.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(torch.zeros(1, T, dtype=torch.long, device=next(model.parameters()).device))
    for h in handles:
        h.remove()
    attention = sum(m.macs for m in model.modules() if isinstance(m, CausalSelfAttention))
    return macs[0] + attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--configs", default="gpt_tiny,gpt2")
    ap.add_argument("--flops-T", type=int, default=0, help="T for the MAC count (0: the config's context)")
    ap.add_argument("--weights")
    a = ap.parse_args()

    if a.json:
        out = {}
        for name in a.configs.split(","):
            c = CONFIGS[name]
            # The meta device has shapes but no memory: GPT-2's 124M parameters cost nothing here.
            model = GPT(c, device="meta").eval()
            T = a.flops_T or c["context"]
            out[name] = {
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "state": {k: list(v.shape) for k, v in model.state_dict().items()},
                "macs": {str(T): linear_macs(model, T)},
            }
        with open(a.json, "w") as f:
            json.dump(out, f)

    if a.weights:
        torch.manual_seed(0)
        model = GPT(CONFIGS["gpt_tiny"]).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
            for m in model.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_(0.0, 0.1)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.normal_(0.0, 0.02)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (2, 37), generator=g)
        with torch.no_grad():
            logits = model(x)
        torch.save({"x": x, "logits": logits, "state": dict(model.state_dict())}, a.weights)


if __name__ == "__main__":
    main()
