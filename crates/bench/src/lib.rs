//! Load generation against a kvplane node and the baselines it is judged by.
//!
//! `kvplane bench` drives one *target* — a kvplane node (or several: keys
//! split among independent nodes by hash slot, or a cluster through its
//! slot table), a plain socket sink/source ([`raw`]: the
//! loopback ceiling), a redis-server ([`redis`]) or a vineyardd
//! ([`vineyard`]) — with the same shape on every side: `clients` connections, each sending
//! batches of `batch` blocks of `block_size` bytes and waiting for the answer
//! before the next batch. Comparing targets is only fair when that shape is
//! identical, so the shape lives here once and each target only says how one
//! batch goes over its wire.
//!
//! None of this ships inside the node: it is the bench and demo commands'
//! crate, kept apart from the product libraries.

pub mod demo;
pub mod raw;
pub mod redis;
pub mod vineyard;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::Bytes;

/// What to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchOp {
    Put,
    Get,
    /// Alternate GET and PUT batches.
    Mixed,
}

impl std::str::FromStr for BenchOp {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "put" => Ok(BenchOp::Put),
            "get" => Ok(BenchOp::Get),
            "mixed" => Ok(BenchOp::Mixed),
            other => bail!("--op {other:?}: expected put, get or mixed"),
        }
    }
}

/// Which server is being driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Kvplane,
    /// kvplane nodes in cluster mode, through the client's cluster routing
    /// (the slot table the nodes serve).
    Cluster,
    Raw,
    /// The raw server keeping every block in memory of its own (see
    /// [`raw`]): the one copy per block a store cannot avoid, and nothing
    /// else.
    RawStore,
    Redis,
    /// vineyardd's RPC port, through `builtin:vineyard`'s protocol code
    /// compiled natively.
    Vineyard,
    /// A kvplane node's Unix socket, block bytes through the memory the
    /// node shares with the client: PUT from and GET into that memory
    /// (PUT_SHM / GET_SHM), as an engine staging its KV blocks there would.
    Local,
}

impl std::str::FromStr for Target {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "kvplane" => Ok(Target::Kvplane),
            "cluster" => Ok(Target::Cluster),
            "raw" => Ok(Target::Raw),
            "raw-store" => Ok(Target::RawStore),
            "redis" => Ok(Target::Redis),
            "vineyard" => Ok(Target::Vineyard),
            "local" => Ok(Target::Local),
            other => bail!("--target {other:?}: expected kvplane, cluster, raw, raw-store, redis, vineyard or local"),
        }
    }
}

#[derive(Clone)]
pub struct BenchConfig {
    pub target: Target,
    /// `HOST:PORT` or `unix:///path` (the kvplane endpoint syntax, for every
    /// target). For `kvplane`, several endpoints separated by commas are
    /// independent nodes: each key goes to the node owning its hash slot
    /// ([`owner`]) and a batch is split into one request per node, sent
    /// concurrently. For `cluster`, the nodes of the cluster: the seeds of
    /// its slot table, and how many members to wait for.
    pub endpoint: String,
    pub token: Option<String>,
    /// `kvplane` and `cluster` over TCP: TLS to the nodes.
    pub tls: Option<kvplane_client::ClientTls>,
    pub block_size: usize,
    /// Distinct keys; GET benchmarks store them all first (untimed).
    pub blocks: usize,
    pub batch: usize,
    pub clients: usize,
    /// `kvplane` and `cluster`: connections in each client's pool (per
    /// node); a large batch is split over them.
    pub connections: usize,
    pub op: BenchOp,
    /// GET runs store every key first (untimed). Off: the keys must already
    /// be where the target reads them from (a node's second tier seeded by
    /// a run against the store itself).
    pub seed: bool,
    pub duration: Duration,
    /// `kvplane` over a Unix socket: let the client move bytes through the
    /// node's shared memory (false: every byte on the socket).
    pub shared_memory: bool,
    /// Called about twice a second with the fraction of the run done.
    pub progress: Option<Arc<dyn Fn(f64, u64) + Send + Sync>>,
}

