//! Hit ratio and per-operation cost of the L1 block cache, S3-FIFO against
//! LRU, on two traces replayed single-threaded against a real `BlockCache`:
//!
//! * `zipf`: 1M requests over 100k keys, Zipf(0.99); each request is a get,
//!   and a miss stores the block (the classic read-through cache).
//! * `chat`: a multi-turn chat prefix trace. Each conversation's prompt is
//!   the previous prompt plus the assistant's reply plus a new user message;
//!   block keys are chained hashes of the prefix, so conversations sharing a
//!   system prompt share its blocks. Conversations are picked with skew and
//!   abandoned at random. Per turn the engine asks `match_prefix` for the
//!   whole chain, gets the matched blocks and stores the rest.
//!
//! Each trace runs with a pool holding 10% and 1% of its distinct blocks
//! (4 KiB each). Hit ratio is over block lookups. Op timings are medians of
//! every `SAMPLE_EVERY`th call, measured in the same run.
//!
//! Then the batched paths against one call per key, in the shape of
//! `scripts/bench-node`'s 4 KiB cell (8192 stored blocks, batches of 32 in
//! the order a client walks them, 16 shards): `get_many` against `get`,
//! and a PUT's pool allocations and inserts (`try_allocate_many` and
//! `insert_many` against `allocate` and `insert`), replacing stored keys
//! as the benchmark does; nanoseconds per key, median of the rounds.
//!
//! Run: `cargo bench -p kvplane-node --bench cache` (release; about half a
//! minute), `-- batch` for the batched paths alone, or `-- insert` for a
//! PUT's `insert_many` alone (what a profiler should look at for the
//! index's share of a PUT).
//! The traces are fixed by the seed; the cache's hash is keyed per process,
//! so shard assignment, and with it the hit ratio, can move in the fourth
//! digit between runs.

use std::time::Instant;

use bytes::Bytes;
use kvplane_node::cache::{BlockCache, CacheConfig, EvictionPolicy, NewEntry};
use kvplane_node::memory::{MemoryPool, PoolConfig};

const BLOCK: usize = 4096;
/// Slab page size of the bench pools: small, so the pool can be sized to the
/// block count closely.
const SLAB: usize = 64 << 10;
const SEED: u64 = 0x5EED_CAC4E;
/// Timing every call would add two clock reads (~40 ns) to calls that cost
/// about that much; one in eight still gives plenty of samples.
const SAMPLE_EVERY: u64 = 8;
const FRACTIONS: [(f64, &str); 2] = [(0.10, "10%"), (0.01, "1%")];
const POLICIES: [EvictionPolicy; 2] = [EvictionPolicy::S3Fifo, EvictionPolicy::Lru];

const ZIPF_KEYS: usize = 100_000;
const ZIPF_REQUESTS: usize = 1_000_000;
const ZIPF_ALPHA: f64 = 0.99;

const CHAT_SLOTS: usize = 2_000;
const CHAT_TURNS: usize = 60_000;
const CHAT_SLOT_SKEW: f64 = 0.9;
const SYSTEM_PROMPTS: usize = 20;
/// Chance a conversation ends after a turn (the user leaves).
const CHAT_ABANDON: f64 = 0.15;
/// Context limit in blocks; a conversation that reaches it ends.
const CHAT_MAX_BLOCKS: usize = 256;

