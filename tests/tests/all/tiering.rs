//! The second tier end to end: a node whose memory tier is backed by
//! `builtin:resp` against Debian's real redis-server, driven by the real
//! client. Each ingest mode, both tiers seen by EXISTS / MATCH_PREFIX /
//! DELETE, the store killed under load (fail-open: misses, nothing
//! corrupted, recovery), fail-closed errors, the in-flight bound, and peers
//! that never answer or answer garbage.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint, KvError};
use kvplane_config::{AtBound, ByteSize, FailurePolicy, IngestMode, TieringConfig, WriteMode};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use kvplane_node::tier::{envelope, TierSetup};
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{Backend, PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_tests::redis::RedisServer;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// How long a test waits for a state it polls for: far longer than any
/// should take, so a slow machine is not a failure.
const PATIENCE: Duration = Duration::from_secs(30);
const NONE: BackendCallOptions = BackendCallOptions { ttl_ms: None, namespace: None };

fn resp(endpoint: &str, policy: FailurePolicy) -> PluginDecl {
    let mut d = PluginDecl::new("resp", World::Backend, PluginSource::Builtin("resp".into()));
    d.config.insert("endpoint".into(), endpoint.to_string());
    d.config.insert("prefix".into(), "tier:".into());
    d.allowed_endpoints = vec![endpoint.to_string()];
    d.failure_policy = policy;
    d.limits.timeout = Duration::from_millis(500);
    d
}

fn backend(runtime: &PluginRuntime, d: PluginDecl) -> Arc<Backend> {
    Arc::new(runtime.load_backend(d).expect("loading builtin:resp"))
}

fn setup(backend: Arc<Backend>, settings: TieringConfig) -> TierSetup {
    TierSetup { name: "resp".into(), backend, retry: None, settings }
}

async fn node(memory: usize, tier: TierSetup) -> Node {
    let config = NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: Some("127.0.0.1:0".parse().unwrap()),
        pool: PoolConfig::new(memory),
        tier: Some(tier),
        drain_timeout: PATIENCE,
        ..NodeConfig::default()
    };
    Node::start(config).await.expect("node starts")
}

async fn client(node: &Node) -> Client {
    let endpoint = Endpoint::Tcp(node.tcp_addr().expect("tcp").to_string());
    Client::connect(ClientConfig::new(endpoint)).await.expect("client connects")
}

/// A block whose every byte derives from its key: a reader can check any
/// block it gets without remembering what was written.
/// A block and its trailer as the node writes them to the second tier
/// (see `kvplane_node::tier::envelope`), for a test that fills the store
/// behind the node's back.
fn sealed(key: &str, value: &Bytes) -> [(Vec<u8>, Bytes); 2] {
    [
        (key.as_bytes().to_vec(), value.clone()),
        (envelope::trailer_key(key.as_bytes()), envelope::trailer(key.as_bytes(), value.len(), kvplane_protocol::checksum(value))),
    ]
}

