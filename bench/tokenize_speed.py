#!/usr/bin/env python3
"""GPT-2 tokenization speed: `trainer convert-text --tokenizer` against tiktoken, on the same text and
cores, side by side in one run, written as JSON.

  $(bash scripts/install-torch.sh --python) bench/tokenize_speed.py --out OUT.json \\
      [--trainer build/trainer] [--inputs distinct,repeated] [--threads 1,2] [--rounds 3] [--memory]

Two inputs, each file one document (tiktoken is given the same documents, as one batch):
  - `distinct`: every file of Debian's `fortunes` package (2.6 MB of English, the .dat indexes left out)
    and of Python's standard library (/usr/lib/python3.11, 11.6 MB of Python source): 14.2 MB, 722
    documents, that each encoder meets for the first time;
  - `repeated`: the fortunes 32 times (82 MB, 1,376 files), on which the trainer's per-thread piece cache
    (data/text/bpe.h) is warm after the first copy (the fortunes hold 47,649 distinct pieces, under its
    65,536 entries); tiktoken keeps no such cache. The trainer's best case.

For each thread count T, best of --rounds, both held to the same T cores (CPUs 0 .. T-1: taskset for
the trainer, sched_setaffinity for tiktoken), so the trainer's reading thread, which replaces invalid
UTF-8, cuts the parts and writes the file beside its T encoding threads, shares those cores too:
  - trainer: the whole `trainer convert-text --src DIR --tokenizer gpt2.tiktoken --threads T
    --val-fraction 0` command, wall time: the process's start, reading the tokenizer and the files,
    replacing invalid UTF-8, encoding and writing the HDF5 file all count.
  - tiktoken: `encode_ordinary_batch(texts, num_threads=T)` of tiktoken's gpt2 encoding (the same rank
    file, openai-whisper's copy), timed alone: the files are read and decoded before the clock starts.
MB/s = input bytes / seconds. `ratio` = trainer MB/s / tiktoken MB/s. The token counts are checked to
agree (the trainer's holds one <|endoftext|> per document more); the ids themselves are compared by
tests/test_tokenizer.cpp. `trainer_startup_s` is the same command on a 3-byte file (LibTorch's libraries
and the tokenizer loaded, about 0.5 s); `trainer_encode_mb_per_s` and `encode_ratio` leave it out.

--memory adds the peak resident memory (GNU time's %M) of `trainer convert-text --tokenizer` on three
hard inputs, each beside the same command on a 3-byte file: the fortunes 800 times in one 2.06 GB file;
one line of 100 MB without a space (base64 of random bytes); 2 GiB of NUL bytes (refused, exit 2). They
need about 3 GB of free disk in the temporary folder for a minute.

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


def read_tree(root, keep):
    """Every file under root that keep(path) accepts: flat name -> bytes."""
    files = sorted(f for f in glob.glob(os.path.join(root, "**"), recursive=True) if os.path.isfile(f) and keep(f))
    if not files:
        sys.exit(f"no files under {root}")
    return {os.path.relpath(f, root).replace("/", "_"): open(f, "rb").read() for f in files}


def fortunes():
    """The fortunes package's files (the .dat indexes and .u8 links left out)."""
    if not os.path.isdir("/usr/share/games/fortunes"):
        sys.exit("no /usr/share/games/fortunes (apt-get install fortunes)")
    return read_tree("/usr/share/games/fortunes", lambda f: not f.endswith((".dat", ".u8")))


def inputs(name):
    """The documents of one input: name -> bytes (see the module's docstring)."""
    if name == "distinct":
        docs = {"fortunes_" + k: v for k, v in fortunes().items()}
        docs.update({"python_" + k: v for k, v in read_tree("/usr/lib/python3.11", lambda f: f.endswith(".py")).items()})
        return docs
    if name == "repeated":
        return {f"copy{i:03d}_{k}": v for i in range(32) for k, v in fortunes().items()}
    sys.exit(f"--inputs: unknown input '{name}' (distinct, repeated)")