fn main() {
    let started = Instant::now();
    if std::env::args().skip(1).any(|a| a == "batch") {
        batched(BatchRun::All);
        return;
    }
    if std::env::args().skip(1).any(|a| a == "insert") {
        batched(BatchRun::InsertOnly);
        return;
    }
    let zipf = zipf_trace();
    let chat = chat_trace();
    println!(
        "traces: zipf {} requests over {} keys (alpha {ZIPF_ALPHA}); chat {} turns, {} block lookups, {} distinct blocks",
        zipf.requests.len(),
        zipf.keys.len(),
        chat.turns.len(),
        chat.lookups(),
        chat.keys.len()
    );
    println!();
    println!(
        "{:<6} {:>16} {:<8} {:>9} {:>12} {:>8} {:>9} {:>10}",
        "trace", "cache", "policy", "hit ratio", "s3-fifo/lru", "get ns", "alloc ns", "insert ns"
    );
    for (name, distinct) in [("zipf", zipf.keys.len()), ("chat", chat.keys.len())] {
        for (fraction, label) in FRACTIONS {
            let blocks = ((distinct as f64 * fraction) as usize).max(SLAB / BLOCK);
            let mut rows = Vec::new();
            for policy in POLICIES {
                let mut engine = Engine::new(blocks, policy);
                match name {
                    "zipf" => zipf.replay(&mut engine),
                    _ => chat.replay(&mut engine),
                }
                rows.push((policy, engine.report()));
            }
            let lru = rows.iter().find(|(p, _)| *p == EvictionPolicy::Lru).map_or(f64::NAN, |(_, r)| r.hit_ratio);
            for (policy, r) in rows {
                let vs = match policy {
                    EvictionPolicy::S3Fifo => format!("{:.3}x", r.hit_ratio / lru),
                    EvictionPolicy::Lru => "-".to_owned(),
                };
                println!(
                    "{:<6} {:>16} {:<8} {:>9.4} {:>12} {:>8} {:>9} {:>10}",
                    name,
                    format!("{label} ({} blk)", r.capacity_blocks),
                    policy,
                    r.hit_ratio,
                    vs,
                    r.get_ns,
                    r.alloc_ns,
                    r.insert_ns
                );
                if r.refused > 0 {
                    println!("       ({} puts refused for capacity)", r.refused);
                }
            }
        }
    }
    println!();
    batched(BatchRun::All);
    println!();
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}

const BATCH_KEYS: usize = 8192;
const BATCH: usize = 32;
const BATCH_ROUNDS: usize = 15;
/// One batch's worth of work of the batched bench.
type BatchOp<'a> = dyn Fn(&[Bytes]) + 'a;
/// Bytes the batched bench sweeps its caches with (see `batched`).
const SWEEP_BYTES: usize = 256 << 20;

/// What [`batched`] runs.
#[derive(PartialEq)]
enum BatchRun {
    /// Every comparison, then `insert_many` alone.
    All,
    /// `insert_many` alone (`-- insert`): the index's part of a PUT, for a
    /// profiler to look at without the pool's allocations beside it.
    InsertOnly,
}

