#!/usr/bin/env python3
"""Gathers the `fulcrum bench generate --json` files of one bench/run_gpu_env_sweep.sh call into one JSON of the form
`scripts/engine_bench_tables.py --sweep` prints: {"what", "git_commit", "machine", "commands", "runs_by_value"},
the runs in the order given (so a table keeps the call's order, repeats included).

Usage: gather_sweep.py OUT.json --what TEXT --command TEXT LABEL=RUN.json [LABEL=RUN.json ...]  (split at the last "=")
A missing or unreadable run, a run of another commit than the first, or a label given twice is a one-line error
(exit 1), and OUT.json is then not written; it is written whole (a temporary file, then a rename) or not at all.
"""
import argparse
import json
import os
import sys


def gather(what, command, labelled):
    runs = {}
    commit = machine = None
    for item in labelled:
        label, sep, path = item.rpartition("=")  # labels hold "VAR=value"; paths no "="
        if not sep or not label or not path:
            raise ValueError(f"'{item}': expected LABEL=RUN.json")
        if label in runs:
            raise ValueError(f"label '{label}' given twice")
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
            raise ValueError(f"{path}: not a bench generate JSON (no runs list)")
        if commit is None:
            commit, machine = doc.get("git_commit"), doc.get("gpu")
        elif doc.get("git_commit") != commit:
            raise ValueError(f"{path}: commit {doc.get('git_commit')}, the first run's is {commit}")
        runs[label] = doc
    if not runs:
        raise ValueError("no runs given")
    return {"what": what, "git_commit": commit, "machine": machine, "commands": [command], "runs_by_value": runs}


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--what", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN.json")
    args = parser.parse_args(argv)
    try:
        doc = gather(args.what, args.command, args.runs)
    except ValueError as e:
        print(f"gather_sweep: {e}", file=sys.stderr)
        return 1
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
