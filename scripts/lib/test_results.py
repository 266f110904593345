"""Counts what scripts/test's runners report, from their JUnit XML files:
cargo-nextest's (one file per `cargo nextest run`) and pytest's
(`--junitxml`, one file per run). Nothing is read from the tests' own text
output except one marker line, below.

A test that cannot run for want of hardware (a GPU, an RDMA NIC) returns
early and passes in the runner's eyes; it prints one line starting with
`SKIPPED (no hardware): ` saying what it lacks. nextest keeps each test's
output in its JUnit file (`store-success-output`, .config/nextest.toml), so
such a test is found there, listed, and counted as skipped, never as passed.

    test_results.py --run LABEL=RC:JUNIT ... [--status NAME=RC ...]

LABEL names a runner's run (`cargo`, `cargo-cuda`, `pytest-python-ring`, ...;
the part before the first `-` says which runner), RC is its exit status and
JUNIT its file (absent when the run never got as far as writing one: a build
error, a crash). A run fails the suite when its status is not 0, its file is
missing or unreadable, a test in it failed, or it ran no test at all.
`--status NAME=RC` is a step that counts by its exit status alone: the
benches' smoke runs (a harness-less bench is not a test nextest can list),
`cargo test --doc` (a handful of compile-only examples; libtest has no
stable machine-readable output), the Python wheel's build and install.

Prints the results by runner and one last line, `SUMMARY: ...`; exits 0 when
every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field

HW_MARKER = "SKIPPED (no hardware):"


@dataclass
class Run:
    label: str
    rc: int
    path: str
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: int = 0
    hw_skips: list[str] = field(default_factory=list)
    problem: str | None = None

    @property
    def runner(self) -> str:
        return self.label.split("-", 1)[0]

    @property
    def ok(self) -> bool:
        return self.problem is None and self.rc == 0 and not self.failed and self.passed + len(self.hw_skips) > 0


def read(run: Run) -> Run:
    try:
        root = ET.parse(run.path).getroot()
    except FileNotFoundError:
        run.problem = f"no results file ({run.path}): the run stopped before writing it (exit {run.rc})"
        return run
    except ET.ParseError as e:
        run.problem = f"{run.path}: not JUnit XML ({e})"
        return run
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')} {case.get('name', '')}".strip()
        if case.find("failure") is not None or case.find("error") is not None:
            run.failed.append(name)
        elif case.find("skipped") is not None:
            run.skipped += 1
        else:
            output = "\n".join(e.text or "" for e in (case.find("system-out"), case.find("system-err")) if e is not None)
            marks = [line.strip() for line in output.splitlines() if HW_MARKER in line]
            if marks:
                run.hw_skips.append(f"{name}: {marks[0][marks[0].index(HW_MARKER):]}")
            else:
                run.passed += 1
    if run.rc != 0 and not run.failed:
        run.problem = f"exited {run.rc} although no test in {run.path} failed"
    return run


def parse_run(spec: str) -> Run:
    label, sep, rest = spec.partition("=")
    rc, sep2, path = rest.partition(":")
    if not sep or not sep2 or not label or not rc.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected LABEL=RC:JUNIT")
    return Run(label, int(rc), path)


def parse_status(spec: str) -> tuple[str, int]:
    name, sep, rc = spec.partition("=")
    if not sep or not name or not rc.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=RC")
    return name, int(rc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=parse_run, action="append", default=[], metavar="LABEL=RC:JUNIT")
    parser.add_argument("--status", type=parse_status, action="append", default=[], metavar="NAME=RC")
    args = parser.parse_args()
    runs = [read(r) for r in args.run]

    print()
    print("==> results (from the runners' JUnit files)")
    totals: Counter[str] = Counter()
    failed_runners = []
    for runner in dict.fromkeys(r.runner for r in runs):
        mine = [r for r in runs if r.runner == runner]
        passed = sum(r.passed for r in mine)
        failed = sum(len(r.failed) for r in mine)
        skipped = sum(r.skipped for r in mine)
        hw = [s for r in mine for s in r.hw_skips]
        totals.update(passed=passed, failed=failed, skipped=skipped, hw=len(hw))
        detail = ", ".join(f"{r.label}: {r.passed}" for r in mine)
        print(f"{runner}: {passed} passed, {failed} failed, {skipped} skipped ({detail})")
        for s in hw:
            print(f"        skipped for want of hardware (not counted as passed): {s}")
        for r in mine:
            for name in r.failed:
                print(f"        FAILED {r.label}: {name}")
            if r.problem:
                print(f"        {r.label}: {r.problem}")
            elif r.rc == 0 and not r.failed and r.passed + len(r.hw_skips) == 0:
                print(f"        {r.label}: ran no test")
        if not all(r.ok for r in mine):
            failed_runners.append(runner)
    for name, rc in args.status:
        print(f"{name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'}")
        if rc != 0:
            failed_runners.append(name)

    summary = f"{totals['passed']} passed, {totals['failed']} failed"
    if totals["hw"]:
        summary += f", {totals['hw']} skipped (no hardware)"
    if totals["skipped"]:
        summary += f", {totals['skipped']} skipped (pytest)"
    per_runner = "; ".join(
        f"{runner}: {sum(r.passed for r in runs if r.runner == runner)} passed" for runner in dict.fromkeys(r.runner for r in runs)
    )
    summary += f" ({per_runner})"
    if failed_runners:
        summary += ", FAILED: " + " ".join(dict.fromkeys(failed_runners))
    print(f"SUMMARY: {summary}")
    return 1 if failed_runners or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
