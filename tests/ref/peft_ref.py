"""peft's LoRA adapter folders against peft itself (tests/test_lora_files.cpp), for two tiny random models:
llama (LlamaForCausalLM: hidden 64, 2 layers, 4 heads over 2 key/value heads, intermediate 128, vocabulary
128, untied) and gpt2 (GPT2LMHeadModel: n_embd 64, 2 layers, 4 heads, vocabulary 128; c_attn is a Conv1D,
so its LoraConfig has fan_in_fan_out).

  write DIR    for each KIND in llama, gpt2: a random base model saved by save_pretrained into DIR/KIND/base,
               and a LoRA adapter made by get_peft_model (r 4, lora_alpha 16, lora_dropout 0.05; llama: q_proj,
               k_proj, v_proj, o_proj; gpt2: c_attn) with lora_B drawn from N(0, 0.1^2) rather than peft's
               zeros (so that the adapter changes the logits), saved by save_pretrained into DIR/KIND/adapter;
               DIR/KIND/ref.safetensors holds "x", a (2, 12) int64 token batch, and "logits", the PeftModel's
               (2, 12, 128) float32 logits for it in eval mode.
  load DIR     for each KIND: from_pretrained(DIR/KIND/base) with PeftModel.from_pretrained(base,
               DIR/KIND/adapter) and no code of ours; writes "logits" for DIR/KIND/tokens.safetensors's "x"
               into DIR/KIND/out.safetensors, and prints "KIND config R ALPHA RSLORA FAN_IN_FAN_OUT TARGETS"
               (what peft read from adapter_config.json) and "KIND warnings N", the warnings about adapter
               keys missing from the file or left over.
  modules      exits 0 when peft, transformers and safetensors import, else prints the first missing one

fp32 on the CPU, one thread.
"""
import sys
import warnings

KINDS = ("llama", "gpt2")


def modules():
    # Looked up, not imported: importing transformers and peft takes seconds, the lookup milliseconds.
    import importlib.util
    for name in ("safetensors", "transformers", "peft"):
        if importlib.util.find_spec(name) is None:
            print(name)
            sys.exit(1)


def base_model(kind):
    import transformers
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                          pad_token_id=None)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config)


def logits_of(model, x):
    model.eval()
    with torch.no_grad():
        return model(x).logits.float().contiguous()


def write(d):
    import peft
    import safetensors.torch
    for i, kind in enumerate(KINDS):
        torch.manual_seed(10 + i)
        base = base_model(kind)
        base.save_pretrained(f"{d}/{kind}/base")
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if kind == "llama" else ["c_attn"]
        config = peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.05, target_modules=targets,
                                 fan_in_fan_out=kind == "gpt2", task_type="CAUSAL_LM")
        model = peft.get_peft_model(base, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
        model.save_pretrained(f"{d}/{kind}/adapter")
        x = torch.randint(0, 128, (2, 12))
        safetensors.torch.save_file({"x": x, "logits": logits_of(model, x)}, f"{d}/{kind}/ref.safetensors")


def load(d):
    import peft
    import safetensors.torch
    import transformers
    for kind in KINDS:
        base = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/{kind}/base", dtype=torch.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = peft.PeftModel.from_pretrained(base, f"{d}/{kind}/adapter")
        keys = [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
        for w in keys:
            print(f"{kind} warning: {w.message}")
        c = model.peft_config["default"]
        print(f"{kind} config {c.r} {c.lora_alpha} {c.use_rslora} {c.fan_in_fan_out} {','.join(sorted(c.target_modules))}")
        print(f"{kind} warnings {len(keys)}")
        x = safetensors.torch.load_file(f"{d}/{kind}/tokens.safetensors")["x"]
        safetensors.torch.save_file({"logits": logits_of(model, x)}, f"{d}/{kind}/out.safetensors")


if __name__ == "__main__":
    if sys.argv[1] == "modules":
        modules()
        sys.exit(0)
    import torch  # after the modules check, which needs none of it: importing torch takes a second
    torch.set_num_threads(1)
    if sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "load":
        load(sys.argv[2])