/// What one run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub target: String,
    pub endpoint: String,
    pub op: String,
    pub block_size: usize,
    pub batch: usize,
    pub clients: usize,
    /// Blocks moved in the timed part.
    pub blocks: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub gb_per_s: f64,
    pub blocks_per_s: f64,
    /// Batch round trip, microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
    /// Keys a GET did not find (zero in a healthy run).
    pub misses: u64,
    /// kvplane targets: GETs the memory tiers answered during the timed
    /// part (the nodes' `hits` counter, summed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_hits: Option<u64>,
    /// kvplane targets: keys read through the second tier during the timed
    /// part (`backend_hits`; absent for nodes without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_hits: Option<u64>,
}

/// The node among `nodes` that owns `key`: slot ranges of equal size, in
/// endpoint order, as a slot table of that many members with one owner per
/// slot would assign them.
pub fn owner(key: &[u8], nodes: usize) -> usize {
    let slot = kvplane_slots::slot_of(key, kvplane_slots::SLOTS) as usize;
    slot * nodes / kvplane_slots::SLOTS as usize
}

/// A batch-capable connection to a target. Implemented by an enum rather
/// than a trait object: three variants, no allocation per call.
pub(crate) enum Conn {
    /// One client per node (one node: no splitting).
    Kvplane(Vec<kvplane_client::Client>),
    Cluster(kvplane_client::ClusterClient),
    Raw(raw::RawClient),
    RawStore(raw::RawClient),
    Redis(redis::RedisClient),
    Vineyard(vineyard::VineyardClient),
    /// One connection with shared memory; PUTs read the first `batch`
    /// block-sized slots of it, GETs write the next `batch`.
    Local {
        conn: kvplane_client::Connection,
        filled: bool,
    },
}

async fn kvplane_client(endpoint: &str, cfg: &BenchConfig) -> anyhow::Result<kvplane_client::Client> {
    let parsed = endpoint.parse().map_err(anyhow::Error::from)?;
    let mut config = kvplane_client::ClientConfig::new(parsed);
    config.connections = cfg.connections.max(1);
    let (token, shared_memory) = (cfg.token.clone(), cfg.shared_memory);
    config.token = token;
    config.tls.clone_from(&cfg.tls);
    config.shared_memory = shared_memory;
    kvplane_client::Client::connect(config).await.with_context(|| format!("connecting to {endpoint}"))
}

/// How long a cluster client waits for every node to be in the slot table.
const CLUSTER_PATIENCE: Duration = Duration::from_secs(30);

/// A cluster client whose slot table lists every node of `endpoint`.
async fn cluster_client(
    endpoint: &str,
    token: Option<String>,
    tls: Option<kvplane_client::ClientTls>,
    connections: usize,
) -> anyhow::Result<kvplane_client::ClusterClient> {
    let seeds =
        endpoint.split(',').map(|e| e.parse().map_err(anyhow::Error::from)).collect::<anyhow::Result<Vec<kvplane_client::Endpoint>>>()?;
    let expected = seeds.len();
    let mut config = kvplane_client::ClusterClientConfig::new(seeds);
    config.connections = connections.max(1);
    config.token = token;
    config.tls = tls;
    let client =
        kvplane_client::ClusterClient::connect(config).await.with_context(|| format!("connecting to the cluster of {endpoint}"))?;
    let deadline = tokio::time::Instant::now() + CLUSTER_PATIENCE;
    loop {
        let table = client.table();
        if table.members().len() >= expected {
            return Ok(client);
        }
        if tokio::time::timeout_at(deadline, client.table_after(table.version)).await.is_err() {
            bail!("the cluster's slot table lists {} of the {expected} nodes after {CLUSTER_PATIENCE:?}", table.members().len());
        }
    }
}

fn check_put(keys: &[Bytes], results: Vec<Result<(), kvplane_client::KvError>>) -> anyhow::Result<()> {
    for (k, r) in keys.iter().zip(results) {
        r.with_context(|| format!("PUT {}", String::from_utf8_lossy(k)))?;
    }
    Ok(())
}

