"""The engine connectors' settings (kvplane._settings): one validator for
vLLM's ``kv_connector_extra_config`` and LMCache's ``kvplane://`` URL, and
ReconnectingClient passing every `kvplane.Client` option on.

Pure Python (no engine): vLLM's mapping and the URL are what the engines
hand the connectors unchanged. The last test talks to a real node.
"""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path
from typing import Any

import pytest

import kvplane
from conftest import Node
from kvplane._reconnecting import ReconnectingClient
from kvplane._settings import Settings, SettingsError

STUB = Path(__file__).resolve().parents[1] / "kvplane" / "__init__.pyi"
DEFAULTS = Settings(endpoint="h:1")


def vllm(**extra: Any) -> Settings:
    return Settings.from_extra_config({"endpoint": "h:1", **extra})


# --- what both front ends accept --------------------------------------------------------


def test_the_defaults_are_the_same_from_both_front_ends() -> None:
    assert Settings.from_extra_config({"endpoint": "h:1"}) == DEFAULTS
    assert Settings.from_url("kvplane://h:1") == DEFAULTS
    assert (DEFAULTS.cluster, DEFAULTS.token, DEFAULTS.connections, DEFAULTS.timeout_s) == (False, None, None, 5.0)
    assert (DEFAULTS.write_quorum, DEFAULTS.shared_memory, DEFAULTS.lease_ms, DEFAULTS.retry_after_s) == (
        None,
        True,
        10_000,
        1.0,
    )
    assert DEFAULTS.namespace == ""


@pytest.mark.parametrize(
    "extra, url",
    [
        ({"timeout_s": 2.5}, "kvplane://h:1?timeout_s=2.5"),
        ({"timeout_s": 0}, "kvplane://h:1?timeout_s=0"),
        ({"connections": 3}, "kvplane://h:1?connections=3"),
        ({"lease_ms": 500}, "kvplane://h:1?lease_ms=500"),
        ({"retry_after_s": 0}, "kvplane://h:1?retry_after_s=0"),
        ({"token": "secret"}, "kvplane://h:1?token=secret"),
        ({"shared_memory": False}, "kvplane://h:1?shared_memory=false"),
        ({"shared_memory": True}, "kvplane://h:1?shared_memory=1"),
        ({"cluster": True}, "kvplane://h:1?cluster=true"),
        ({"cluster": True, "write_quorum": 2}, "kvplane://h:1?cluster=true&write_quorum=2"),
    ],
)
def test_a_setting_means_the_same_in_vllm_and_in_a_url(extra: dict[str, Any], url: str) -> None:
    assert vllm(**extra) == Settings.from_url(url)


def test_vllm_endpoints_a_cluster_and_its_json_values() -> None:
    s = Settings.from_extra_config(
        {
            "endpoint": ["a:1", "b:2"],
            "cluster": True,
            "write_quorum": 2,
            "connections": 2.7,  # JSON numbers: a float is truncated where a whole number is wanted
            "lease_ms": 1500.0,
            "namespace": "prod",
            "something_else": {"for": "another tool"},  # not a setting: left alone
        }
    )
    assert s.endpoint == ("a:1", "b:2") and s.cluster
    assert (s.write_quorum, s.connections, s.lease_ms, s.namespace) == (2, 2, 1500, "prod")
    assert isinstance(s.connections, int) and isinstance(s.lease_ms, int) and isinstance(s.timeout_s, float)
    # As it always was: `cluster` by its truth, `namespace` as its text,
    # JSON null for the optional numbers and the token.
    assert vllm(cluster=1).cluster is True and vllm(cluster=0).cluster is False
    assert vllm(namespace=7).namespace == "7"
    assert vllm(connections=None, token=None) == DEFAULTS
    assert vllm(endpoint="unix:///run/kvplane/node.sock").endpoint == "unix:///run/kvplane/node.sock"
    assert vllm(endpoint=["a:1"]).endpoint == ("a:1",)


def test_urls_name_a_node_a_socket_or_a_cluster() -> None:
    assert Settings.from_url("kvplane://127.0.0.1:9600").endpoint == "127.0.0.1:9600"
    assert Settings.from_url("kvplane:///run/kvplane/node.sock").endpoint == "unix:///run/kvplane/node.sock"
    seeds = Settings.from_url("kvplane://a:1,b:2?lease_ms=500&token=t")
    assert (seeds.endpoint, seeds.cluster, seeds.lease_ms, seeds.token) == (("a:1", "b:2"), True, 500, "t")
    assert Settings.from_url("kvplane://a:1,b:2?write_quorum=1").write_quorum == 1
    # The last of a repeated parameter wins; text numbers as Python reads them.
    assert Settings.from_url("kvplane://h:1?lease_ms=1&lease_ms=2").lease_ms == 2
    assert Settings.from_url("kvplane://h:1?connections=1_000").connections == 1000
    assert math.isinf(Settings.from_url("kvplane://h:1?retry_after_s=inf").retry_after_s)


