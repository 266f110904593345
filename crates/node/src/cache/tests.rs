use std::thread;
use std::time::Instant;

use super::*;
use crate::memory::PoolConfig;
use kvplane_protocol::KvError;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const BLOCK: usize = 4 * KIB;
/// A 1 MiB pool of 4 KiB blocks holds exactly this many.
const SLOTS: u64 = (MIB / BLOCK) as u64;
const POLICIES: [EvictionPolicy; 2] = [EvictionPolicy::S3Fifo, EvictionPolicy::Lru];

fn pool(capacity: usize) -> Arc<MemoryPool> {
    MemoryPool::new(PoolConfig::new(capacity)).expect("pool")
}

/// A cache on a 1 MiB pool whose clock stands still: no lease expires
/// unless the test advances the clock.
fn cache(policy: EvictionPolicy, shards: usize) -> BlockCache {
    clocked(policy, shards).0
}

/// A cache on a 1 MiB pool, and the manual clock its leases read.
fn clocked(policy: EvictionPolicy, shards: usize) -> (BlockCache, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new());
    let cache = BlockCache::new(pool(MIB), CacheConfig { shards, policy, clock: Arc::clone(&clock) as Arc<dyn Clock>, tenants: None });
    (cache, clock)
}

fn key(i: u64) -> Bytes {
    Bytes::from(format!("key-{i:08}"))
}

/// Stores `len` bytes of `fill` under `key` the way the server does a PUT.
fn put(cache: &BlockCache, key: &Bytes, len: usize, fill: u8) -> Result<u32, KvError> {
    let mut block = cache.allocate(len)?;
    block.as_mut_slice().fill(fill);
    let crc = crc32c::crc32c(block.as_slice());
    cache.insert(key.clone(), block.freeze(), crc);
    Ok(crc)
}

fn put_ok(cache: &BlockCache, key: &Bytes, fill: u8) -> u32 {
    match put(cache, key, BLOCK, fill) {
        Ok(crc) => crc,
        Err(err) => panic!("put {key:?}: {err}"),
    }
}

fn all(bytes: &[u8], fill: u8) -> bool {
    bytes.iter().all(|&b| b == fill)
}

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn block_cache_is_send_and_sync() {
    assert_send_sync::<BlockCache>();
    assert_send_sync::<CachedBlock>();
}

#[test]
fn policy_names_parse_and_display_and_an_unknown_name_lists_the_accepted_ones() {
    assert_eq!("s3-fifo".parse::<EvictionPolicy>(), Ok(EvictionPolicy::S3Fifo));
    assert_eq!("LRU".parse::<EvictionPolicy>(), Ok(EvictionPolicy::Lru));
    for policy in POLICIES {
        assert_eq!(policy.to_string().parse::<EvictionPolicy>(), Ok(policy));
    }
    let err = "clock".parse::<EvictionPolicy>().expect_err("unknown policy");
    let msg = err.to_string();
    assert!(msg.contains("clock") && msg.contains("s3-fifo") && msg.contains("lru"), "{msg}");
}

#[test]
fn config_defaults_to_sixteen_shards_and_s3_fifo() {
    let config = CacheConfig::default();
    assert_eq!((config.shards, config.policy), (16, EvictionPolicy::S3Fifo));
    assert_eq!(format!("{:?}", config.clock), "SystemClock", "a node's leases run on real time");
    let cache = BlockCache::new(pool(MIB), CacheConfig { shards: 0, ..config });
    assert_eq!(cache.policy(), EvictionPolicy::S3Fifo);
    let crc = put_ok(&cache, &key(1), 7);
    assert_eq!(cache.get(&key(1)).map(|c| c.crc()), Some(crc), "zero shards is taken as one");
}

#[test]
fn insert_get_contains_remove_follow_map_semantics_and_are_counted() {
    let cache = cache(EvictionPolicy::S3Fifo, 16);
    let pool = Arc::clone(cache.pool());
    let (k1, k2, k3) = (key(1), key(2), key(3));
    let crc1 = put_ok(&cache, &k1, 0xAA);
    put(&cache, &k2, 1000, 0xBB).expect("put k2");

    assert!(cache.contains(&k1) && cache.contains(&k2) && !cache.contains(&k3));
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses), (0, 0), "contains counts nothing");

    let got = cache.get(&k1).expect("k1 present");
    assert_eq!((got.block.len(), got.crc()), (BLOCK, crc1));
    assert!(all(&got.block, 0xAA));
    assert!(cache.get(&k3).is_none());
    assert_eq!(
        cache.stats(),
        CacheStats { entries: 2, bytes_stored: (BLOCK + 1000) as u64, hits: 1, misses: 1, inserts: 2, ..CacheStats::default() }
    );

    assert!(cache.remove(&k1));
    assert!(!cache.remove(&k1), "second remove finds nothing");
    assert!(!cache.remove(&k3));
    assert!(!cache.contains(&k1));
    assert!(cache.get(&k1).is_none());
    assert_eq!(
        cache.stats(),
        CacheStats { entries: 1, bytes_stored: 1000, hits: 1, misses: 2, inserts: 2, removals: 1, ..CacheStats::default() }
    );
    assert_eq!(pool.stats().blocks, 2, "the reader of k1 still holds its block");
    drop(got);
    assert_eq!(pool.stats().blocks, 1, "k1's memory returned with its last reader");
    drop(cache);
    assert_eq!(pool.stats().blocks, 0);
}

