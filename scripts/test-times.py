#!/usr/bin/env python3
"""Every test case's time, from the GoogleTest XML reports that each suite's process writes under
<build>/tests/results/ (tests/add_suites.cmake): how many ran, passed, failed and were skipped, and the
slowest test cases and suites.

    scripts/test-times.py build [build-cuda ...]        a summary per build folder (a leg)
    scripts/test-times.py build --top 20 --markdown     the table docs/TESTING.md shows
    scripts/test-times.py build build-cuda --costs tests/costs.txt
                                                        each suite's seconds (the larger of the legs), which
                                                        CTest reads to start the long suites first
    scripts/test-times.py build --json out.json         the same figures as JSON

Exit 0; 1 if a report holds a failure; 2 if a folder has no reports (run ctest there first).
"""
import argparse
import json
import pathlib
import sys
import xml.etree.ElementTree as ET


def read_leg(folder):
    """The test cases and suites of one build folder's reports."""
    path = pathlib.Path(folder)
    results = path / "tests" / "results" if (path / "tests" / "results").is_dir() else path
    files = sorted(results.glob("*.xml"))
    cases, suites, setups = [], {}, []
    for f in files:
        try:
            root = ET.parse(f).getroot()
        except ET.ParseError as e:
            sys.exit(f"test-times: {f}: not a complete GoogleTest report ({e}); was its process killed?")
        # A report is one process: its time less its suites' is what the suites' shared fixtures took
        # (SetUpTestSuite, TearDownTestSuite), which GoogleTest counts in no test case.
        in_suites = sum(float(s.get("time", 0)) for s in root.iter("testsuite"))
        shared = float(root.get("time", 0)) - in_suites
        for suite in root.iter("testsuite"):
            name = suite.get("name")
            suites[name] = suites.get(name, 0.0) + float(suite.get("time", 0)) + max(shared, 0.0)
            if shared >= 0.5:
                setups.append({"name": f"{name} (the suite's shared set-up)", "seconds": shared, "state": "set-up"})
                shared = 0.0
            for case in suite.iter("testcase"):
                if case.get("status") == "notrun" or case.get("result") == "suppressed":
                    state = "disabled"
                elif case.find("failure") is not None or case.find("error") is not None:
                    state = "failed"
                elif case.get("result") == "skipped" or case.find("skipped") is not None:
                    state = "skipped"
                else:
                    state = "passed"
                cases.append({"name": f"{name}.{case.get('name')}", "seconds": float(case.get("time", 0)),
                              "state": state})
    counts = {s: sum(1 for c in cases if c["state"] == s) for s in ("passed", "failed", "skipped", "disabled")}
    counts["run"] = counts["passed"] + counts["failed"] + counts["skipped"]
    # The shared set-ups are listed with the test cases' times (they are a suite's cost), not counted as tests.
    return {"folder": str(folder), "reports": len(files), "cases": cases + setups, "suites": suites,
            "counts": counts, "seconds": sum(c["seconds"] for c in cases + setups)}


def slowest(leg, top):
    return sorted(leg["cases"], key=lambda c: -c["seconds"])[:top]


def print_leg(leg, top, markdown):
    n = leg["counts"]
    print(f"{leg['folder']}: {n['run']} tests run: {n['passed']} passed, {n['failed']} failed, "
          f"{n['skipped']} skipped ({n['disabled']} disabled, not run); {len(leg['suites'])} suites, "
          f"{leg['seconds']:.0f} s of test time")
    rows = slowest(leg, top)
    share = sum(c["seconds"] for c in rows)
    if markdown:
        print(f"\n| # | test | seconds |\n| ---: | --- | ---: |")
        for i, c in enumerate(rows, 1):
            print(f"| {i} | `{c['name']}` | {c['seconds']:.1f} |")
        print(f"\nThe {len(rows)} slowest: {share:.0f} s of {leg['seconds']:.0f} s.\n")
        return
    print(f"  the {len(rows)} slowest ({share:.0f} s):")
    for c in rows:
        mark = "" if c["state"] in ("passed", "set-up") else f"  [{c['state']}]"
        print(f"  {c['seconds']:8.1f} s  {c['name']}{mark}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="build folders (or their tests/results)")
    ap.add_argument("--top", type=int, default=20, help="how many of the slowest to list (default 20)")
    ap.add_argument("--markdown", action="store_true", help="the slowest as a Markdown table")
    ap.add_argument("--costs", metavar="FILE", help="write each suite's seconds, the larger of the folders'")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    a = ap.parse_args()

    legs = [read_leg(f) for f in a.folders]
    empty = [leg["folder"] for leg in legs if leg["reports"] == 0]
    if empty:
        print(f"test-times: no GoogleTest reports in {', '.join(empty)} (run ctest there first)", file=sys.stderr)
        return 2
    for leg in legs:
        print_leg(leg, a.top, a.markdown)
    if a.costs:
        costs = {}
        for leg in legs:
            for s, t in leg["suites"].items():
                costs[s] = max(costs.get(s, 0.0), t)
        with open(a.costs, "w") as f:
            f.write("# Each GoogleTest suite's seconds, the larger of the legs' (scripts/test-times.py --costs);\n"
                    "# CTest starts the costly suites first (tests/add_suites.cmake). Order only: a stale figure\n"
                    "# makes no test pass or fail.\n")
            for s, t in sorted(costs.items(), key=lambda kv: (-kv[1], kv[0])):
                f.write(f"{s} {t:.1f}\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: leg[k] for k in ("folder", "counts", "seconds", "suites")} |
                       {"slowest": slowest(leg, a.top)} for leg in legs], f, indent=1)
    return 1 if any(leg["counts"]["failed"] for leg in legs) else 0


if __name__ == "__main__":
    sys.exit(main())