/// The batched paths against one call per key (see the module docs).
fn batched(run: BatchRun) {
    let pool = match MemoryPool::new(PoolConfig::new(256 << 20)) {
        Ok(pool) => pool,
        Err(err) => panic!("bench pool: {err}"),
    };
    let cache = BlockCache::new(pool, CacheConfig::default());
    let keys: Vec<Bytes> = (0..BATCH_KEYS).map(|i| Bytes::from(format!("bench/{i:08}"))).collect();
    let lens = [BLOCK; BATCH];
    let put_one = |batch: &[Bytes]| {
        for key in batch {
            let block = cache.allocate(BLOCK).expect("room");
            cache.insert(key.clone(), block.freeze(), 7);
        }
    };
    // A PUT's entries: its blocks from the pool in one call.
    let new_entries = |batch: &[Bytes]| -> Vec<NewEntry> {
        let mut blocks = Vec::with_capacity(BATCH);
        assert_eq!(cache.pool().try_allocate_many(&lens[..batch.len()], &mut blocks), batch.len(), "room");
        batch.iter().zip(blocks).map(|(key, b)| NewEntry { key: key.clone(), block: b.freeze(), crc: Some(7) }).collect()
    };
    let put_many = |batch: &[Bytes]| cache.insert_many(new_entries(batch));
    // A PUT's inserts alone: the blocks allocated untimed, `insert_many`
    // timed (its time added up in `inserting`).
    let inserting = std::cell::Cell::new(0u128);
    let insert_alone = |batch: &[Bytes]| {
        let entries = new_entries(batch);
        let t = Instant::now();
        cache.insert_many(entries);
        inserting.set(inserting.get() + t.elapsed().as_nanos());
    };
    let get_one = |batch: &[Bytes]| {
        let found: Vec<_> = batch.iter().map(|k| cache.get(k)).collect();
        assert!(found.iter().all(Option::is_some));
    };
    let get_many = |batch: &[Bytes]| {
        let found = cache.get_many(batch);
        assert!(found.iter().all(Option::is_some));
    };
    put_one(&keys);
    // Between two batches the node moves a batch's payload (128 KiB)
    // through its caches; so does this, untimed, reading the next part of
    // a buffer too large to stay in cache.
    let sweep: Vec<u8> = (0..SWEEP_BYTES).map(|i| i as u8).collect();
    let swept = std::cell::Cell::new(0usize);
    let pollute = || {
        let at = swept.get();
        let part = &sweep[at..at + BATCH * BLOCK];
        std::hint::black_box(part.iter().step_by(64).fold(0u8, |a, &b| a ^ b));
        swept.set((at + BATCH * BLOCK) % (SWEEP_BYTES - BATCH * BLOCK));
    };
    // ns per key of one pass over every key in batches, the batches alone
    // timed; the two ways alternate round by round, so a drift of the
    // machine falls on both.
    let pass = |op: &BatchOp| {
        let mut nanos = 0u128;
        for batch in keys.chunks(BATCH) {
            pollute();
            let t = Instant::now();
            op(batch);
            nanos += t.elapsed().as_nanos();
        }
        nanos as f64 / BATCH_KEYS as f64
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "batches of {BATCH} over {BATCH_KEYS} stored blocks of {} KiB, 16 shards (ns per key, median of {BATCH_ROUNDS} rounds):",
        BLOCK >> 10
    );
    if run == BatchRun::All {
        let ops: [(&str, &BatchOp, &BatchOp); 2] = [("get", &get_one, &get_many), ("put", &put_one, &put_many)];
        for (name, one, many) in ops {
            let (ones, manys): (Vec<f64>, Vec<f64>) = (0..BATCH_ROUNDS).map(|_| (pass(one), pass(many))).unzip();
            let (one, many) = (median(ones), median(manys));
            println!("  {name}: one at a time {one:6.1}, batched {many:6.1} ({:.2}x)", one / many);
        }
    }
    let inserts: Vec<f64> = (0..BATCH_ROUNDS)
        .map(|_| {
            inserting.set(0);
            pass(&insert_alone);
            inserting.get() as f64 / BATCH_KEYS as f64
        })
        .collect();
    println!("  put, insert_many alone (blocks allocated untimed): {:6.1}", median(inserts));
}

/// A cache plus the bookkeeping of one replay.
struct Engine {
    cache: BlockCache,
    capacity_blocks: usize,
    lookups: u64,
    hits: u64,
    refused: u64,
    ops: u64,
    get_ns: Vec<u32>,
    alloc_ns: Vec<u32>,
    insert_ns: Vec<u32>,
}

struct Report {
    capacity_blocks: usize,
    hit_ratio: f64,
    get_ns: u32,
    alloc_ns: u32,
    insert_ns: u32,
    refused: u64,
}

impl Engine {
    fn new(blocks: usize, policy: EvictionPolicy) -> Self {
        let capacity = blocks.div_ceil(SLAB / BLOCK) * SLAB;
        let config = PoolConfig { max_block_bytes: SLAB, ..PoolConfig::new(capacity) };
        let pool = match MemoryPool::new(config) {
            Ok(pool) => pool,
            Err(err) => panic!("bench pool of {capacity} bytes: {err}"),
        };
        Engine {
            cache: BlockCache::new(pool, CacheConfig { policy, ..CacheConfig::default() }),
            capacity_blocks: capacity / BLOCK,
            lookups: 0,
            hits: 0,
            refused: 0,
            ops: 0,
            get_ns: Vec::new(),
            alloc_ns: Vec::new(),
            insert_ns: Vec::new(),
        }
    }