#[test]
fn replacing_a_key_swaps_the_block_and_frees_the_old_one_when_its_last_reader_drops() {
    for policy in POLICIES {
        let cache = cache(policy, 4);
        let pool = Arc::clone(cache.pool());
        let k = key(9);
        put_ok(&cache, &k, 1);
        let held = cache.get(&k).expect("present");
        let crc2 = put(&cache, &k, 2000, 2).expect("replace");

        let now = cache.get(&k).expect("still present");
        assert_eq!((now.block.len(), now.crc()), (2000, crc2));
        assert!(all(&now.block, 2));
        assert!(all(&held.block, 1), "{policy}: the old reader sees the old bytes");
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.bytes_stored, stats.inserts, stats.removals), (1, 2000, 2, 0));
        drop(now);
        assert_eq!(pool.stats().blocks, 2);
        drop(held);
        assert_eq!(pool.stats().blocks, 1, "{policy}: replaced block freed by its last reader");
    }
}

#[test]
fn a_full_pool_keeps_serving_puts_by_evicting_and_never_stores_more_than_its_capacity() {
    for policy in POLICIES {
        let cache = cache(policy, 16);
        let capacity = cache.pool().capacity_bytes() as u64;
        for i in 0..2000 {
            put_ok(&cache, &key(i), i as u8);
            assert!(cache.stats().bytes_stored <= capacity, "{policy}: over capacity after {i}");
        }
        let stats = cache.stats();
        assert_eq!(stats.entries, SLOTS, "{policy}: the pool stays full");
        assert_eq!(stats.evictions, 2000 - SLOTS, "{policy}: one eviction per put once full");
        assert_eq!(stats.bytes_stored, capacity);
        assert!(cache.contains(&key(1999)), "{policy}: the newest put is kept");
        assert_eq!(cache.pool().stats().blocks, SLOTS);
    }
}

#[test]
fn s3_fifo_keeps_a_read_working_set_through_a_one_hit_scan_that_lru_flushes() {
    let working: Vec<Bytes> = (0..100).map(key).collect();
    for policy in POLICIES {
        let cache = cache(policy, 1);
        for k in &working {
            put_ok(&cache, k, 1);
        }
        for _ in 0..2 {
            for k in &working {
                assert!(cache.get(k).is_some());
            }
        }
        for i in 1000..2000 {
            put_ok(&cache, &key(i), 2);
        }
        let survivors = working.iter().filter(|k| cache.contains(k)).count();
        match policy {
            EvictionPolicy::S3Fifo => assert_eq!(survivors, working.len(), "S3-FIFO lost working-set blocks to a scan"),
            EvictionPolicy::Lru => {
                assert_eq!(survivors, 0, "LRU is expected to flush the working set")
            }
        }
    }
}

#[test]
fn s3_fifo_sends_a_recently_evicted_key_straight_to_the_main_queue() {
    let cache = cache(EvictionPolicy::S3Fifo, 1);
    for i in 0..SLOTS {
        put_ok(&cache, &key(i), 1);
    }
    put_ok(&cache, &key(SLOTS), 1);
    assert!(!cache.contains(&key(0)), "the oldest one-hit block goes first");
    put_ok(&cache, &key(0), 1); // back soon: a ghost hit
    let control = key(10_000); // new at the same moment, but never seen before
    put_ok(&cache, &control, 1);
    for i in 20_000..20_000 + 3 * SLOTS {
        put_ok(&cache, &key(i), 1);
    }
    assert!(cache.contains(&key(0)), "the returning key was admitted to main and outlived the scan");
    assert!(!cache.contains(&control), "a first-time key stays on probation");
}

#[test]
fn removed_and_replaced_entries_leave_no_stale_queue_items() {
    for policy in POLICIES {
        let cache = cache(policy, 1);
        for i in 0..SLOTS {
            put_ok(&cache, &key(i), 1);
        }
        assert!(cache.remove(&key(0)));
        // Into the freed memory: a new entry, the newest one.
        put_ok(&cache, &key(0), 2);
        // Evicts key 1 for its new block, then counts a use of key 5 (LRU
        // moves it to the back, S3-FIFO promotes it when it comes up); the
        // replaced block's memory is what the next put gets.
        put_ok(&cache, &key(5), 2);
        put_ok(&cache, &key(5000), 3);
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.evictions, stats.removals), (SLOTS, 1, 1), "{policy}");
        assert!(!cache.contains(&key(1)) && cache.contains(&key(2)), "{policy}: the oldest entry went first");
        for i in 5001..5001 + (SLOTS - 3) {
            put_ok(&cache, &key(i), 3);
        }
        assert!((1..SLOTS).filter(|&i| i != 5).all(|i| !cache.contains(&key(i))), "{policy}: old entries went in order");
        assert!(cache.contains(&key(0)) && cache.contains(&key(5)), "{policy}: re-put keys were evicted early");
        put_ok(&cache, &key(9000), 3);
        assert!(!cache.contains(&key(0)), "{policy}: the re-inserted key is next, at its new place");
        assert!(cache.contains(&key(5)));
        assert_eq!(cache.stats().entries, SLOTS);
    }
}

