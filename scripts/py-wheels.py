#!/usr/bin/env python3
"""Makes the wheels a bundle carries importable by a Python that lacks them, without pip and without
touching that Python's own packages (scripts/bundle-gpu.sh carries transformers and what it needs for
the GPU window's Llama-family row; scripts/gpu-check.sh calls this on the host).

    py-wheels.py DEST WHEEL...

Each wheel whose top-level modules this interpreter cannot import already is unpacked into DEST (a wheel
is a zip laid out as site-packages, its .dist-info included, so importlib.metadata finds its version);
a wheel this interpreter already has is left out, so the host's own torch, numpy or filelock stay the
ones imported. Prints one line: what was unpacked and what was already there. Put DEST on PYTHONPATH
after this. Exit 0; 2 on a wheel that is not a readable zip (named in one line)."""
import importlib.util
import os
import sys
import zipfile


def top_modules(names):
    """The importable top-level names a wheel installs ("yaml/...", "typing_extensions.py", "_yaml/...")."""
    tops = set()
    for n in names:
        head = n.split("/", 1)[0]
        if head.endswith((".dist-info", ".data")):
            continue
        mod = head[:-3] if head.endswith(".py") else head
        if mod.isidentifier():
            tops.add(mod)
    return tops


def main(argv):
    if len(argv) < 2:
        print("usage: py-wheels.py DEST WHEEL...", file=sys.stderr)
        return 2
    dest, wheels = argv[0], argv[1:]
    unpacked, present = [], []
    for whl in wheels:
        name = os.path.basename(whl).split("-", 1)[0]
        try:
            with zipfile.ZipFile(whl) as z:
                mods = top_modules(z.namelist())
                if mods and all(importlib.util.find_spec(m) is not None for m in mods):
                    present.append(name)
                    continue
                z.extractall(dest)
                unpacked.append(name)
        except (OSError, zipfile.BadZipFile) as e:
            print("error: wheel %s: %s" % (whl, e), file=sys.stderr)
            return 2
    print("py-wheels: unpacked into %s: %s; already importable: %s"
          % (dest, " ".join(unpacked) or "none", " ".join(present) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
