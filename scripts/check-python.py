#!/usr/bin/env python3
"""Names a function of bench/ or scripts/ reads that nothing defines: a module-level name that does not
exist, in under a second, without running anything. Most of bench/'s Python runs in full only on a GPU
host (the CUDA branches of bench/reference.py): a name that exists only in another function's scope there
(`torch`, imported lazily and passed as an argument) fails only in a GPU window, where every minute
counts. Usage: scripts/check-python.py [FILE ...] (default: bench/*.py scripts/*.py). Exit 1: one line
per such name, `file:line: function: name`."""
import builtins
import glob
import os
import symtable
import sys


def undefined(path):
    src = open(path, encoding="utf-8").read()
    top = symtable.symtable(src, path, "exec")
    module = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = module | set(dir(builtins)) | {"__file__", "__name__", "__doc__"}
    found = []

    def walk(table):
        for child in table.get_children():
            if child.get_type() == "function":
                for s in child.get_symbols():
                    if s.is_global() and s.is_referenced() and s.get_name() not in known:
                        found.append((child.get_lineno(), child.get_name(), s.get_name()))
            walk(child)

    walk(top)
    return found


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sys.argv[1:] or sorted(glob.glob(os.path.join(root, "bench", "*.py")) +
                                   glob.glob(os.path.join(root, "scripts", "*.py")))
    bad = 0
    for f in files:
        for line, func, name in undefined(f):
            print(f"{os.path.relpath(f, root)}:{line}: {func}: '{name}' is defined nowhere in its module")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