    fn sampled(&mut self) -> bool {
        self.ops += 1;
        self.ops % SAMPLE_EVERY == 0
    }

    /// A lookup of one block; true on a hit.
    fn get(&mut self, key: &[u8]) -> bool {
        self.lookups += 1;
        let found = if self.sampled() {
            let t = Instant::now();
            let found = self.cache.get(key);
            self.get_ns.push(nanos(t));
            found
        } else {
            self.cache.get(key)
        };
        let hit = found.is_some();
        self.hits += u64::from(hit);
        hit
    }

    /// Stores one block. Only its first bytes are written: the copy of the
    /// payload is the server's cost, not the cache's.
    fn put(&mut self, key: &Bytes) {
        let sampled = self.sampled();
        let t = Instant::now();
        let mut block = match self.cache.allocate(BLOCK) {
            Ok(block) => block,
            Err(_) => {
                self.refused += 1;
                return;
            }
        };
        if sampled {
            self.alloc_ns.push(nanos(t));
        }
        block.as_mut_slice()[..8].copy_from_slice(&self.ops.to_le_bytes());
        let block = block.freeze();
        let t = Instant::now();
        self.cache.insert(key.clone(), block, 0);
        if sampled {
            self.insert_ns.push(nanos(t));
        }
    }

    fn report(mut self) -> Report {
        Report {
            capacity_blocks: self.capacity_blocks,
            hit_ratio: self.hits as f64 / self.lookups.max(1) as f64,
            get_ns: median(&mut self.get_ns),
            alloc_ns: median(&mut self.alloc_ns),
            insert_ns: median(&mut self.insert_ns),
            refused: self.refused,
        }
    }
}

fn nanos(since: Instant) -> u32 {
    since.elapsed().as_nanos().min(u32::MAX as u128) as u32
}

fn median(samples: &mut [u32]) -> u32 {
    if samples.is_empty() {
        return 0;
    }
    let mid = samples.len() / 2;
    *samples.select_nth_unstable(mid).1
}

/// splitmix64: spreads ids and chains hashes into key bytes.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A 32-byte key (the size of a SHA-256 block hash) derived from `h`.
fn key_bytes(h: u64) -> Bytes {
    let mut key = Vec::with_capacity(32);
    let mut x = h;
    for _ in 0..4 {
        key.extend_from_slice(&x.to_le_bytes());
        x = mix(x);
    }
    Bytes::from(key)
}