def measure(a, enc, rank_file, src, tiny, texts, size, threads, work):
    """One row: the trainer's command and tiktoken on the same T cores, best of a.rounds each."""
    if threads > os.cpu_count():
        sys.exit(f"--threads {threads}: this machine has {os.cpu_count()} CPUs")
    cores = f"0-{threads - 1}"
    pinned = ["taskset", "-c", cores, a.trainer, "convert-text", "--tokenizer", rank_file, "--threads", str(threads),
              "--val-fraction", "0", "--out", os.path.join(work, "out")]
    best_ours = best_ref = startup = float("inf")
    summary, ref_tokens = "", 0
    for _ in range(a.rounds):
        # The command's fixed cost (loading LibTorch's libraries and the tokenizer), on a 3-byte file.
        t0 = time.perf_counter()
        subprocess.run(pinned + ["--src", tiny], capture_output=True, check=True)
        startup = min(startup, time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = subprocess.run(pinned + ["--src", src], capture_output=True, text=True)
        best_ours = min(best_ours, time.perf_counter() - t0)
        if r.returncode != 0:
            print(r.stdout + r.stderr, file=sys.stderr)
            return None
        summary = r.stdout.strip()
        everywhere = os.sched_getaffinity(0)
        os.sched_setaffinity(0, set(range(threads)))
        try:
            t0 = time.perf_counter()
            ids = enc.encode_ordinary_batch(texts, num_threads=threads)
            best_ref = min(best_ref, time.perf_counter() - t0)
        finally:
            os.sched_setaffinity(0, everywhere)
        ref_tokens = sum(map(len, ids))
    ours_tokens = int(summary.split(" tokens")[0].split()[-1])
    if ours_tokens != ref_tokens + len(texts):
        print(f"token counts differ: trainer {ours_tokens}, tiktoken {ref_tokens} + {len(texts)} documents", file=sys.stderr)
        return None
    return {"threads": threads, "cores": cores, "bytes": size, "tokens": ours_tokens, "trainer_summary": summary,
            "trainer_s": best_ours, "tiktoken_s": best_ref, "trainer_startup_s": startup,
            "trainer_mb_per_s": size / best_ours / 1e6, "tiktoken_mb_per_s": size / best_ref / 1e6,
            "ratio": best_ref / best_ours,
            # Without the fixed cost: the rate of the encoding itself, which a longer input approaches.
            "trainer_encode_mb_per_s": size / (best_ours - startup) / 1e6, "encode_ratio": best_ref / (best_ours - startup)}


def peak(cmd):
    """Peak RSS in bytes, seconds, exit code and the command's last line, from GNU time."""
    r = subprocess.run(["/usr/bin/time", "-f", "TIME %M %e"] + cmd, capture_output=True, text=True)
    lines = (r.stdout + r.stderr).strip().splitlines()
    kib, secs = next(l for l in reversed(lines) if l.startswith("TIME ")).split()[1:]
    said = [l for l in lines if not l.startswith(("TIME ", "Command exited"))]
    return {"peak_rss_bytes": int(kib) * 1024, "seconds": float(secs), "exit": r.returncode, "said": said[-1] if said else ""}


def measure_memory(trainer, rank_file, text, work):
    files = {"tiny": os.path.join(work, "tiny.txt"), "fortunes_x800": os.path.join(work, "big.txt"),
             "line_100mb": os.path.join(work, "line.txt"), "nul_2gib": os.path.join(work, "nul.txt")}
    with open(files["tiny"], "wb") as f:
        f.write(b"hi\n")
    with open(files["fortunes_x800"], "wb") as f:
        for _ in range(800):
            f.write(text)
    with open(files["line_100mb"], "wb") as f:
        import base64
        f.write(base64.b64encode(os.urandom(75_000_000)))
    with open(files["nul_2gib"], "wb") as f:
        for _ in range(2048):
            f.write(bytes(1 << 20))
    out = {}
    for name, path in files.items():
        out[name] = peak([trainer, "convert-text", "--src", path, "--out", os.path.join(work, "mem_" + name),
                          "--tokenizer", rank_file, "--threads", "2"])
        out[name]["bytes"] = os.path.getsize(path)
        os.remove(path)
        shutil.rmtree(os.path.join(work, "mem_" + name), ignore_errors=True)
        print(f"memory: {name}: {out[name]['peak_rss_bytes'] / 2**20:.0f} MiB peak, {out[name]['seconds']:.1f} s, exit {out[name]['exit']}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    ap.add_argument("--inputs", default="distinct,repeated")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", action="store_true")
    a = ap.parse_args()

    rank_file = tokenizer_ref.rank_file()
    enc = tokenizer_ref.gpt2_encoding()
    work = tempfile.mkdtemp(prefix="tokenize_speed_")
    try:
        text = b"".join(fortunes().values())
        tiny = os.path.join(work, "tiny")
        os.makedirs(tiny)
        with open(os.path.join(tiny, "hi.txt"), "wb") as f:
            f.write(b"hi\n")
        rows = []
        for name in a.inputs.split(","):
            docs = inputs(name)
            src = os.path.join(work, "src_" + name)
            os.makedirs(src)
            for doc, data in docs.items():
                with open(os.path.join(src, doc), "wb") as f:
                    f.write(data)
            texts = [data.decode("utf-8", errors="replace") for data in docs.values() if data]
            for threads in [int(t) for t in a.threads.split(",")]:
                row = measure(a, enc, rank_file, src, tiny, texts, sum(map(len, docs.values())), threads, work)
                if row is None:
                    return 2
                row["input"], row["documents"] = name, len(texts)
                rows.append(row)
                print(f"{name}, {threads} thread(s): trainer {row['trainer_mb_per_s']:.1f} MB/s "
                      f"({row['trainer_encode_mb_per_s']:.1f} without its start), tiktoken {row['tiktoken_mb_per_s']:.1f} MB/s")
            shutil.rmtree(src)
        memory = measure_memory(a.trainer, rank_file, text, work) if a.memory else None
        import tiktoken
        result = {"date": datetime.date.today().isoformat(), "text_bytes": len(text), "rounds": a.rounds,
                  "rank_file": rank_file, "tiktoken": tiktoken.__version__,
                  "trainer_version": subprocess.run([a.trainer, "--version"], capture_output=True, text=True).stdout.strip(),
                  "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                  "rows": rows, "memory": memory}
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
