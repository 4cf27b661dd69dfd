"""Greedy decoding against transformers itself (tests/test_sample.cpp).

  write DIR PROMPT N   a small random GPT2LMHeadModel (vocab 64, context 32, 2 layers, 4 heads, 32 wide), saved
                       by save_pretrained into DIR/hf (model.safetensors + config.json); then
                       generate(do_sample=False, max_new_tokens=N) from PROMPT (comma-separated ids) in eval
                       mode, fp32 on the CPU. Prints "tokens A,B,C,..." (the new ones) and "gap G": the
                       smallest difference between the largest and second largest logit over the greedy
                       path, so that a tie is seen rather than compared.
  modules              exits 0 when transformers and safetensors import, else prints the first missing one

The weights are random with a larger spread than GPT-2's initialization (token embedding std 0.5): the logits
are then peaked, and argmax has no near-ties that rounding could flip.
"""
import sys

import torch


def modules():
    for name in ("safetensors", "transformers"):
        try:
            __import__(name)
        except ImportError:
            print(name)
            sys.exit(1)


def write(d, prompt, n):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=None,
                        eos_token_id=None, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and "ln" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() <= 1:
                p.normal_(0.0, 0.1)
            elif "wte" in name or "wpe" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(f"{d}/hf")
    x = torch.tensor([[int(t) for t in prompt.split(",")]])
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x),
                             pad_token_id=0, eos_token_id=None)
        logits = model(out).logits[0, x.size(1) - 1:-1]  # the logits each new token was drawn from
    new = out[0, x.size(1):].tolist()
    top2 = logits.topk(2, dim=-1).values
    print("tokens " + ",".join(str(t) for t in new))
    print(f"gap {(top2[:, 0] - top2[:, 1]).min().item():.4e}")


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        modules()
    elif sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