/// Zipf(`alpha`) over `n` ranks by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, alpha: f64) -> Self {
        let mut cdf: Vec<f64> = (1..=n).map(|rank| 1.0 / (rank as f64).powf(alpha)).collect();
        let mut sum = 0.0;
        for w in cdf.iter_mut() {
            sum += *w;
            *w = sum;
        }
        for w in cdf.iter_mut() {
            *w /= sum;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut fastrand::Rng) -> usize {
        let u = rng.f64();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

struct ZipfTrace {
    keys: Vec<Bytes>,
    requests: Vec<u32>,
}

fn zipf_trace() -> ZipfTrace {
    let mut rng = fastrand::Rng::with_seed(SEED);
    let zipf = Zipf::new(ZIPF_KEYS, ZIPF_ALPHA);
    let keys = (0..ZIPF_KEYS as u64).map(|i| key_bytes(mix(i))).collect();
    let requests = (0..ZIPF_REQUESTS).map(|_| zipf.sample(&mut rng) as u32).collect();
    ZipfTrace { keys, requests }
}

impl ZipfTrace {
    fn replay(&self, engine: &mut Engine) {
        for &r in &self.requests {
            let key = &self.keys[r as usize];
            if !engine.get(key) {
                engine.put(key);
            }
        }
    }
}

fn new_key(keys: &mut Vec<Bytes>, h: u64) -> u32 {
    keys.push(key_bytes(h));
    (keys.len() - 1) as u32
}

struct ChatTrace {
    keys: Vec<Bytes>,
    /// Each conversation's final chain, as indices into `keys`.
    conversations: Vec<Vec<u32>>,
    /// (conversation, prompt length in blocks), in request order.
    turns: Vec<(u32, u32)>,
}

fn chat_trace() -> ChatTrace {
    let mut rng = fastrand::Rng::with_seed(SEED ^ 0xC4A7);
    let mut keys: Vec<Bytes> = Vec::new();
    // System prompts: shared by every conversation that uses them.
    let systems: Vec<(u64, Vec<u32>)> = (0..SYSTEM_PROMPTS as u64)
        .map(|s| {
            let mut h = 0;
            let chain = (0..rng.u64(4..=16))
                .map(|pos| {
                    h = mix(h ^ mix(s << 32 | pos));
                    new_key(&mut keys, h)
                })
                .collect();
            (h, chain)
        })
        .collect();
    let system_pick = Zipf::new(SYSTEM_PROMPTS, 1.0);
    let slot_pick = Zipf::new(CHAT_SLOTS, CHAT_SLOT_SKEW);

    /// A live conversation: its trace index, the hash of its last block, and
    /// whether it has had a turn yet.
    struct Live {
        conversation: u32,
        tail_hash: u64,
        replied: bool,
    }
    let mut conversations: Vec<Vec<u32>> = Vec::new();
    let mut slots: Vec<Option<Live>> = (0..CHAT_SLOTS).map(|_| None).collect();
    let mut turns = Vec::with_capacity(CHAT_TURNS);
    for _ in 0..CHAT_TURNS {
        let slot = slot_pick.sample(&mut rng);
        let live = slots[slot].get_or_insert_with(|| {
            let (hash, chain) = &systems[system_pick.sample(&mut rng)];
            conversations.push(chain.clone());
            Live { conversation: (conversations.len() - 1) as u32, tail_hash: *hash, replied: false }
        });
        let chain = &mut conversations[live.conversation as usize];
        let id = live.conversation as u64;
        // The previous reply (none before the first turn), then the new message.
        let reply = if live.replied { rng.u64(1..=4) } else { 0 };
        live.replied = true;
        let added = reply + rng.u64(1..=3);
        for _ in 0..added {
            live.tail_hash = mix(live.tail_hash ^ mix(id << 32 | chain.len() as u64) ^ 0xC0);
            chain.push(new_key(&mut keys, live.tail_hash));
        }
        turns.push((live.conversation, chain.len() as u32));
        if chain.len() >= CHAT_MAX_BLOCKS || rng.f64() < CHAT_ABANDON {
            slots[slot] = None;
        }
    }
    ChatTrace { keys, conversations, turns }
}

impl ChatTrace {
    fn lookups(&self) -> u64 {
        self.turns.iter().map(|&(_, len)| len as u64).sum()
    }

    fn replay(&self, engine: &mut Engine) {
        let mut chain: Vec<&[u8]> = Vec::with_capacity(CHAT_MAX_BLOCKS + 8);
        for &(conversation, len) in &self.turns {
            let ids = &self.conversations[conversation as usize][..len as usize];
            chain.clear();
            chain.extend(ids.iter().map(|&id| self.keys[id as usize].as_ref()));
            let matched = engine.cache.match_prefix(&chain, None);
            for &id in &ids[..matched] {
                engine.get(&self.keys[id as usize]);
            }
            // Everything after the first gap is recomputed and stored, as an
            // engine with prefix caching does; the lookups count as misses.
            for &id in &ids[matched..] {
                engine.lookups += 1;
                engine.put(&self.keys[id as usize]);
            }
        }
    }
}