fn value_of(key: &str, len: usize) -> Bytes {
    let seed = key.bytes().fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    Bytes::from((0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:04}")).collect()
}

fn stat(node: &Node, name: &str) -> u64 {
    node.stats().into_iter().find(|(n, _)| n == name).map(|(_, v)| v).unwrap_or_else(|| panic!("no stat {name}"))
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn put_all(c: &Client, names: &[String], len: usize) {
    let entries = names.iter().map(|k| (Bytes::from(k.clone()), value_of(k, len))).collect();
    let results = c.put(entries).await.expect("put");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// GETs every key and checks each found block against its key; answers
/// how many were found.
async fn get_checked(c: &Client, names: &[String], len: usize) -> usize {
    let got = c.get(names.iter().map(|k| Bytes::from(k.clone())).collect()).await.expect("get");
    let mut found = 0;
    for (k, r) in names.iter().zip(got) {
        match r {
            Ok(v) => {
                assert_eq!(v, value_of(k, len), "block {k} came back different");
                found += 1;
            }
            Err(KvError::NotFound) => {}
            Err(e) => panic!("{k}: {e}"),
        }
    }
    found
}

#[tokio::test]
async fn a_miss_reads_through_into_the_memory_tier_with_identical_bytes() {
    let redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let names = keys("rt/", 16);
    // The first node writes every PUT behind the reply (mode all) and
    // drains its queue when it stops.
    let first =
        node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), TieringConfig::default())).await;
    put_all(&client(&first).await, &names, 64 * KIB).await;
    assert!(first.shutdown().await, "the second tier took every queued block before the deadline");

    // A fresh node has nothing in memory: each GET is a second-tier hit
    // read into a pool block, then a memory hit.
    let second =
        node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), TieringConfig::default())).await;
    let c = client(&second).await;
    assert_eq!(get_checked(&c, &names, 64 * KIB).await, 16);
    assert_eq!(stat(&second, "backend_hits"), 16);
    assert_eq!(stat(&second, "backend_read_bytes"), 16 * 64 * KIB as u64);
    assert_eq!(get_checked(&c, &names, 64 * KIB).await, 16);
    assert_eq!(stat(&second, "backend_hits"), 16, "the second read was served by the memory tier");
    assert_eq!(stat(&second, "hits"), 16);
    // Absent everywhere: a miss, counted in both tiers.
    assert_eq!(get_checked(&c, &["nowhere".to_string()], 1).await, 0);
    assert_eq!(stat(&second, "backend_misses"), 1);
    // The same figures per tier on /metrics, with the store's latency.
    let url = format!("http://{}/metrics", second.admin_addr().unwrap());
    let text = tokio::task::spawn_blocking(move || ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap()).await.unwrap();
    for series in [
        "kvplane_tier_hits_total{tier=\"backend\"} 16",
        "kvplane_tier_hits_total{tier=\"memory\"} 16",
        "kvplane_tier_misses_total{tier=\"backend\"} 1",
        "kvplane_backend_read_bytes_total 1048576",
        "kvplane_backend_duration_seconds_count{op=\"get\"}",
    ] {
        assert!(text.contains(series), "no {series} in\n{text}");
    }
    second.shutdown().await;
}

#[tokio::test]
async fn on_evict_copies_only_what_the_memory_tier_drops() {
    let redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let settings = TieringConfig { mode: IngestMode::OnEvict, ..TieringConfig::default() };
    let store = backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed));
    // 8 MiB of memory, 64 KiB blocks: 200 blocks (12.5 MiB) cannot all stay.
    let n = node(8 * MIB, setup(Arc::clone(&store), settings)).await;
    let c = client(&n).await;
    let names = keys("ev/", 200);
    for chunk in names.chunks(10) {
        put_all(&c, chunk, 64 * KIB).await;
    }
    let evicted = stat(&n, "evictions");
    assert!(evicted > 0, "the pool was meant to overflow");
    wait_for("evicted blocks written", || stat(&n, "tier_ingest_stored") == evicted).await;
    assert_eq!(stat(&n, "tier_ingest_skipped") + stat(&n, "tier_ingest_failed"), 0);
    // Exactly the evicted blocks are in the store: the first ones put.
    let present = store.exists(names.iter().map(|k| k.as_bytes().to_vec()).collect(), NONE).await.unwrap();
    let in_store = present.iter().filter(|r| matches!(r, Ok(true))).count() as u64;
    assert_eq!(in_store, evicted, "the store holds the evicted blocks and nothing else");
    // Every block is still served, from one tier or the other.
    for chunk in names.chunks(20) {
        assert_eq!(get_checked(&c, chunk, 64 * KIB).await, chunk.len());
    }
    n.shutdown().await;
}