def test_the_token_is_not_in_the_settings_repr() -> None:
    assert "secret" not in repr(vllm(token="secret"))


# --- what both refuse, named in the user's terms ------------------------------------------


@pytest.mark.parametrize(
    "extra, setting, message",
    [
        ({"endpoint": None}, "endpoint", "kv_connector_extra_config.endpoint: the kvplane node to use is required"),
        ({"endpoint": ""}, "endpoint", "kv_connector_extra_config.endpoint: the kvplane node to use is required"),
        ({"endpoint": []}, "endpoint", "kv_connector_extra_config.endpoint: the kvplane node to use is required"),
        ({"endpoint": 9600}, "endpoint", "kv_connector_extra_config.endpoint: the kvplane node to use is required"),
        ({"endpoint": ["a:1", 2]}, "endpoint", "kv_connector_extra_config.endpoint: expected an endpoint or a list"),
        ({"timeout_s": "soon"}, "timeout_s", "kv_connector_extra_config.timeout_s: expected a number >= 0, got 'soon'"),
        ({"timeout_s": -1}, "timeout_s", "kv_connector_extra_config.timeout_s: expected a number >= 0, got -1"),
        ({"timeout_s": None}, "timeout_s", "kv_connector_extra_config.timeout_s: expected a number >= 0, got None"),
        ({"timeout_s": True}, "timeout_s", "kv_connector_extra_config.timeout_s: expected a number >= 0, got True"),
        ({"lease_ms": "500"}, "lease_ms", "kv_connector_extra_config.lease_ms: expected a number >= 0, got '500'"),
        ({"lease_ms": math.inf}, "lease_ms", "kv_connector_extra_config.lease_ms: expected a number >= 0, got inf"),
        ({"connections": -2}, "connections", "kv_connector_extra_config.connections: expected a number >= 0"),
        ({"retry_after_s": [1]}, "retry_after_s", "kv_connector_extra_config.retry_after_s: expected a number >= 0"),
        ({"token": 1234}, "token", "kv_connector_extra_config.token: expected a string, got 1234"),
        ({"shared_memory": "no"}, "shared_memory", "kv_connector_extra_config.shared_memory: expected true or false"),
        ({"write_quorum": 2}, "write_quorum", 'kv_connector_extra_config.write_quorum: applies to a cluster only ("cluster": true)'),
        ({"cluster": True, "write_quorum": 0}, "write_quorum", "kv_connector_extra_config.write_quorum: expected a number >= 1"),
    ],
)
def test_vllm_refusals_name_the_extra_config_key(extra: dict[str, Any], setting: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        Settings.from_extra_config({"endpoint": "h:1", **extra})
    assert message in str(e.value)
    assert isinstance(e.value, SettingsError) and e.value.setting == setting


def test_vllm_without_an_endpoint_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.endpoint: the kvplane node to use is required"):
        Settings.from_extra_config({"timeout_s": 5})


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis://h:1", "'redis://h:1': a kvplane URL starts with kvplane://"),
        ("kvplane://host", "'kvplane://host': 'host' is not HOST:PORT"),
        ("kvplane://h:x", "'kvplane://h:x': 'h:x' is not HOST:PORT"),
        ("kvplane://", "'kvplane://': no HOST:PORT and no socket path"),
        ("kvplane://,", "'kvplane://,': no HOST:PORT and no socket path"),
        ("kvplane://h:1?lease=5", "'kvplane://h:1?lease=5': unknown parameter(s) lease"),
        ("kvplane://h:1?namespace=a", "unknown parameter(s) namespace"),  # a vLLM setting only
        ("kvplane://h:1?endpoint=b:2", "unknown parameter(s) endpoint"),  # the URL's hosts are the endpoint
        ("kvplane://h:1?timeout_s=soon", "'kvplane://h:1?timeout_s=soon': timeout_s: expected a number >= 0, got 'soon'"),
        ("kvplane://h:1?timeout_s=-1", "timeout_s: expected a number >= 0, got '-1'"),
        ("kvplane://h:1?connections=2.5", "connections: expected a whole number >= 0, got '2.5'"),
        ("kvplane://h:1?lease_ms=-5", "lease_ms: expected a whole number >= 0, got '-5'"),
        ("kvplane://h:1?retry_after_s=later", "retry_after_s: expected a number >= 0, got 'later'"),
        ("kvplane://h:1?shared_memory=off", "shared_memory: expected true or false (or 1, 0), got 'off'"),
        ("kvplane://h:1?cluster=yes", "cluster: expected true or false (or 1, 0), got 'yes'"),
        ("kvplane://h:1?write_quorum=2", "write_quorum: applies to a cluster only (cluster=true)"),
        ("kvplane://a:1,b:2?write_quorum=0", "write_quorum: expected a whole number >= 1, got '0'"),
        ("kvplane://a:1,b:2?cluster=false", "cluster: several hosts are a cluster's seeds"),
        ("kvplane://h:1?tls_ca=/ca.pem&tls_cert=/me.crt", "tls_key: tls_cert and tls_key go together"),
        ("kvplane://h:1?tls_server_name=cache.example", "tls_server_name: needs tls_ca"),
    ],
)
def test_url_refusals_name_the_url_and_the_parameter(url: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        Settings.from_url(url)
    assert message in str(e.value)


# --- every Client option reaches the client --------------------------------------------------


def client_keywords() -> set[str]:
    """The keyword arguments of `kvplane.Client`, from its stub (and from
    the native class itself where it tells its signature)."""
    tree = ast.parse(STUB.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Client"]
    (init,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("__init__", "__new__")]
    stub = {a.arg for a in init.args.kwonlyargs}
    try:
        native = {p.name for p in inspect.signature(kvplane.Client).parameters.values() if p.kind == p.KEYWORD_ONLY}
    except (TypeError, ValueError):  # no signature: the stub alone
        native = stub
    assert stub == native, f"the stub's Client keywords {sorted(stub)} differ from the native {sorted(native)}"
    return stub


def test_client_options_are_every_keyword_of_client() -> None:
    keywords = client_keywords()
    assert {"write_quorum", "shared_memory", "timeout", "token"} <= keywords
    assert set(DEFAULTS.client_options()) == keywords


EVERY_OPTION = {
    "vllm": lambda: Settings.from_extra_config(
        {
            "endpoint": ["a:1", "b:2"],
            "cluster": True,
            "token": "t",
            "connections": 3,
            "timeout_s": 2,
            "write_quorum": 1,
            "shared_memory": False,
            "tls_ca": "/ca.pem",
            "tls_cert": "/me.crt",
            "tls_key": "/me.key",
            "tls_server_name": "cache.example",
            "retry_after_s": 0,
        }
    ),
    "lmcache": lambda: Settings.from_url(
        "kvplane://a:1,b:2?token=t&connections=3&timeout_s=2&write_quorum=1&shared_memory=false&retry_after_s=0"
        "&tls_ca=/ca.pem&tls_cert=/me.crt&tls_key=/me.key&tls_server_name=cache.example"
    ),
}


@pytest.mark.parametrize("front", sorted(EVERY_OPTION))
def test_reconnecting_client_passes_every_option_unchanged(front: str, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = EVERY_OPTION[front]()
    made: list[tuple[Any, dict[str, Any]]] = []

    class Recorder:
        # What a node grants by default (the client reads it at connect).
        max_lease_ms = 10_000

        def __init__(self, endpoints: Any, **options: Any) -> None:
            made.append((endpoints, options))

        def close(self) -> None:
            pass

    monkeypatch.setattr(kvplane, "Client", Recorder)
    node = ReconnectingClient(settings)
    assert node.get() is not None
    assert made == [
        (
            ("a:1", "b:2"),
            {
                "cluster": True,
                "connections": 3,
                "token": "t",
                "timeout": 2.0,
                "write_quorum": 1,
                "shared_memory": False,
                "tls_ca": "/ca.pem",
                "tls_cert": "/me.crt",
                "tls_key": "/me.key",
                "tls_server_name": "cache.example",
            },
        )
    ]
    node.close()


def test_a_reconnecting_client_made_from_each_front_end_talks_to_a_node(node: Node, unique: str) -> None:
    for i, settings in enumerate((
        Settings.from_extra_config({"endpoint": node.endpoint, "connections": 1, "shared_memory": False, "timeout_s": 5}),
        Settings.from_url(f"kvplane://{node.endpoint}?connections=1&shared_memory=false&timeout_s=5"),
    )):
        client = ReconnectingClient(settings)
        try:
            key = f"{unique}{i}"
            client.call("put_from", None, [key], [b"kv"])
            assert client.call("get", [None], [key]) == [b"kv"]
            assert client.call("delete", [False], [key]) == [True]
        finally:
            client.close()
