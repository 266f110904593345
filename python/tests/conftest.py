"""Fixtures: a real `kvplane node` process on a loopback port.

The node binary is $KVPLANE_BIN, else target/debug/kvplane of this
repository (scripts/test builds it before running these tests). Each node
is started on 127.0.0.1 port 0, its address is read from its
"kvplane node serving: tcp ADDR" line on stderr, and it is stopped by its
PID (SIGTERM, then SIGKILL); the kernel also kills it should pytest die
first (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"kvplane node serving.*?tcp (\S+?)(?:,|\s|$)")
START_TIMEOUT_S = 30.0


def kvplane_bin() -> str:
    path = os.environ.get("KVPLANE_BIN") or str(REPO / "target" / "debug" / "kvplane")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no kvplane binary at {path}: build it (cargo build -p kvplane) or set KVPLANE_BIN")
    return path


def die_with_parent() -> None:
    """In a child before exec: the kernel SIGKILLs it when pytest dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Node:
    """A `kvplane node` child process serving on `endpoint`."""

    def __init__(
        self, *extra: str, memory: str = "256MiB", env: dict[str, str] | None = None, listen: str = "127.0.0.1:0"
    ) -> None:
        args = [kvplane_bin(), "node", "--listen", listen, "--admin", "none", "--memory", memory, *extra]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        found = threading.Event()
        self.endpoint = ""

        def drain() -> None:
            # Keeps reading after the serving line, so a chatty node never
            # blocks on a full pipe.
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                m = SERVING.search(line)
                if m and not found.is_set():
                    self.endpoint = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(START_TIMEOUT_S) or not self.endpoint:
            self.stop()
            log = "\n".join(self.log)
            pytest.fail(f"kvplane node did not say where it serves within {START_TIMEOUT_S} s; it printed:\n{log}")
        assert self.endpoint.startswith("127.0.0.1:") and not self.endpoint.endswith(":0"), self.endpoint

    def stop(self) -> None:
        """SIGTERM to this process's PID, then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def client(node: Node) -> Iterator["kvplane.Client"]:  # noqa: F821
    import kvplane

    c = kvplane.Client(node.endpoint)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def unique() -> str:
    """A key prefix no other test uses (the node is shared by a module)."""
    return f"t{time.monotonic_ns()}/"