/// The keys a GET answer misses; an error for a wrong length or a failure.
fn count_misses(keys: &[Bytes], results: Vec<Result<Bytes, kvplane_client::KvError>>, block_size: usize) -> anyhow::Result<u64> {
    let mut misses = 0;
    for (k, r) in keys.iter().zip(results) {
        match r {
            Ok(b) if b.len() == block_size => {}
            Ok(b) => bail!("GET {} returned {} bytes, expected {block_size}", String::from_utf8_lossy(k), b.len()),
            Err(kvplane_client::KvError::NotFound) => misses += 1,
            Err(e) => return Err(e).with_context(|| format!("GET {}", String::from_utf8_lossy(k))),
        }
    }
    Ok(misses)
}

/// Each node's share of `keys`: (node, keys), nodes without keys left out.
/// (One node is called directly by `Conn::put` and `Conn::get`.)
fn split(keys: &[Bytes], nodes: usize) -> Vec<(usize, Vec<Bytes>)> {
    let mut parts: Vec<Vec<Bytes>> = vec![Vec::new(); nodes];
    for k in keys {
        parts[owner(k, nodes)].push(k.clone());
    }
    parts.into_iter().enumerate().filter(|(_, p)| !p.is_empty()).collect()
}

impl Conn {
    async fn open(cfg: &BenchConfig) -> anyhow::Result<Conn> {
        Ok(match cfg.target {
            Target::Kvplane => {
                let mut clients = Vec::new();
                for endpoint in cfg.endpoint.split(',') {
                    clients.push(kvplane_client(endpoint, cfg).await?);
                }
                Conn::Kvplane(clients)
            }
            Target::Cluster => Conn::Cluster(cluster_client(&cfg.endpoint, cfg.token.clone(), cfg.tls.clone(), cfg.connections).await?),
            Target::Raw => Conn::Raw(raw::RawClient::connect(&cfg.endpoint).await?),
            Target::RawStore => Conn::RawStore(raw::RawClient::connect(&cfg.endpoint).await?),
            Target::Redis => Conn::Redis(redis::RedisClient::connect(&cfg.endpoint).await?),
            Target::Vineyard => Conn::Vineyard(vineyard::VineyardClient::connect(&cfg.endpoint).await?),
            Target::Local => {
                let endpoint: kvplane_client::Endpoint = cfg.endpoint.parse().map_err(anyhow::Error::from)?;
                let conn = kvplane_client::Connection::open(&endpoint, cfg.token.as_deref(), Duration::from_secs(30))
                    .await
                    .with_context(|| format!("connecting to {}", cfg.endpoint))?;
                let Some(memory) = conn.shared_memory() else {
                    bail!("{} shares no memory with this client (a Unix socket endpoint of a node with --shm-region above 0)", cfg.endpoint)
                };
                let needed = 2 * cfg.batch * cfg.block_size;
                if memory.len() < needed {
                    bail!(
                        "--batch {} of --block-size {} needs {needed} bytes of shared memory; the node shares {}",
                        cfg.batch,
                        cfg.block_size,
                        memory.len()
                    );
                }
                Conn::Local { conn, filled: false }
            }
        })
    }

    async fn put(&mut self, keys: &[Bytes], value: &Bytes) -> anyhow::Result<()> {
        match self {
            // One node: its client alone, as an application calls it (the
            // joined futures below cost a single GET a tenth of the bench
            // client's instructions, which `raw` does not pay).
            Conn::Kvplane(clients) if clients.len() == 1 => {
                check_put(keys, clients[0].put(keys.iter().map(|k| (k.clone(), value.clone())).collect()).await?)
            }
            Conn::Kvplane(clients) => {
                let parts = split(keys, clients.len());
                let sent = parts.iter().map(|(node, part)| clients[*node].put(part.iter().map(|k| (k.clone(), value.clone())).collect()));
                for ((_, part), results) in parts.iter().zip(futures::future::try_join_all(sent).await?) {
                    check_put(part, results)?;
                }
                Ok(())
            }
            Conn::Cluster(c) => check_put(keys, c.put(keys.iter().map(|k| (k.clone(), value.clone())).collect()).await?),
            Conn::Raw(c) => c.put_value(keys.len(), value).await,
            Conn::RawStore(c) => c.put_at(&indices(keys)?, value).await,
            Conn::Redis(c) => c.set(keys, value).await,
            Conn::Vineyard(c) => c.put(keys, value).await,
            Conn::Local { conn, filled } => {
                let size = value.len();
                if !*filled {
                    let memory = conn.shared_memory().expect("checked at open");
                    for i in 0..keys.len() {
                        memory.write_at(i * size, value)?;
                    }
                    *filled = true;
                }
                let entries: Vec<(Bytes, usize, usize)> = keys.iter().enumerate().map(|(i, k)| (k.clone(), i * size, size)).collect();
                check_put(keys, conn.put_from_shared(&entries).await?)
            }
        }
    }