#[tokio::test]
async fn a_block_waiting_to_be_written_to_the_second_tier_is_still_served() {
    // An evicted block is in neither tier until its writer has stored it
    // (its memory is freed only then). The store holds its writes (CLIENT
    // PAUSE ... WRITE) so that window stays open: every queued block must
    // still be found by GET and EXISTS. With the writes held, the queue
    // fills to its bound (an eighth of the pool) and, at `skip`, the next
    // evicted blocks are dropped, which frees their memory for the PUTs.
    let redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let settings = TieringConfig { mode: IngestMode::OnEvict, at_bound: AtBound::Skip, deadline_ms: 60_000, ..TieringConfig::default() };
    let mut decl = resp(&redis.endpoint(), FailurePolicy::FailClosed);
    // Long enough for a write held by the pause never to time out.
    decl.limits.timeout = Duration::from_secs(60);
    let store = backend(&runtime, decl);
    let n = node(8 * MIB, setup(Arc::clone(&store), settings)).await;
    let c = client(&n).await;
    assert_eq!(redis.command(&["CLIENT", "PAUSE", "60000", "WRITE"]), "+OK");
    let names = keys("held/", 200);
    for chunk in names.chunks(10) {
        put_all(&c, chunk, 64 * KIB).await;
    }
    let (evicted, skipped, queued) = (stat(&n, "evictions"), stat(&n, "tier_ingest_skipped"), stat(&n, "tier_queued_blocks"));
    assert!(queued > 0 && skipped > 0, "the pool was meant to overflow the queue: {queued} queued, {skipped} skipped");
    assert_eq!(queued + skipped, evicted, "every evicted block is queued or, past the bound, skipped");
    assert_eq!(stat(&n, "tier_ingest_stored"), 0, "the paused store took a write");

    // EXISTS first (it allocates nothing, so evicts nothing): every block
    // but the skipped ones. Then GET those: each from memory or from the
    // queue, none from the store, so again nothing is evicted.
    let present = c.exists(names.iter().map(|k| Bytes::from(k.clone())).collect()).await.unwrap();
    let kept: Vec<String> = names.iter().zip(&present).filter(|(_, p)| **p).map(|(k, _)| k.clone()).collect();
    assert_eq!(kept.len(), names.len() - skipped as usize, "EXISTS missed a block waiting for its write");
    // In batches of 20: a batch's answer holds its blocks.
    let get_kept = || async {
        let mut found = 0;
        for chunk in kept.chunks(20) {
            found += get_checked(&c, chunk, 64 * KIB).await;
        }
        found
    };
    assert_eq!(get_kept().await, kept.len(), "a block waiting for its write was reported absent");
    assert_eq!(stat(&n, "tier_queued_hits"), queued, "the queued blocks were served from the queue");
    assert_eq!(stat(&n, "evictions"), evicted, "serving them evicted nothing");

    // Once the store takes writes again the queue empties into it.
    assert_eq!(redis.command(&["CLIENT", "UNPAUSE"]), "+OK");
    wait_for("the held blocks written", || stat(&n, "tier_ingest_stored") == queued).await;
    wait_for("the queue emptied", || stat(&n, "tier_queued_blocks") == 0).await;
    let in_store = store.exists(names.iter().map(|k| k.as_bytes().to_vec()).collect(), NONE).await.unwrap();
    assert_eq!(in_store.iter().filter(|r| matches!(r, Ok(true))).count() as u64, queued);
    assert_eq!(get_kept().await, kept.len());
    n.shutdown().await;
}

#[tokio::test]
async fn hot_mode_copies_a_block_once_it_was_read_often_enough() {
    let redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let settings = TieringConfig { mode: IngestMode::Hot, hot_reads: 3, ..TieringConfig::default() };
    let store = backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed));
    let n = node(64 * MIB, setup(Arc::clone(&store), settings)).await;
    let c = client(&n).await;
    let names = keys("hot/", 2);
    put_all(&c, &names, 4 * KIB).await;
    for _ in 0..2 {
        get_checked(&c, &names[..1], 4 * KIB).await;
    }
    let in_store = |store: Arc<Backend>| async move { store.exists(vec![b"hot/0000".to_vec(), b"hot/0001".to_vec()], NONE).await.unwrap() };
    assert_eq!(stat(&n, "tier_ingest_stored"), 0, "two reads are not hot yet");
    get_checked(&c, &names[..1], 4 * KIB).await;
    wait_for("the hot block written", || stat(&n, "tier_ingest_stored") == 1).await;
    assert_eq!(in_store(Arc::clone(&store)).await, vec![Ok(true), Ok(false)]);
    // More reads do not copy it again.
    get_checked(&c, &names[..1], 4 * KIB).await;
    assert_eq!(stat(&n, "tier_ingest_stored"), 1);
    n.shutdown().await;
}