#[test]
fn s3_fifo_counts_a_rewrite_as_one_use_and_leaves_the_key_where_it_was_in_the_queue() {
    let (a, b) = (key(0), key(1));
    // The use: a rewritten key outlives one stored after it and never read.
    let unread = cache(EvictionPolicy::S3Fifo, 1);
    put_ok(&unread, &a, 1);
    put_ok(&unread, &b, 1);
    put_ok(&unread, &a, 2);
    assert_eq!(unread.evict_one().map(|e| e.key), Some(b.clone()), "the rewrite counted as a use of a");
    // The place: with both used once (a by its rewrite, b by a read after
    // it), both are promoted to the main queue in their queue order, and
    // there the older goes first. Had the rewrite moved a behind b, b would.
    let cache = cache(EvictionPolicy::S3Fifo, 1);
    put_ok(&cache, &a, 1);
    put_ok(&cache, &b, 1);
    put_ok(&cache, &a, 2);
    assert!(cache.get(&b).is_some());
    let first = cache.evict_one().expect("an entry to evict");
    assert_eq!(first.key, a, "the rewritten key kept its place ahead of b");
    assert!(all(&first.block, 2), "the evicted block is the rewrite's");
    assert_eq!(cache.evict_one().map(|e| e.key), Some(b));
    assert_eq!(cache.stats().entries, 0);
}

#[test]
fn rewrites_of_other_sizes_keep_the_queues_accounts_exact_through_eviction_of_everything() {
    for policy in POLICIES {
        let cache = cache(policy, 1);
        let keys: Vec<Bytes> = (0..8).map(key).collect();
        for k in &keys {
            put_ok(&cache, k, 1);
        }
        // Half the keys rewritten larger, smaller, then larger again: each
        // queue's byte count must follow, or evicting them all below runs
        // it past zero (a panic in this debug build) or leaves bytes behind.
        for (len, fill) in [(16 * KIB, 2), (KIB, 3), (8 * KIB, 4)] {
            for k in &keys[..4] {
                put(&cache, k, len, fill).expect("room for the rewrite");
            }
        }
        assert_eq!(cache.stats().bytes_stored, (4 * 8 * KIB + 4 * BLOCK) as u64, "{policy}");
        let mut evicted = 0;
        while let Some(victim) = cache.evict_one() {
            let fill = if keys[..4].contains(&victim.key) { 4 } else { 1 };
            assert!(all(&victim.block, fill), "{policy}: {:?} evicted with another block than its last", victim.key);
            evicted += 1;
        }
        let stats = cache.stats();
        assert_eq!((evicted, stats.entries, stats.bytes_stored), (8, 0, 0), "{policy}");
    }
}

#[test]
fn match_prefix_counts_the_leading_present_keys_and_stops_at_the_first_gap() {
    let cache = cache(EvictionPolicy::S3Fifo, 16);
    for i in [0, 1, 2, 4] {
        put_ok(&cache, &key(i), 1);
    }
    let chain: Vec<Bytes> = (0..5).map(key).collect();
    assert_eq!(cache.match_prefix(&chain, None), 3);
    assert_eq!(cache.match_prefix(&chain[3..], None), 0, "a missing first key matches nothing");
    assert_eq!(cache.match_prefix::<Bytes>(&[], None), 0);
    assert_eq!(cache.match_prefix(&[b"key-00000004".as_slice()], None), 1, "any AsRef<[u8]> key works");
    assert_eq!(cache.match_prefix(&chain, Some(Duration::ZERO)), 3);
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.pinned), (0, 0, 0), "matching counts nothing; a zero lease pins nothing");
    assert_eq!(cache.match_prefix(&chain, Some(Duration::from_secs(60))), 3);
    assert_eq!(cache.stats().pinned, 3, "only the matched prefix is pinned");
}

#[test]
fn a_pinned_block_survives_pressure_that_evicts_everything_else() {
    for policy in POLICIES {
        let cache = cache(policy, 16);
        let pinned = key(7);
        put_ok(&cache, &pinned, 0x77);
        for i in 100..200 {
            put_ok(&cache, &key(i), 1);
        }
        assert_eq!(cache.match_prefix(&[&pinned], Some(Duration::from_secs(60))), 1);
        for i in 1000..1000 + 4 * SLOTS {
            put_ok(&cache, &key(i), 2);
        }
        assert!((100..200).all(|i| !cache.contains(&key(i))), "{policy}: the unpinned blocks were evicted");
        let got = cache.get(&pinned).expect("the pinned block survived");
        assert!(all(&got.block, 0x77), "{policy}");
        assert_eq!(cache.stats().pinned, 1);
    }
}

