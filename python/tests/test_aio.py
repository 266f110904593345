"""kvplane.aio.Client against real `kvplane node` processes: the sync
client's operations as coroutines on the same native core, typed errors,
lazy connection, an event loop that keeps running while a call waits, and
cancellation that leaves no buffer written after the coroutine raised.

Every test runs twice: with the client's default I/O (for a node over TCP,
the event loop's own sockets) and with ``KVPLANE_AIO_IO=thread`` (every
call a task on an I/O thread)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvplane
import kvplane.aio
from conftest import Node
from test_cluster import PATIENCE_S, cluster_node, etcd  # noqa: F401 -- etcd is a fixture

DEADLINE_S = 30.0
MiB = 1 << 20


@pytest.fixture(autouse=True, params=["default", "thread"], ids=lambda io: f"io-{io}")
def io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the clients made in the test do their I/O (read by the
    constructor; subprocesses inherit it)."""
    if request.param == "default":
        monkeypatch.delenv("KVPLANE_AIO_IO", raising=False)
    else:
        monkeypatch.setenv("KVPLANE_AIO_IO", request.param)
    return str(request.param)


def pattern(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


def test_every_operation_round_trips(node: Node, unique: str) -> None:
    async def main() -> None:
        async with kvplane.aio.Client(node.endpoint) as kv:
            assert kv.connected and not kv.closed and not kv.cluster
            assert kv.endpoints == [node.endpoint]
            assert kv.max_block_bytes == 4 * MiB and kv.max_lease_ms > 0
            keys = [f"{unique}{i}" for i in range(8)]
            blocks = [pattern(i, 4096 + i) for i in range(8)]
            # Buffers of every kind the sync client takes.
            sources = [bytearray(b) if i % 2 else memoryview(b) for i, b in enumerate(blocks)]
            assert await kv.put_from(keys, sources) is None
            back = [bytearray(8192) for _ in keys]
            assert await kv.get_into([*keys, f"{unique}absent"], [*back, bytearray(1)]) == [len(b) for b in blocks] + [None]
            assert [bytes(b[: len(blocks[i])]) for i, b in enumerate(back)] == blocks
            assert all(not any(b[len(blocks[i]) :]) for i, b in enumerate(back)), "nothing written past a value"
            assert await kv.get(keys[3]) == blocks[3]
            assert await kv.get(keys[3].encode()) == blocks[3]
            assert await kv.get(f"{unique}absent") is None
            assert await kv.get([keys[0], f"{unique}absent"]) == [blocks[0], None]
            await kv.put(f"{unique}one", b"v1")
            assert await kv.get(f"{unique}one") == b"v1"
            assert await kv.exists([keys[0], f"{unique}absent"]) == [True, False]
            matched, lease_ms = await kv.match_prefix([*keys[:3], f"{unique}gap", *keys[3:]], lease_ms=1000)
            assert matched == 3 and 0 < lease_ms <= 1000
            assert await kv.match_prefix(keys[:2]) == (2, 0), "no pin asked, none granted"
            stats = await kv.stats()
            assert stats["requests_match_prefix"] >= 2 and stats["keys_put"] >= 9
            assert await kv.delete([keys[0], f"{unique}absent"]) == [True, False]
            assert await kv.exists([keys[0]]) == [False]
            assert await kv.put_from([], []) is None and await kv.get_into([], []) == []
        assert kv.closed
        with pytest.raises(kvplane.Error, match="is closed"):
            await kv.get("k")

    asyncio.run(main())


def test_many_calls_in_flight_at_once(node: Node, unique: str) -> None:
    async def main() -> None:
        async with kvplane.aio.Client(node.endpoint) as kv:
            keys = [f"{unique}{i}" for i in range(64)]
            await asyncio.gather(*(kv.put(k, pattern(i, 16384)) for i, k in enumerate(keys)))
            buffers = [bytearray(16384) for _ in keys]
            got = await asyncio.gather(*(kv.get_into([k], [b]) for k, b in zip(keys, buffers)))
            assert got == [[16384]] * 64
            assert [bytes(b) for b in buffers] == [pattern(i, 16384) for i in range(64)]
            # A key's buffer may be a list of buffers, filled in order.
            halves = [(bytearray(8192), bytearray(8192)) for _ in keys]
            assert await kv.get_into(keys, halves) == [16384] * 64
            assert [bytes(a + b) for a, b in halves] == [pattern(i, 16384) for i in range(64)]

    asyncio.run(main())


def test_no_call_sleeps_until_its_timeout_when_many_share_the_connections(node: Node, unique: str) -> None:
    """64 calls at once over a fresh client's 4 connections, fifty times:
    each call ends long before the client's timeout. A lost wake-up in the
    connections' read hand-over (a call that had driven the reads replacing
    the new driver's waker) left a call asleep with its answer in hand until
    its timeout's timer polled it, which then succeeded, with no error to
    show for it: twenty rounds met it in two runs of three."""
    timeout = 8.0

    async def main() -> None:
        for n in range(50):
            kv = kvplane.aio.Client(node.endpoint, timeout=timeout)

            async def timed(key: str) -> float:
                started = time.monotonic()
                await kv.put(key, b"x" * 16384)
                return time.monotonic() - started

            took = await asyncio.gather(*(timed(f"{unique}{n}/{i}") for i in range(64)))
            kv.close()
            slow = [(i, seconds) for i, seconds in enumerate(took) if seconds > timeout / 2]
            assert not slow, f"round {n}: calls (index, seconds) that waited for their timeout: {slow}"

    asyncio.run(main())


def test_errors_are_typed_and_name_the_key(node: Node, unique: str) -> None:
    async def main() -> None:
        async with kvplane.aio.Client(node.endpoint) as kv:
            await kv.put(f"{unique}big", b"x" * 100)
            small = bytearray(10)
            with pytest.raises(kvplane.BufferTooSmall) as e:
                await kv.get_into([f"{unique}a", f"{unique}big"], [bytearray(4), small])
            assert (e.value.key, e.value.index) == (f"{unique}big".encode(), 1)
            assert "buffers[1] is too small" in str(e.value) and small == bytearray(10)
            with pytest.raises(kvplane.ReadOnlyBuffer, match=r"buffers\[0\]"):
                await kv.get_into([f"{unique}big"], [b"read-only"])
            shared = bytearray(64)
            view = memoryview(shared)
            with pytest.raises(kvplane.OverlappingBuffers, match=r"buffers\[0\] and buffers\[1\] share memory"):
                await kv.get_into(["a", "b"], [view[0:40], view[32:64]])
            with pytest.raises(kvplane.Invalid, match="2 keys but 1 buffers"):
                await kv.put_from(["a", "b"], [b"x"])
            with pytest.raises(TypeError, match=r"keys\[1\]: a key is str or bytes, not int"):
                await kv.exists(["a", 5])
            with pytest.raises(kvplane.Invalid, match="expected a key"):
                await kv.get(5)
            too_long = bytes(5 * MiB)
            with pytest.raises(kvplane.Error) as refused:
                await kv.put(f"{unique}huge", too_long)
            assert refused.value.key == f"{unique}huge".encode() and refused.value.index == 0
            with pytest.raises(kvplane.Invalid, match="node client"):
                kv.cluster_table()
            # The client goes on after every refusal.
            assert await kv.get(f"{unique}big") == b"x" * 100

    asyncio.run(main())


def test_options_are_checked_and_connecting_is_lazy() -> None:
    gone = Node()
    endpoint = gone.endpoint
    gone.stop()

    async def main() -> None:
        with pytest.raises(kvplane.Invalid, match="timeout must be a positive number"):
            kvplane.aio.Client(endpoint, timeout=0)
        with pytest.raises(kvplane.Invalid, match="write_quorum applies to a cluster client"):
            kvplane.aio.Client(endpoint, write_quorum=1)
        with pytest.raises(kvplane.Invalid, match="write_quorum must be at least 1"):
            kvplane.aio.Client([endpoint], cluster=True, write_quorum=0)
        with pytest.raises(kvplane.Invalid, match="takes one endpoint, not 2"):
            kvplane.aio.Client([endpoint, endpoint])
        # Made without I/O; the node's absence shows at the first call.
        kv = kvplane.aio.Client(endpoint, timeout=5)
        assert not kv.connected
        with pytest.raises(kvplane.Error, match=r"max_block_bytes: .* not connected yet; await connect\(\) first"):
            kv.max_block_bytes
        with pytest.raises(kvplane.Unavailable, match=f"connect to {endpoint}"):
            await kv.connect()
        with pytest.raises(kvplane.Unavailable, match=f"connect to {endpoint}"):
            await kv.exists(["k"])
        assert not kv.connected
        kv.close()

    asyncio.run(main())


def test_calls_waiting_for_the_first_connection_share_it(unique: str) -> None:
    node = Node()
    try:

        async def main() -> None:
            async with kvplane.aio.Client(node.endpoint, connections=1) as probe:
                before = (await probe.stats())["connections_total"]
                kv = kvplane.aio.Client(node.endpoint, connections=1)
                answers = await asyncio.gather(*(kv.exists([f"{unique}{i}"]) for i in range(20)))
                assert answers == [[False]] * 20
                assert (await probe.stats())["connections_total"] == before + 1, "one connection for all 20 calls"
                kv.close()

        asyncio.run(main())
    finally:
        node.stop()


EXIT_SCRIPT = """
import asyncio, sys
import kvplane.aio

async def main():
    kv = kvplane.aio.Client(sys.argv[1])
    blocks = [bytes(4096)] * 16
    for i in range(100):
        await kv.put_from([f"{sys.argv[2]}{j}" for j in range(16)], blocks)

asyncio.run(main())
"""


def test_a_program_exits_cleanly_right_after_its_last_call(unique: str) -> None:
    """A program whose last call has just returned exits with status 0.
    The I/O thread that woke the loop for that call may still be inside
    Python (call_soon_threadsafe) when the program starts to finalize; it
    is waited for at exit (without that, 'Fatal Python error: Aborted' in
    4 to 6 of 15 runs of scripts/bench-python's asyncio client). A node of
    its own: the other tests' keys stay where they are."""
    node = Node()
    try:
        failed = []
        for run in range(12):
            proc = subprocess.run(
                [sys.executable, "-c", EXIT_SCRIPT, node.endpoint, unique],
                capture_output=True,
                text=True,
                timeout=DEADLINE_S,
                env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            )
            if proc.returncode != 0:
                failed.append(f"run {run}: status {proc.returncode}: {proc.stderr.strip()[-300:]}")
        assert not failed, "\n".join(failed)
    finally:
        node.stop()


def stop_and_wait(pid: int) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is stopped:
    the signal is delivered asynchronously, so a thread running on another
    core can still answer a request sent right after `kill` returns."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                # The state follows the parenthesised command name.
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped within {DEADLINE_S} s: thread states {states}"
        time.sleep(0.001)


def test_the_event_loop_runs_while_a_call_waits(unique: str) -> None:
    """A node frozen by SIGSTOP: the call waits, the loop keeps running
    other coroutines; SIGCONT and the call completes."""
    node = Node()
    try:

        async def main() -> None:
            async with kvplane.aio.Client(node.endpoint, timeout=DEADLINE_S) as kv:
                await kv.put(f"{unique}k", b"v")
                stop_and_wait(node.proc.pid)
                try:
                    call = asyncio.create_task(kv.get(f"{unique}k"))
                    turns = 0
                    deadline = time.monotonic() + DEADLINE_S
                    while turns < 200:
                        await asyncio.sleep(0)
                        turns += 1
                        assert time.monotonic() < deadline, "the event loop was held up: 200 turns took longer than the deadline"
                    assert not call.done(), "the call cannot finish while the node is frozen"
                finally:
                    os.kill(node.proc.pid, signal.SIGCONT)
                assert await call == b"v"

        asyncio.run(main())
    finally:
        node.stop()


def test_a_cancelled_get_into_writes_no_buffer_after_it_raised(node: Node, unique: str) -> None:
    """A 24 MiB GET over one connection, cancelled as soon as it is sent:
    the coroutine raises CancelledError only once its task is gone, so
    buffers overwritten right after stay as written even once the node's
    answer has arrived (a later GET on the same connection, answered in
    order, proves it has)."""

    async def main() -> None:
        async with kvplane.aio.Client(node.endpoint, connections=1, shared_memory=False) as kv:
            keys = [f"{unique}{i}" for i in range(24)]
            await kv.put_from(keys, [bytes([i + 1]) * MiB for i in range(24)])
            before = (await kv.stats())["requests_get"]
            buffers = [bytearray(MiB) for _ in keys]
            cancelled = 0
            for attempt in range(20):
                task = asyncio.create_task(kv.get_into(keys, buffers))
                await asyncio.sleep(0)  # one turn: the coroutine starts and spawns its task
                if task.done():
                    # Finished within that turn (seen now and then with a
                    # release build on a loaded machine): nothing to cancel.
                    await task
                    continue
                cancelled += 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                for b in buffers:
                    b[:] = b"\xee" * MiB
                # The same keys again, on the same connection: its answer comes
                # after the cancelled one's, which the client has then read.
                fresh = [bytearray(MiB) for _ in keys]
                assert await kv.get_into(keys, fresh) == [MiB] * 24
                assert all(f == bytes([i + 1]) * MiB for i, f in enumerate(fresh))
                written = [i for i, b in enumerate(buffers) if b != b"\xee" * MiB]
                assert not written, f"attempt {attempt}: buffers {written} were written after the coroutine raised"
            assert cancelled >= 10, f"only {cancelled} of 20 GETs were still running when cancelled"
            served = (await kv.stats())["requests_get"] - before
            assert served > 20, f"the node served {served} GETs: the cancelled ones were sent too"

    asyncio.run(main())


def test_a_cluster_client(etcd: str, tmp_path: Path, unique: str) -> None:  # noqa: F811
    nodes = [cluster_node(tmp_path, f"a{i}", etcd) for i in range(3)]
    try:

        async def main() -> None:
            async with kvplane.aio.Client([nodes[0].endpoint], cluster=True, timeout=5) as kv:
                assert kv.cluster
                deadline = time.monotonic() + PATIENCE_S
                while sorted((m[0], m[2]) for m in kv.cluster_table()[1]) != [("a0", "up"), ("a1", "up"), ("a2", "up")]:
                    assert time.monotonic() < deadline, f"the table never listed a0..a2 up: {kv.cluster_table()}"
                    await asyncio.sleep(0.1)
                keys = [f"{unique}{i}" for i in range(24)]
                await kv.put_from(keys, [pattern(i, 8192) for i in range(24)])
                back = [bytearray(8192) for _ in keys]
                assert await kv.get_into(keys, back) == [8192] * 24
                assert [bytes(b) for b in back] == [pattern(i, 8192) for i in range(24)]
                matched, lease_ms = await kv.match_prefix([*keys[:5], "gap"], lease_ms=500)
                assert matched == 5 and 0 < lease_ms <= 500
                with pytest.raises(kvplane.Unsupported, match="cluster client"):
                    await kv.stats()

        asyncio.run(main())
    finally:
        for n in nodes:
            n.stop()


def test_the_package_works_without_numpy(node: Node, unique: str) -> None:
    """numpy is an optional extra: with its import blocked, kvplane and
    kvplane.aio import and move bytes."""
    script = f"""
import asyncio, sys
sys.modules["numpy"] = None  # any `import numpy` now raises ImportError
import kvplane, kvplane.aio
with kvplane.Client({node.endpoint!r}) as kv:
    kv.put({unique!r} + "n", bytearray(b"abc"))
    assert kv.get({unique!r} + "n") == b"abc"
async def main():
    async with kvplane.aio.Client({node.endpoint!r}) as kv:
        assert await kv.get({unique!r} + "n") == b"abc"
asyncio.run(main())
assert "numpy" not in {{m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}}
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_io_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_AIO_IO", "fibers")
    with pytest.raises(kvplane.Invalid, match="KVPLANE_AIO_IO must be loop or thread, not \"fibers\""):
        kvplane.aio.Client("127.0.0.1:1")
    monkeypatch.setenv("KVPLANE_AIO_IO", "loop")
    with pytest.raises(kvplane.Invalid, match="KVPLANE_AIO_IO=loop carries plain TCP to one node only, not a cluster client"):
        kvplane.aio.Client(["127.0.0.1:1"], cluster=True)
    kvplane.aio.Client("127.0.0.1:1").close()


def test_a_node_that_never_answers_times_out() -> None:
    """A listener that accepts and never answers the handshake: the call
    fails with Timeout after the client's timeout (the timer fires on the
    I/O runtime's thread and wakes the loop), and the loop is not held."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = "127.0.0.1:%d" % listener.getsockname()[1]

        async def main() -> None:
            kv = kvplane.aio.Client(endpoint, timeout=0.3)
            call = asyncio.create_task(kv.connect())
            turns = 0
            while not call.done():
                await asyncio.sleep(0.01)
                turns += 1
                assert turns < DEADLINE_S * 100, "no timeout"
            assert turns > 3, "the loop ran while the call waited"
            with pytest.raises(kvplane.Timeout, match=f"connect to {endpoint}"):
                await call
            kv.close()

        asyncio.run(main())


def test_a_client_moves_to_the_next_event_loop_once_its_own_is_not_running(node: Node, unique: str, io: str) -> None:
    """One client, two asyncio.run in turn: the second loop's calls work,
    and so do they after a loop that was only stopped, never closed. A call
    from another loop while the first one is running is refused (loop I/O:
    its connections belong to the first loop), saying so."""
    kv = kvplane.aio.Client(node.endpoint)

    async def put() -> None:
        await kv.put(f"{unique}k", b"v")

    async def get() -> bytes | None:
        return await kv.get(f"{unique}k")

    asyncio.run(put())
    assert asyncio.run(get()) == b"v"
    stopped = asyncio.new_event_loop()
    try:
        assert stopped.run_until_complete(get()) == b"v"
        # `stopped` is not closed, yet runs no more: the next loop takes over.
        assert asyncio.run(get()) == b"v"
        assert stopped.run_until_complete(get()) == b"v"
    finally:
        stopped.close()

    outcome: list[object] = []
    holding = threading.Event()
    release = threading.Event()

    async def hold() -> None:
        await kv.exists([f"{unique}k"])
        holding.set()
        while not release.is_set():
            await asyncio.sleep(0.01)

    holder = threading.Thread(target=lambda: asyncio.run(hold()))
    holder.start()
    try:
        assert holding.wait(DEADLINE_S)
        try:
            outcome.append(asyncio.run(get()))
        except kvplane.Error as e:
            outcome.append(e)
    finally:
        release.set()
        holder.join(DEADLINE_S)
    if io == "thread":
        assert outcome == [b"v"]
    else:
        assert isinstance(outcome[0], kvplane.Error) and "another event loop, which is running" in str(outcome[0]), outcome
        # That loop is closed now: this one takes the client over.
        assert asyncio.run(get()) == b"v"
    kv.close()


def test_a_node_killed_mid_call_fails_the_call_and_the_next_call_reconnects(unique: str) -> None:
    """The node is frozen with a GET sent, then killed: the call fails with
    Unavailable (the connection's end reaches the waiting call), other
    coroutines kept running meanwhile, and a new node at the same address
    serves the same client's next call. The GET was never read, so the kill
    resets the connection: the client's reads see ECONNRESET, then end of
    stream; the call is failed by whichever it meets (it waited forever, in
    the event loop's mode, when the socket took both for "not ready yet")."""
    node = Node()
    try:

        async def main() -> None:
            kv = kvplane.aio.Client(node.endpoint, timeout=DEADLINE_S, connections=1)
            await kv.put(f"{unique}k", b"v" * MiB)
            stop_and_wait(node.proc.pid)
            call = asyncio.create_task(kv.get_into([f"{unique}k"], [bytearray(MiB)]))
            await asyncio.sleep(0)
            node.proc.kill()
            node.proc.wait(DEADLINE_S)
            turns = 0
            deadline = time.monotonic() + DEADLINE_S
            while not call.done():
                await asyncio.sleep(0.001)
                turns += 1
                assert time.monotonic() < deadline, "the call never learnt that the node is gone"
            with pytest.raises(kvplane.Unavailable):
                await call
            assert turns > 0, "the loop ran while the call waited"
            again = Node(listen=node.endpoint)
            try:
                assert await kv.get(f"{unique}k") is None, "a new, empty node"
                await kv.put(f"{unique}k", b"w")
                assert await kv.get(f"{unique}k") == b"w"
            finally:
                again.stop()
            kv.close()

        asyncio.run(main())
    finally:
        node.stop()


def sockets_to(port: int) -> int:
    """How many of this process's descriptors are TCP sockets connected to
    `port` on loopback (from /proc: the kernel's own account)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    mine = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        mine += target.startswith("socket:[") and target[8:-1] in inodes
    return mine


def test_a_client_closed_before_its_loop_closes_leaves_no_socket_open(unique: str) -> None:
    """The client is closed between two runs of a loop, and the loop is then
    closed without running again: the connections' sockets are closed all
    the same (the loop's queue held their readers' last wake-ups, and
    closing the loop dropped it). The node is the test's own, so no other
    test's client is counted."""
    node = Node()
    try:
        port = int(node.endpoint.rsplit(":", 1)[1])
        kv = kvplane.aio.Client(node.endpoint, connections=2)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(kv.put_from([f"{unique}a", f"{unique}b"], [b"x" * MiB, b"y" * MiB]))
            assert sockets_to(port) > 0
            kv.close()
        finally:
            loop.close()
        deadline = time.monotonic() + DEADLINE_S
        while sockets_to(port) > 0:
            assert time.monotonic() < deadline, f"{sockets_to(port)} socket(s) to the node still open"
            time.sleep(0.01)
    finally:
        node.stop()