#[tokio::test]
async fn exists_match_prefix_and_delete_see_both_tiers() {
    let redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let store = backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed));
    let settings = TieringConfig { mode: IngestMode::OnEvict, ..TieringConfig::default() };
    let n = node(64 * MIB, setup(Arc::clone(&store), settings)).await;
    let c = client(&n).await;
    // c0 in memory; c1, c2 only in the second tier; c3 nowhere; c4 only in
    // the second tier (after the gap).
    put_all(&c, &["c0".to_string()], 64 * KIB).await;
    let only_in_store = ["c1", "c2", "c4"];
    let r = store.put(only_in_store.iter().flat_map(|k| sealed(k, &value_of(k, 64 * KIB))).collect(), NONE).await.unwrap();
    assert!(r.iter().all(Result::is_ok), "{r:?}");

    let chain: Vec<Bytes> = ["c0", "c1", "c2", "c3", "c4"].iter().map(|k| Bytes::from_static(k.as_bytes())).collect();
    let exists = c.exists(chain.clone()).await.unwrap();
    assert_eq!(exists, vec![true, true, true, false, true]);

    // The prefix runs through the second tier up to the gap; what it read is
    // now in memory and pinned for the lease.
    let m = c.match_prefix(chain.clone(), Duration::from_secs(30)).await.unwrap();
    assert_eq!(m.matched, 3, "{m:?}");
    assert_eq!(stat(&n, "pinned"), 3);
    assert_eq!(get_checked(&c, &["c1".to_string(), "c2".to_string()], 64 * KIB).await, 2);

    // DELETE removes from both tiers. A store's delete is idempotent (an
    // absent key is a success), so a key in neither tier is not told apart.
    let deleted = c.delete(vec![Bytes::from_static(b"c0"), Bytes::from_static(b"c4"), Bytes::from_static(b"c3")]).await.unwrap();
    assert_eq!(deleted, vec![true, true, true]);
    assert_eq!(store.exists(vec![b"c4".to_vec()], NONE).await.unwrap(), vec![Ok(false)]);
    assert_eq!(c.exists(vec![Bytes::from_static(b"c0"), Bytes::from_static(b"c4")]).await.unwrap(), vec![false, false]);
    n.shutdown().await;
}

