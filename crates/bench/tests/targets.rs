//! The bench targets scripts/bench-second-tier relies on, against real
//! servers: the native vineyardd client (in a private network namespace,
//! since vineyardd binds every address), keys split over independent nodes
//! by hash slot, and a node whose memory tier is too small to keep what it
//! reads, so that every GET of a `--no-seed` run goes through its second
//! tier (builtin:resp on redis-server) to keys the native client stored.

use std::sync::Arc;
use std::time::Duration;

use kvplane_bench::{BenchConfig, BenchOp, BenchReport, Target};
use kvplane_node::cache::{CacheConfig, EvictionPolicy};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use kvplane_node::tier::TierSetup;
use kvplane_runtime::{PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_tests::redis::RedisServer;
use kvplane_tests::vineyard::{in_private_network, VineyardServer};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn shape(target: Target, endpoint: String, op: BenchOp, block_size: usize, blocks: usize) -> BenchConfig {
    BenchConfig {
        target,
        endpoint,
        token: None,
        tls: None,
        block_size,
        blocks,
        batch: 8,
        clients: 2,
        connections: 1,
        op,
        seed: true,
        duration: Duration::from_millis(500),
        shared_memory: true,
        progress: None,
    }
}

fn moved_all(r: &BenchReport) {
    assert!(r.blocks > 0, "{r:?}");
    assert_eq!(r.misses, 0, "{r:?}");
}

#[test]
fn the_native_vineyard_client_stores_and_reads_blocks_in_vineyardd() {
    if !in_private_network(module_path!(), "the_native_vineyard_client_stores_and_reads_blocks_in_vineyardd") {
        return;
    }
    let server = VineyardServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        for op in [BenchOp::Put, BenchOp::Get, BenchOp::Mixed] {
            let r = kvplane_bench::run(shape(Target::Vineyard, server.endpoint(), op, 64 * KIB, 32)).await.expect("vineyard run");
            moved_all(&r);
            assert_eq!(r.memory_hits, None, "only nodes have a memory tier: {r:?}");
        }
        // Keys that were never stored (all but the first 32) are misses, not errors.
        let mut absent = shape(Target::Vineyard, server.endpoint(), BenchOp::Get, 64 * KIB, 100_000);
        absent.seed = false;
        let r = kvplane_bench::run(absent).await.expect("vineyard run");
        assert!(r.misses > 0, "{r:?}");
    });
}

async fn node(memory: usize, max_block: usize, tier: Option<TierSetup>) -> Node {
    let mut pool = PoolConfig::new(memory);
    pool.max_block_bytes = max_block;
    let config = NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: None,
        pool,
        cache: CacheConfig { policy: EvictionPolicy::Lru, ..CacheConfig::default() },
        tier,
        ..NodeConfig::default()
    };
    Node::start(config).await.expect("node starts")
}

