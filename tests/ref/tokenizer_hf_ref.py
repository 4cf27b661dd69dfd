"""Reference tokenizer.json files of the Llama 3, Qwen2 and SmolLM2 kinds, and their ids, for tests/test_tokenizer.cpp.

Hub files cannot be fetched, so the tokenizers library builds tokenizers of the same form: a byte-level
BPE trained on the given text files, pre-tokenized by a Split with Llama 3's or Qwen2's pattern then
ByteLevel(use_regex=False), or (SmolLM2, StarCoder) by Digits(individual_digits=True) then
ByteLevel(use_regex=True), with their special tokens after the vocabulary (Llama 3: a TemplateProcessing
post-processor that puts <|begin_of_text|> first; Qwen2: an NFC normalizer and a ByteLevel post-processor;
SmolLM2: a ByteLevel post-processor, no BOS).

  tokenizer_hf_ref.py modules
      exits 0 when tokenizers imports, else prints "tokenizers"
  tokenizer_hf_ref.py build --kind llama3|qwen2|smollm2 --vocab N --out tokenizer.json --files FILE...
  tokenizer_hf_ref.py encode --tokenizer-json FILE --texts IN.json --out OUT.json
      IN.json is a list of base64 strings (the texts' bytes), each decoded as Python's
      bytes.decode("utf-8", errors="replace") does. OUT.json: {"plain": [[ids]...] (added tokens' texts are
      text: encode_special_tokens=True, add_special_tokens=False), "specials": [[ids]...] (added tokens
      recognized, none added), "template": [[ids]...] (add_special_tokens=True)}
"""
import argparse
import base64
import json
import sys

LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPECIALS = {
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "smollm2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}


def build(kind, vocab, out, files):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if kind == "smollm2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3 if kind == "llama3" else QWEN2), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    # SmolLM2's special tokens come first (ids 0, 1, 2, in the vocabulary too); Llama 3's and Qwen2's
    # after the vocabulary, as the real files have them.
    first = SPECIALS[kind] if kind == "smollm2" else []
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=first,
                                  show_progress=False)
    tok.train(files, trainer)
    if not first:
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS[kind]])
    if kind == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(out)


def encode(tokenizer_json, texts_path, out):
    from tokenizers import Tokenizer

    with open(texts_path) as f:
        texts = [base64.b64decode(t).decode("utf-8", errors="replace") for t in json.load(f)]
    tok = Tokenizer.from_file(tokenizer_json)
    result = {"specials": [tok.encode(t, add_special_tokens=False).ids for t in texts],
              "template": [tok.encode(t, add_special_tokens=True).ids for t in texts]}
    tok.encode_special_tokens = True
    result["plain"] = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    with open(out, "w") as f:
        json.dump(result, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["modules", "build", "encode"])
    ap.add_argument("--kind", choices=["llama3", "qwen2", "smollm2"])
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--out")
    ap.add_argument("--files", nargs="*")
    ap.add_argument("--tokenizer-json")
    ap.add_argument("--texts")
    a = ap.parse_args()
    if a.mode == "modules":
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            print("tokenizers")
            sys.exit(1)
    elif a.mode == "build":
        build(a.kind, a.vocab, a.out, a.files)
    else:
        encode(a.tokenizer_json, a.texts, a.out)


if __name__ == "__main__":
    main()