#[tokio::test]
async fn a_killed_backend_under_load_degrades_to_misses_and_recovers() {
    let mut redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    // 4 MiB of memory for 16 KiB blocks: most reads of older keys miss the
    // memory tier and go to the store. While the store is down the writers
    // keep what they hold (write-behind delivers it later); past that bound
    // the PUTs skip the copy instead of waiting for the store to return
    // (`atBound: skip`), so the load goes on and its reads meet the outage.
    let settings = TieringConfig { at_bound: AtBound::Skip, ..TieringConfig::default() };
    let n = node(4 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailOpen)), settings)).await;
    let addr = n.tcp_addr().unwrap().to_string();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two load generators: PUT a batch, GET an older batch; every block
    // that comes back is checked against its key, and any error other
    // than not-found fails the test.
    let mut load = Vec::new();
    for w in 0..2 {
        let stop = Arc::clone(&stop);
        let addr = addr.clone();
        load.push(tokio::spawn(async move {
            let c = Client::connect(ClientConfig::new(Endpoint::Tcp(addr))).await.unwrap();
            let (mut round, mut found, mut asked) = (0usize, 0usize, 0usize);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let batch = keys(&format!("load/{w}/{round}/"), 8);
                put_all(&c, &batch, 16 * KIB).await;
                let old = keys(&format!("load/{w}/{}/", round / 2), 8);
                found += get_checked(&c, &old, 16 * KIB).await;
                asked += old.len();
                round += 1;
            }
            (round, found, asked)
        }));
    }
    wait_for("blocks written to the store", || stat(&n, "tier_ingest_stored") > 64).await;
    redis.kill();
    let failed_before = stat(&n, "backend_failed_open");
    wait_for("failures answered as misses", || stat(&n, "backend_failed_open") > failed_before).await;
    redis.restart();
    let stored = stat(&n, "tier_ingest_stored");
    wait_for("writes reaching the restarted store", || stat(&n, "tier_ingest_stored") > stored + 32).await;
    let hits = stat(&n, "backend_hits");
    wait_for("reads from the restarted store", || stat(&n, "backend_hits") > hits).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in load {
        let (rounds, found, asked) = l.await.expect("no load generator saw corruption or an error");
        assert!(rounds > 0 && found <= asked);
    }
    n.shutdown().await;
}

#[tokio::test]
async fn fail_closed_answers_the_typed_error() {
    let mut redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let n = node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), TieringConfig::default())).await;
    let c = client(&n).await;
    put_all(&c, &["here".to_string()], 4 * KIB).await;
    redis.kill();
    let got = c.get(vec![Bytes::from_static(b"here"), Bytes::from_static(b"elsewhere")]).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &value_of("here", 4 * KIB), "a memory hit needs no store");
    assert!(matches!(got[1], Err(KvError::Unavailable(_))), "{:?}", got[1]);
    assert!(stat(&n, "backend_retries") > 0, "unavailable is retried before it is answered");
    n.shutdown().await;
}

/// A TCP peer that accepts and then answers `reply` to anything (nothing:
/// never answers), for as long as the test holds it.
struct Peer {
    addr: String,
    task: tokio::task::JoinHandle<()>,
}

