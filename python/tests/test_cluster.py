"""The cluster client against three `kvplane node` processes in cluster
mode, registered in a real (one-member) etcd: keys are routed to their
owners by the slot table the nodes serve, R=2, W=2.

etcd is the binary scripts/control-plane/build builds:
${KVPLANE_TOOLS:-~/.cache/kvplane-tools}/etcd-vVERSION/etcd, VERSION from
scripts/control-plane/versions. Without it the test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvplane
from conftest import REPO, Node, die_with_parent

PATIENCE_S = 60.0


def etcd_binary() -> Path:
    versions = (REPO / "scripts" / "control-plane" / "versions").read_text()
    version = next(line.split("=", 1)[1].strip().strip('"') for line in versions.splitlines() if line.startswith("ETCD_VERSION="))
    tools = Path(os.environ.get("KVPLANE_TOOLS") or Path.home() / ".cache" / "kvplane-tools")
    return tools / f"etcd-v{version}" / "etcd"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return b'"health":"true"' in r.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One etcd member on loopback ports, stopped by its PID."""
    binary = etcd_binary()
    if not os.access(binary, os.X_OK):
        pytest.skip(f"no etcd at {binary} (scripts/control-plane/build builds it)")
    folder = tmp_path_factory.mktemp("etcd")
    client, peer = free_ports(2)
    log = open(folder / "etcd.log", "w")
    proc = subprocess.Popen(
        [
            str(binary),
            "--name=etcd0",
            f"--data-dir={folder / 'data'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=etcd0=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        preexec_fn=die_with_parent,
    )
    try:
        deadline = time.monotonic() + PATIENCE_S
        while not healthy(client):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"etcd did not become healthy ({proc.poll()}); its log:\n{(folder / 'etcd.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def cluster_node(folder: Path, node_id: str, etcd: str) -> Node:
    config = {
        "backend": "kvplane",
        "metadata": {"etcd": [etcd]},
        "cluster": {"name": "py", "nodeId": node_id, "replicas": 2, "leaseTtlSeconds": 2},
    }
    path = folder / f"{node_id}.json"
    path.write_text(json.dumps(config))
    return Node("--config", str(path), env={"KVPLANE_CACHE_DIR": str(folder / "cache")})


def test_cluster_client_routes_keys_to_their_owners(etcd: str, tmp_path: Path) -> None:
    nodes = [cluster_node(tmp_path, f"n{i}", etcd) for i in range(3)]
    try:
        with kvplane.Client([nodes[0].endpoint], cluster=True, write_quorum=2, timeout=5) as c:
            assert c.cluster
            deadline = time.monotonic() + PATIENCE_S
            while True:
                version, members = c.cluster_table()
                if sorted((m[0], m[2]) for m in members) == [("n0", "up"), ("n1", "up"), ("n2", "up")]:
                    break
                assert time.monotonic() < deadline, f"the table never listed n0..n2 up: version {version}, {members}"
                time.sleep(0.1)
            assert {m[1] for m in members} == {n.endpoint for n in nodes}

            blocks = np.random.default_rng(3).integers(0, 255, size=(48, 8192), dtype=np.uint8)
            keys = [f"chain/{i}" for i in range(48)]
            c.put_from(keys, list(blocks))
            back = np.zeros_like(blocks)
            assert c.get_into(keys, list(back)) == [8192] * 48
            assert np.array_equal(back, blocks)
            assert c.exists([*keys[:2], "absent"]) == [True, True, False]

            # Each key is on its two owners, and every node owns some.
            held = []
            for n in nodes:
                with kvplane.Client(n.endpoint) as direct:
                    held.append(sum(direct.exists(keys)))
            assert sum(held) == 2 * len(keys) and min(held) > 0, held

            matched, lease_ms = c.match_prefix([*keys[:10], "gap", *keys[10:]], lease_ms=1000)
            assert matched == 10 and 0 < lease_ms <= 1000
            assert c.delete(keys[:4]) == [True] * 4
            assert c.exists(keys[:5]) == [False] * 4 + [True]

        with kvplane.Client(nodes[0].endpoint) as node_client, pytest.raises(kvplane.Invalid, match="node client"):
            node_client.cluster_table()
    finally:
        for n in nodes:
            n.stop()
