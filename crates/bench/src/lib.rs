//! Load generation against a kvplane node and the baselines it is judged by.
//!
//! `kvplane bench` drives one *target* — a kvplane node, a plain socket
//! sink/source ([`raw`]: the loopback ceiling) or a redis-server ([`redis`])
//! — with the same shape on every side: `clients` connections, each sending
//! batches of `batch` blocks of `block_size` bytes and waiting for the answer
//! before the next batch. Comparing targets is only fair when that shape is
//! identical, so the shape lives here once and each target only says how one
//! batch goes over its wire.
//!
//! None of this ships inside the node: it is the bench and demo commands'
//! crate, kept apart from the product libraries.

#![forbid(unsafe_code)]

pub mod demo;
pub mod raw;
pub mod redis;

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
    Raw,
    Redis,
}

impl std::str::FromStr for Target {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "kvplane" => Ok(Target::Kvplane),
            "raw" => Ok(Target::Raw),
            "redis" => Ok(Target::Redis),
            other => bail!("--target {other:?}: expected kvplane, raw or redis"),
        }
    }
}

#[derive(Clone)]
pub struct BenchConfig {
    pub target: Target,
    /// `HOST:PORT` or `unix:///path` (the kvplane endpoint syntax, for every target).
    pub endpoint: String,
    pub token: Option<String>,
    pub block_size: usize,
    /// Distinct keys; GET benchmarks store them all first (untimed).
    pub blocks: usize,
    pub batch: usize,
    pub clients: usize,
    pub op: BenchOp,
    pub duration: Duration,
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
}

/// A batch-capable connection to a target. Implemented by an enum rather
/// than a trait object: three variants, no allocation per call.
pub(crate) enum Conn {
    Kvplane(kvplane_client::Client),
    Raw(raw::RawClient),
    Redis(redis::RedisClient),
}

impl Conn {
    async fn open(cfg: &BenchConfig) -> anyhow::Result<Conn> {
        Ok(match cfg.target {
            Target::Kvplane => {
                let endpoint = cfg.endpoint.parse().map_err(anyhow::Error::from)?;
                let mut config = kvplane_client::ClientConfig::new(endpoint);
                config.connections = 1;
                config.token = cfg.token.clone();
                Conn::Kvplane(kvplane_client::Client::connect(config).await.with_context(|| format!("connecting to {}", cfg.endpoint))?)
            }
            Target::Raw => Conn::Raw(raw::RawClient::connect(&cfg.endpoint).await?),
            Target::Redis => Conn::Redis(redis::RedisClient::connect(&cfg.endpoint).await?),
        })
    }

    async fn put(&mut self, keys: &[Bytes], value: &Bytes) -> anyhow::Result<()> {
        match self {
            Conn::Kvplane(c) => {
                let results = c.put(keys.iter().map(|k| (k.clone(), value.clone())).collect()).await?;
                for (k, r) in keys.iter().zip(results) {
                    r.with_context(|| format!("PUT {}", String::from_utf8_lossy(k)))?;
                }
                Ok(())
            }
            Conn::Raw(c) => c.put_value(keys.len(), value).await,
            Conn::Redis(c) => c.set(keys, value).await,
        }
    }

    /// Returns how many keys were missing.
    async fn get(&mut self, keys: &[Bytes], block_size: usize) -> anyhow::Result<u64> {
        match self {
            Conn::Kvplane(c) => {
                let mut misses = 0;
                for (k, r) in keys.iter().zip(c.get(keys.to_vec()).await?) {
                    match r {
                        Ok(b) if b.len() == block_size => {}
                        Ok(b) => bail!("GET {} returned {} bytes, expected {block_size}", String::from_utf8_lossy(k), b.len()),
                        Err(kvplane_client::KvError::NotFound) => misses += 1,
                        Err(e) => return Err(e).with_context(|| format!("GET {}", String::from_utf8_lossy(k))),
                    }
                }
                Ok(misses)
            }
            Conn::Raw(c) => c.get(keys.len(), block_size).await.map(|()| 0),
            Conn::Redis(c) => c.get(keys, block_size).await,
        }
    }
}

fn key(i: usize) -> Bytes {
    Bytes::from(format!("bench/{i:08}"))
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
    if cfg.op != BenchOp::Put {
        // Store every key once so GETs hit; untimed.
        let keys: Vec<Bytes> = (0..cfg.blocks).map(key).collect();
        for chunk in keys.chunks(cfg.batch) {
            conns[0].put(chunk, &value).await.context("storing the blocks before the GET run")?;
        }
    }
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
            let mut latencies = Vec::new();
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
                    latencies.push(t.elapsed());
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
    let mut latencies = Vec::new();
    let mut misses = 0;
    while let Some(r) = tasks.join_next().await {
        let (l, m) = r.context("benchmark client panicked")??;
        latencies.extend(l);
        misses += m;
    }
    let seconds = started.elapsed().as_secs_f64();
    let blocks = moved.load(Ordering::Relaxed);
    let bytes = blocks * cfg.block_size as u64;
    latencies.sort_unstable();
    let pct = |p: f64| -> f64 {
        if latencies.is_empty() {
            return 0.0;
        }
        let i = ((latencies.len() - 1) as f64 * p).round() as usize;
        latencies[i].as_secs_f64() * 1e6
    };
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
    })
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