    /// Returns how many keys were missing.
    async fn get(&mut self, keys: &[Bytes], block_size: usize) -> anyhow::Result<u64> {
        match self {
            Conn::Kvplane(clients) if clients.len() == 1 => count_misses(keys, clients[0].get(keys.to_vec()).await?, block_size),
            Conn::Kvplane(clients) => {
                let parts = split(keys, clients.len());
                let asked = parts.iter().map(|(node, part)| clients[*node].get(part.clone()));
                let mut misses = 0;
                for ((_, part), results) in parts.iter().zip(futures::future::try_join_all(asked).await?) {
                    misses += count_misses(part, results, block_size)?;
                }
                Ok(misses)
            }
            Conn::Cluster(c) => count_misses(keys, c.get(keys.to_vec()).await?, block_size),
            Conn::Raw(c) => c.get(keys.len(), block_size).await.map(|()| 0),
            Conn::RawStore(c) => c.get_at(&indices(keys)?, block_size).await.map(|()| 0),
            Conn::Redis(c) => c.get(keys, block_size).await,
            Conn::Vineyard(c) => c.get(keys, block_size).await,
            Conn::Local { conn, .. } => {
                let base = keys.len() * block_size;
                let entries: Vec<(Bytes, usize, usize)> =
                    keys.iter().enumerate().map(|(i, k)| (k.clone(), base + i * block_size, block_size)).collect();
                let mut misses = 0;
                for (k, r) in keys.iter().zip(conn.get_into_shared(&entries).await?) {
                    match r {
                        Ok(len) if len == block_size => {}
                        Ok(len) => bail!("GET {} returned {len} bytes, expected {block_size}", String::from_utf8_lossy(k)),
                        Err(kvplane_client::KvError::NotFound) => misses += 1,
                        Err(e) => return Err(e).with_context(|| format!("GET {}", String::from_utf8_lossy(k))),
                    }
                }
                Ok(misses)
            }
        }
    }
}

const KEY_PREFIX: &str = "bench/";

fn key(i: usize) -> Bytes {
    Bytes::from(format!("{KEY_PREFIX}{i:08}"))
}

/// The index each of `keys` was made from by [`key`].
fn indices(keys: &[Bytes]) -> anyhow::Result<Vec<u32>> {
    keys.iter()
        .map(|k| {
            std::str::from_utf8(k)
                .ok()
                .and_then(|k| k.strip_prefix(KEY_PREFIX))
                .and_then(|i| i.parse().ok())
                .context("a bench key without its index")
        })
        .collect()
}

