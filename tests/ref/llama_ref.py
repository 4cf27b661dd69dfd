"""Llama-family models against transformers itself (tests/test_llama.cpp).

  write DIR   for each configuration below, a LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM on random
              weights (torch.manual_seed), fp32 on the CPU, eval mode, saved by save_pretrained into DIR/NAME
              (model.safetensors + config.json; a tied model's file has no lm_head.weight), and
              DIR/NAME/expected.safetensors with
                tokens      (2, T) int64   fixed random tokens
                logits      (2, T, V) f32  the model's logits for them
                prompt      (P) int64      a prompt
                generated   (N) int64      generate(do_sample=False, max_new_tokens=N) after it
                gap         (1) f32        the smallest largest-minus-second-largest logit on that greedy path
                                           (a near-tie would make the comparison depend on rounding)
              Prints one line per configuration: "NAME V T".
  modules     exits 0 when transformers and safetensors import, else prints the first missing one

The weights have a larger spread than the models' initialization (embeddings std 1, Linear weights std 0.3,
RMSNorm weights in [0.5, 1.5], q/k/v biases std 0.1): the logits are then peaked and greedy decoding has no
near-ties (gaps of 0.04 and more), and tied models do not just repeat their last token. The shapes are tiny; the C++ test builds the same shapes from the same numbers (CONFIGS).
"""
import sys

import torch

T = 40           # tokens per sequence of the logits check (past llama3's original context below)
PROMPT = 16      # prompt length of the greedy check
NEW_TOKENS = 20  # tokens generated

# name: (class, config arguments). Keep in step with test_llama.cpp's reference_options().
CONFIGS = {
    # grouped-query: 8 query heads over 2 key/value heads, untied
    "llama_gqa": ("LlamaForCausalLM", dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)),
    # Llama 3's rope scaling with T = 40 past original_max_position_embeddings = 32 (the frequencies fall in all
    # three bands: kept, blended, divided by the factor), tied
    "llama3_scaled": ("LlamaForCausalLM", dict(vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                                               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                 high_freq_factor=4.0,
                                                                 original_max_position_embeddings=32))),
    # Qwen2: q/k/v biases, tied, eps 1e-6, theta 1e6
    "qwen2_bias": ("Qwen2ForCausalLM", dict(vocab_size=72, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                                            use_sliding_window=False)),
    # Mistral: head_dim 16 given explicitly (not hidden / heads = 8), one key/value head, untied
    "mistral_head_dim": ("MistralForCausalLM", dict(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                                    head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
                                                    rope_theta=10000.0, tie_word_embeddings=False,
                                                    sliding_window=None)),
}


def modules():
    for name in ("safetensors", "transformers"):
        try:
            __import__(name)
        except ImportError:
            print(name)
            sys.exit(1)


def config_of(cls_name, args):
    import transformers
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    args = dict(args)
    rope = args.pop("rope_scaling", None)
    theta = args.pop("rope_theta")
    # transformers 5.x keeps rope_theta and the scaling in rope_parameters (4.x: rope_theta, rope_scaling).
    rope_parameters = dict(rope or {"rope_type": "default"}, rope_theta=theta)
    return config_cls(**args, rope_parameters=rope_parameters, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, attention_dropout=0.0)


def randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.3)


def write_one(d, name, cls_name, args):
    import transformers
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config_of(cls_name, args))
    randomize(model)
    model.eval()
    model.save_pretrained(f"{d}/{name}")
    V = args["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(V, (2, T), generator=gen)
    prompt = torch.randint(V, (1, PROMPT), generator=gen)
    with torch.no_grad():
        logits = model(tokens).logits
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(prompt), pad_token_id=0, eos_token_id=None)
        path = model(out).logits[0, PROMPT - 1:-1]  # the logits each new token was chosen from
    top2 = path.topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]).min().reshape(1)
    save_file({"tokens": tokens.contiguous(), "logits": logits.contiguous().float(), "prompt": prompt[0].contiguous(),
               "generated": out[0, PROMPT:].contiguous(), "gap": gap.float()}, f"{d}/{name}/expected.safetensors")
    print(name, V, T)


def write(d):
    for name, (cls_name, args) in CONFIGS.items():
        write_one(d, name, cls_name, args)


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        modules()
    elif sys.argv[1] == "write":
        write(sys.argv[2])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
