"""Builds with clippy's lints on, and fails as `cargo clippy -- -D warnings`
would: the dependencies compiled once for both the tests and the linter.

    lint_build.py CARGO_SUBCOMMAND [ARG...]     e.g.  lint_build.py test --no-run --all-targets

Why: `cargo clippy` runs `cargo check`, whose metadata-only artifacts a test
build cannot use, so CI used to compile every dependency twice, once checked
for clippy and once built for the tests (on 2 cores the check of the default
members alone took about as long as their test build). Clippy's driver is a
complete rustc with clippy's lints added (the Linux kernel builds with it
the same way): cargo runs it for the workspace's own crates when it is
`RUSTC_WORKSPACE_WRAPPER`, and plain rustc for the dependencies, so the
dependencies' artifacts are the test build's own. The workspace's crates
are compiled again for the tests, by rustc: clippy's driver turns off MIR
passes a test build wants (at MIR opt level 0, without the CheckNull and
CheckAlignment passes that make a debug build panic on a null or misaligned
pointer dereference), so its artifacts are for the lints alone.

The lints run at their own levels (warnings stay warnings, so one run shows
every one of them and the build goes on), and cargo replays a fresh crate's
diagnostics, so a warm run counts them as a cold one does. Every warning or
error the compiler reports is printed and counted; the exit status is
non-zero when cargo failed or anything was counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def clippy_driver() -> str:
    """The clippy-driver beside the toolchain's rustc (the `clippy` component)."""
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], check=True, capture_output=True, text=True).stdout.strip()
    driver = os.path.join(sysroot, "bin", "clippy-driver")
    if not os.access(driver, os.X_OK):
        sys.exit(f"lint_build: no {driver}: install the component with `rustup component add clippy`")
    return driver


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    env = dict(os.environ)
    env.setdefault("RUSTC_WORKSPACE_WRAPPER", clippy_driver())
    cmd = ["cargo", *sys.argv[1:], "--message-format=json"]
    print("+ RUSTC_WORKSPACE_WRAPPER=" + env["RUSTC_WORKSPACE_WRAPPER"], *cmd, flush=True)
    counted = {"warning": 0, "error": 0}
    # cargo's own progress goes to stderr, untouched; stdout is JSON lines.
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as cargo:
        assert cargo.stdout is not None
        for line in cargo.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                print(line, end="")
                continue
            if message.get("reason") != "compiler-message":
                continue
            diagnostic = message["message"]
            level = diagnostic.get("level", "")
            if level.startswith("error"):
                level = "error"
            print(diagnostic.get("rendered") or diagnostic.get("message", ""), end="", flush=True)
            if level in counted:
                counted[level] += 1
    status = cargo.returncode
    what = f"{counted['warning']} warning(s), {counted['error']} error(s)"
    if status != 0 or any(counted.values()):
        print(f"lint_build: {what}; cargo exited {status}: failed, as -D warnings fails", flush=True)
        return status or 1
    print(f"lint_build: {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
