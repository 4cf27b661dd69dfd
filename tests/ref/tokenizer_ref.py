"""Reference tokenizations for tests/test_tokenizer.cpp: OpenAI's tiktoken and Hugging Face tokenizers.

  tokenizer_ref.py where
      prints the path of GPT-2's rank file, gpt2.tiktoken, as the openai-whisper package ships it
  tokenizer_ref.py encode --texts IN.json --out OUT.json [--tokenizer-json FILE]
      IN.json is a list of base64 strings (the texts' bytes). Each is decoded as Python's
      bytes.decode("utf-8", errors="replace") does and encoded with tiktoken's gpt2 encoding,
      encode_ordinary; with --tokenizer-json, also with that tokenizer.json (tokenizers, no special
      tokens added or recognized). OUT.json: {"tiktoken": [[ids]...], "hf": [[ids]...],
      "replaced": [the texts after replacement, base64]}
  tokenizer_ref.py files --out OUT.bin --files FILE...
      each file's text encoded as above, followed by <|endoftext|> (50256), an empty file adding
      nothing; all ids as little-endian int32
  tokenizer_ref.py hf-json --out tokenizer.json [--string-merges]
      GPT-2's tokenizer as a Hugging Face tokenizer.json (BPE, ByteLevel pre-tokenizer with GPT-2's
      pattern, <|endoftext|> added), built from the rank file: a pair merges when its concatenation is a
      token, the merge's priority that token's rank. --string-merges writes merges as "a b" strings
      (the form before tokenizers 0.20) instead of pairs.
  tokenizer_ref.py speed --files F... --threads N --out OUT.json
      MB/s of tiktoken's encode_ordinary_batch over the files' texts with N threads (best of 3)

Needs tiktoken and openai-whisper (installed with --no-deps, for its gpt2.tiktoken), and tokenizers for
the Hugging Face forms: scripts/install-torch.sh adds them to the 2.11 environment.
"""
import argparse
import base64
import importlib.util
import json
import os
import sys
import time

import numpy as np


def rank_file():
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no module named 'whisper' (pip install --no-deps openai-whisper)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "assets", "gpt2.tiktoken")
    if not os.path.exists(path):
        sys.exit(f"{path} is missing")
    return path


def gpt2_encoding():
    import tiktoken
    import tiktoken_ext.openai_public as public
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(rank_file())
    return tiktoken.Encoding("gpt2-local", pat_str=public.r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def hf_json(out, string_merges):
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    ranks = load_tiktoken_bpe(rank_file())
    alphabet = bytes_to_unicode()
    text = lambda b: "".join(alphabet[x] for x in b)
    vocab = {text(t): r for t, r in ranks.items()}
    merges = []
    for t, r in ranks.items():
        for k in range(1, len(t)):
            if t[:k] in ranks and t[k:] in ranks:
                merges.append((r, ranks[t[:k]], ranks[t[k:]], text(t[:k]), text(t[k:])))
    merges.sort()
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(out)
    if string_merges:
        with open(out) as f:
            j = json.load(f)
        j["model"]["merges"] = [a + " " + b if isinstance(a, str) else a for a, b in j["model"]["merges"]]
        with open(out, "w") as f:
            json.dump(j, f, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["where", "encode", "files", "hf-json", "speed"])
    ap.add_argument("--texts")
    ap.add_argument("--out")
    ap.add_argument("--tokenizer-json")
    ap.add_argument("--string-merges", action="store_true")
    ap.add_argument("--files", nargs="*")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    if a.mode == "where":
        print(rank_file())
    elif a.mode == "hf-json":
        hf_json(a.out, a.string_merges)
    elif a.mode == "encode":
        enc = gpt2_encoding()
        with open(a.texts) as f:
            texts = [base64.b64decode(t).decode("utf-8", errors="replace") for t in json.load(f)]
        out = {"tiktoken": [enc.encode_ordinary(t) for t in texts],
               "replaced": [base64.b64encode(t.encode("utf-8")).decode() for t in texts]}
        if a.tokenizer_json:
            from tokenizers import Tokenizer

            hf = Tokenizer.from_file(a.tokenizer_json)
            hf.encode_special_tokens = True  # special tokens in the text are text, as in encode_ordinary
            out["hf"] = [hf.encode(t, add_special_tokens=False).ids for t in texts]
        with open(a.out, "w") as f:
            json.dump(out, f)
    elif a.mode == "files":
        enc = gpt2_encoding()
        ids = []
        for path in a.files:
            with open(path, "rb") as f:
                data = f.read()
            if data:
                ids += enc.encode_ordinary(data.decode("utf-8", errors="replace")) + [50256]
        np.asarray(ids, dtype="<i4").tofile(a.out)
    elif a.mode == "speed":
        enc = gpt2_encoding()
        texts = []
        for path in a.files:
            with open(path, "rb") as f:
                texts.append(f.read().decode("utf-8", errors="replace"))
        size = sum(len(t.encode("utf-8")) for t in texts)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            ids = enc.encode_ordinary_batch(texts, num_threads=a.threads)
            best = min(best, time.perf_counter() - t0)
        with open(a.out, "w") as f:
            json.dump({"bytes": size, "tokens": sum(map(len, ids)), "seconds": best, "mb_per_s": size / best / 1e6,
                       "threads": a.threads}, f)


if __name__ == "__main__":
    main()