fn stat(node: &Node, name: &str) -> u64 {
    node.stats().into_iter().find(|(n, _)| n == name).map(|(_, v)| v).unwrap_or_else(|| panic!("no stat {name}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_target_moves_blocks_through_the_nodes_shared_memory() {
    let dir = tempfile::tempdir().unwrap();
    let config = NodeConfig {
        listen: None,
        admin: None,
        unix: Some(dir.path().join("node.sock")),
        pool: PoolConfig::new(64 * MIB),
        ..NodeConfig::default()
    };
    let n = Node::start(config).await.expect("node starts");
    let endpoint = format!("unix://{}", dir.path().join("node.sock").display());
    let mut moved = 0;
    for op in [BenchOp::Put, BenchOp::Get] {
        let r = kvplane_bench::run(shape(Target::Local, endpoint.clone(), op, 64 * KIB, 64)).await.expect("local run");
        moved_all(&r);
        moved += r.blocks * 64 * KIB as u64;
    }
    // Bytes went through shared memory: the socket carried keys, offsets
    // and statuses (about 30 bytes per 64 KiB block).
    let (received, sent) = (stat(&n, "bytes_received"), stat(&n, "bytes_sent"));
    assert!(received + sent < moved / 100, "block bytes crossed the socket: {received} + {sent} bytes for {moved} moved");
    // A node that shares no memory is refused by name.
    let dir2 = tempfile::tempdir().unwrap();
    let plain = Node::start(NodeConfig {
        listen: None,
        admin: None,
        unix: Some(dir2.path().join("node.sock")),
        pool: PoolConfig::new(16 * MIB),
        shm_region_bytes: 0,
        ..NodeConfig::default()
    })
    .await
    .unwrap();
    let e =
        kvplane_bench::run(shape(Target::Local, format!("unix://{}", dir2.path().join("node.sock").display()), BenchOp::Put, 4 * KIB, 8))
            .await
            .unwrap_err();
    assert!(format!("{e:#}").contains("shares no memory"), "{e:#}");
    n.shutdown().await;
    plain.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_split_over_independent_nodes_by_hash_slot() {
    let nodes = [node(64 * MIB, MIB, None).await, node(64 * MIB, MIB, None).await, node(64 * MIB, MIB, None).await];
    let endpoints: Vec<String> = nodes.iter().map(|n| n.tcp_addr().unwrap().to_string()).collect();
    let r = kvplane_bench::run(shape(Target::Kvplane, endpoints.join(","), BenchOp::Get, 16 * KIB, 256)).await.expect("run");
    moved_all(&r);
    // Every GET hit a memory tier (the one of the key's node), and every
    // node holds its share of the keys.
    assert_eq!(r.memory_hits, Some(r.blocks), "{r:?}");
    assert_eq!(r.backend_hits, None, "no second tier: {r:?}");
    for (i, n) in nodes.iter().enumerate() {
        assert!(stat(n, "hits") > 0, "node {i} served no GET");
    }
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_too_small_to_keep_its_reads_serves_every_get_through_its_second_tier() {
    let redis = RedisServer::start(&[]);
    let mut decl = PluginDecl::new("resp", World::Backend, PluginSource::Builtin("resp".into()));
    decl.config.insert("endpoint".into(), redis.endpoint());
    decl.allowed_endpoints = vec![redis.endpoint()];
    let backend = Arc::new(PluginRuntime::new(None).unwrap().load_backend(decl).expect("loading builtin:resp"));
    let tier = TierSetup { name: "resp".into(), backend, retry: None, settings: Default::default() };
    // A roomy node writes the blocks through to redis-server (mode all:
    // with their trailers, as the second tier keeps them) and drains on
    // stop.
    let writer = node(64 * MIB, MIB, Some(tier.clone())).await;
    // A GET run seeds every key once (untimed) before it reads.
    let mut seeding = shape(Target::Kvplane, writer.tcp_addr().unwrap().to_string(), BenchOp::Get, 64 * KIB, 256);
    seeding.duration = Duration::from_millis(100);
    kvplane_bench::run(seeding).await.expect("seeding run");
    assert!(writer.shutdown().await, "every block reached redis-server before the writer stopped");
    // 64 blocks of 64 KiB: four times the 16 blocks two clients of batch 8
    // hold in flight (a GET's blocks stay referenced until its answer is
    // written, so a pool of exactly 16 refuses a read-through now and then),
    // a quarter of the 256 read. The scan is cyclic and the cache LRU, so
    // almost every GET misses the memory tier all the same.
    let block = 64 * KIB;
    let node = node(64 * block, block, Some(tier)).await;

    let mut through = shape(Target::Kvplane, node.tcp_addr().unwrap().to_string(), BenchOp::Get, block, 256);
    through.seed = false;
    let r = kvplane_bench::run(through).await.expect("node run");
    moved_all(&r);
    let read_through = r.backend_hits.expect("a node with a second tier reports backend_hits");
    let hits = r.memory_hits.expect("memory_hits");
    assert_eq!(hits + read_through, r.blocks, "{r:?}");
    assert!(hits * 10 < r.blocks, "most GETs missed the memory tier: {r:?}");
    node.shutdown().await;
}
