"""peft itself, against `trainer sample --lora`, `trainer export --layout peft` and `--merge` (tests/test_lora_run.cpp).

  base DIR             a small random LlamaForCausalLM (vocab 256, 2 layers, 64 wide, 4 heads, 2 key/value heads),
                       saved by save_pretrained into DIR/hf; a second one of other weights into DIR/other
  adapter DIR PROMPT N a peft LoRA adapter on DIR/hf (r 4, alpha 8, q_proj and v_proj, A and B random: B is not
                       zero, so the adapter changes the logits), saved into DIR/adapter; then PeftModel's
                       generate(do_sample=False, max_new_tokens=N) from PROMPT (comma-separated ids). Prints
                       "tokens A,B,..." and "gap G" (the smallest top-2 logit gap on the greedy path)
  merged DIR ADAPTER MERGED  PeftModel.from_pretrained(DIR/hf, ADAPTER)'s logits on a fixed batch against
                       LlamaForCausalLM.from_pretrained(MERGED)'s (trainer export --layout peft and --merge of one
                       checkpoint). Prints "max_diff D" and "adapter_diff D" (the adapter's own effect: the
                       base's logits against peft's, so that a comparison of two unchanged models is seen)
  modules              exits 0 when transformers, peft and safetensors import, else prints the first missing one

The weights are random with a larger spread than Llama's initialization: peaked logits, no near-ties in argmax.
"""
import sys

import torch


def modules():
    for name in ("safetensors", "transformers", "peft"):
        try:
            __import__(name)
        except ImportError:
            print(name)
            sys.exit(1)


def llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def base(d):
    llama(0).save_pretrained(f"{d}/hf")
    llama(1).save_pretrained(f"{d}/other")


def adapter(d, prompt, n):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(f"{d}/hf")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(f"{d}/adapter")
    peft_model.eval()
    x = torch.tensor([[int(t) for t in prompt.split(",")]])
    with torch.no_grad():
        out = peft_model.generate(input_ids=x, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x),
                                  pad_token_id=0, eos_token_id=None)
        logits = peft_model(input_ids=out).logits[0, x.size(1) - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    print("tokens " + ",".join(str(t) for t in out[0, x.size(1):].tolist()))
    print(f"gap {(top2[:, 0] - top2[:, 1]).min().item():.4e}")


def merged(d, adapter_dir, merged_dir):
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    torch.manual_seed(3)
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        plain = LlamaForCausalLM.from_pretrained(f"{d}/hf").eval()(input_ids=x).logits
        peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(f"{d}/hf"), adapter_dir).eval()
        want = peft_model(input_ids=x).logits
        got = LlamaForCausalLM.from_pretrained(merged_dir).eval()(input_ids=x).logits
    print(f"max_diff {(want - got).abs().max().item():.4e}")
    print(f"adapter_diff {(want - plain).abs().max().item():.4e}")


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        modules()
    elif sys.argv[1] == "base":
        base(sys.argv[2])
    elif sys.argv[1] == "adapter":
        adapter(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "merged":
        merged(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
