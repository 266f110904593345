"""`kvplane._native.HostPages` with `Client.get_pages` / `put_pages`: the
native page path of the SGLang backend (kvplane.sglang_backend), here on a
host pool of numpy arrays laid out as SGLang's ``page_first`` MHA pool is
(per token slot: K in one buffer, V in another), against a real node. The
backend itself, with SGLang's own pool, is tested in
engines/test_sglang_backend.py."""

from __future__ import annotations

import numpy as np
import pytest

import kvplane
from kvplane._native import HostPages

PAGE = 4  # token slots per page
TOKEN_BYTES = 256  # bytes of K (and of V) per token slot
TOKENS = 16 * PAGE  # slots in the pool: 16 pages


class Pool:
    """A host pool: K and V buffers of TOKENS slots, and SGLang's kind of
    description of where a page's parts lie (counted, to see the table
    ask once per slot)."""

    def __init__(self) -> None:
        self.k = np.zeros(TOKENS * TOKEN_BYTES, dtype=np.uint8)
        self.v = np.zeros(TOKENS * TOKEN_BYTES, dtype=np.uint8)
        self.described: list[int] = []

    def describe(self, starts: list[int]) -> tuple[list[int], list[int]]:
        self.described.extend(starts)
        ptrs = [b.ctypes.data + s * TOKEN_BYTES for s in starts for b in (self.k, self.v)]
        return ptrs, [PAGE * TOKEN_BYTES] * len(ptrs)

    def page(self, start: int) -> bytes:
        span = slice(start * TOKEN_BYTES, (start + PAGE) * TOKEN_BYTES)
        return self.k[span].tobytes() + self.v[span].tobytes()

    def pages(self, prefix: str) -> HostPages:
        return HostPages(
            [memoryview(self.k), memoryview(self.v)],
            prefix=prefix,
            suffixes=["/0", "/1"],
            block_sizes=[PAGE * TOKEN_BYTES] * 2,
            page_tokens=PAGE,
            tokens=TOKENS,
        )


def indices(*starts: int) -> np.ndarray:
    """Host indices of pages from `starts`, as SGLang's int64 tensor's numpy view."""
    return np.concatenate([np.arange(s, s + PAGE, dtype=np.int64) for s in starts])


def test_page_keys_are_prefix_hash_and_suffix_block_by_block(unique: str) -> None:
    pages = Pool().pages(unique)
    assert pages.per_page == 2
    hashes = ["a1", "b2", "ünï"]
    assert pages.keys(hashes) == [f"{unique}{h}/{j}" for h in hashes for j in (0, 1)]
    assert pages.keys([]) == []
    with pytest.raises(TypeError, match=r"hashes\[1\]: a page hash is a str, not bytes"):
        pages.keys(["a", b"b"])


def test_pages_round_trip_into_their_slots_and_each_slot_is_described_once(client: kvplane.Client, unique: str) -> None:
    pool = Pool()
    rng = np.random.default_rng(7)
    pool.k[:] = rng.integers(0, 256, pool.k.size, dtype=np.uint8)
    pool.v[:] = rng.integers(0, 256, pool.v.size, dtype=np.uint8)
    pages = pool.pages(unique)
    hashes = ["p0", "p1", "p2"]
    src = (0, 8, 20)
    sent = {h: pool.page(s) for h, s in zip(hashes, src)}
    assert client.put_pages(pages, hashes, indices(*src), pool.describe) == [False, False, False]
    assert sorted(pool.described) == sorted(src) and len(pages) == 3
    # The blocks are the pages' K and V under the keys the table builds.
    assert client.get(pages.keys(["p1"])) == [sent["p1"][: PAGE * TOKEN_BYTES], sent["p1"][PAGE * TOKEN_BYTES :]]

    # Stored pages are not sent again.
    puts = client.stats()["requests_put"]
    assert client.put_pages(pages, hashes, indices(*src), pool.describe) == [True, True, True]
    assert client.stats()["requests_put"] == puts

    into = (40, 4, 60)
    whole, partial = client.get_pages(pages, hashes, indices(*into), pool.describe)
    assert whole == [True, True, True] and partial == []
    for h, s in zip(hashes, into):
        assert pool.page(s) == sent[h], f"page {h} at slot {s}"
    described = len(pool.described)
    assert client.get_pages(pages, hashes, indices(*into), pool.describe) == ([True] * 3, [])
    assert len(pool.described) == described, "slots seen before are not described again"


def test_a_page_counts_only_whole_and_pages_read_in_part_are_named(client: kvplane.Client, unique: str) -> None:
    pool = Pool()
    pool.k[:] = 1
    pool.v[:] = 2
    pages = pool.pages(unique)
    hashes = ["w0", "w1", "w2"]
    client.put_pages(pages, hashes, indices(0, 4, 8), pool.describe)
    assert client.delete([f"{unique}w1/1"]) == [True]
    whole, partial = client.get_pages(pages, hashes + ["never"], indices(12, 16, 20, 24), pool.describe)
    assert whole == [True, False, True, False]
    assert partial == [1], "w1 has its K and not its V; 'never' has neither"