#[test]
fn allocate_answers_capacity_without_hanging_when_every_entry_is_pinned() {
    for policy in POLICIES {
        let cache = cache(policy, 16);
        let keys: Vec<Bytes> = (0..SLOTS).map(key).collect();
        for k in &keys {
            put_ok(&cache, k, 1);
        }
        assert_eq!(cache.match_prefix(&keys, Some(Duration::from_secs(60))), keys.len());
        assert_eq!(cache.stats().pinned, SLOTS);
        let started = Instant::now();
        match cache.allocate(BLOCK) {
            Err(KvError::Capacity(msg)) => assert!(msg.contains("4096"), "{policy}: message names the size: {msg}"),
            other => panic!("{policy}: expected Capacity, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(1), "{policy}: took {:?}", started.elapsed());
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.evictions), (SLOTS, 0), "{policy}: nothing was evicted");
    }
}

#[test]
fn an_expired_pin_is_evicted_under_pressure_and_its_memory_reused() {
    for policy in POLICIES {
        let (cache, clock) = clocked(policy, 16);
        let keys: Vec<Bytes> = (0..SLOTS).map(key).collect();
        for k in &keys {
            put_ok(&cache, k, 1);
        }
        let short = &keys[17];
        assert_eq!(cache.match_prefix(&keys, Some(Duration::from_secs(60))), keys.len());
        // Pins are per entry: re-pin the target alone, from scratch, briefly.
        assert!(cache.remove(short));
        put_ok(&cache, short, 1);
        let lease = Duration::from_millis(100);
        assert_eq!(cache.match_prefix(&[short], Some(lease)), 1);
        assert!(matches!(cache.allocate(BLOCK), Err(KvError::Capacity(_))), "{policy}: evicted while pinned");

        // A nanosecond short of the lease it still holds; at its end it lapses.
        clock.advance(lease - Duration::from_nanos(1));
        assert!(matches!(cache.allocate(BLOCK), Err(KvError::Capacity(_))), "{policy}: evicted before the lease ended");
        assert_eq!(cache.stats().pinned, SLOTS, "{policy}");
        clock.advance(Duration::from_nanos(1));
        assert_eq!(cache.stats().pinned, SLOTS - 1, "{policy}: the expired pin is no longer counted");
        let fresh = key(50_000);
        put_ok(&cache, &fresh, 9);
        assert!(!cache.contains(short), "{policy}: the expired entry was the one evicted");
        assert!(cache.contains(&fresh));
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.evictions), (SLOTS, 1), "{policy}");
        assert_eq!(cache.pool().stats().blocks, SLOTS, "{policy}: the new block took the freed memory");
    }
}

#[test]
fn a_pin_is_extended_but_never_shortened() {
    for policy in POLICIES {
        let (cache, clock) = clocked(policy, 4);
        let (long_then_short, short_then_long) = (key(1), key(2));
        put_ok(&cache, &long_then_short, 1);
        put_ok(&cache, &short_then_long, 2);
        assert_eq!(cache.match_prefix(&[&long_then_short], Some(Duration::from_millis(600))), 1);
        assert_eq!(cache.match_prefix(&[&long_then_short], Some(Duration::from_millis(20))), 1);
        assert_eq!(cache.match_prefix(&[&short_then_long], Some(Duration::from_millis(20))), 1);
        assert_eq!(cache.match_prefix(&[&short_then_long], Some(Duration::from_millis(600))), 1);
        // Past the short leases, well within the long ones.
        clock.advance(Duration::from_millis(60));
        for i in 100..100 + 2 * SLOTS {
            put_ok(&cache, &key(i), 3);
        }
        assert!(cache.contains(&long_then_short), "{policy}: a shorter lease shortened the pin");
        assert!(cache.contains(&short_then_long), "{policy}: a longer lease did not extend the pin");
        assert_eq!(cache.stats().pinned, 2);
        // Past the long leases too: both are ordinary entries again.
        clock.advance(Duration::from_millis(540));
        assert_eq!(cache.stats().pinned, 0, "{policy}");
        for i in 1000..1000 + 2 * SLOTS {
            put_ok(&cache, &key(i), 4);
        }
        assert!(!cache.contains(&long_then_short) && !cache.contains(&short_then_long), "{policy}: an expired pin still protects");
    }
}