impl Peer {
    async fn start(reply: &'static [u8]) -> Peer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut s, _)) = listener.accept().await {
                if reply.is_empty() {
                    held.push(s);
                    continue;
                }
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = vec![0u8; 64 * KIB];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(reply).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Peer { addr, task }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn at_the_bound_puts_skip_or_wait_and_both_are_counted() {
    let runtime = PluginRuntime::new(None).unwrap();
    let silent = Peer::start(b"").await;
    // A store that never answers: each write holds its bytes until the
    // plugin's 500 ms deadline; the bound is one block.
    let bound = TieringConfig { max_in_flight: ByteSize(64 * KIB as u64), ..TieringConfig::default() };
    let skip = TieringConfig { at_bound: AtBound::Skip, ..bound.clone() };
    let n = node(64 * MIB, setup(backend(&runtime, resp(&silent.addr, FailurePolicy::FailOpen)), skip)).await;
    let c = client(&n).await;
    put_all(&c, &keys("skip/", 8), 64 * KIB).await;
    assert!(stat(&n, "tier_ingest_skipped") >= 1, "the bound was reached at once");
    wait_for("every offered block accounted for", || {
        stat(&n, "tier_ingest_stored") + stat(&n, "tier_ingest_failed") + stat(&n, "tier_ingest_skipped") == 8
    })
    .await;
    assert_eq!(get_checked(&c, &keys("skip/", 8), 64 * KIB).await, 8, "the memory tier kept every block");
    n.shutdown().await;

    let n = node(64 * MIB, setup(backend(&runtime, resp(&silent.addr, FailurePolicy::FailOpen)), bound)).await;
    let c = client(&n).await;
    put_all(&c, &keys("wait/", 2), 64 * KIB).await;
    assert_eq!(stat(&n, "tier_ingest_waits"), 1, "the second PUT waited for the first write to end");
    assert_eq!(stat(&n, "tier_ingest_skipped"), 0);
    n.shutdown().await;
}

#[tokio::test]
async fn a_backend_answering_garbage_gets_a_typed_error_and_stores_nothing() {
    let runtime = PluginRuntime::new(None).unwrap();
    let garbage = Peer::start(b"%not resp at all\r\n").await;
    let n = node(64 * MIB, setup(backend(&runtime, resp(&garbage.addr, FailurePolicy::FailClosed)), TieringConfig::default())).await;
    let c = client(&n).await;
    let got = c.get(vec![Bytes::from_static(b"k")]).await.unwrap();
    assert!(got[0].is_err() && !matches!(got[0], Err(KvError::NotFound)), "{:?}", got[0]);
    assert_eq!(stat(&n, "entries"), 0, "nothing from the garbage reached the memory tier");
    assert_eq!(stat(&n, "backend_hits"), 0);
    n.shutdown().await;
}

#[tokio::test]
async fn second_tier_failures_go_through_the_declared_retry_policy() {
    let mut redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let mut d = PluginDecl::new("backoff", World::RetryPolicy, PluginSource::Builtin("backoff".into()));
    d.config.insert("base-ms".into(), "5".into());
    let retry = Arc::new(runtime.load_retry_policy(d).expect("loading builtin:backoff"));
    let tier = TierSetup {
        name: "resp".into(),
        backend: backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)),
        retry: Some(Arc::clone(&retry)),
        settings: TieringConfig { deadline_ms: 3_000, ..TieringConfig::default() },
    };
    let n = node(64 * MIB, tier).await;
    let c = client(&n).await;
    redis.kill();
    let got = c.get(vec![Bytes::from_static(b"gone")]).await.unwrap();
    assert!(matches!(got[0], Err(KvError::Unavailable(_))), "{:?}", got[0]);
    assert!(stat(&n, "backend_retries") >= 1, "the policy asked for at least one retry");
    assert!(retry.plugin.instantiations() >= 1, "the declared retry plugin decided");
    n.shutdown().await;
}

/// One byte changed inside redis (SETRANGE) was served as ok with a fresh
/// CRC; now the block's trailer catches it: a typed `corrupt`, counted,
/// never served and never cached. A value written raw (before trailers)
/// is a miss, counted.
#[tokio::test]
async fn a_block_changed_in_the_store_is_corrupt_and_never_served() {
    let redis = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let names = keys("intact/", 4);
    let first =
        node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), TieringConfig::default())).await;
    put_all(&client(&first).await, &names, 64 * KIB).await;
    assert!(first.shutdown().await, "every block written before the node stopped");
    // One byte of one block changed behind the node's back (the resp
    // plugin's keys carry its `tier:` prefix).
    assert_eq!(redis.command(&["SETRANGE", &format!("tier:{}", names[1]), "1000", "X"]), ":65536");
    // And one block written raw, as a node before trailers did.
    assert_eq!(redis.command(&["SET", "tier:legacy", "plain bytes"]), "+OK");

    let second =
        node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), TieringConfig::default())).await;
    let c = client(&second).await;
    let got = c.get(names.iter().map(|k| Bytes::from(k.clone())).chain([Bytes::from_static(b"legacy")]).collect()).await.unwrap();
    for (i, r) in got.iter().enumerate().take(4) {
        if i == 1 {
            let e = r.as_ref().expect_err("a changed block is never served");
            assert!(matches!(e, KvError::Corrupt(_)), "{e:?}");
            assert!(e.to_string().contains("intact/0001") && e.to_string().contains("failed its check"), "{e}");
        } else {
            assert_eq!(r.as_ref().unwrap(), &value_of(&names[i], 64 * KIB), "{} came back different", names[i]);
        }
    }
    assert!(matches!(got[4], Err(KvError::NotFound)), "a block without a trailer is a miss: {:?}", got[4]);
    assert_eq!(stat(&second, "backend_corrupt"), 1);
    // Read once more before the answer (a read racing an overwrite looks
    // the same), and still changed.
    assert_eq!(stat(&second, "backend_corrupt_rereads"), 1);
    assert_eq!(stat(&second, "backend_unsealed"), 1);
    assert_eq!(stat(&second, "entries"), 3, "only the intact blocks entered the memory tier");
    // Asked again: still not served (it was never cached).
    let again = c.get(vec![Bytes::from(names[1].clone())]).await.unwrap();
    assert!(matches!(again[0], Err(KvError::Corrupt(_))), "{:?}", again[0]);
    second.shutdown().await;
}

