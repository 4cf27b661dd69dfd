#!/usr/bin/env python3
"""Checks README.md and docs/*.md: the figures they cite from JSON, and the voice they speak in.

1. Figures. A line that cites a JSON field as `path/to/file.json`: `field.path[0].key` must hold as many
   bold numbers (**0.960**, **87.6 MiB**, **+15%**, **1582x**) as it has citations; the i-th bold number
   must equal the i-th cited value, rounded as written. Units: % (the JSON holds a fraction), MiB and MB
   (bytes), s and x (as stored). Every bench/results/ path a doc names must exist.
2. Voice. The docs speak to users of the product: no sessions, lent machines, engineers, agents or
   coordinators, nothing about who worked on it.

One line per problem ("FILE:LINE: what"), exit 1 if there is any; silent with exit 0 otherwise.
Standard library only: /usr/bin/python3 scripts/check-docs.py [ROOT]
"""
import json
import pathlib
import re
import sys

CITE = re.compile(r"`([\w./-]+\.json)`:\s*`([\w.\[\]-]+)`")
BOLD = re.compile(r"\*\*([+-]?[\d,]*\.?\d+)\s*(%|MiB|MB|s|x)?\*\*")
PATH = re.compile(r"bench/results/[\w./-]+\.(?:jsonl|json|txt)\b")
VOICE = [
    (re.compile(r"\bsessions?\b", re.I), "speaks of sessions"),
    (re.compile(r"\blent\b", re.I), "speaks of machines lent"),
    (re.compile(r"\bengineers?\b", re.I), "speaks of engineers"),
    (re.compile(r"\bcoordinators?\b", re.I), "speaks of coordinators"),
    (re.compile(r"\b(?:AI |coding )?agents? (?:of|working|who)\b", re.I), "speaks of agents"),
    (re.compile(r"\bthis task\b", re.I), "speaks of a task instead of the product"),
    (re.compile(r"\bother people'?s\b|\bwhose (?:compilers|builds|work)\b", re.I), "speaks of whose work ran beside it"),
    (re.compile(r"\bdiscarded (?:run|round)s?\b", re.I), "keeps the history of discarded runs (git log has it)"),
]


def lookup(data, field):
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", field):
        data = data[int(index)] if index else data[key]
    return data


def as_written(value, unit):
    if unit == "%":
        return value * 100
    if unit == "MiB":
        return value / 2**20
    if unit == "MB":
        return value / 1e6
    return value


def check_figures(root, rel, lineno, line, problems):
    cites = CITE.findall(line)
    if not cites:
        return
    bolds = BOLD.findall(line)
    if len(bolds) != len(cites):
        problems.append(f"{rel}:{lineno}: {len(bolds)} bold figure(s) for {len(cites)} JSON citation(s)")
        return
    for (text, unit), (path, field) in zip(bolds, cites):
        if PATH.fullmatch(path) and not (root / path).exists():
            continue  # main() reports the missing bench/results/ file
        try:
            data = json.loads((root / path).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{rel}:{lineno}: cannot read {path}: {e}")
            continue
        try:
            value = lookup(data, field)
        except (KeyError, IndexError, TypeError):
            problems.append(f"{rel}:{lineno}: {path} has no field {field}")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{rel}:{lineno}: {path} {field} is {value!r}, not a number")
            continue
        written = float(text.replace(",", ""))
        decimals = len(text.split(".")[1]) if "." in text else 0
        expected = as_written(float(value), unit)
        if abs(written - expected) > 0.5 * 10 ** -decimals + 1e-9:
            problems.append(f"{rel}:{lineno}: says {text}{unit or ''}, {path} {field} is {expected:.{decimals + 2}f}")


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    problems = []
    for doc in docs:
        rel = doc.relative_to(root)
        try:
            lines = doc.read_text().splitlines()
        except OSError as e:
            problems.append(f"{rel}: cannot read: {e}")
            continue
        for lineno, line in enumerate(lines, 1):
            for pattern, what in VOICE:
                m = pattern.search(line)
                if m:
                    problems.append(f"{rel}:{lineno}: {what}: \"{m.group(0)}\"")
            for path in PATH.findall(line):
                if not (root / path).exists():
                    problems.append(f"{rel}:{lineno}: names {path}, which does not exist")
            check_figures(root, rel, lineno, line, problems)
    for p in problems:
        print(f"check-docs: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