/// Runs the benchmark and reports throughput and batch latency.
pub async fn run(cfg: BenchConfig) -> anyhow::Result<BenchReport> {
    if cfg.block_size == 0 || cfg.blocks == 0 || cfg.batch == 0 || cfg.clients == 0 {
        bail!("--block-size, --blocks, --batch and --clients must all be at least 1");
    }
    let value = Bytes::from((0..cfg.block_size).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>());
    let mut conns = Vec::with_capacity(cfg.clients);
    for _ in 0..cfg.clients {
        conns.push(Conn::open(&cfg).await?);
    }
    if cfg.op != BenchOp::Put && cfg.seed {
        // Store every key once so GETs hit; untimed.
        let keys: Vec<Bytes> = (0..cfg.blocks).map(key).collect();
        for chunk in keys.chunks(cfg.batch) {
            conns[0].put(chunk, &value).await.context("storing the blocks before the GET run")?;
        }
    }
    // Nodes: one more connection each, to read their counters around the
    // timed part.
    let counter_conn = match cfg.target {
        Target::Kvplane | Target::Cluster | Target::Local => {
            Some(Conn::open(&BenchConfig { target: Target::Kvplane, ..cfg.clone() }).await?)
        }
        _ => None,
    };
    let counters_before = node_counters(counter_conn.as_ref()).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (c, mut conn) in conns.into_iter().enumerate() {
        let cfg = cfg.clone();
        let (stop, moved, value) = (Arc::clone(&stop), Arc::clone(&moved), value.clone());
        tasks.spawn(async move {
            // Each client walks its own stride of the key space.
            let mine: Vec<Bytes> = (c..cfg.blocks).step_by(cfg.clients).map(key).collect();
            let mine = if mine.is_empty() { vec![key(c)] } else { mine };
            let mut latencies = latency_histogram();
            let mut misses = 0u64;
            let mut round = 0usize;
            while !stop.load(Ordering::Relaxed) {
                for chunk in mine.chunks(cfg.batch) {
                    let t = Instant::now();
                    let get = match cfg.op {
                        BenchOp::Put => false,
                        BenchOp::Get => true,
                        BenchOp::Mixed => round % 2 == 0,
                    };
                    if get {
                        misses += conn.get(chunk, cfg.block_size).await?;
                    } else {
                        conn.put(chunk, &value).await?;
                    }
                    latencies.saturating_record(t.elapsed().as_nanos().try_into().unwrap_or(u64::MAX));
                    round += 1;
                    moved.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
            anyhow::Ok((latencies, misses))
        });
    }
    // The clock, and progress for long runs.
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    ticker.tick().await;
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                let done = started.elapsed().as_secs_f64() / cfg.duration.as_secs_f64();
                if let Some(p) = &cfg.progress {
                    p(done.min(1.0), moved.load(Ordering::Relaxed));
                }
                if done >= 1.0 {
                    stop.store(true, Ordering::Relaxed);
                    break;
                }
            }
            Some(early) = tasks.join_next() => {
                // A client finished before the clock: it failed.
                early.context("benchmark client panicked")??;
                bail!("a benchmark client stopped early");
            }
        }
    }
    let mut latencies = latency_histogram();
    let mut misses = 0;
    while let Some(r) = tasks.join_next().await {
        let (l, m) = r.context("benchmark client panicked")??;
        latencies.add(l).context("merging the clients' latency histograms")?;
        misses += m;
    }
    let seconds = started.elapsed().as_secs_f64();
    let blocks = moved.load(Ordering::Relaxed);
    let counters_after = node_counters(counter_conn.as_ref()).await?;
    let delta = |f: fn(&NodeCounters) -> Option<u64>| -> Option<u64> {
        match (&counters_before, &counters_after) {
            (Some(b), Some(a)) => Some(f(a)?.saturating_sub(f(b)?)),
            _ => None,
        }
    };
    let bytes = blocks * cfg.block_size as u64;
    // In microseconds; 0 when no call completed.
    let pct = |p: f64| -> f64 { latencies.value_at_quantile(p) as f64 / 1e3 };
    Ok(BenchReport {
        target: format!("{:?}", cfg.target).to_lowercase(),
        endpoint: cfg.endpoint.clone(),
        op: format!("{:?}", cfg.op).to_lowercase(),
        block_size: cfg.block_size,
        batch: cfg.batch,
        clients: cfg.clients,
        blocks,
        bytes,
        seconds,
        gb_per_s: bytes as f64 / seconds / 1e9,
        blocks_per_s: blocks as f64 / seconds,
        p50_us: pct(0.5),
        p99_us: pct(0.99),
        misses,
        memory_hits: delta(|c| Some(c.memory_hits)),
        backend_hits: delta(|c| c.backend_hits),
    })
}