#[test]
fn a_block_being_read_is_never_reused_under_the_reader() {
    for policy in POLICIES {
        let cache = cache(policy, 16);
        let k = key(42);
        put_ok(&cache, &k, 0x5A);
        let held = cache.get(&k).expect("present");

        for i in 1000..1000 + 3 * SLOTS {
            put_ok(&cache, &key(i), 0xFF);
        }
        assert!(cache.contains(&k), "{policy}: an entry being read is skipped by eviction");
        assert!(all(&held.block, 0x5A), "{policy}: bytes changed under the reader");

        put_ok(&cache, &k, 0x11);
        assert!(cache.remove(&k));
        for i in 5000..5000 + 3 * SLOTS {
            put_ok(&cache, &key(i), 0xEE);
        }
        assert!(all(&held.block, 0x5A), "{policy}: a replaced and removed block was reused under its reader");
        assert_eq!(crc32c::crc32c(&held.block), held.crc());

        let pool = Arc::clone(cache.pool());
        let entries = cache.stats().entries;
        assert_eq!(pool.stats().blocks, entries + 1, "{policy}: the held block is still allocated");
        drop(held);
        assert_eq!(pool.stats().blocks, entries);
    }
}

/// Header of a stress block: key and version, then a pattern derived from both.
fn fill_pattern(bytes: &mut [u8], key: u64, version: u64) {
    bytes[..8].copy_from_slice(&key.to_le_bytes());
    bytes[8..16].copy_from_slice(&version.to_le_bytes());
    for (i, b) in bytes.iter_mut().enumerate().skip(16) {
        *b = pattern_byte(key, version, i);
    }
}

fn pattern_byte(key: u64, version: u64, i: usize) -> u8 {
    (key.wrapping_mul(0x9E37_79B9) ^ version ^ (i as u64).wrapping_mul(31)) as u8
}

/// Panics unless `found` is an intact block written for `key`.
fn verify(found: &CachedBlock, key: u64) {
    let bytes = found.block.as_slice();
    assert!(bytes.len() >= 16, "short block {}", bytes.len());
    let stored_key = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let version = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    assert_eq!(stored_key, key, "a block for another key was returned");
    for (i, &b) in bytes.iter().enumerate().skip(16) {
        assert_eq!(b, pattern_byte(key, version, i), "key {key} version {version}: byte {i} corrupted");
    }
    assert_eq!(crc32c::crc32c(bytes), found.crc(), "key {key}: crc does not match the bytes");
}

fn stress_key(k: u64) -> Bytes {
    Bytes::from(k.to_le_bytes().to_vec())
}

#[derive(Default, Debug)]
struct Tally {
    puts: u64,
    capacity_refusals: u64,
    verified: u64,
    removes: u64,
    matched: u64,
}

fn stress_worker(cache: &BlockCache, seed: u64, deadline: Instant) -> Tally {
    const KEYS: u64 = 600;
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut tally = Tally::default();
    while Instant::now() < deadline {
        let k = rng.u64(0..KEYS);
        match rng.u32(0..100) {
            0..35 => {
                // Mostly one size class, some of the next: slab pages then
                // have to change class under eviction.
                let len = if rng.u32(0..10) == 0 { rng.usize(BLOCK + 1..=2 * BLOCK) } else { rng.usize(16..=BLOCK) };
                match cache.allocate(len) {
                    Ok(mut block) => {
                        fill_pattern(block.as_mut_slice(), k, rng.u64(..));
                        let crc = crc32c::crc32c(block.as_slice());
                        cache.insert(stress_key(k), block.freeze(), crc);
                        tally.puts += 1;
                    }
                    // Legitimate while short leases and readers hold most of
                    // a pool this small.
                    Err(KvError::Capacity(_)) => tally.capacity_refusals += 1,
                    Err(err) => panic!("allocate({len}): {err}"),
                }
            }
            35..80 => {
                if let Some(found) = cache.get(&stress_key(k)) {
                    verify(&found, k);
                    tally.verified += 1;
                }
            }
            80..90 => {
                if cache.remove(&stress_key(k)) {
                    tally.removes += 1;
                }
            }
            _ => {
                let chain: Vec<Bytes> = (k..k + rng.u64(1..=8)).map(stress_key).collect();
                let lease = Duration::from_millis(rng.u64(1..=20));
                let matched = cache.match_prefix(&chain, Some(lease));
                tally.matched += matched as u64;
                for (i, key) in chain[..matched].iter().enumerate() {
                    if let Some(found) = cache.get(key) {
                        verify(&found, k + i as u64);
                        tally.verified += 1;
                    }
                }
            }
        }
    }
    tally
}

#[test]
fn concurrent_puts_gets_removes_and_leases_never_hand_out_a_corrupted_block() {
    const THREADS: u64 = 6;
    for policy in POLICIES {
        let config = PoolConfig { max_block_bytes: 64 * KIB, ..PoolConfig::new(2 * MIB) };
        let pool = MemoryPool::new(config).expect("pool");
        // The real clock: leases of 1-20 ms lapse while the workers run.
        let cache = Arc::new(BlockCache::new(Arc::clone(&pool), CacheConfig { shards: 4, policy, ..CacheConfig::default() }));
        let deadline = Instant::now() + Duration::from_millis(750);
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let cache = Arc::clone(&cache);
                thread::spawn(move || stress_worker(&cache, 0xC0FFEE + t, deadline))
            })
            .collect();
        let mut total = Tally::default();
        for worker in workers {
            let t = worker.join().expect("a stress worker panicked");
            total.puts += t.puts;
            total.capacity_refusals += t.capacity_refusals;
            total.verified += t.verified;
            total.removes += t.removes;
            total.matched += t.matched;
        }
        let stats = cache.stats();
        assert!(total.puts > 200 && total.verified > 50 && total.matched > 0, "{policy}: too little work: {total:?}");
        assert!(stats.evictions > 0, "{policy}: the pool was meant to force eviction: {stats:?}");
        assert!(stats.bytes_stored <= pool.capacity_bytes() as u64, "{policy}: {stats:?}");
        assert_eq!(stats.entries, pool.stats().blocks, "{policy}: every live block belongs to exactly one entry");
        drop(cache);
        let after = pool.stats();
        assert_eq!((after.blocks, after.used_bytes, after.requested_bytes), (0, 0, 0), "{policy}: pool accounting leaked");
    }
}

