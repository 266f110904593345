"""kvplane as the L2 cache of AIBrix's KV cache offloading framework
(PyPI ``aibrix-kvcache`` 0.8), without editing its files.

AIBrix has no registry of L2 backends: ``Connector.create``
(``aibrix_kvcache/l2/connectors/connector.py``) is a fixed if/elif on the
backend name (ROCKSDB, INFINISTORE, HPKV, PRISKV, MOCK, EIC, SHFS). So
kvplane gets in by one explicit call, made in every process that builds
AIBrix's cache (before it is built)::

    import kvplane.aibrix
    kvplane.aibrix.install()      # Connector.create now knows KVPLANE

and the environment AIBrix reads::

    AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND=KVPLANE
    AIBRIX_KV_CACHE_OL_KVPLANE_ENDPOINT=unix:///run/kvplane/node.sock   # or HOST:PORT

`install` wraps ``Connector.create``: for the backend name ``KVPLANE`` it
returns a `KVPlaneConnector`, for every other name it calls AIBrix's own
``create`` unchanged. It is idempotent, and `uninstall` puts the original
back.

Settings (environment; the engine connectors' settings, read and checked by
the same `kvplane._settings`): ``AIBRIX_KV_CACHE_OL_KVPLANE_`` followed by
``ENDPOINT`` (required; ``HOST:PORT``, ``unix:///path.sock``, or
comma-separated seeds of a cluster), ``CLUSTER``, ``TOKEN``,
``CONNECTIONS``, ``TIMEOUT_S`` (5), ``WRITE_QUORUM``, ``SHARED_MEMORY``
(true), ``RETRY_AFTER_S`` (1), ``NAMESPACE`` ("").

Keys: ``{NAMESPACE}@aibrix@{conn_id}@`` followed by AIBrix's own key bytes,
where ``conn_id`` is what AIBrix gives each of its connectors (its
namespace, the partition of heads and layers, and the signatures of the
block spec, key builder and layout), so two deployments whose blocks
differ never share keys.

The connector declares ``mput_mget``: AIBrix's L2 cache then sends a batch
of blocks as one ``put_from`` and reads one as one ``get_into``, straight
between AIBrix's memory regions (CPU slabs) and the node (no copy in
Python; through the memory a node on the same host shares over its Unix
socket). Calls are coroutines of `kvplane.aio` awaited on AIBrix's own
event loop: no thread of AIBrix's executor is taken for I/O. A node that cannot be reached, or an error from it, answers
a status that is not OK (NOT_FOUND for an absent block, ERROR with the
reason otherwise), logged and counted (`KVPlaneConnector.stats`); it never
raises into AIBrix. GPU-direct (``gdr_put``/``gdr_get``), RDMA slab
registration and AIBrix's zero-copy allocate/acquire are not offered.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Awaitable, Callable

import torch
from aibrix_kvcache.l2.connectors.connector import Connector, ConnectorConfig, ConnectorFeature
from aibrix_kvcache.memory import MemoryRegion
from aibrix_kvcache.status import Status, StatusCodes

import kvplane
from kvplane._failures import Failures
from kvplane._settings import _SETTINGS, Settings, _check, _Source
from kvplane.aio import Client as AsyncClient
from kvplane.aio import ReconnectingClient

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "ENV_PREFIX", "KVPlaneConnector", "install", "installed", "uninstall"]

# The value of AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND that selects kvplane
# (AIBrix upper-cases what it reads).
BACKEND = "KVPLANE"
# Each setting is read from ENV_PREFIX + its name upper-cased.
ENV_PREFIX = "AIBRIX_KV_CACHE_OL_KVPLANE_"
# The settings that mean something here (lease_ms does not: AIBrix's L2
# interface has no lookup that pins).
_ENV_SETTINGS = _SETTINGS - {"lease_ms"}

_install_lock = threading.Lock()


def install() -> None:
    """Makes ``aibrix_kvcache``'s ``Connector.create`` return a
    `KVPlaneConnector` for the backend name ``KVPLANE``; other names go to
    AIBrix's own ``create``. Call it before AIBrix builds its cache (its L2
    cache makes its connector when it is constructed); calling it again does
    nothing."""
    with _install_lock:
        if installed():
            return
        original = Connector.__dict__["create"]

        def create(config: ConnectorConfig, **kwargs: Any) -> Connector:
            if config.backend_name == BACKEND:
                return KVPlaneConnector.from_envs(_conn_id(config), config.executor, **kwargs)
            return original.__func__(config, **kwargs)

        create._kvplane_original = original  # type: ignore[attr-defined]
        Connector.create = staticmethod(create)  # type: ignore[method-assign]
        logger.info("kvplane: aibrix_kvcache's Connector.create now makes %s connectors", BACKEND)


def installed() -> bool:
    """Whether `install` has wrapped ``Connector.create``."""
    return hasattr(Connector.__dict__["create"].__func__, "_kvplane_original")


def uninstall() -> None:
    """Puts AIBrix's own ``Connector.create`` back."""
    with _install_lock:
        if installed():
            Connector.create = Connector.__dict__["create"].__func__._kvplane_original  # type: ignore[method-assign]


