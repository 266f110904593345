"""The kvplane package against a real node: round trips from and into
caller buffers, presence, prefix match with a pin lease, buffer checks that
write nothing outside a buffer, typed errors, the GIL released during I/O."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvplane
from conftest import Node

GUARD = 0xA5


def guarded(size: int, pad: int = 64) -> tuple[bytearray, memoryview]:
    """A bytearray of `size` zero bytes between `pad` guard bytes on each side,
    and a view of just the middle."""
    raw = bytearray([GUARD]) * pad + bytearray(size) + bytearray([GUARD]) * pad
    return raw, memoryview(raw)[pad : pad + size]


def guards_intact(raw: bytearray, pad: int = 64) -> bool:
    return raw[:pad] == bytearray([GUARD]) * pad and raw[-pad:] == bytearray([GUARD]) * pad


def test_round_trip_from_and_into_bytearrays(client: kvplane.Client, unique: str) -> None:
    values = [bytes([i]) * (1000 + i) for i in range(8)]
    keys = [f"{unique}block{i}" for i in range(8)]
    client.put_from(keys, [bytearray(v) for v in values])

    raws, views = zip(*(guarded(2048) for _ in keys))
    absent = f"{unique}absent"
    lengths = client.get_into([*keys, absent], [*views, bytearray(16)])
    assert lengths == [len(v) for v in values] + [None]
    for raw, view, value in zip(raws, views, values):
        assert bytes(view[: len(value)]) == value
        # Only the value's bytes were written; the rest of the buffer and the
        # guards around it are as they were.
        assert bytes(view[len(value) :]) == bytes(2048 - len(value))
        assert guards_intact(raw)
    # str and bytes keys name the same key.
    assert client.get([keys[0].encode()]) == [values[0]]


def test_round_trip_from_and_into_numpy(client: kvplane.Client, unique: str) -> None:
    # A KV cache as one tensor; blocks are its rows (views, no copies).
    cache = np.arange(16 * 4096, dtype=np.uint16).reshape(16, 4096).view(np.float16)
    keys = [f"{unique}layer0/{i}" for i in range(16)]
    client.put_from(keys, list(cache))

    back = np.zeros_like(cache)
    lengths = client.get_into(keys, list(back))
    assert lengths == [cache[0].nbytes] * 16
    assert np.array_equal(back.view(np.uint16), cache.view(np.uint16))

    # memoryviews of one big uint8 array, as an engine's connector passes them.
    flat = np.zeros(16 * cache[0].nbytes, dtype=np.uint8)
    view = memoryview(flat)
    blocks = [view[i * cache[0].nbytes : (i + 1) * cache[0].nbytes] for i in range(16)]
    assert client.get_into(keys, blocks) == lengths
    assert flat.tobytes() == cache.tobytes()


def test_exists_and_delete(client: kvplane.Client, unique: str) -> None:
    keys = [f"{unique}{i}" for i in range(4)]
    client.put_from(keys[:2], [b"a", b"bb"])
    assert client.exists(keys) == [True, True, False, False]
    assert client.delete([keys[0], keys[2]]) == [True, False]
    assert client.exists(keys) == [False, True, False, False]
    assert client.get(keys) == [None, b"bb", None, None]
    assert client.exists([]) == [] and client.delete([]) == []


def test_match_prefix_pins_the_matched_blocks_for_the_lease(client: kvplane.Client, unique: str) -> None:
    chain = [f"{unique}chain/{i}" for i in range(8)]
    # Blocks 0..4 stored, 5 missing, 6..7 stored: the prefix stops at the gap.
    stored = chain[:5] + chain[6:]
    client.put_from(stored, [bytes([i]) * 512 for i in range(len(stored))])

    matched, lease_ms = client.match_prefix(chain, lease_ms=2000)
    assert matched == 5
    assert 0 < lease_ms <= 2000
    assert client.match_prefix(chain, lease_ms=0) == (5, 0)
    assert client.match_prefix([f"{unique}nothing", *chain]) == (0, 0)

    # What was matched is there to read.
    buffers = [bytearray(512) for _ in range(matched)]
    assert client.get_into(chain[:matched], buffers) == [512] * matched


def test_too_small_buffer_raises_and_is_not_written(client: kvplane.Client, unique: str) -> None:
    keys = [f"{unique}small", f"{unique}big"]
    client.put_from(keys, [b"x" * 10, b"y" * 100])
    raw_ok, ok = guarded(64)
    raw_small, small = guarded(99)
    with pytest.raises(kvplane.BufferTooSmall) as e:
        client.get_into(keys, [ok, small])
    assert e.value.index == 1 and e.value.key == keys[1].encode()
    assert "buffers[1]" in str(e.value) and keys[1] in str(e.value) and "99" in str(e.value)
    assert isinstance(e.value, kvplane.BadBuffer) and isinstance(e.value, ValueError)
    # The small buffer untouched; the good one holds its value and nothing
    # past it; nothing around either.
    assert bytes(small) == bytes(99)
    assert bytes(ok) == b"x" * 10 + bytes(54)
    assert guards_intact(raw_ok) and guards_intact(raw_small)


def test_buffers_sharing_memory_are_refused_before_any_io(client: kvplane.Client, unique: str) -> None:
    keys = [f"{unique}a", f"{unique}b"]
    client.put_from(keys, [b"a" * 32, b"b" * 32])
    whole = bytearray(64)
    view = memoryview(whole)
    with pytest.raises(kvplane.OverlappingBuffers) as e:
        client.get_into(keys, [view[0:40], view[32:64]])
    assert e.value.index == 1 and "buffers[0] and buffers[1]" in str(e.value)
    assert whole == bytearray(64)
    # Adjacent, not overlapping: fine.
    assert client.get_into(keys, [view[0:32], view[32:64]]) == [32, 32]
    assert whole == bytearray(b"a" * 32 + b"b" * 32)


def test_a_list_of_buffers_is_filled_in_order(client: kvplane.Client, unique: str) -> None:
    # A KV block stored under one key whose layers lie in separate tensors:
    # the value is read straight into each layer's place, in order.
    keys = [f"{unique}p{i}" for i in range(3)]
    values = [bytes(range(256)) * 35, b"short", bytes(range(100, 200)) * 10]
    client.put_from(keys, values)
    layers = [guarded(4096) for _ in range(3)]
    tail_raw, tail = guarded(1000)
    lengths = client.get_into(keys[:2], [[view for _, view in layers[:2]] + [tail], (bytearray(3), bytearray(8))])
    assert lengths == [8960, 5]
    filled = b"".join(bytes(view) for _, view in layers[:2]) + bytes(tail)
    assert filled[:8960] == values[0] and filled[8960:] == bytes(len(filled) - 8960)
    assert all(guards_intact(raw) for raw, _ in layers) and guards_intact(tail_raw)

    # Too small together: BufferTooSmall, and no part is written.
    parts = [bytearray(400), bytearray(599)]
    with pytest.raises(kvplane.BufferTooSmall) as e:
        client.get_into(keys[2:], [parts])
    assert e.value.index == 0 and "buffers[0]" in str(e.value)
    assert parts == [bytearray(400), bytearray(599)]
    # Parts are checked as buffers are, naming the part; two parts of one
    # key sharing memory are refused before any I/O.
    with pytest.raises(kvplane.ReadOnlyBuffer, match=r"buffers\[0\]\[1\]"):
        client.get_into(keys[2:], [[bytearray(500), bytes(500)]])
    whole = bytearray(1000)
    with pytest.raises(kvplane.OverlappingBuffers, match=r"two parts of buffers\[0\] share memory"):
        client.get_into(keys[2:], [[memoryview(whole)[:600], memoryview(whole)[500:]]])
    assert whole == bytearray(1000)


def test_read_only_and_non_contiguous_buffers_raise_before_any_io(client: kvplane.Client, unique: str) -> None:
    key = f"{unique}v"
    client.put_from([key], [b"z" * 32])
    raw, first = guarded(32)

    for readonly in (bytes(32), memoryview(bytearray(32)).toreadonly(), np.zeros(32, dtype=np.uint8)[:]):
        if isinstance(readonly, np.ndarray):
            readonly.flags.writeable = False
        with pytest.raises(kvplane.ReadOnlyBuffer) as e:
            client.get_into([key, key], [first, readonly])
        assert e.value.index == 1 and "buffers[1]" in str(e.value) and "read-only" in str(e.value)

    strided_raw = bytearray(64)
    for strided in (memoryview(strided_raw)[::2], np.zeros((8, 8), dtype=np.uint8)[:, 1], np.zeros((8, 8), dtype=np.uint8).T):
        with pytest.raises(kvplane.NonContiguousBuffer) as e:
            client.get_into([key, key], [first, strided])
        assert e.value.index == 1 and "not C-contiguous" in str(e.value)
        # A PUT needs one contiguous run too.
        with pytest.raises(kvplane.NonContiguousBuffer):
            client.put_from([key], [strided])
    assert strided_raw == bytearray(64)
    assert bytes(first) == bytes(32) and guards_intact(raw)

    with pytest.raises(kvplane.BadBuffer) as e:
        client.get_into([key], [[0] * 32])
    assert "does not export a buffer" in str(e.value)


def test_bad_arguments_are_typed(client: kvplane.Client, unique: str) -> None:
    with pytest.raises(kvplane.Invalid) as e:
        client.get_into([f"{unique}a", f"{unique}b"], [bytearray(1)])
    assert isinstance(e.value, ValueError) and "2 keys but 1 buffers" in str(e.value)
    with pytest.raises(TypeError, match=r"keys\[1\]"):
        client.exists([f"{unique}a", 7])


def test_errors_name_the_key_at_fault(node: Node, unique: str) -> None:
    # A block over the node's largest (16 MiB by default, less for a small
    # pool) is refused for that key alone.
    with kvplane.Client(node.endpoint) as c:
        keys = [f"{unique}fine", f"{unique}huge"]
        with pytest.raises(kvplane.Error) as e:
            c.put_from(keys, [b"ok", bytearray(32 << 20)])
        assert e.value.index == 1 and e.value.key == keys[1].encode() and keys[1] in str(e.value)
        assert c.get([keys[0]]) == [b"ok"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_that_is_down_raises_unavailable() -> None:
    with pytest.raises(kvplane.Unavailable) as e:
        kvplane.Client(f"127.0.0.1:{free_port()}", timeout=5)
    assert isinstance(e.value, ConnectionError) and "127.0.0.1" in str(e.value)

    n = Node()
    c = kvplane.Client(n.endpoint, connections=1, timeout=5)
    c.put_from(["k"], [b"v"])
    n.stop()
    with pytest.raises(kvplane.Unavailable):
        c.get_into(["k"], [bytearray(8)])
    c.close()
    assert c.closed
    with pytest.raises(kvplane.Error, match="closed"):
        c.exists(["k"])


def test_invalid_settings_are_typed() -> None:
    with pytest.raises(kvplane.Invalid, match="HOST:PORT"):
        kvplane.Client("no-port-here")
    with pytest.raises(kvplane.Invalid, match="cluster=True"):
        kvplane.Client(["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(kvplane.Invalid, match="timeout"):
        kvplane.Client("127.0.0.1:1", timeout=0)


def test_the_gil_is_released_during_a_large_get(client: kvplane.Client, unique: str) -> None:
    block = 2 << 20
    n = 32  # 64 MiB in one call
    keys = [f"{unique}big/{i}" for i in range(n)]
    source = np.random.default_rng(7).integers(0, 255, size=(n, block), dtype=np.uint8)
    client.put_from(keys, list(source))
    dest = np.zeros_like(source)

    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.05)
        start = time.perf_counter()
        lengths = client.get_into(keys, list(dest))
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
    assert lengths == [block] * n
    assert np.array_equal(dest, source)

    # With the GIL held through the call the ticker could not run at all
    # between its start and its end; released, it ticks all along.
    during = [x for x in ticks if start < x < end]
    span = end - start
    gaps = np.diff([start, *during, end])
    print(f"get_into of 64 MiB: {span * 1000:.0f} ms, {len(during)} ticks of another thread meanwhile")
    assert len(during) > 100, f"{len(during)} ticks during a {span * 1000:.0f} ms get"
    assert gaps.max() < span / 2, f"the ticker stalled {gaps.max() * 1000:.0f} ms of a {span * 1000:.0f} ms get"


def test_a_unix_socket_endpoint(tmp_path: Path, unique: str) -> None:
    # On a Unix socket the client may move block bytes through memory the
    # node shares with it; the package's calls are the same.
    path = tmp_path / "kv.sock"
    n = Node("--unix", str(path))
    try:
        for shared_memory in (True, False):
            unix_round_trip(kvplane.Client(f"unix://{path}", shared_memory=shared_memory), f"{unique}{shared_memory}/")
    finally:
        n.stop()


def unix_round_trip(client: kvplane.Client, unique: str) -> None:
    with client as c:
        keys = [f"{unique}u{i}" for i in range(8)]
        blocks = np.random.default_rng(5).integers(0, 255, size=(8, 65536), dtype=np.uint8)
        c.put_from(keys, list(blocks))
        back = np.zeros_like(blocks)
        assert c.get_into(keys, list(back)) == [65536] * 8
        assert np.array_equal(back, blocks)
        raw, small = guarded(65535)
        with pytest.raises(kvplane.BufferTooSmall):
            c.get_into(keys[:1], [small])
        assert bytes(small) == bytes(65535) and guards_intact(raw)
        # A block read straight into the layers it belongs to: each key's
        # value fills its list of buffers in order.
        layers = np.zeros((4, 8, 16384), dtype=np.uint8)
        assert c.get_into(keys, [list(layers[:, b]) for b in range(8)]) == [65536] * 8
        assert np.array_equal(layers.transpose(1, 0, 2).reshape(8, 65536), blocks)


def test_one_client_shared_by_threads(client: kvplane.Client, unique: str) -> None:
    # Engines call from several threads at once (one per layer or request);
    # calls on one client run concurrently and each gets its own answers.
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for r in range(20):
                keys = [f"{unique}w{w}/r{r}/{i}" for i in range(8)]
                blocks = [bytes([w, r, i]) * 1000 for i in range(8)]
                client.put_from(keys, blocks)
                back = [bytearray(3000) for _ in keys]
                assert client.get_into(keys, back) == [3000] * 8
                assert [bytes(b) for b in back] == blocks
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


def test_after_fork_the_child_makes_its_own_client(client: kvplane.Client, node: Node, unique: str) -> None:
    # Engines fork workers; a client's I/O threads do not survive a fork, so
    # the child's use of the parent's client is refused with a typed error,
    # and a client made in the child works.
    client.put_from([f"{unique}f"], [b"parent"])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                client.exists([f"{unique}f"])
            except kvplane.Error as e:
                if "fork" in str(e):
                    with kvplane.Client(node.endpoint) as mine:
                        code = 0 if mine.get([f"{unique}f"]) == [b"parent"] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.get([f"{unique}f"]) == [b"parent"]


def test_a_client_goes_on_after_its_node_restarts() -> None:
    """Between calls nothing reads a client's connections; the next call
    must notice that the node closed them and open new ones, not fail."""
    first = Node()
    endpoint = first.endpoint
    with kvplane.Client(endpoint, connections=1) as kv:
        kv.put_from(["restart/a"], [b"x" * 10])
        first.stop()
        second = Node(listen=endpoint)
        try:
            assert kv.exists(["restart/a"]) == [False], "a new, empty node answers"
            kv.put_from(["restart/b"], [b"y" * 10])
            assert kv.get(["restart/b"]) == [b"y" * 10]
        finally:
            second.stop()


def test_a_refused_block_names_its_key_and_both_sizes(tmp_path: Path) -> None:
    """A block over the node's largest was refused as ``invalid: `` with
    nothing else; now the client knows the node's largest block, refuses
    the block itself and says which key, how large, and the limit."""
    small = Node("--max-block", "64KiB", "--max-lease", "2s", memory="16MiB")
    try:
        with kvplane.Client(small.endpoint) as kv:
            assert kv.max_block_bytes == 64 << 10
            assert kv.max_lease_ms == 2000
            with pytest.raises(kvplane.Invalid) as e:
                kv.put_from(["fits", "too-big"], [bytes(64 << 10), bytes(100_000)])
            text = str(e.value)
            assert e.value.key == b"too-big" and e.value.index == 1, text
            assert "too-big" in text and "100000 bytes" in text and "65536 bytes" in text and "--max-block" in text, text
            assert kv.exists(["fits", "too-big"]) == [True, False]
    finally:
        small.stop()


def test_a_lease_longer_than_the_node_grants_is_reported_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The connectors documented ``lease_ms: 30000`` while a node grants at
    most 10 s by default; now the default fits, and a longer setting is
    reported when the first connection is made."""
    import logging

    from kvplane._reconnecting import ReconnectingClient
    from kvplane._settings import Settings

    short = Node("--max-lease", "2s", memory="16MiB")
    try:
        assert Settings.from_url(f"kvplane://{short.endpoint}").lease_ms <= 10_000
        log = logging.getLogger("kvplane.test.lease")
        node = ReconnectingClient(Settings.from_url(f"kvplane://{short.endpoint}?lease_ms=5000"), log=log)
        with caplog.at_level(logging.WARNING, logger="kvplane.test.lease"):
            assert node.get() is not None
            assert node.get() is not None
        warnings = [r.getMessage() for r in caplog.records if "lease_ms" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "5000" in warnings[0] and "--max-lease 2000 ms" in warnings[0], warnings
        node.close()
    finally:
        short.stop()


def test_one_key_gets_and_puts_as_redis_py_users_expect(client: kvplane.Client, unique: str) -> None:
    """``kv.get("k")`` raised ``TypeError: Can't extract 'str' to 'Vec'``:
    a single key now reads one value (``None`` when absent), ``put`` stores
    one, and a list still reads a batch."""
    key = f"{unique}one"
    assert client.get(key) is None
    client.put(key, b"hello")
    assert client.get(key) == b"hello"
    assert client.get(key.encode()) == b"hello", "a bytes key is one key too"
    client.put(f"{unique}two", bytearray(b"world"))
    assert client.get([key, f"{unique}two", f"{unique}absent"]) == [b"hello", b"world", None]
    with pytest.raises(kvplane.Invalid, match="a key .str or bytes. or a list of keys"):
        client.get(42)  # type: ignore[call-overload]
