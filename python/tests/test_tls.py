"""The Python clients over TLS, against a real `kvplane node --tls-cert`
process (issue 21, item 1). The certificates are made here with the
openssl command-line tool: a CA, a certificate for 127.0.0.1 it signed, and
another CA the node's certificate does not chain to."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvplane
import kvplane.aio
from kvplane._reconnecting import ReconnectingClient
from kvplane._settings import Settings

from conftest import Node

def openssl(*args: str) -> None:
    # scripts/prereqs installs it; missing, every test here fails saying so
    # (never a skip: nothing here needs hardware).
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command line tool is missing (scripts/prereqs python-package installs it)")
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(dir: Path, name: str) -> Path:
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
        "-subj", f"/CN={name}", "-keyout", str(dir / f"{name}.key"), "-out", str(dir / f"{name}.crt"),
    )  # fmt: skip
    return dir / f"{name}.crt"


def issue(dir: Path, ca: str, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by CA `ca`: (certificate, key)."""
    key, csr, cert, ext = (dir / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(dir / f"{ca}.crt"), "-CAkey", str(dir / f"{ca}.key"),
        "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert),
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dir = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(dir, "ca"), make_ca(dir, "other")
    cert, key = issue(dir, "ca", "node")
    return {"ca": ca, "other": other, "cert": cert, "key": key}


@pytest.fixture(scope="module")
def tls_node(pki: dict[str, Path]) -> Iterator[Node]:
    n = Node("--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]), memory="64MiB")
    try:
        yield n
    finally:
        n.stop()


def test_the_client_speaks_tls_and_each_refusal_says_why(tls_node: Node, pki: dict[str, Path], unique: str) -> None:
    with kvplane.Client(tls_node.endpoint, tls_ca=pki["ca"], connections=1) as kv:
        kv.put(f"{unique}k", b"over tls")
        assert kv.get(f"{unique}k") == b"over tls"
    with kvplane.Client(tls_node.endpoint, tls_ca=str(pki["ca"]), tls_server_name="127.0.0.1") as kv:
        assert kv.get(f"{unique}k") == b"over tls"

    with pytest.raises(kvplane.Invalid, match=r"this port requires TLS \(the node runs with --tls-cert\)"):
        kvplane.Client(tls_node.endpoint)
    with pytest.raises(kvplane.Invalid, match=r"TLS: the certificate of .* is not signed by a CA in .*other\.crt \(unknown issuer\)"):
        kvplane.Client(tls_node.endpoint, tls_ca=pki["other"])
    with pytest.raises(kvplane.Invalid, match=r"is not valid for the name \"cache\.example\""):
        kvplane.Client(tls_node.endpoint, tls_ca=pki["ca"], tls_server_name="cache.example")
    with pytest.raises(kvplane.Invalid, match=r"tls_cert and tls_key go together"):
        kvplane.Client(tls_node.endpoint, tls_ca=pki["ca"], tls_cert=pki["cert"])
    with pytest.raises(kvplane.Invalid, match=r"reading the TLS CA file .*missing\.pem"):
        kvplane.Client(tls_node.endpoint, tls_ca=pki["ca"].parent / "missing.pem")


def test_a_plaintext_node_tells_a_tls_client_it_speaks_none(node: Node, pki: dict[str, Path]) -> None:
    with pytest.raises(kvplane.Invalid, match=r"does not speak TLS on this port; it answered in plaintext"):
        kvplane.Client(node.endpoint, tls_ca=pki["ca"])


def test_the_connectors_settings_and_the_asyncio_client_reach_a_tls_node(tls_node: Node, pki: dict[str, Path], unique: str) -> None:
    # The settings the vLLM and LMCache connectors read (a kvplane:// URL here).
    settings = Settings.from_url(f"kvplane://{tls_node.endpoint}?tls_ca={pki['ca']}&connections=1&timeout_s=5")
    node = ReconnectingClient(settings)
    try:
        node.call("put_from", None, [f"{unique}c"], [b"connector"])
        assert node.call("get", [None], [f"{unique}c"]) == [b"connector"]
    finally:
        node.close()

    async def run() -> bytes | None:
        async with kvplane.aio.Client(tls_node.endpoint, tls_ca=pki["ca"]) as kv:
            return await kv.get(f"{unique}c")

    assert asyncio.run(run()) == b"connector"