/// Batch latencies in nanoseconds, from 1 ns up to an hour, to three
/// significant digits (0.1%): a fixed few tens of KiB per client however
/// long the run, where keeping every sample grew with it.
fn latency_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// The nodes' counters a report quotes, summed over the nodes.
struct NodeCounters {
    memory_hits: u64,
    backend_hits: Option<u64>,
}

/// `None` unless `conn` is to kvplane nodes.
async fn node_counters(conn: Option<&Conn>) -> anyhow::Result<Option<NodeCounters>> {
    let Some(Conn::Kvplane(clients)) = conn else { return Ok(None) };
    let mut sum = NodeCounters { memory_hits: 0, backend_hits: None };
    for c in clients {
        let stats = c.stats().await.context("reading the node's counters (STATS)")?;
        let find = |name: &str| stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        sum.memory_hits += find("hits").unwrap_or(0);
        if let Some(b) = find("backend_hits") {
            sum.backend_hits = Some(sum.backend_hits.unwrap_or(0) + b);
        }
    }
    Ok(Some(sum))
}

pub(crate) type BoxRead = tokio::io::BufReader<Box<dyn tokio::io::AsyncRead + Send + Unpin>>;
pub(crate) type BoxWrite = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;

/// Opens a TCP (`HOST:PORT`, with TCP_NODELAY) or Unix (`unix:///path`)
/// stream, buffered for reading like the kvplane client's.
pub(crate) async fn dial(endpoint: &str) -> anyhow::Result<(BoxRead, BoxWrite)> {
    let parsed: kvplane_client::Endpoint = endpoint.parse().map_err(anyhow::Error::from)?;
    let (r, w): (Box<dyn tokio::io::AsyncRead + Send + Unpin>, BoxWrite) = match parsed {
        kvplane_client::Endpoint::Tcp(addr) => {
            let s = tokio::net::TcpStream::connect(&addr).await.with_context(|| format!("connecting to {addr}"))?;
            s.set_nodelay(true)?;
            let (r, w) = s.into_split();
            (Box::new(r), Box::new(w))
        }
        kvplane_client::Endpoint::Unix(path) => {
            let s = tokio::net::UnixStream::connect(&path).await.with_context(|| format!("connecting to {}", path.display()))?;
            let (r, w) = s.into_split();
            (Box::new(r), Box::new(w))
        }
    };
    Ok((tokio::io::BufReader::with_capacity(256 << 10, r), w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bench_key_gives_back_the_index_it_was_made_from() {
        let keys: Vec<Bytes> = [0, 7, 123_456].into_iter().map(key).collect();
        assert_eq!(indices(&keys).unwrap(), vec![0, 7, 123_456]);
        assert!(indices(&[Bytes::from_static(b"other/1")]).is_err());
    }

    #[test]
    fn nodes_own_contiguous_slot_ranges_in_endpoint_order() {
        let n = 3;
        let owners: Vec<usize> = (0..kvplane_slots::SLOTS as usize).map(|slot| slot * n / 16384).collect();
        assert_eq!(owners.first(), Some(&0));
        assert_eq!(owners.last(), Some(&(n - 1)));
        assert!(owners.windows(2).all(|w| w[0] <= w[1]), "ranges are contiguous");
        for i in 0..1000 {
            let k = key(i);
            let slot = kvplane_slots::slot_of(&k, kvplane_slots::SLOTS) as usize;
            assert_eq!(owner(&k, n), owners[slot]);
            assert_eq!(owner(&k, 1), 0);
        }
    }

    #[test]
    fn a_batch_is_split_into_one_part_per_node_with_every_key_once() {
        let keys: Vec<Bytes> = (0..64).map(key).collect();
        let parts = split(&keys, 3);
        assert!(parts.len() > 1 && parts.len() <= 3, "64 keys spread over the nodes: {}", parts.len());
        let mut seen: Vec<Bytes> = Vec::new();
        for (node, part) in &parts {
            assert!(!part.is_empty());
            assert!(part.iter().all(|k| owner(k, 3) == *node));
            seen.extend(part.iter().cloned());
        }
        seen.sort();
        let mut all = keys.clone();
        all.sort();
        assert_eq!(seen, all);
        assert_eq!(split(&keys, 1), vec![(0, keys)]);
    }
}