/// A backend that answers "filled the whole destination" without writing a
/// byte made the node serve whatever the lent pool block held before: after
/// PUT and DELETE of tenant A's block, a GET of a key never written answered
/// ok with tenant A's deleted bytes. Now the missing trailer says so.
#[tokio::test]
async fn a_backend_claiming_bytes_it_did_not_write_serves_nothing() {
    let runtime = PluginRuntime::new(None).unwrap();
    let mut liar = PluginDecl::new("liar", World::Backend, PluginSource::File(kvplane_tests::HOSTILE.into()));
    liar.config.insert("lie".into(), "full".into());
    liar.failure_policy = FailurePolicy::FailClosed;
    let n = node(64 * MIB, setup(backend(&runtime, liar), TieringConfig::default())).await;
    let c = client(&n).await;
    let secret = Bytes::from(vec![0x5a; 64 * KIB]);
    c.put(vec![(Bytes::from_static(b"tenant-a/block0"), secret.clone())]).await.unwrap().remove(0).unwrap();
    assert_eq!(c.delete(vec![Bytes::from_static(b"tenant-a/block0")]).await.unwrap(), vec![true]);
    let got = c.get(vec![Bytes::from_static(b"tenant-b/never-written")]).await.unwrap();
    match &got[0] {
        Err(KvError::Corrupt(m)) => assert!(m.contains("tenant-b/never-written"), "{m}"),
        other => panic!("a claimed, unwritten block was answered {other:?}"),
    }
    assert_eq!(stat(&n, "backend_corrupt"), 1);
    assert_eq!(stat(&n, "entries"), 0, "nothing the liar claimed entered the memory tier");
    n.shutdown().await;
}

/// A redis-server that keeps what it took across a kill (append-only file,
/// fsync on every write), so a test can tell the node's losses from the
/// store's own.
fn durable_redis(dir: &std::path::Path) -> RedisServer {
    RedisServer::start(&["--appendonly", "yes", "--appendfsync", "always", "--dir", dir.to_str().unwrap()])
}

/// Whether redis holds `key`'s block and its trailer (under the resp
/// plugin's `tier:` prefix).
fn in_redis(redis: &RedisServer, key: &str) -> bool {
    let trailer = String::from_utf8(envelope::trailer_key(key.as_bytes())).unwrap();
    redis.command(&["EXISTS", &format!("tier:{key}"), &format!("tier:{trailer}")]) == ":2"
}

async fn put_one(c: &Client, key: &str) -> Result<(), KvError> {
    c.put(vec![(Bytes::from(key.to_owned()), value_of(key, 64 * KIB))]).await.expect("the node answers").remove(0)
}

