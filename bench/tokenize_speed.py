#!/usr/bin/env python3
"""GPT-2 tokenization speed: `trainer convert-text --tokenizer` against tiktoken, on the same text and
cores, side by side in one run, written as JSON.

  $(bash scripts/install-torch.sh --python) bench/tokenize_speed.py --out OUT.json \\
      [--trainer build/trainer] [--copies 16] [--threads 1,2] [--rounds 3]

The text: every file of Debian's `fortunes` package (2.6 MB of English, the .dat indexes left out),
written --copies times as separate documents into a temporary folder (16 copies: 41 MB).

For each thread count T, best of --rounds:
  - trainer: the whole `trainer convert-text --src DIR --tokenizer gpt2.tiktoken --threads T
    --val-fraction 0` command, wall time: the process's start, reading the tokenizer and the files,
    replacing invalid UTF-8, encoding and writing the HDF5 file all count.
  - tiktoken: `encode_ordinary_batch(texts, num_threads=T)` of tiktoken's gpt2 encoding (the same rank
    file, openai-whisper's copy), timed alone: the files are read and decoded before the clock starts.
MB/s = input bytes / seconds. `ratio` = trainer MB/s / tiktoken MB/s. The token counts are checked to
agree (the trainer's holds one <|endoftext|> per document more); the ids themselves are compared by
tests/test_tokenizer.cpp.

Exit 0 on success, 2 when a command fails or the counts differ.
"""
import argparse
import datetime
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "ref"))
import tokenizer_ref  # noqa: E402  (the rank file and tiktoken's gpt2 encoding, as the tests make them)


def fortunes():
    files = sorted(f for f in glob.glob("/usr/share/games/fortunes/**", recursive=True)
                   if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
    if not files:
        sys.exit("no /usr/share/games/fortunes (apt-get install fortunes)")
    return b"".join(open(f, "rb").read() for f in files)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()

    rank_file = tokenizer_ref.rank_file()
    enc = tokenizer_ref.gpt2_encoding()
    work = tempfile.mkdtemp(prefix="tokenize_speed_")
    try:
        text = fortunes()
        src = os.path.join(work, "src")
        os.makedirs(src)
        for i in range(a.copies):
            with open(os.path.join(src, f"copy{i:03d}.txt"), "wb") as f:
                f.write(text)
        size = len(text) * a.copies
        texts = [text.decode("utf-8", errors="replace")] * a.copies
        rows = []
        for threads in [int(t) for t in a.threads.split(",")]:
            best_ours, best_ref, summary, ref_tokens = float("inf"), float("inf"), "", 0
            for _ in range(a.rounds):
                out = os.path.join(work, "out")
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                r = subprocess.run([a.trainer, "convert-text", "--src", src, "--out", out, "--tokenizer", rank_file,
                                    "--threads", str(threads), "--val-fraction", "0"], capture_output=True, text=True)
                best_ours = min(best_ours, time.perf_counter() - t0)
                if r.returncode != 0:
                    print(r.stdout + r.stderr, file=sys.stderr)
                    return 2
                summary = r.stdout.strip()
                t0 = time.perf_counter()
                ids = enc.encode_ordinary_batch(texts, num_threads=threads)
                best_ref = min(best_ref, time.perf_counter() - t0)
                ref_tokens = sum(map(len, ids))
            ours_tokens = int(summary.split(" tokens")[0].split()[-1])
            if ours_tokens != ref_tokens + a.copies:
                print(f"token counts differ: trainer {ours_tokens}, tiktoken {ref_tokens} + {a.copies} documents", file=sys.stderr)
                return 2
            rows.append({"threads": threads, "trainer_s": best_ours, "tiktoken_s": best_ref,
                         "trainer_mb_per_s": size / best_ours / 1e6, "tiktoken_mb_per_s": size / best_ref / 1e6,
                         "ratio": best_ref / best_ours, "tokens": ours_tokens, "trainer_summary": summary})
            print(f"{threads} thread(s): trainer {size / best_ours / 1e6:.1f} MB/s, tiktoken {size / best_ref / 1e6:.1f} MB/s, "
                  f"ratio {best_ref / best_ours:.2f}")
        import tiktoken
        result = {"date": datetime.date.today().isoformat(), "bytes": size, "copies": a.copies, "rounds": a.rounds,
                  "rank_file": rank_file, "tiktoken": tiktoken.__version__,
                  "trainer_version": subprocess.run([a.trainer, "--version"], capture_output=True, text=True).stdout.strip(),
                  "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                  "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
