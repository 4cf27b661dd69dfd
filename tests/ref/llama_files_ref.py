"""Hub folders of the Llama family in and out, against transformers itself (tests/test_llama_files.cpp).

  write DIR TYPE PROMPT N   a small random model of model_type TYPE (llama: 8 heads over 2 key/value heads,
                            TYPE_init: with transformers' own initialization rather than the spread below;
                            untied, Llama 3's rope scaling from an original context of 16 in a context of
                            64; qwen2: q/k/v biases, tied), vocabulary 256 (byte tokens), saved by
                            save_pretrained into DIR/hf in shards (model.safetensors.index.json); then
                            generate(do_sample=False, max_new_tokens=N) from PROMPT (comma-separated ids), fp32
                            on the CPU. Prints "tokens A,B,..." (the new ones) and "gap G": the smallest
                            margin between the two largest logits over the greedy path.
  load DIR TOKENS           from_pretrained(DIR) with no code of ours; prints "missing K", "unexpected K"
                            (counts of keys transformers did not find or did not use), "class NAME" and
                            "logits x,y,..." (the last position's logits for TOKENS, comma-separated ids).
  generate DIR PROMPT N     from_pretrained(DIR), fp32 on the CPU: generate(do_sample=False, max_new_tokens=N) from
                            PROMPT (comma-separated ids); prints "tokens ..." and "gap G" as write does.
  hub DIR TEXT PROMPT N     a Hub folder DIR/hub as the Hub has them, without fetching one: a Llama 3-kind
                            tokenizer.json trained on TEXT (tests/ref/tokenizer_hf_ref.py, vocabulary 600,
                            <|begin_of_text|> put first by its post-processor) and a random LlamaForCausalLM of
                            its vocabulary (save_pretrained, one model.safetensors). Prints "prompt A,B,..."
                            (transformers' tokenizer(PROMPT) ids), "tokens ..." (generate(do_sample=False,
                            max_new_tokens=N) from them) and "gap G".
  train DIR BATCHES LR      a plain PyTorch loop over transformers' model: from_pretrained(DIR), fp32 on the
                            CPU, torch.optim.AdamW(lr=LR, betas (0.9, 0.95), eps 1e-8, no weight decay), one
                            step per batch of BATCHES (a safetensors file of x0, y0, x1, y1, ...: the trainer's
                            own batches), the mean cross-entropy of the logits against y. Prints "losses a,b,...".
  modules                   exits 0 when transformers, safetensors and tokenizers import, else prints the first
                            missing one

The weights are random with a larger spread than the models' initialization, so that the logits are peaked
and greedy decoding has no near-ties that rounding could flip.
"""
import sys

import torch


def modules():
    for name in ("safetensors", "transformers", "tokenizers"):
        try:
            __import__(name)
        except ImportError:
            print(name)
            sys.exit(1)


def make(kind, pad_token_id=0):
    import transformers
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=None,
                  eos_token_id=None, pad_token_id=pad_token_id)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                                          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16})
        return transformers.LlamaForCausalLM(config)
    config = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    return transformers.Qwen2ForCausalLM(config)


def spread(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() <= 1:
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.25)
    model.eval()


def greedy(model, x, n):
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x),
                             pad_token_id=0, eos_token_id=None)
        logits = model(out).logits[0, x.size(1) - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    print("tokens " + ",".join(str(t) for t in out[0, x.size(1):].tolist()))
    print(f"gap {(top2[:, 0] - top2[:, 1]).min().item():.4e}")


def write(d, kind, prompt, n):
    torch.manual_seed(3)
    if kind.endswith("_init"):
        # "llama_init", for training: transformers' own initialization, and no padding token (transformers
        # keeps its embedding row at a zero gradient; the trainer trains every row).
        model = make(kind.removesuffix("_init"), pad_token_id=None)
    else:
        model = make(kind)
        spread(model)
    model.save_pretrained(f"{d}/hf", max_shard_size="100KB")
    greedy(model, torch.tensor([[int(t) for t in prompt.split(",")]]), n)


def hub(d, text, prompt, n):
    import os
    import transformers
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tokenizer_hf_ref
    os.makedirs(f"{d}/hub", exist_ok=True)
    tokenizer_hf_ref.build("llama3", 600, f"{d}/hub/tokenizer.json", [text])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{d}/hub/tokenizer.json")
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    spread(model)
    model.save_pretrained(f"{d}/hub")
    ids = tok(prompt)["input_ids"]
    print("prompt " + ",".join(str(t) for t in ids))
    greedy(model, torch.tensor([ids]), n)


def load(d, tokens):
    import transformers
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True,
                                                                    dtype=torch.float32)
    model.eval()
    print(f"missing {len(info['missing_keys'])}")
    print(f"unexpected {len(info['unexpected_keys'])}")
    print(f"class {type(model).__name__}")
    x = torch.tensor([[int(t) for t in tokens.split(",")]])
    with torch.no_grad():
        logits = model(x).logits[0, -1]
    print("logits " + ",".join(f"{v:.9e}" for v in logits.tolist()))


def generate(d, prompt, n):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    greedy(model, torch.tensor([[int(t) for t in prompt.split(",")]]), n)


def train(d, batches, lr):
    import safetensors.torch
    import transformers
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.train()
    pool = safetensors.torch.load_file(batches)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for i in range(len(pool) // 2):
        x, y = pool[f"x{i}"], pool[f"y{i}"]
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("losses " + ",".join(f"{v:.9e}" for v in losses))


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        modules()
    elif sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif sys.argv[1] == "hub":
        hub(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "generate":
        generate(sys.argv[2], sys.argv[3], int(sys.argv[4]))
