#!/usr/bin/env python3
"""Measure `tollgate audit` on a corpus of public Rust services against hand labels.

The services' code is not in this repository. Their checkouts live in one folder, one
sub-folder per service named `owner+name` (e.g. `dani-garcia+vaultwarden`), each at the commit
pinned in scripts/audit_corpus_labels.json. To make them (needs the network):

    python3 scripts/audit_corpus.py --clone CHECKOUTS      # git clone + checkout each pin

or by hand, for each service: `git clone https://github.com/<repo> CHECKOUTS/<owner+name>`
then `git -C CHECKOUTS/<owner+name> checkout <commit>`. A tree exported with `git archive` at
the pinned commit is as good (it has no .git, so its commit is not checked).

Then, from the repository's root:

    cargo build --release -p tollgate-cli
    python3 scripts/audit_corpus.py CHECKOUTS [--tollgate target/release/tollgate]

prints per service the lines of Rust read, the audit's time, its findings, what was found
of the labels (true), what was reported but not labelled real (false hits), what was missed,
and recall and precision per service and overall. A finding counts as true when its file and
line are a label's; its kind is compared too and a different kind is printed. Exit status 1
when overall recall is below 90 % or precision below 80 %, 2 on an error.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LABELS = os.path.join(HERE, "audit_corpus_labels.json")


def folder(service):
    return service["repo"].replace("/", "+")


def rust_lines(root, excludes):
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = [
            d
            for d in dirnames
            if not d.startswith(".")
            and d not in ("target", "tests", "benches")
            and os.path.normpath(os.path.join(rel, d)) not in excludes
        ]
        for name in filenames:
            if name.endswith(".rs"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    total += f.read().count(b"\n")
    return total


def clone(checkouts, services):
    os.makedirs(checkouts, exist_ok=True)
    for service in services:
        target = os.path.join(checkouts, folder(service))
        if not os.path.isdir(target):
            url = "https://github.com/" + service["repo"]
            subprocess.run(["git", "clone", "--quiet", url, target], check=True)
        subprocess.run(
            ["git", "-C", target, "checkout", "--quiet", service["commit"]], check=True
        )


def measure(checkouts, tollgate, services):
    rows = []
    totals = {"true": 0, "false": 0, "missed": 0}
    for service in services:
        base = os.path.join(checkouts, folder(service))
        if not os.path.isdir(base):
            print(f"error: {base}: no checkout (see --clone)", file=sys.stderr)
            sys.exit(2)
        if os.path.isdir(os.path.join(base, ".git")):
            head = subprocess.run(
                ["git", "-C", base, "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            if head != service["commit"]:
                print(
                    f"warning: {service['name']}: checkout at {head}, labels at {service['commit']}",
                    file=sys.stderr,
                )
        root = os.path.normpath(os.path.join(base, service["path"]))
        excludes = [os.path.normpath(e) for e in service.get("exclude", [])]
        args = [tollgate, "audit", root, "--format", "json"]
        for exclude in excludes:
            args += ["--exclude", exclude]
        start = time.monotonic()
        run = subprocess.run(args, capture_output=True, text=True)
        elapsed = time.monotonic() - start
        if run.returncode not in (0, 1):
            print(f"error: {service['name']}: exit {run.returncode}: {run.stderr}", file=sys.stderr)
            sys.exit(2)
        out = json.loads(run.stdout)
        found = {(f["file"], f["line"]): f["kind"] for f in out["findings"]}
        real = {(r["file"], r["line"]): r for r in service["real"]}
        true = [key for key in found if key in real]
        false = [key for key in found if key not in real]
        missed = [key for key in real if key not in found]
        wrong_kind = [key for key in true if found[key] != real[key]["kind"]]
        totals["true"] += len(true)
        totals["false"] += len(false)
        totals["missed"] += len(missed)
        recall = len(true) / len(real) if real else None
        precision = len(true) / len(found) if found else None
        rows.append(
            {
                "service": service["name"],
                "framework": service["framework"],
                "lines": rust_lines(root, excludes),
                "seconds": elapsed,
                "skipped": len(out["skipped"]),
                "labelled": len(real),
                "found": len(found),
                "true": len(true),
                "recall": recall,
                "precision": precision,
            }
        )
        for key in false:
            print(f"  false hit  {service['name']}: {key[0]}:{key[1]} [{found[key]}]")
        for key in missed:
            print(f"  missed     {service['name']}: {key[0]}:{key[1]} [{real[key]['kind']}]")
        for key in wrong_kind:
            print(
                f"  other kind {service['name']}: {key[0]}:{key[1]} "
                f"[{found[key]}, labelled {real[key]['kind']}]"
            )
    return rows, totals


def pct(value):
    return "n/a" if value is None else f"{100 * value:.0f} %"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", help="the folder of the services' checkouts")
    parser.add_argument("--tollgate", default="target/release/tollgate")
    parser.add_argument("--clone", action="store_true", help="clone and check out the pins first")
    args = parser.parse_args()
    with open(LABELS) as f:
        services = json.load(f)["services"]
    if args.clone:
        clone(args.checkouts, services)
    rows, totals = measure(args.checkouts, args.tollgate, services)
    print()
    print("| service | framework | lines | time | labelled | findings | true | recall | precision |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['service']} | {row['framework']} | {row['lines']:,} | {row['seconds']:.2f} s "
            f"| {row['labelled']} | {row['found']} | {row['true']} | {pct(row['recall'])} "
            f"| {pct(row['precision'])} |"
        )
    labelled = totals["true"] + totals["missed"]
    found = totals["true"] + totals["false"]
    recall = totals["true"] / labelled if labelled else 1.0
    precision = totals["true"] / found if found else 1.0
    print(
        f"| **all** | | {sum(r['lines'] for r in rows):,} | {sum(r['seconds'] for r in rows):.2f} s "
        f"| {labelled} | {found} | {totals['true']} | **{pct(recall)}** | **{pct(precision)}** |"
    )
    sys.exit(0 if recall >= 0.9 and precision >= 0.8 else 1)


if __name__ == "__main__":
    main()