@pytest.mark.parametrize(
    ("host_indices", "message"),
    [
        (indices(0, TOKENS), rf"host_indices\[4\] = {TOKENS}: page 1 of 4 slots from there lies outside the host pool's {TOKENS} slots"),
        (indices(0, TOKENS - 2), rf"host_indices\[4\] = {TOKENS - 2}: page 1 .* outside the host pool's"),
        (indices(0, -4), r"host_indices\[4\] = -4: page 1 .* outside"),
        (np.array([0, 1, 2, 3, 8, 9, 11, 12], dtype=np.int64), r"host_indices\[6\] = 11: page 1 is not 4 consecutive slots from 8"),
        (indices(0), r"host_indices: 4 indices for 2 pages of 4 tokens"),
        (np.array([0.0] * 8), r"host_indices: a .*ndarray is not a buffer of 8- or 4-byte integers"),
        (indices(4, 4), r"pages 0 and 1 of the batch share memory \(host indices from 4 and 4\)"),
    ],
)
def test_host_indices_that_are_not_pages_of_the_pool_are_refused_before_any_io(
    client: kvplane.Client, unique: str, host_indices: np.ndarray, message: str
) -> None:
    pool = Pool()
    pages = pool.pages(unique)
    before = client.stats()
    for call in (client.get_pages, client.put_pages):
        with pytest.raises(kvplane.Invalid, match=message):
            call(pages, ["x", "y"], host_indices, pool.describe)
    after = client.stats()
    assert [after[k] - before[k] for k in ("requests_get", "requests_put", "requests_exists")] == [0, 0, 0]


def test_int32_host_indices_are_read_too(client: kvplane.Client, unique: str) -> None:
    pool = Pool()
    pool.k[:] = 5
    pages = pool.pages(unique)
    client.put_pages(pages, ["i"], indices(8).astype(np.int32), pool.describe)
    assert client.get_pages(pages, ["i"], indices(12).astype(np.int32), pool.describe) == ([True], [])


def test_a_description_outside_the_pool_or_of_another_size_is_refused(client: kvplane.Client, unique: str) -> None:
    pool = Pool()
    pages = pool.pages(unique)
    elsewhere = np.zeros(PAGE * TOKEN_BYTES, dtype=np.uint8)
    with pytest.raises(kvplane.Invalid, match=r"describe: block 1 of the page at slot 0 \(0x[0-9a-f]+, 1024 bytes\) lies outside the pool's buffers"):
        client.get_pages(pages, ["o"], indices(0), lambda starts: ([pool.k.ctypes.data, elsewhere.ctypes.data], [1024, 1024]))
    # The last page slot's block ends where K ends; one byte more does not fit.
    with pytest.raises(kvplane.Invalid, match=r"lies outside the pool's buffers"):
        client.get_pages(pages, ["o"], indices(0), lambda starts: ([pool.k.ctypes.data + pool.k.size - 1023, pool.v.ctypes.data], [1024, 1024]))
    with pytest.raises(kvplane.Invalid, match=r"describe: block 0 of the page at slot 0 is 512 bytes, not 1024"):
        client.get_pages(pages, ["o"], indices(0), lambda starts: ([pool.k.ctypes.data, pool.v.ctypes.data], [512, 1024]))
    with pytest.raises(kvplane.Invalid, match=r"describe\(1 page starts\) answered 1 addresses and 1 sizes; 2 blocks per page expected"):
        client.get_pages(pages, ["o"], indices(0), lambda starts: ([pool.k.ctypes.data], [1024]))
    assert len(pages) == 0, "nothing refused was learnt"
    with pytest.raises(ZeroDivisionError):
        client.get_pages(pages, ["o"], indices(0), lambda starts: 1 / 0)


def test_the_pool_must_be_writable_memory_and_the_layout_consistent(unique: str) -> None:
    k = np.zeros(1024, dtype=np.uint8)
    k.flags.writeable = False
    with pytest.raises(kvplane.ReadOnlyBuffer, match=r"regions\[0\] .* is read-only"):
        HostPages([k], prefix=unique, suffixes=["/0"], block_sizes=[1024], page_tokens=1, tokens=1)
    with pytest.raises(kvplane.Invalid, match=r"2 suffixes and 1 block sizes"):
        HostPages([], prefix=unique, suffixes=["/0", "/1"], block_sizes=[1024], page_tokens=1, tokens=1)
    with pytest.raises(kvplane.Invalid, match=r"block_sizes\[0\] is 0"):
        HostPages([], prefix=unique, suffixes=["/0"], block_sizes=[0], page_tokens=1, tokens=1)
