//! The node configuration files of `examples/node/`, each started as a user
//! starts it (`kvplane node --config FILE`) against the real servers it
//! names: Debian's redis-server, vineyardd (PyPI vineyard 0.24.2, in a
//! private network namespace: it binds every address), a three-member etcd.
//!
//! Only the servers' addresses change: the test parses the file, sets each
//! endpoint field (`backendEndpoints`, `allowedEndpoints`, a plugin's
//! `endpoint`, `metadata.etcd`, ...) to the server it started, and writes
//! the result to a temporary file; every other field is as committed. Each
//! node serves a PUT and a GET through the real client; a block is shown to
//! reach each second tier the way the file's `tiering.mode` sends it there
//! (a fresh node process then reads it back from that tier); the cluster
//! member is shown in the slot table its node serves, and keys route to it.
//! A file in the folder that no test here knows is a failure.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, ClusterClient, ClusterClientConfig, Endpoint};
use kvplane_config::{IngestMode, NodeConfigFile, PluginSpec};
use serde_json::Value;

use crate::{etcd, support};
use support::{kvplane, NodeProcess};

/// The configuration files of `examples/node/`, each started by the test
/// named after it below.
const EXAMPLES: &[&str] = &["cluster.json", "memory.json", "redis.json", "vineyard.json"];
/// The folder's explanations, which must name every example.
const README: &str = "README.md";

/// Far longer than any state here should take to reach.
const PATIENCE: Duration = Duration::from_secs(60);

fn folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/node")
}

#[test]
fn every_file_of_examples_node_is_tested_and_explained() {
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(folder()).expect("listing examples/node") {
        let name = entry.unwrap().file_name().into_string().expect("a UTF-8 file name");
        assert!(
            name == README || EXAMPLES.contains(&name.as_str()),
            "examples/node/{name} is not started by any test in crates/cli/tests/all/examples.rs: add a test for it"
        );
        found.insert(name);
    }
    let readme = std::fs::read_to_string(folder().join(README)).expect("reading examples/node/README.md");
    for name in EXAMPLES {
        assert!(found.contains(*name), "examples/node/{name} is gone: drop it from EXAMPLES and its test");
        assert!(readme.contains(&format!("[`{name}`]({name})")), "examples/node/README.md does not list {name}");
    }
}

/// Each file as committed is a node configuration the node accepts
/// (strictly: a misspelt field is an error naming it).
#[test]
fn every_example_is_a_valid_node_configuration() {
    for name in EXAMPLES {
        let text = std::fs::read_to_string(folder().join(name)).unwrap();
        let file: NodeConfigFile = kvplane_config::from_json_strict(&text).unwrap_or_else(|e| panic!("examples/node/{name}: {e}"));
        file.validate().unwrap_or_else(|e| panic!("examples/node/{name}: {e}"));
    }
}

/// JSON pointers of the fields of a node configuration that hold a
/// server's address, in file order.
fn endpoint_fields(config: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let mut each = |base: String, list: Option<&Value>| {
        out.extend((0..list.and_then(Value::as_array).map_or(0, Vec::len)).map(|i| format!("{base}/{i}")));
    };
    each("/backendEndpoints".into(), config.get("backendEndpoints"));
    each("/metadata/etcd".into(), config.pointer("/metadata/etcd"));
    let plugins = config.get("plugins").and_then(Value::as_array).cloned().unwrap_or_default();
    for (i, p) in plugins.iter().enumerate() {
        each(format!("/plugins/{i}/allowedEndpoints"), p.get("allowedEndpoints"));
    }
    for (i, p) in plugins.iter().enumerate() {
        for key in ["endpoint", "remote_url"] {
            if p.pointer(&format!("/config/{key}")).is_some() {
                out.push(format!("/plugins/{i}/config/{key}"));
            }
        }
    }
    for single in ["/metadata/redis", "/cluster/advertise"] {
        if config.pointer(single).is_some() {
            out.push(single.into());
        }
    }
    out
}

/// The `host:port` of an endpoint field's value (`http://host:port/` too).
fn host_port(value: &str) -> &str {
    let rest = value.split_once("://").map_or(value, |(_, rest)| rest);
    rest.strip_suffix('/').unwrap_or(rest)
}

