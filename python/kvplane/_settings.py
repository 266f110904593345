"""The settings of the engine connectors, and their one validator.

Both connectors take the same settings, each spelled in its engine's terms:
vLLM's ``kv_connector_extra_config`` (JSON values) and the ``kvplane://``
URL LMCache gives its remote storage (text). `Settings.from_extra_config`
and `Settings.from_url` only translate that syntax into values (for a URL:
its hosts or socket path, and its query); `_check` validates the values,
the same rules for both, and a refusal names the setting the way its user
wrote it: ``kv_connector_extra_config.timeout_s: ...`` for vLLM, the URL
and its parameter for LMCache.

The settings (the vLLM key, the URL parameter; the default):

- ``endpoint``: ``HOST:PORT``, ``unix:///path.sock``, or a list of a
  cluster's seeds. In a URL: ``kvplane://HOST:PORT``,
  ``kvplane:///path.sock``, ``kvplane://H1:P1,H2:P2``. Required.
- ``cluster`` (false; in a URL, true when it names several hosts): route
  over the cluster the seeds belong to.
- ``token`` (none): for nodes started with ``--token-file``.
- ``connections`` (the client's default): connections per node.
- ``timeout_s`` (5): seconds allowed for connecting and for each answer.
- ``write_quorum`` (the cluster's ``writeQuorum``, else every owner; a
  cluster only): owners that must store a block before a save succeeds.
- ``shared_memory`` (true): over a Unix socket, move block bytes through
  the memory the node shares; false keeps every byte on the socket.
- ``tls_ca`` (none): a PEM CA file; given, TCP endpoints are reached over
  TLS (nodes started with ``--tls-cert``) and their certificates must be
  signed by it. ``tls_cert`` and ``tls_key`` (none, together): a client
  certificate for nodes started with ``--tls-client-ca``.
  ``tls_server_name`` (the endpoint's host): the name the nodes'
  certificates must carry.
- ``lease_ms`` (10000, the node's default ``--max-lease``): how long a
  lookup pins the blocks it matched, for the load that follows. The node
  grants at most its ``--max-lease``; a longer setting is reported at the
  first connection and clamped by the node.
- ``retry_after_s`` (1): how long a node that could not be reached is taken
  to be down (every lookup a miss) before the next attempt.
- ``namespace`` (""; vLLM only): the first part of every key, so that
  deployments sharing a node do not share blocks.

From ``cluster`` to ``tls_server_name`` they are `kvplane.Client`'s options
(`client_options`); the others are the connectors' own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["Settings", "SettingsError", "SCHEME"]

SCHEME = "kvplane://"

# Text flags (a URL's query); JSON flags are JSON booleans.
_FLAGS = {"true": True, "1": True, "false": False, "0": False}


class SettingsError(ValueError):
    """A setting refused; the message names it in its user's terms, and
    ``setting`` is its name (``None`` for a URL that cannot be read at all)."""

    def __init__(self, message: str, setting: str | None) -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class Settings:
    """What a connector needs to reach kvplane (see the module documentation)."""

    endpoint: str | tuple[str, ...]
    cluster: bool = False
    token: str | None = field(default=None, repr=False)
    connections: int | None = None
    timeout_s: float = 5.0
    write_quorum: int | None = None
    shared_memory: bool = True
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    lease_ms: int = 10_000
    retry_after_s: float = 1.0
    namespace: str = ""

    def client_options(self) -> dict[str, Any]:
        """The keyword arguments of `kvplane.Client` besides its endpoints:
        every one of its options."""
        return {
            "cluster": self.cluster,
            "connections": self.connections,
            "token": self.token,
            "timeout": self.timeout_s,
            "write_quorum": self.write_quorum,
            "shared_memory": self.shared_memory,
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
            "tls_server_name": self.tls_server_name,
        }

    @staticmethod
    def from_extra_config(extra: Mapping[str, Any]) -> Settings:
        """From vLLM's ``kv_connector_extra_config``: JSON values; keys that
        are not settings are left alone (the mapping is the user's)."""
        return _check(extra, _Source("kv_connector_extra_config", text=False, known=_SETTINGS))

    @staticmethod
    def from_url(url: str) -> Settings:
        """From a ``kvplane://`` URL (LMCache's remote storage URL): the
        hosts or the socket path, then the query's parameters; an unknown
        parameter is refused."""
        if not url.startswith(SCHEME):
            raise SettingsError(f"{url!r}: a kvplane URL starts with {SCHEME}", None)
        parts = urlsplit(url)
        # The last of a repeated parameter wins; empty ones are ignored.
        values: dict[str, Any] = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        source = _Source(repr(url), text=True, known=_SETTINGS - {"endpoint", "namespace"})
        source.check_known(values)
        if parts.netloc:
            hosts = [h for h in parts.netloc.split(",") if h]
            if not hosts:
                raise SettingsError(f"{url!r}: no HOST:PORT and no socket path", "endpoint")
            for h in hosts:
                host, _, port = h.rpartition(":")
                if not host or not port.isdigit():
                    raise SettingsError(f"{url!r}: {h!r} is not HOST:PORT", "endpoint")
            endpoint: str | list[str] = hosts if len(hosts) > 1 else hosts[0]
        elif parts.path.startswith("/"):
            hosts = []
            endpoint = f"unix://{parts.path}"
        else:
            raise SettingsError(f"{url!r}: no HOST:PORT and no socket path", "endpoint")
        several = len(hosts) > 1
        settings = _check(values, source, endpoint=endpoint, cluster=several)
        if several and not settings.cluster:
            raise SettingsError(
                f"{source.name('cluster')}: several hosts are a cluster's seeds; cluster=false takes one HOST:PORT", "cluster"
            )
        return settings


_SETTINGS = frozenset(
    {
        "endpoint",
        "cluster",
        "token",
        "connections",
        "timeout_s",
        "write_quorum",
        "shared_memory",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "tls_server_name",
        "lease_ms",
        "retry_after_s",
        "namespace",
    }
)


@dataclass(frozen=True)
class _Source:
    """Where the values come from: `place` (``kv_connector_extra_config``,
    or a URL), whether its values are text (a URL's query) or JSON values,
    and which settings it may set (`known`: another name is refused in a
    URL, left alone in vLLM's mapping)."""

    place: str
    text: bool
    known: frozenset[str]

    def name(self, setting: str) -> str:
        """`setting` as its user names it."""
        return f"{self.place}: {setting}" if self.text else f"{self.place}.{setting}"

    def spell(self, setting: str, value: str) -> str:
        """`setting` set to `value` (JSON text) as its user writes it."""
        return f"{setting}={value}" if self.text else f'"{setting}": {value}'

    def check_known(self, values: Mapping[str, Any]) -> None:
        unknown = sorted(set(values) - self.known)
        if self.text and unknown:
            raise SettingsError(
                f"{self.place}: unknown parameter(s) {', '.join(unknown)} (known: {', '.join(sorted(self.known))})",
                unknown[0],
            )


class _Refused(Exception):
    """What is wrong with one value (`_check` names the setting)."""


def _number(raw: Any, *, text: bool, whole: bool, least: int) -> Any:
    """A number >= `least` (an int when `whole`): from text, as int() or
    float() reads it; a JSON value must be a number (a float is truncated
    when `whole`)."""
    refused = _Refused(f"expected {'a whole number' if whole and text else 'a number'} >= {least}, got {raw!r}")
    if text:
        try:
            value = int(raw) if whole else float(raw)
        except ValueError:
            raise refused from None
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = raw
    else:
        raise refused
    if value < least or (whole and not math.isfinite(value)):
        raise refused
    return int(value) if whole else float(value)


def _flag(raw: Any, *, text: bool, loose: bool = False) -> bool:
    """true or false: in text, true/false/1/0; in JSON a boolean, or, when
    `loose`, any value taken by its truth (`cluster`, which always was)."""
    if text:
        value = _FLAGS.get(str(raw).lower())
        if value is None:
            raise _Refused(f"expected true or false (or 1, 0), got {raw!r}")
        return value
    if isinstance(raw, bool) or loose:
        return bool(raw)
    raise _Refused(f"expected true or false, got {raw!r}")


def _endpoint(raw: Any) -> str | tuple[str, ...]:
    if not raw or not isinstance(raw, (str, list)):
        raise _Refused(
            "the kvplane node to use is required "
            '(e.g. "127.0.0.1:9600", "unix:///run/kvplane/node.sock", or a list of seeds with "cluster": true)'
        )
    if isinstance(raw, str):
        return raw
    if not all(isinstance(e, str) for e in raw):
        raise _Refused(f"expected an endpoint or a list of endpoints (strings), got {raw!r}")
    return tuple(raw)


def _check(values: Mapping[str, Any], source: _Source, *, endpoint: Any = None, cluster: bool = False) -> Settings:
    """The one validator: `values` as `source` gives them. A URL's
    `endpoint` is its hosts or socket path (else ``values["endpoint"]``);
    `cluster` is that setting's default."""
    source.check_known(values)
    text = source.text

    def setting(name: str, parse: Callable[[Any], Any], default: Any) -> Any:
        """`parse` of the value of `name`, or `default` without one."""
        if name not in values or name not in source.known:
            return default
        return value(name, parse, values[name])

    def value(name: str, parse: Callable[[Any], Any], raw: Any) -> Any:
        try:
            return parse(raw)
        except _Refused as e:
            raise SettingsError(f"{source.name(name)}: {e}", name) from None

    def optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda raw: None if raw is None else parse(raw)

    def token(raw: Any) -> str:
        if not isinstance(raw, str):
            raise _Refused(f"expected a string, got {raw!r}")
        return raw

    settings = Settings(
        endpoint=value("endpoint", _endpoint, values.get("endpoint") if endpoint is None else endpoint),
        # Any JSON value, by its truth (as it always was).
        cluster=setting("cluster", lambda raw: _flag(raw, text=text, loose=True), cluster),
        token=setting("token", optional(token), None),
        connections=setting("connections", optional(lambda raw: _number(raw, text=text, whole=True, least=0)), None),
        timeout_s=setting("timeout_s", lambda raw: _number(raw, text=text, whole=False, least=0), 5.0),
        write_quorum=setting("write_quorum", optional(lambda raw: _number(raw, text=text, whole=True, least=1)), None),
        shared_memory=setting("shared_memory", lambda raw: _flag(raw, text=text), True),
        tls_ca=setting("tls_ca", optional(token), None),
        tls_cert=setting("tls_cert", optional(token), None),
        tls_key=setting("tls_key", optional(token), None),
        tls_server_name=setting("tls_server_name", optional(token), None),
        lease_ms=setting("lease_ms", lambda raw: _number(raw, text=text, whole=True, least=0), 10_000),
        retry_after_s=setting("retry_after_s", lambda raw: _number(raw, text=text, whole=False, least=0), 1.0),
        # Any JSON value, as its text (as it always was).
        namespace=setting("namespace", str, ""),
    )
    if (settings.tls_cert is None) != (settings.tls_key is None):
        which = "tls_key" if settings.tls_key is None else "tls_cert"
        raise SettingsError(f"{source.name(which)}: tls_cert and tls_key go together (a client certificate and its key)", which)
    if settings.tls_ca is None:
        for other in ("tls_cert", "tls_server_name"):
            if getattr(settings, other) is not None:
                raise SettingsError(f"{source.name(other)}: needs tls_ca (the CA the nodes' certificates are signed by)", other)
    if settings.write_quorum is not None and not settings.cluster:
        raise SettingsError(
            f"{source.name('write_quorum')}: applies to a cluster only ({source.spell('cluster', 'true')})", "write_quorum"
        )
    return settings