/// A cache on a 1 MiB pool that charges tenants, with a manual clock.
fn tenanted(policy: EvictionPolicy) -> (BlockCache, Arc<TenantAccounts>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new());
    let accounts = Arc::new(TenantAccounts::default());
    let config = CacheConfig { shards: 4, policy, clock: Arc::clone(&clock) as Arc<dyn Clock>, tenants: Some(Arc::clone(&accounts)) };
    (BlockCache::new(pool(MIB), config), accounts, clock)
}

/// `key` in tenant `name`'s namespace (its tag first, as the server does).
fn tkey(name: &str, i: u64) -> Bytes {
    let mut k = vec![name.len() as u8];
    k.extend_from_slice(name.as_bytes());
    k.extend_from_slice(format!("key-{i:08}").as_bytes());
    Bytes::from(k)
}

#[test]
fn tenant_accounts_stay_exact_through_insert_replace_remove_pin_expiry_and_eviction() {
    // Charged the pool memory each block takes, its size class (4 KiB
    // at least, powers of two), not its length: a block of 0 or 1000
    // bytes holds 4 KiB of the pool.
    let class = |len: u64| len.max(BLOCK as u64).next_power_of_two();
    for policy in POLICIES {
        let (cache, accounts, clock) = tenanted(policy);
        let a = accounts.account(b"\x01a", "a");
        put(&cache, &tkey("a", 1), 1000, 1).unwrap();
        put(&cache, &tkey("a", 2), 5000, 2).unwrap();
        put(&cache, &tkey("b", 1), 0, 3).unwrap();
        let b = accounts.account(b"\x01b", "b");
        assert_eq!((a.bytes(), b.bytes()), (4 * KIB as u64 + 8 * KIB as u64, 4 * KIB as u64), "{policy}: insert, by size class");
        put(&cache, &tkey("a", 1), 9000, 4).unwrap();
        assert_eq!(a.bytes(), 24 * KIB as u64, "{policy}: a replacement charges the difference");
        assert_eq!(cache.match_prefix(&[tkey("a", 1), tkey("a", 2)], Some(Duration::from_secs(5))), 2);
        assert_eq!(a.pinned_bytes(), 24 * KIB as u64, "{policy}: pins");
        put(&cache, &tkey("a", 1), 700, 5).unwrap();
        assert_eq!((a.bytes(), a.pinned_bytes()), (12 * KIB as u64, 12 * KIB as u64), "{policy}: a pinned replacement");
        assert!(cache.remove(&tkey("a", 1)));
        assert_eq!((a.bytes(), a.pinned_bytes()), (8 * KIB as u64, 8 * KIB as u64), "{policy}: remove");
        clock.advance(Duration::from_secs(6));
        cache.expire_pins();
        assert_eq!(a.pinned_bytes(), 0, "{policy}: expiry");
        // Fill the pool with b's blocks: a's last block and b's first go.
        for i in 10..(SLOTS + 20) {
            put_ok(&cache, &tkey("b", i), 9);
        }
        assert_eq!(a.bytes(), 0, "{policy}: eviction");
        assert_eq!(a.evictions.load(std::sync::atomic::Ordering::Relaxed), 1);
        let stored: u64 = cache.entries().iter().map(|(_, blk)| class(blk.len() as u64)).sum();
        assert_eq!(a.bytes() + b.bytes(), stored, "{policy}: the accounts add up to the pool memory stored blocks take");
        assert_eq!(b.bytes(), cache.pool().stats().used_bytes as u64, "{policy}: what the pool says its blocks hold");
    }
}