def _conn_id(config: ConnectorConfig) -> str:
    """The id AIBrix's ``Connector.create`` gives a connector (the same
    formula, so a kvplane connector is keyed as AIBrix's own are)."""
    conn_id = f"{config.namespace}_{config.partition_id}"
    signatures = f"{config.block_spec_signature}{config.key_builder_signature}{config.layout_signature}"
    return f"{conn_id}_{signatures}" if signatures else conn_id


class _EnvSource(_Source):
    """Settings from the environment: a refusal names the variable."""

    def name(self, setting: str) -> str:
        return f"{ENV_PREFIX}{setting.upper()}"

    def spell(self, setting: str, value: str) -> str:
        return f"{ENV_PREFIX}{setting.upper()}={value}"


def settings_from_env(env: Any = None) -> Settings:
    """The connector's settings from ``AIBRIX_KV_CACHE_OL_KVPLANE_*``; a
    `kvplane._settings.SettingsError` names the variable at fault."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for setting in _ENV_SETTINGS:
        raw = env.get(ENV_PREFIX + setting.upper())
        if raw is not None and raw != "":
            values[setting] = raw
    endpoint = values.pop("endpoint", None)
    if endpoint is not None and "," in endpoint:
        endpoint = [e.strip() for e in endpoint.split(",") if e.strip()]
    return _check(values, _EnvSource("environment", text=True, known=frozenset(_ENV_SETTINGS)), endpoint=endpoint or "")


class KVPlaneConnector(Connector[bytes, torch.Tensor]):
    """AIBrix's L2 connector interface over a kvplane node or cluster (see
    the module documentation)."""

    def __init__(self, settings: Settings, conn_id: str, executor: Executor) -> None:
        self.settings = settings
        self.conn_id = conn_id
        # AIBrix hands every connector an executor; this one awaits
        # kvplane.aio instead and needs none.
        self._executor = executor
        self._prefix = f"{settings.namespace}@aibrix@{conn_id}@".encode()
        self._node: ReconnectingClient | None = None
        # Counters and failures (logged at most once per kind every
        # kvplane._failures.LOG_EVERY_S).
        self._failures = Failures(logger, "failed")

    @classmethod
    def from_envs(cls, conn_id: str, executor: Executor, **kwargs: Any) -> KVPlaneConnector:
        """From ``AIBRIX_KV_CACHE_OL_KVPLANE_*`` (see the module
        documentation); AIBrix passes no keyword arguments to its L2
        connectors, and any given is refused, named."""
        if kwargs:
            raise ValueError(f"kvplane connector: unexpected arguments {sorted(kwargs)} (its settings come from {ENV_PREFIX}*)")
        return cls(settings_from_env(), conn_id, executor)

    @property
    def name(self) -> str:
        return "kvplane"

    @property
    def feature(self) -> ConnectorFeature:
        return ConnectorFeature(mput_mget=True)

    def __repr__(self) -> str:
        return f"<KVPlaneConnector {self.settings.endpoint} {self.conn_id}>"

    # --- life ------------------------------------------------------------------------

    def open(self) -> Status:
        """Checks the settings and connects once, so that a wrong token or
        endpoint fails here (INVALID / DENIED); a node that is down is not an
        error (every call a miss until it answers). AIBrix calls this
        outside its event loop."""
        if self._node is None:
            self._node = ReconnectingClient(self.settings, log=logger)
        try:
            AsyncClient(self.settings.endpoint, **self.settings.client_options()).close()
            kvplane.Client(self.settings.endpoint, **self.settings.client_options()).close()
        except (kvplane.Unavailable, kvplane.Timeout) as e:
            logger.warning("kvplane: %s does not answer yet (%s); AIBrix's L2 lookups are misses until it does", self.settings.endpoint, e)
        except kvplane.Denied as e:
            return Status(StatusCodes.DENIED, f"kvplane: {e}")
        except kvplane.Error as e:
            return Status(StatusCodes.INVALID, f"kvplane: {e}")
        return Status.ok()

    def close(self) -> Status:
        if self._node is not None:
            self._node.close()
        # AIBrix closes its L2 cache from __del__, possibly at interpreter
        # exit once this module's globals are gone: the class keeps its own.
        return self._ok()

    _ok = staticmethod(Status.ok)

    def _key(self, key: bytes | str) -> bytes:
        """The node key of one of AIBrix's keys (bytes from its key
        builders; a str, as block hashes, as its UTF-8)."""
        return self._prefix + (key if isinstance(key, (bytes, bytearray)) else str(key).encode())

    def stats(self) -> dict[str, int]:
        """Blocks asked for and found or stored, and ``failed_{op}_{reason}``
        for every call answered with a failure."""
        return self._failures.snapshot()

    # --- the L2 interface ------------------------------------------------------------

    async def exists(self, key: bytes) -> Status:
        found = await self._run("exists", lambda c: c.exists([self._key(key)]))
        if isinstance(found, Status):
            return found
        self._count("exists_found" if found[0] else "exists_missing", 1)
        return Status.ok() if found[0] else Status(StatusCodes.NOT_FOUND)

    async def get(self, key: bytes, mr: MemoryRegion | Sequence[MemoryRegion]) -> Status:
        return _first(await self.mget([key], [mr]))

    async def put(self, key: bytes, mr: MemoryRegion | Sequence[MemoryRegion]) -> Status:
        return _first(await self.mput([key], [mr]))

    async def delete(self, key: bytes) -> Status:
        done = await self._run("delete", lambda c: c.delete([self._key(key)]))
        return done if isinstance(done, Status) else Status.ok()

    async def mget(
        self, keys: Sequence[bytes], mrs: Sequence[MemoryRegion | Sequence[MemoryRegion]]
    ) -> Sequence[Status] | Status:
        """One GET of every key, each value read straight into its memory
        region: per key OK or NOT_FOUND, or one status (ERROR, TIMEOUT,
        with the reason) when the batch failed as a whole."""
        return await self._mget(list(keys), list(mrs))

    async def mput(
        self, keys: Sequence[bytes], mrs: Sequence[MemoryRegion | Sequence[MemoryRegion]]
    ) -> Sequence[Status] | Status:
        """One PUT of every key, sent straight from its memory region: OK per
        key, or one status when the batch failed."""
        return await self._mput(list(keys), list(mrs))

    def get_batches(
        self, keys: Sequence[Any], mrs: Sequence[MemoryRegion | Sequence[MemoryRegion]], batch_size: int
    ) -> Sequence[Sequence[tuple[Any, MemoryRegion | Sequence[MemoryRegion]]]]:
        """Consecutive (key, region) pairs, at most `batch_size` a batch
        (AIBrix's ``AIBRIX_KV_CACHE_OL_L2_CACHE_OP_BATCH``); the client
        splits a batch further only where the node's limits require."""
        pairs = list(zip(keys, mrs))
        step = max(1, batch_size)
        return [pairs[i : i + step] for i in range(0, len(pairs), step)]

    # --- the calls --------------------------------------------------------------------

    async def _mget(self, keys: list[bytes], mrs: list[Any]) -> list[Status] | Status:
        views = [_region_bytes(mr) for mr in mrs]
        refused = next((v for v in views if isinstance(v, Status)), None)
        if refused is not None:
            return refused
        lengths = await self._run("get", lambda c: c.get_into([self._key(k) for k in keys], views))
        if isinstance(lengths, Status):
            return lengths  # the whole batch failed: one status (see _mput)
        statuses: list[Status] = []
        for key, view, n in zip(keys, views, lengths):
            if n is None:
                statuses.append(Status(StatusCodes.NOT_FOUND))
            elif n != len(view):
                # A value of another length is not a block of this spec.
                self._failure("get", "length", f"{self._key(key)!r}: stored {n} bytes, the block is {len(view)}")
                statuses.append(Status(StatusCodes.NOT_FOUND, f"kvplane: stored value is {n} bytes, the block {len(view)}"))
            else:
                statuses.append(Status.ok())
        found = sum(s.is_ok() for s in statuses)
        self._count("get_found", found)
        self._count("get_missing", len(keys) - found)
        return statuses

    async def _mput(self, keys: list[bytes], mrs: list[Any]) -> list[Status] | Status:
        views = [_region_bytes(mr) for mr in mrs]
        refused = next((v for v in views if isinstance(v, Status)), None)
        if refused is not None:
            return refused
        done = await self._run("put", lambda c: c.put_from([self._key(k) for k in keys], views))
        if isinstance(done, Status):
            # The whole batch failed: one status, which AIBrix's L2 cache
            # takes for the batch. A list holding failures is not an option
            # with aibrix_kvcache 0.8: its L2Cache._mput_impl then calls
            # .result() on a Status, which has none, and raises.
            return done
        self._count("put_stored", len(keys))
        return [Status.ok()] * len(keys)

    async def _run(self, op: str, call: Callable[[AsyncClient], Awaitable[Any]]) -> Any:
        """`await call(client)`, or an ERROR status naming the reason when
        the node is down or the call fails (logged and counted, never
        raised)."""
        if self._node is None:
            self._failure(op, "not-open", "the connector was not opened")
            return Status(StatusCodes.ERROR, "kvplane: the connector was not opened")
        client = await self._node.get()
        if client is None:
            self._failure(op, "node-down", f"{self.settings.endpoint} is taken to be down", log=False)
            return Status(StatusCodes.ERROR, f"kvplane: {self.settings.endpoint} is taken to be down")
        try:
            return await call(client)
        except kvplane.Error as e:
            if isinstance(e, (kvplane.Unavailable, kvplane.Timeout)):
                self._node.failed(client, e)
            self._failure(op, type(e).__name__, str(e))
            code = StatusCodes.TIMEOUT if isinstance(e, kvplane.Timeout) else StatusCodes.ERROR
            return Status(code, f"kvplane: {e}")
        except Exception as e:  # noqa: BLE001 -- a bug here must not fail AIBrix's request either
            logger.exception("kvplane: %s failed unexpectedly", op)
            self._failure(op, type(e).__name__, str(e), log=False)
            return Status(StatusCodes.ERROR, e)

    def _failure(self, op: str, reason: str, detail: str, *, log: bool = True) -> None:
        self._failures.failure(op, reason, detail, log=log)

    def _count(self, name: str, n: int) -> None:
        self._failures.count((name, n))


def _first(statuses: Sequence[Status] | Status) -> Status:
    return statuses if isinstance(statuses, Status) else statuses[0]


def _region_bytes(mr: Any) -> memoryview | Status:
    """An AIBrix memory region's bytes as a memoryview of its slab (no
    copy), or INVALID for what this connector does not move (GPU memory,
    lists of regions for GPU-direct)."""
    if not isinstance(mr, MemoryRegion):
        return Status(StatusCodes.INVALID, "kvplane: GPU-direct region lists are not supported (feature gdr_* is off)")
    slab = mr.slab
    if slab.device.type != "cpu":
        return Status(StatusCodes.INVALID, f"kvplane: a memory region on {slab.device} (only host memory is moved)")
    return memoryview(slab.view(torch.uint8)[mr.addr : mr.addr + mr.length].numpy())