/// Example `name` with the servers a test started put in: the k-th distinct
/// `host:port` its endpoint fields hold (in file order) becomes
/// `servers[k]`, and there must be exactly as many (a typo in one copy of
/// an address is a second one, and fails here). Written into `dir`; answers
/// its path and what the node will read from it.
fn with_servers(name: &str, dir: &Path, servers: &[String]) -> (PathBuf, NodeConfigFile) {
    let text = std::fs::read_to_string(folder().join(name)).unwrap();
    let mut config: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("examples/node/{name}: {e}"));
    let fields = endpoint_fields(&config);
    let mut placeholders: Vec<String> = Vec::new();
    for field in &fields {
        let value =
            config.pointer(field).and_then(Value::as_str).unwrap_or_else(|| panic!("examples/node/{name}: {field} is not a string"));
        let hp = host_port(value).to_owned();
        if !placeholders.contains(&hp) {
            placeholders.push(hp);
        }
    }
    assert_eq!(
        placeholders.len(),
        servers.len(),
        "examples/node/{name}: its endpoint fields {fields:?} name {placeholders:?}, the test started {servers:?}"
    );
    for field in &fields {
        let slot = config.pointer_mut(field).unwrap();
        let value = slot.as_str().unwrap().to_owned();
        let k = placeholders.iter().position(|p| *p == host_port(&value)).unwrap();
        *slot = Value::String(value.replacen(&placeholders[k], &servers[k], 1));
    }
    let rewritten = serde_json::to_string_pretty(&config).unwrap();
    for p in &placeholders {
        assert!(!rewritten.contains(p.as_str()), "examples/node/{name}: {p} is also in a field that is not an endpoint:\n{rewritten}");
    }
    let path = dir.join(name);
    std::fs::write(&path, &rewritten).unwrap();
    let file = kvplane_config::from_json_strict(&rewritten).unwrap_or_else(|e| panic!("examples/node/{name}: {e}"));
    (path, file)
}

/// `kvplane node --config CONFIG` on a kernel-given port, taking every
/// setting but the addresses from the file (its `memory` included).
fn start(config: &Path, dir: &Path, env: &[(&str, &str)]) -> NodeProcess {
    let mut node = kvplane();
    node.args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--config"])
        .arg(config)
        .env("KVPLANE_CACHE_DIR", dir.join("cache"))
        .env_remove(kvplane_config::node::BACKEND_SECRET_ENV)
        .envs(env.iter().copied());
    NodeProcess::spawn(node)
}

/// SIGTERM, and the node must drain and exit 0; its log is shown if not.
async fn stop(node: NodeProcess) {
    let log = std::sync::Arc::clone(&node.log);
    let status = tokio::task::spawn_blocking(move || node.sigterm_and_wait()).await.unwrap();
    assert!(status.success(), "node exit after SIGTERM: {status}; it said:\n{}", log.lock().unwrap().join("\n"));
}

fn said(node: &NodeProcess) -> String {
    node.log.lock().unwrap().join("\n")
}

async fn client(node: &NodeProcess) -> Client {
    Client::connect(ClientConfig::new(Endpoint::Tcp(node.endpoint.clone()))).await.expect("the client connects")
}