#[test]
fn eviction_takes_from_a_tenant_over_its_quota_first() {
    for policy in POLICIES {
        let (cache, accounts, _clock) = tenanted(policy);
        let over = accounts.account(b"\x04over", "over");
        let under = accounts.account(b"\x05under", "under");
        // Older blocks of `under` first: without the quota they would go first.
        let half = SLOTS / 2;
        for i in 0..half {
            put_ok(&cache, &tkey("under", i), 1);
        }
        for i in 0..half {
            put_ok(&cache, &tkey("over", i), 2);
        }
        under.set_quotas(MIB as u64, MIB as u64);
        over.set_quotas(8 * BLOCK as u64, MIB as u64);
        assert!(over.over_quota() && !under.over_quota() && accounts.any_over_quota());
        let under_before = under.bytes();
        // New blocks of `under` need room: it comes from `over` until it
        // is back at its quota.
        let mut taken = 0;
        while over.over_quota() {
            put_ok(&cache, &tkey("under", 1000 + taken), 3);
            taken += 1;
            assert!(taken <= half, "{policy}: over never got back to its quota");
        }
        assert_eq!(under.evictions.load(std::sync::atomic::Ordering::Relaxed), 0, "{policy}: nothing of under's went first");
        assert_eq!(under.bytes(), under_before + taken * BLOCK as u64);
        assert_eq!(over.bytes(), 8 * BLOCK as u64, "{policy}");
        assert!(!accounts.any_over_quota());
        // At the quota, eviction goes back to the policy's own order.
        put_ok(&cache, &tkey("under", 5000), 4);
        assert_eq!(
            over.evictions.load(std::sync::atomic::Ordering::Relaxed) + under.evictions.load(std::sync::atomic::Ordering::Relaxed),
            taken + 1
        );
    }
}

/// Found in review: while a tenant was over its quota with every block
/// pinned, each eviction first walked every entry of every shard looking
/// for one of its blocks, found none, and only then took the policy's
/// victim: a tenant over its quota (a read-through, a lowered quota) that
/// pinned its blocks made every PUT on the node pay a walk of the cache.
/// A pass that finds nothing is not repeated within `OVER_QUOTA_RETRY`.
#[test]
fn a_fruitless_over_quota_pass_is_not_repeated_for_every_eviction() {
    for policy in POLICIES {
        let (cache, accounts, clock) = tenanted(policy);
        let over = accounts.account(b"\x04over", "over");
        for i in 0..16 {
            put_ok(&cache, &tkey("over", i), 1);
        }
        let chain: Vec<Bytes> = (0..16).map(|i| tkey("over", i)).collect();
        assert_eq!(cache.match_prefix(&chain, Some(Duration::from_secs(60))), 16);
        over.set_quotas(BLOCK as u64, MIB as u64);
        assert!(accounts.any_over_quota());
        // Another tenant's PUTs fill the pool and go on: each needs an eviction.
        for i in 0..(2 * SLOTS) {
            put_ok(&cache, &tkey("other", i), 2);
        }
        let passes = || accounts.fruitless_passes.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(passes(), 1, "{policy}: one fruitless pass, not one per eviction");
        assert_eq!(over.bytes(), 16 * BLOCK as u64, "{policy}: the pinned blocks stay");
        // Once the retry interval passed, eviction looks again.
        clock.advance(super::tenants::OVER_QUOTA_RETRY);
        put_ok(&cache, &tkey("other", 100_000), 3);
        assert_eq!(passes(), 2, "{policy}");
        // The pins ran out: the next pass finds the over-quota blocks.
        clock.advance(Duration::from_secs(61) + super::tenants::OVER_QUOTA_RETRY);
        put_ok(&cache, &tkey("other", 100_001), 4);
        assert_eq!(over.bytes(), 15 * BLOCK as u64, "{policy}: over's block went first");
        assert_eq!(passes(), 2, "{policy}");
    }
}

/// `len` bytes of `fill` in a fresh pool block, ready for `insert_many`.
fn new_entry(cache: &BlockCache, key: &Bytes, len: usize, fill: u8) -> NewEntry {
    let mut block = cache.allocate(len).expect("room");
    block.as_mut_slice().fill(fill);
    let crc = crc32c::crc32c(block.as_slice());
    NewEntry { key: key.clone(), block: block.freeze(), crc: Some(crc) }
}

#[test]
fn insert_many_across_every_shard_stores_each_key_once_and_a_key_given_twice_keeps_its_later_block() {
    for policy in POLICIES {
        let cache = cache(policy, 16);
        // 48 keys over 16 shards, key 7 twice (first fill 1, then 2).
        let mut batch: Vec<NewEntry> = (0..48).map(|i| new_entry(&cache, &key(i), BLOCK, i as u8 + 10)).collect();
        batch.insert(3, new_entry(&cache, &key(7), BLOCK, 1));
        batch.push(new_entry(&cache, &key(7), BLOCK, 2));
        // The first key-7 block is replaced within the batch (its memory
        // goes back to the pool); the ordinary key-7 block between them is
        // replaced too, so the last one wins.
        cache.insert_many(batch);
        for i in (0..48).filter(|&i| i != 7) {
            let hit = cache.get(&key(i)).unwrap_or_else(|| panic!("{policy}: key {i} stored"));
            assert!(all(&hit.block, i as u8 + 10), "{policy}: key {i} has its own bytes");
            assert_eq!(hit.crc(), crc32c::crc32c(&hit.block), "{policy}: key {i}'s checksum recorded");
        }
        assert!(all(&cache.get(&key(7)).expect("key 7").block, 2), "{policy}: the later block of a key given twice wins");
        let stats = cache.stats();
        assert_eq!((stats.entries, stats.bytes_stored, stats.inserts), (48, 48 * BLOCK as u64, 50), "{policy}: {stats:?}");
        assert_eq!(cache.pool().stats().blocks, 48, "{policy}: the two replaced key-7 blocks went back to the pool");
        // Replacing every key in one batch gives all 48 old blocks back.
        cache.insert_many((0..48).map(|i| new_entry(&cache, &key(i), BLOCK, 99)).collect());
        assert_eq!(cache.pool().stats().blocks, 48, "{policy}: replaced blocks released");
        assert!((0..48).all(|i| all(&cache.get(&key(i)).expect("stored").block, 99)), "{policy}");
    }
}

