"""kvplane.DeviceClient where no GPU path exists.

The wheel the tests build has no `cuda` feature, and these machines have no
GPU: a DeviceClient must say so with `GpuUnavailable` and how to get one,
and the rest of the package must keep working. Copies between device memory
and a node are checked on a GPU machine by scripts/device-check (the Rust
path DeviceClient calls); here nothing can run them, and no test pretends to.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import kvplane
from conftest import Node
from test_client import unix_round_trip


def test_without_a_gpu_path_device_client_says_why_and_client_still_serves(tmp_path: Path, unique: str) -> None:
    reason = kvplane.gpu_unavailable_reason()
    if reason is None:
        pytest.skip("a GPU answers here: DeviceClient is checked against it by scripts/device-check")
    path = tmp_path / "kv.sock"
    n = Node("--unix", str(path))
    try:
        with pytest.raises(kvplane.GpuUnavailable) as raised:
            kvplane.DeviceClient(f"unix://{path}", device=0)
        message = str(raised.value)
        assert reason in message, message
        assert message.startswith("DeviceClient("), message
        assert isinstance(raised.value, kvplane.GpuError) and isinstance(raised.value, RuntimeError)
        if "without GPU support" in reason:
            assert "--features cuda" in reason, reason

        # Nothing else is affected: the same node through the same socket.
        unix_round_trip(kvplane.Client(f"unix://{path}"), unique)
    finally:
        n.stop()


def test_device_client_needs_the_nodes_unix_socket() -> None:
    # Checked before the GPU: the GPU path only exists through memory a node
    # shares over its Unix socket.
    with pytest.raises(kvplane.Invalid, match="unix:///path/to/node.sock"):
        kvplane.DeviceClient("127.0.0.1:9600")
    with pytest.raises(kvplane.Invalid, match="timeout"):
        kvplane.DeviceClient("unix:///nonexistent.sock", timeout=0)