/// A 64 KiB block whose bytes derive from its key.
fn block(key: &str) -> Bytes {
    let seed = key.bytes().fold(11u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    Bytes::from((0..65_536usize).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

async fn put(c: &Client, key: &str) {
    let results = c.put(vec![(Bytes::from(key.to_owned()), block(key))]).await.expect("put");
    assert!(results.iter().all(Result::is_ok), "{key}: {results:?}");
}

/// GETs `key` and checks it came back byte for byte.
async fn get(c: &Client, key: &str) {
    let got = c.get(vec![Bytes::from(key.to_owned())]).await.expect("get").remove(0);
    assert!(got.unwrap_or_else(|e| panic!("{key}: {e}")) == block(key), "{key} came back different");
}

async fn stat(c: &Client, name: &str) -> u64 {
    let stats = c.stats().await.expect("stats");
    stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap_or_else(|| panic!("no stat {name} in {stats:?}"))
}

async fn wait_for_stat(c: &Client, name: &str, want: u64) {
    let started = Instant::now();
    while stat(c, name).await != want {
        assert!(started.elapsed() < PATIENCE, "{name} did not reach {want} within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn plugin<'a>(file: &'a NodeConfigFile, name: &str) -> &'a PluginSpec {
    file.plugins.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no plugin {name} declared"))
}

/// Sends `commands` to a Redis on one connection and answers the first
/// line of each reply (`+OK`, `:1`).
fn redis_replies(endpoint: &str, commands: &[&[&str]]) -> Vec<String> {
    let mut conn = std::net::TcpStream::connect(endpoint).expect("connect to redis-server");
    conn.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut frame = String::new();
    for args in commands {
        frame.push_str(&format!("*{}\r\n", args.len()));
        for a in *args {
            frame.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
    }
    conn.write_all(frame.as_bytes()).unwrap();
    let mut reader = BufReader::new(conn);
    let mut replies = Vec::new();
    for _ in commands {
        let mut line = String::new();
        reader.read_line(&mut line).expect("redis-server's reply");
        replies.push(line.trim_end().to_owned());
    }
    replies
}

#[tokio::test]
async fn the_memory_example_serves_from_its_memory_tier() {
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = with_servers("memory.json", dir.path(), &[]);
    let node = start(&path, dir.path(), &[]);
    let mib = file.memory.expect("memory.json sets the memory tier's size").bytes() >> 20;
    assert!(said(&node).contains(&format!("memory {mib} MiB")), "the node did not take the file's memory:\n{}", said(&node));
    assert!(said(&node).contains("no backend plugin declared; the memory tier serves alone"), "{}", said(&node));

    let c = client(&node).await;
    put(&c, "examples/memory/block0").await;
    get(&c, "examples/memory/block0").await;
    assert_eq!(stat(&c, "hits").await, 1);
    stop(node).await;
}

/// `redis.json` with a password, given as a user would: through the
/// environment, not the file.
#[tokio::test]
async fn the_redis_example_writes_every_block_to_redis() {
    const PASSWORD: &str = "examples-s3cret";
    let redis = kvplane_tests::redis::RedisServer::start(&["--requirepass", PASSWORD]);
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = with_servers("redis.json", dir.path(), &[redis.endpoint()]);
    let tiering = file.tiering.clone().expect("redis.json sets tiering");
    assert_eq!(tiering.mode, IngestMode::All, "this test expects every PUT to reach redis");
    let env = [(kvplane_config::node::BACKEND_SECRET_ENV, PASSWORD)];
    let key = "examples/redis/block0";

    let first = start(&path, dir.path(), &env);
    assert!(said(&first).contains("second tier through plugin resp"), "{}", said(&first));
    let c = client(&first).await;
    put(&c, key).await;
    get(&c, key).await;
    wait_for_stat(&c, "tier_ingest_stored", 1).await;
    // In redis as the plugin's config says: its database, under its
    // prefix, with its time to live.
    let config = &plugin(&file, "resp").config;
    let stored = format!("{}{key}", config["prefix"]);
    let replies = redis_replies(
        &redis.endpoint(),
        &[&["AUTH", PASSWORD], &["SELECT", config["database"].as_str()], &["EXISTS", &stored], &["TTL", &stored]],
    );
    assert_eq!(replies[..3], ["+OK", "+OK", ":1"], "{stored} is not in redis: {replies:?}");
    let ttl: u64 = replies[3].strip_prefix(':').and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("TTL {stored}: {replies:?}"));
    let most: u64 = config["ttl-seconds"].parse().unwrap();
    assert!(ttl > 0 && ttl <= most, "{stored} expires in {ttl} s, not within the config's {most} s");
    stop(first).await;

    // A fresh node holds nothing in memory: the block comes from redis.
    let second = start(&path, dir.path(), &env);
    let c = client(&second).await;
    get(&c, key).await;
    assert_eq!(stat(&c, "backend_hits").await, 1, "the block was not read back from redis");
    stop(second).await;
}

#[test]
fn the_vineyard_example_copies_hot_blocks_to_vineyardd() {
    use kvplane_tests::vineyard::{in_private_network, VineyardServer};
    if !in_private_network(module_path!(), "the_vineyard_example_copies_hot_blocks_to_vineyardd") {
        return;
    }
    println!("running inside a private network namespace");
    let vineyardd = VineyardServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = with_servers("vineyard.json", dir.path(), &[vineyardd.endpoint()]);
    let tiering = file.tiering.clone().expect("vineyard.json sets tiering");
    assert_eq!(tiering.mode, IngestMode::Hot, "this test expects blocks to reach vineyardd once read hotReads times");
    let key = "examples/vineyard/block0";
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let first = start(&path, dir.path(), &[]);
        assert!(said(&first).contains("second tier through plugin vineyard"), "{}", said(&first));
        let c = client(&first).await;
        put(&c, key).await;
        for read in 1..=tiering.hot_reads {
            assert_eq!(stat(&c, "tier_ingest_stored").await, 0, "copied to vineyardd after {} reads", read - 1);
            get(&c, key).await;
        }
        wait_for_stat(&c, "tier_ingest_stored", 1).await;
        stop(first).await;

        let second = start(&path, dir.path(), &[]);
        let c = client(&second).await;
        get(&c, key).await;
        assert_eq!(stat(&c, "backend_hits").await, 1, "the block was not read back from vineyardd");
        stop(second).await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_example_joins_its_cluster() {
    let etcd = etcd::EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = with_servers("cluster.json", dir.path(), &etcd.endpoints());
    let cluster = file.cluster.clone().expect("cluster.json has a cluster section");
    let id = cluster.node_id.clone().expect("cluster.json names its node");
    let node = start(&path, dir.path(), &[]);
    assert!(said(&node).contains(&format!("cluster {}: member {id}", cluster.name)), "{}", said(&node));

    let mut config = ClusterClientConfig::new(vec![Endpoint::Tcp(node.endpoint.clone())]);
    config.timeout = Duration::from_secs(5);
    let c = ClusterClient::connect(config).await.expect("the cluster client connects");
    let member =
        etcd::eventually(&format!("{id} in the slot table"), PATIENCE, || c.table().members().iter().find(|m| m.id == id).cloned()).await;
    assert_eq!(member.endpoint, node.endpoint, "the member is advertised at the address it listens on");
    assert_eq!(member.zone, cluster.zone.clone().unwrap_or_default());
    assert_eq!(member.weight, cluster.weight);

    // Keys route to it, and round-trip through the cluster client.
    let keys: Vec<String> = (0..8).map(|i| format!("examples/cluster/block{i}")).collect();
    let table = c.table();
    for k in &keys {
        assert_eq!(table.owner_members(k.as_bytes()).next().map(|m| m.id.as_str()), Some(id.as_str()), "{k}");
    }
    let entries = keys.iter().map(|k| (Bytes::from(k.clone()), block(k))).collect();
    let put = c.put(entries).await.expect("put");
    assert!(put.iter().all(Result::is_ok), "{put:?}");
    let got = c.get(keys.iter().map(|k| Bytes::from(k.clone())).collect()).await.expect("get");
    for (k, r) in keys.iter().zip(got) {
        assert!(r.unwrap_or_else(|e| panic!("{k}: {e}")) == block(k), "{k} came back different");
    }
    let plain = client(&node).await;
    assert_eq!(stat(&plain, "cluster_registered").await, 1);
    stop(node).await;
}

/// A node did not start while its store was unreachable (`open/configure
/// failed: unavailable`), so a pod restarted during a store outage
/// crash-looped. Now `redis.json` (made fail-closed here) starts with redis
/// down: it serves its memory tier, says it is not ready, probes the store,
/// and uses it once redis answers.
#[tokio::test]
async fn the_redis_example_starts_while_redis_is_down_and_uses_it_once_it_answers() {
    const PASSWORD: &str = "examples-s3cret";
    let mut redis = kvplane_tests::redis::RedisServer::start(&["--requirepass", PASSWORD]);
    redis.kill();
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = with_servers("redis.json", dir.path(), &[redis.endpoint()]);
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["plugins"][0]["failurePolicy"] = Value::String("failClosed".into());
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();

    let mut cmd = kvplane();
    cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--config"])
        .arg(&path)
        .env("KVPLANE_CACHE_DIR", dir.path().join("cache"))
        .env(kvplane_config::node::BACKEND_SECRET_ENV, PASSWORD);
    let node = NodeProcess::spawn(cmd);
    assert!(said(&node).contains("its store is unreachable"), "{}", said(&node));
    let admin = said(&node).split("admin http://").nth(1).and_then(|r| r.split('/').next()).expect("the admin address").to_string();
    let ready = |admin: String| async move {
        tokio::task::spawn_blocking(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
            let mut r = agent.get(&format!("http://{admin}/readyz")).call().expect("the admin port answers");
            (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
        })
        .await
        .unwrap()
    };
    let c = client(&node).await;
    assert_eq!(stat(&c, "backend_reachable").await, 0);
    let (status, body) = ready(admin.clone()).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("unreachable"), "{body}");
    // The memory tier serves meanwhile.
    put(&c, "down/block0").await;
    get(&c, "down/block0").await;

    redis.restart();
    wait_for_stat(&c, "backend_reachable", 1).await;
    let (status, body) = ready(admin).await;
    assert_eq!(status, 200, "{body}");
    put(&c, "up/block1").await;
    let started = Instant::now();
    while stat(&c, "tier_ingest_stored").await == 0 {
        assert!(started.elapsed() < PATIENCE, "no block reached redis once it answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop(node).await;
}