#[test]
fn insert_many_keeps_a_block_a_reader_holds_until_the_reader_drops_it() {
    let cache = cache(EvictionPolicy::S3Fifo, 4);
    cache.insert_many((0..8).map(|i| new_entry(&cache, &key(i), BLOCK, 1)).collect());
    let held = cache.get(&key(3)).expect("stored");
    cache.insert_many((0..8).map(|i| new_entry(&cache, &key(i), BLOCK, 2)).collect());
    assert!(all(&held.block, 1), "the reader's bytes are not reused under it");
    assert_eq!(cache.pool().stats().blocks, 9, "8 stored and the one the reader holds");
    drop(held);
    assert_eq!(cache.pool().stats().blocks, 8);
}

#[test]
fn get_many_answers_in_key_order_counting_hits_misses_and_reads_as_one_get_after_another() {
    for policy in POLICIES {
        let cache = cache(policy, 16);
        for i in 0..40 {
            put_ok(&cache, &key(i), i as u8);
        }
        // Hits over many shards, misses between them, key 5 three times.
        let keys: Vec<Bytes> = vec![key(5), key(100), key(0), key(5), key(39), key(101), key(17), key(5)];
        let found = cache.get_many(&keys);
        assert_eq!(found.len(), keys.len());
        let want: [Option<u8>; 8] = [Some(5), None, Some(0), Some(5), Some(39), None, Some(17), Some(5)];
        for ((k, got), want) in keys.iter().zip(&found).zip(want) {
            match (got, want) {
                (Some(hit), Some(fill)) => assert!(all(&hit.block, fill), "{policy}: {k:?}"),
                (None, None) => {}
                _ => panic!("{policy}: {k:?}: got {:?}, want {want:?}", got.as_ref().map(|h| h.block.len())),
            }
        }
        let reads: Vec<u32> = [0, 3, 7].iter().map(|&i| found[i].as_ref().expect("hit").reads).collect();
        assert_eq!(reads, [1, 2, 3], "{policy}: a key given thrice is read thrice, in order");
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses), (6, 2), "{policy}: {stats:?}");
        assert!(cache.get_many::<Bytes>(&[]).is_empty());
    }
}

#[test]
fn insert_many_charges_each_tenant_as_inserts_one_after_another_do() {
    for policy in POLICIES {
        let (cache, accounts, _clock) = tenanted(policy);
        let a = accounts.account(b"\x01a", "a");
        let b = accounts.account(b"\x01b", "b");
        let mut batch: Vec<NewEntry> = (0..6).map(|i| new_entry(&cache, &tkey("a", i), 5000, 1)).collect();
        batch.extend((0..3).map(|i| new_entry(&cache, &tkey("b", i), 1000, 2)));
        // a's key 0 again, smaller: charged its later block's class only.
        batch.push(new_entry(&cache, &tkey("a", 0), 100, 3));
        cache.insert_many(batch);
        assert_eq!(a.bytes(), 5 * 8 * KIB as u64 + 4 * KIB as u64, "{policy}: five blocks of 8 KiB class and one of 4 KiB");
        assert_eq!(b.bytes(), 3 * 4 * KIB as u64, "{policy}");
        assert_eq!(a.bytes() + b.bytes(), cache.pool().stats().used_bytes as u64, "{policy}: the accounts add up to the pool");
    }
}

#[test]
fn group_by_shard_orders_by_shard_keeping_the_items_order_within_a_shard() {
    let by_first = |items: Vec<(usize, char)>, shards| group_by_shard(items, |&(shard, _)| shard, shards);
    let items = vec![(2, 'a'), (0, 'b'), (2, 'c'), (1, 'd'), (0, 'e'), (2, 'f')];
    assert_eq!(by_first(items, 3), [(0, 'b'), (0, 'e'), (1, 'd'), (2, 'a'), (2, 'c'), (2, 'f')]);
    // A shard no item names, and one shard for everything.
    assert_eq!(by_first(vec![(3, 'a'), (3, 'b'), (0, 'c')], 4), [(0, 'c'), (3, 'a'), (3, 'b')]);
    assert_eq!(by_first(vec![(0, 'a'), (0, 'b'), (0, 'c')], 1), [(0, 'a'), (0, 'b'), (0, 'c')]);
    assert!(by_first(Vec::new(), 16).is_empty());
}
