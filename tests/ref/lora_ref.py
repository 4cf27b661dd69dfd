"""LoRA (models/lora.h) against peft itself (tests/test_lora.cpp).

  write DIR   for each case below, a transformers model on random weights (fp32, CPU, no dropout anywhere)
              wrapped by peft's get_peft_model with the case's LoraConfig, its adapters set to random values
              (B nonzero: with peft's zero B the adapted model would be the base and prove nothing), then:
                DIR/NAME/base/        the base model before wrapping, save_pretrained (model.safetensors +
                                      config.json): what the C++ side loads with trainer::load_weights
                DIR/NAME/expected.safetensors with
                  tokens          (B, T) int64       a batch
                  logits          (B, T, V) f32      the peft model's logits for it (eval mode)
                  base_logits     (B, T, V) f32      the base model's (adapters disabled): the adapters matter
                  loss            (1) f32            the causal-LM loss of `tokens` (below)
                  init.<name>     the adapters as set, under our names (<layer>.lora_A.weight, ...)
                  grad.<name>     their gradients of that loss
                  train_tokens    (S, B, T) int64    one batch per AdamW step
                  losses          (S) f32            the loss before each step
                  trained.<name>  the adapters after the S steps
              Prints one line per case: "NAME V T".
  modules     exits 0 when safetensors, transformers and peft are installed, else prints the first missing one

The loss is what the C++ test computes: cross entropy (mean over B * (T - 1) positions) of logits[:, :-1]
against tokens[:, 1:], computed here with F.cross_entropy rather than through the model's `labels`, so both
sides are the same expression. The optimizer is torch.optim.AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight_decay 0.01) over the adapters only (peft leaves nothing else trainable), zero_grad before each step.
The model stays in eval mode throughout: there is no dropout anywhere, so training mode computes the same.

Our names are peft's without `base_model.model.` and the adapter name: peft's
base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight is our
model.layers.0.self_attn.q_proj.lora_A.weight. GPT-2's c_attn is a Conv1D (fan_in_fan_out=True); peft's
adapters on it are still nn.Linear, A (r, in) and B (out, r), the shapes of ours.
"""
import sys

import torch

B, T, STEPS = 2, 16, 20
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name: (model class, config arguments, LoraConfig arguments). Keep in step with test_lora.cpp's cases().
CASES = {
    "llama": ("LlamaForCausalLM",
              dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False),
              dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)),
    "llama_rslora": ("LlamaForCausalLM",
                     dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                          tie_word_embeddings=False),
                     dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, use_rslora=True)),
    "gpt2": ("GPT2LMHeadModel",
             dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4),
             dict(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)),
}


def modules():
    # Looked up, not imported: importing transformers and peft takes seconds, and `write` imports them anyway
    # (a broken installation fails there, with its traceback in the test's output).
    import importlib.util
    for name in ("safetensors", "transformers", "peft"):
        if importlib.util.find_spec(name) is None:
            print(name)
            sys.exit(1)


def make_model(cls_name, args):
    import transformers
    if cls_name == "GPT2LMHeadModel":
        config = transformers.GPT2Config(**args, bos_token_id=None, eos_token_id=None, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        # transformers 5.x keeps rope_theta in rope_parameters.
        config = transformers.LlamaConfig(**args, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                          bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                          attention_dropout=0.0)
    return getattr(transformers, cls_name)(config)


def randomize(model):
    """Norm weights away from 1 and biases away from 0 (a mix-up of either would otherwise hide), matrices
    N(0, 0.1): logits of a few units, so neither side's rounding dominates the comparison."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)


def adapters(peft_model):
    """The trainable tensors under our names, in the model's order."""
    out = {}
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            assert ".lora_" in name, f"peft left {name} trainable"
            out[name.removeprefix("base_model.model.").replace(".default.", ".")] = p
    return out


def causal_loss(model, tokens):
    logits = model(tokens).logits  # (B, T, V)
    V = logits.size(-1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))


def write_one(d, name, cls_name, args, lora_args):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = make_model(cls_name, args)
    randomize(model)
    model.save_pretrained(f"{d}/{name}/base")
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **lora_args))
    ours = adapters(peft_model)
    with torch.no_grad():
        for p in ours.values():
            p.normal_(0.0, 0.1)
    V = args["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(V, (B, T), generator=gen)
    train_tokens = torch.randint(V, (STEPS, B, T), generator=gen)
    out = {"tokens": tokens, "train_tokens": train_tokens}
    out.update({f"init.{k}": p.detach().clone() for k, p in ours.items()})

    peft_model.eval()
    with torch.no_grad():
        out["logits"] = peft_model(tokens).logits
        with peft_model.disable_adapter():
            out["base_logits"] = peft_model(tokens).logits
    loss = causal_loss(peft_model, tokens)
    loss.backward()
    out["loss"] = loss.detach().reshape(1)
    out.update({f"grad.{k}": p.grad.clone() for k, p in ours.items()})

    optimizer = torch.optim.AdamW(list(ours.values()), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for s in range(STEPS):
        optimizer.zero_grad()
        loss = causal_loss(peft_model, train_tokens[s])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    out["losses"] = torch.tensor(losses, dtype=torch.float32)
    out.update({f"trained.{k}": p.detach().clone() for k, p in ours.items()})
    save_file({k: v.contiguous() for k, v in out.items()}, f"{d}/{name}/expected.safetensors")
    print(name, V, T)


def write(d):
    for name, (cls_name, args, lora_args) in CASES.items():
        write_one(d, name, cls_name, args, lora_args)


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        modules()
    elif sys.argv[1] == "write":
        write(sys.argv[2])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