async fn wait_until(what: &str, n: &Node, check: impl Fn(&Node) -> bool) {
    let start = Instant::now();
    while !check(n) {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Write-through: a PUT is acknowledged only once the store holds the
/// block; with the store frozen or killed the PUT gets the store's typed
/// error and the block is not kept in memory either. Every acknowledged
/// block is in redis, whatever happened to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_acknowledges_only_what_the_store_holds() {
    let dir = tempfile::tempdir().unwrap();
    let mut redis = durable_redis(dir.path());
    let runtime = PluginRuntime::new(None).unwrap();
    let settings = TieringConfig { write: WriteMode::Through, deadline_ms: 1_000, ..TieringConfig::default() };
    let n = node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), settings)).await;
    let c = client(&n).await;
    let mut acked = Vec::new();
    for i in 0..8 {
        let key = format!("through/{i}");
        put_one(&c, &key).await.unwrap_or_else(|e| panic!("{key} with the store up: {e}"));
        acked.push(key);
    }
    // Frozen: the PUT waits for its deadline and gets the error.
    redis.freeze();
    let frozen = put_one(&c, "through/frozen").await;
    assert!(matches!(frozen, Err(KvError::Timeout(_) | KvError::Unavailable(_))), "a PUT the frozen store did not take: {frozen:?}");
    redis.thaw();
    // Killed: refused at once, typed.
    redis.kill();
    let killed = put_one(&c, "through/killed").await;
    assert!(matches!(killed, Err(KvError::Unavailable(_) | KvError::Timeout(_))), "a PUT with the store gone: {killed:?}");
    assert_eq!(stat(&n, "entries"), 8, "a block the store refused is not kept in memory");
    // Back: acknowledged again once the store takes writes.
    redis.restart();
    let start = Instant::now();
    loop {
        match put_one(&c, "through/after").await {
            Ok(()) => break,
            Err(e) => assert!(start.elapsed() < PATIENCE, "the restarted store never took a write: {e}"),
        }
    }
    acked.push("through/after".into());
    for key in &acked {
        assert!(in_redis(&redis, key), "{key} was acknowledged but is not in the store");
    }
    n.shutdown().await;
}

/// Write-behind: acknowledged from memory, the copy is retried across a
/// frozen store and a killed and restarted one until the store takes it.
/// Every acknowledged block ends up in redis, and a fresh node reads each
/// back through its second tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_behind_delivers_every_acknowledged_block_across_a_freeze_and_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut redis = durable_redis(dir.path());
    let runtime = PluginRuntime::new(None).unwrap();
    // A short deadline: the retry policy gives up quickly, and the writers'
    // outage rounds take over.
    let settings = TieringConfig { deadline_ms: 300, ..TieringConfig::default() };
    let n = node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), settings.clone())).await;
    let c = client(&n).await;
    let mut acked = Vec::new();
    let mut put_some = |from: usize| {
        let keys: Vec<String> = (from..from + 10).map(|i| format!("behind/{i}")).collect();
        acked.extend(keys.clone());
        keys
    };
    for key in put_some(0) {
        put_one(&c, &key).await.unwrap();
    }
    wait_until("the first blocks written", &n, |n| stat(n, "tier_ingest_stored") == 10).await;

    redis.freeze();
    let retries = stat(&n, "backend_retries");
    for key in put_some(10) {
        put_one(&c, &key).await.expect("acknowledged from memory while the store is frozen");
    }
    wait_until("a write retried against the frozen store", &n, |n| stat(n, "backend_retries") > retries + 1).await;
    redis.thaw();
    wait_until("the frozen store took the held blocks", &n, |n| stat(n, "tier_ingest_stored") == 20).await;

    redis.kill();
    let retries = stat(&n, "backend_retries");
    for key in put_some(20) {
        put_one(&c, &key).await.expect("acknowledged from memory while the store is down");
    }
    wait_until("a write retried against the killed store", &n, |n| stat(n, "backend_retries") > retries + 1).await;
    assert_eq!(stat(&n, "tier_ingest_failed"), 0, "a block was given up during the outage");
    redis.restart();
    wait_until("the restarted store took every held block", &n, |n| {
        stat(n, "tier_ingest_stored") == 30 && stat(n, "tier_in_flight_bytes") == 0
    })
    .await;
    for key in &acked {
        assert!(in_redis(&redis, key), "{key} was acknowledged but never reached the store");
    }
    assert!(n.shutdown().await);
    // A fresh node reads every one back, verified.
    let fresh = node(64 * MIB, setup(backend(&runtime, resp(&redis.endpoint(), FailurePolicy::FailClosed)), settings)).await;
    assert_eq!(get_checked(&client(&fresh).await, &acked, 64 * KIB).await, 30);
    fresh.shutdown().await;
}
