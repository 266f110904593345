//! Tenants end to end (issue 21, item 2): real `kvplane node` processes
//! started with `--tenants-file`, real clients, a real redis-server as the
//! second tier, a real etcd for the cluster. Tenant B can neither read,
//! see, prefix-match, pin nor delete tenant A's keys through any
//! operation (socket and shared memory), nor after A's blocks went through
//! redis, nor after a cluster repair and hand-off; a key crafted to land in
//! A's namespace stays in B's; quotas refuse naming the quota; eviction
//! takes the tenant over its quota first; a reload adds and removes
//! tenants. Every test counts cross-tenant reads and asserts 0.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{etcd, support};
use bytes::Bytes;
use etcd::{eventually, EtcdCluster};
use kvplane_client::{Client, ClientConfig, ClusterClient, ClusterClientConfig, Endpoint, KvError};
use support::NodeProcess;

const PATIENCE: Duration = Duration::from_secs(60);
const KIB: usize = 1 << 10;

/// The SHA-256 of `token` in hex, as `printf %s TOKEN | sha256sum` prints it.
fn digest(token: &str) -> String {
    let out = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().unwrap().write_all(token.as_bytes())?;
            c.wait_with_output()
        })
        .expect("sha256sum");
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

/// `(name, token, memoryBytes, pinnedBytes)` per tenant.
fn write_tenants(path: &Path, tenants: &[(&str, &str, &str, &str)]) {
    let list: Vec<serde_json::Value> = tenants
        .iter()
        .map(|(name, token, memory, pinned)| {
            serde_json::json!({"name": name, "tokenSha256": digest(token), "memoryBytes": memory, "pinnedBytes": pinned})
        })
        .collect();
    // Written aside and renamed: the reloader never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::json!({ "tenants": list }).to_string()).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A node with `extra` flags, its admin port on a kernel-given port; the
/// admin address too.
fn start(extra: &[&str]) -> (NodeProcess, String) {
    let mut cmd = support::kvplane();
    cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]).args(extra);
    if !extra.contains(&"--memory") {
        cmd.args(["--memory", "64MiB"]);
    }
    let node = NodeProcess::spawn(cmd);
    let admin =
        node.log.lock().unwrap().iter().find_map(|l| l.split("admin http://").nth(1).map(|r| r.split('/').next().unwrap().to_string()));
    (node, admin.expect("the admin address in the node's serving line"))
}

async fn connect(endpoint: Endpoint, token: Option<&str>, shared_memory: bool) -> Result<Client, KvError> {
    let mut config = ClientConfig::new(endpoint);
    config.token = token.map(str::to_string);
    config.shared_memory = shared_memory;
    config.connections = 1;
    config.timeout = Duration::from_secs(10);
    Client::connect(config).await
}

async fn tcp(node: &NodeProcess, token: &str) -> Client {
    connect(Endpoint::Tcp(node.endpoint.clone()), Some(token), false).await.unwrap_or_else(|e| panic!("tenant with {token}: {e}"))
}

/// `/metrics` of the node at `admin`.
async fn metrics(admin: &str) -> String {
    let url = format!("http://{admin}/metrics");
    tokio::task::spawn_blocking(move || ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap()).await.unwrap()
}

/// The value of the series `name{labels}` in `text` (0 if absent).
fn series(text: &str, name: &str, labels: &str) -> u64 {
    let prefix = if labels.is_empty() { format!("{name} ") } else { format!("{name}{{{labels}}} ") };
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

fn value(key: &str, len: usize) -> Bytes {
    let seed = key.bytes().fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    Bytes::from((0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

/// Stores each of `keys` with `value(seed, len)`, failing the test unless
/// every one was stored.
async fn put_all(client: &Client, keys: &[Bytes], seed: &str, len: usize) {
    let results = client.put(keys.iter().map(|k| (k.clone(), value(seed, len))).collect()).await.unwrap();
    assert!(results.iter().all(Result::is_ok), "{seed}: {results:?}");
}

fn keys(prefix: &str, n: usize) -> Vec<Bytes> {
    (0..n).map(|i| Bytes::from(format!("{prefix}/{i}"))).collect()
}

/// The key a client would have to send for it to be stored as tenant
/// `name`'s `key` if the node did not tag every tenant's keys.
fn forged(name: &str, key: &[u8]) -> Bytes {
    let mut k = vec![name.len() as u8];
    k.extend_from_slice(name.as_bytes());
    k.extend_from_slice(key);
    Bytes::from(k)
}

/// What `other` can learn of `keys` through GET, EXISTS, MATCH_PREFIX
/// (with a lease) and DELETE, each: the number of keys it read, saw,
/// matched, deleted. All four must be 0 for another tenant's keys.
async fn probe(other: &Client, keys: &[Bytes]) -> [usize; 4] {
    let read = other.get(keys.to_vec()).await.unwrap().into_iter().filter(Result::is_ok).count();
    let seen = other.exists(keys.to_vec()).await.unwrap().into_iter().filter(|p| *p).count();
    let matched = other.match_prefix(keys.to_vec(), Duration::from_secs(5)).await.unwrap().matched;
    let deleted = other.delete(keys.to_vec()).await.unwrap().into_iter().filter(|d| *d).count();
    [read, seen, matched, deleted]
}

/// Every one of `keys` reads back as `value` through `owner`.
async fn all_intact(owner: &Client, keys: &[Bytes], len: usize) {
    let got = owner.get(keys.to_vec()).await.unwrap();
    for (k, r) in keys.iter().zip(got) {
        let k = String::from_utf8_lossy(k).to_string();
        assert_eq!(r.unwrap_or_else(|e| panic!("{k}: {e}")), value(&k, len), "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_b_can_neither_read_see_match_pin_nor_delete_tenant_a_keys() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("a", "token-a", "16Mi", "16Mi"), ("b", "token-b", "16Mi", "16Mi")]);
    let default_token = dir.path().join("token");
    std::fs::write(&default_token, "token-default\n").unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&default_token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let sock = dir.path().join("kv.sock");
    let (node, admin) = start(&[
        "--tenants-file",
        file.to_str().unwrap(),
        "--token-file",
        default_token.to_str().unwrap(),
        "--unix",
        sock.to_str().unwrap(),
    ]);
    let a = tcp(&node, "token-a").await;
    let b = tcp(&node, "token-b").await;
    let d = tcp(&node, "token-default").await;
    let names = keys("model/layer0", 12);
    let len = 64 * KIB;
    let put = a.put(names.iter().map(|k| (k.clone(), value(&String::from_utf8_lossy(k), len))).collect()).await.unwrap();
    assert!(put.iter().all(Result::is_ok), "{put:?}");
    all_intact(&a, &names, len).await;

    // Over the socket: B and the default tenant learn nothing of A's keys.
    assert_eq!(probe(&b, &names).await, [0; 4], "tenant b read / saw / matched / deleted tenant a's keys");
    assert_eq!(probe(&d, &names).await, [0; 4], "the default tenant read / saw / matched / deleted tenant a's keys");
    // Its own keys of the same names are its own.
    let mine: Vec<(Bytes, Bytes)> = names.iter().map(|k| (k.clone(), Bytes::from_static(b"b's own"))).collect();
    assert!(b.put(mine).await.unwrap().iter().all(Result::is_ok));
    assert!(b.get(names.clone()).await.unwrap().iter().all(|r| r.as_ref().is_ok_and(|v| v == &Bytes::from_static(b"b's own"))));
    // Forgery: a key that starts with A's tag stays in B's (or the
    // default tenant's) namespace, through every operation.
    let forgeries: Vec<Bytes> = names.iter().map(|k| forged("a", k)).collect();
    for forger in [&b, &d] {
        assert_eq!(probe(forger, &forgeries).await, [0; 4], "a forged key reached tenant a's namespace");
        let over: Vec<(Bytes, Bytes)> = forgeries.iter().map(|k| (k.clone(), Bytes::from_static(b"poison"))).collect();
        assert!(forger.put(over).await.unwrap().iter().all(Result::is_ok));
    }
    // A's pins: B's MATCH_PREFIX with a lease pinned nothing of A's.
    let m = metrics(&admin).await;
    assert_eq!(series(&m, "kvplane_tenant_pinned_bytes", "tenant=\"a\""), 0, "{m}");
    assert_eq!(series(&m, "kvplane_tenant_bytes", "tenant=\"a\""), (12 * len) as u64, "{m}");

    // Shared memory (PUT_SHM / GET_SHM over the Unix socket) and RDMA
    // descriptors: the same namespaces.
    let b_local = connect(Endpoint::Unix(sock.clone()), Some("token-b"), true).await.unwrap();
    let a_local = connect(Endpoint::Unix(sock.clone()), Some("token-a"), true).await.unwrap();
    let shm_names = keys("shm", 4);
    let shm_put: Vec<(Bytes, Bytes)> = shm_names.iter().map(|k| (k.clone(), value(&String::from_utf8_lossy(k), len))).collect();
    assert!(a_local.put(shm_put).await.unwrap().iter().all(Result::is_ok));
    // b_local learns a block size from a PUT of its own first, so that its
    // GETs go through shared memory.
    assert!(b_local.put(vec![(Bytes::from_static(b"b/sized"), value("b/sized", len))]).await.unwrap()[0].is_ok());
    let over_shm = b_local.get(shm_names.clone()).await.unwrap();
    assert_eq!(over_shm.iter().filter(|r| r.is_ok()).count(), 0, "tenant b read tenant a's blocks through shared memory");
    all_intact(&a_local, &shm_names, len).await;
    all_intact(&a, &shm_names, len).await;
    let described = b.call(kvplane_protocol::Request::RdmaDescribe { keys: names.clone(), lease_ms: 1000 }).await;
    match described {
        Ok(kvplane_protocol::Response::RdmaDescribe { results }) => {
            assert!(results.iter().all(Result::is_err), "tenant b got RDMA descriptors of tenant a's blocks")
        }
        Ok(other) => assert!(matches!(other, kvplane_protocol::Response::Error { .. }), "{other:?}"),
        Err(_) => {}
    }
    // After all of it, A's blocks are A's, unchanged.
    all_intact(&a, &names, len).await;

    // Credentials: a wrong token, none, a removed token.
    let wrong = connect(Endpoint::Tcp(node.endpoint.clone()), Some("token-c"), false).await.err().expect("a wrong token is refused");
    assert!(wrong.to_string().contains("wrong bearer token"), "{wrong}");
    let none = connect(Endpoint::Tcp(node.endpoint.clone()), None, false).await.err().expect("no token is refused");
    assert!(none.to_string().contains("this node requires a bearer token"), "{none}");
    // b's GETs: its own 12 keys found; a's 12, the 12 forgeries and the 4
    // over shared memory not.
    let m = metrics(&admin).await;
    assert_eq!(series(&m, "kvplane_tenant_hits_total", "tenant=\"b\""), 12, "{m}");
    assert_eq!(series(&m, "kvplane_tenant_misses_total", "tenant=\"b\""), 12 + 12 + 4, "{m}");
    drop(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_or_a_pin_past_the_tenants_quota_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("q", "token-q", "256Ki", "64Ki"), ("r", "token-r", "1Mi", "1Mi")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap()]);
    let q = tcp(&node, "token-q").await;
    let r = tcp(&node, "token-r").await;
    let len = 64 * KIB;
    let names = keys("q", 5);
    let fits: Vec<(Bytes, Bytes)> = names[..4].iter().map(|k| (k.clone(), value(&String::from_utf8_lossy(k), len))).collect();
    assert!(q.put(fits).await.unwrap().iter().all(Result::is_ok));
    // A replacement of its own block fits (it frees what it replaces).
    assert!(q.put(vec![(names[0].clone(), value("q/0", len))]).await.unwrap()[0].is_ok());
    let past = q.put(vec![(names[4].clone(), value("q/4", len))]).await.expect_err("a PUT past memoryBytes is refused");
    let said = past.to_string();
    assert!(matches!(past, KvError::Capacity(_)), "{past:?}");
    assert!(said.contains("tenant 'q' holds 262144 of its memoryBytes quota 262144"), "{said}");
    assert!(!q.exists(vec![names[4].clone()]).await.unwrap()[0], "nothing of the refused PUT was stored");
    // Another tenant is not held to q's quota.
    let other: Vec<(Bytes, Bytes)> = keys("r", 8).into_iter().map(|k| (k, value("r", len))).collect();
    assert!(r.put(other).await.unwrap().iter().all(Result::is_ok), "tenant r's PUTs fit its own quota");

    // Pins: the first lease's chain is pinned as far as q's pinnedBytes
    // (one 64 KiB block of the two), the next lease is refused, a lease
    // on the block pinned already is served.
    assert_eq!(q.match_prefix(names[..2].to_vec(), Duration::from_secs(10)).await.unwrap().matched, 1);
    let pin = q.match_prefix(names[2..4].to_vec(), Duration::from_secs(10)).await.expect_err("a pin past pinnedBytes is refused");
    assert!(pin.to_string().contains("tenant 'q' holds 65536 of its pinnedBytes quota 65536"), "{pin}");
    assert_eq!(q.match_prefix(names[..1].to_vec(), Duration::from_secs(10)).await.unwrap().matched, 1, "a pinned block's lease renewed");
    assert_eq!(q.match_prefix(names[2..4].to_vec(), Duration::ZERO).await.unwrap().matched, 2, "a match without a lease is served");
    let m = metrics(&admin).await;
    assert_eq!(series(&m, "kvplane_tenant_pinned_bytes", "tenant=\"q\""), 65536, "{m}");
    assert_eq!(series(&m, "kvplane_tenant_refusals_total", "tenant=\"q\",quota=\"memoryBytes\""), 1, "{m}");
    assert_eq!(series(&m, "kvplane_tenant_refusals_total", "tenant=\"q\",quota=\"pinnedBytes\""), 2, "one lease cut, one refused: {m}");
    assert_eq!(series(&m, "kvplane_tenant_bytes", "tenant=\"q\""), 4 * len as u64, "{m}");
    assert_eq!(series(&m, "kvplane_tenant_memory_quota_bytes", "tenant=\"q\""), 262_144, "{m}");
    drop(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_takes_the_tenant_over_its_quota_first() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("hog", "token-hog", "6Mi", "1Mi"), ("lean", "token-lean", "64Mi", "1Mi")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap(), "--memory", "16MiB", "--tenants-reload-interval", "200ms"]);
    let hog = tcp(&node, "token-hog").await;
    let lean = tcp(&node, "token-lean").await;
    let len = 64 * KIB;
    // lean's blocks first, so that without quotas they would be evicted first.
    let lean_first = keys("lean/old", 32);
    put_all(&lean, &lean_first, "lean", len).await;
    let hog_keys = keys("hog", 96);
    put_all(&hog, &hog_keys, "hog", len).await;
    // The hog's quota lowered below what it holds, by a reload.
    write_tenants(&file, &[("hog", "token-hog", "1Mi", "1Mi"), ("lean", "token-lean", "64Mi", "1Mi")]);
    let mut m = String::new();
    for _ in 0..600 {
        m = metrics(&admin).await;
        if series(&m, "kvplane_tenant_memory_quota_bytes", "tenant=\"hog\"") == 1 << 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(series(&m, "kvplane_tenant_memory_quota_bytes", "tenant=\"hog\""), 1 << 20, "{m}");
    // lean fills the memory, one block per PUT: room comes from the hog
    // until it is back at its quota (where the test stops: past it the
    // policy's own order applies again).
    let mut i = 0;
    loop {
        let put = lean.put(vec![(Bytes::from(format!("lean/new/{i}")), value("lean", len))]).await.unwrap();
        assert!(put[0].is_ok(), "{put:?}");
        i += 1;
        m = metrics(&admin).await;
        if series(&m, "kvplane_tenant_bytes", "tenant=\"hog\"") <= 1 << 20 {
            break;
        }
        assert!(i < 400, "the hog never got back to its quota: {m}");
    }
    assert!(series(&m, "kvplane_tenant_evictions_total", "tenant=\"hog\"") > 0, "{m}");
    assert_eq!(
        series(&m, "kvplane_tenant_evictions_total", "tenant=\"lean\""),
        0,
        "lean lost blocks while the hog was over its quota: {m}"
    );
    assert!(lean.exists(lean_first.clone()).await.unwrap().iter().all(|p| *p), "lean's oldest blocks are all still there");
    drop(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_a_tenant_and_removes_one_whose_connections_are_then_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("a", "token-a", "1Mi", "1Mi"), ("b", "token-b", "1Mi", "1Mi")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap(), "--tenants-reload-interval", "100ms"]);
    let a = tcp(&node, "token-a").await;
    let b = tcp(&node, "token-b").await;
    assert!(b.put(vec![(Bytes::from_static(b"k"), Bytes::from_static(b"b"))]).await.unwrap()[0].is_ok());
    let c_missing = connect(Endpoint::Tcp(node.endpoint.clone()), Some("token-c"), false).await.err().expect("c is not a tenant yet");
    assert!(c_missing.to_string().contains("wrong bearer token"), "{c_missing}");

    // A file that does not validate keeps the tenants loaded before.
    std::fs::write(&file, r#"{"tenants": [{"name": "a", "tokenSha256": "not hex", "memoryBytes": 1, "pinnedBytes": 1}]}"#).unwrap();
    let mut m = String::new();
    for _ in 0..600 {
        m = metrics(&admin).await;
        if series(&m, "kvplane_tenants_reload_failures_total", "") > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(series(&m, "kvplane_tenants_reload_failures_total", ""), 1, "{m}");
    let said = node.said_eventually("tenants reload failed", PATIENCE);
    assert!(said.contains("tenants reload failed") && said.contains("tenants.0.tokenSha256"), "{said}");
    assert!(b.get(vec![Bytes::from_static(b"k")]).await.unwrap()[0].is_ok(), "b still served after a failed reload");

    write_tenants(&file, &[("a", "token-a", "1Mi", "1Mi"), ("c", "token-c", "1Mi", "1Mi")]);
    let c = eventually("tenant c may connect", PATIENCE, || {
        let endpoint = node.endpoint.clone();
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async { connect(Endpoint::Tcp(endpoint), Some("token-c"), false).await.ok() })
        })
    })
    .await;
    assert!(!c.exists(vec![Bytes::from_static(b"k")]).await.unwrap()[0], "c sees nothing of b's");
    // b's open connection: refused at its next request, naming why.
    let refused = b.get(vec![Bytes::from_static(b"k")]).await.expect_err("a removed tenant's connection is refused");
    assert!(refused.to_string().contains("tenant 'b' was removed from the tenants file"), "{refused}");
    let again = connect(Endpoint::Tcp(node.endpoint.clone()), Some("token-b"), false).await.err().expect("b's token is refused now");
    assert!(again.to_string().contains("wrong bearer token"), "{again}");
    assert!(a.put(vec![(Bytes::from_static(b"k"), Bytes::from_static(b"a"))]).await.unwrap()[0].is_ok(), "a kept its connection");
    let m = metrics(&admin).await;
    assert!(series(&m, "kvplane_tenants_reloads_total", "") >= 1, "{m}");
    drop(node);
}

/// A node config with `builtin:resp` against `redis`, every PUT copied
/// there (`mode: all`).
fn redis_config(dir: &Path, redis: &str) -> PathBuf {
    let config = serde_json::json!({
        "backend": "redis",
        "backendEndpoints": [redis],
        "plugins": [{
            "name": "resp", "kind": "backend", "source": {"builtin": "resp"},
            "config": {"database": "0", "prefix": "kv/", "ttl-seconds": "3600"},
            "allowedEndpoints": [redis],
            "limits": {"memory": "64Mi", "timeout": "2s", "connections": 4},
        }],
        "tiering": {"mode": "all", "backend": "resp"},
    });
    let path = dir.join("node.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_stay_apart_through_a_real_redis_second_tier() {
    let redis = kvplane_tests::redis::RedisServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("a", "token-a", "32Mi", "1Mi"), ("b", "token-b", "32Mi", "1Mi")]);
    let config = redis_config(dir.path(), &redis.endpoint());
    let args = ["--tenants-file", file.to_str().unwrap(), "--config", config.to_str().unwrap()];
    let env = [("KVPLANE_CACHE_DIR", dir.path().join("cache"))];
    let spawn = || {
        let mut cmd = support::kvplane();
        cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "64MiB"]).args(args).envs(env.clone());
        NodeProcess::spawn(cmd)
    };
    let first = spawn();
    let a = tcp(&first, "token-a").await;
    let names = keys("tiered", 8);
    let len = 64 * KIB;
    assert!(a
        .put(names.iter().map(|k| (k.clone(), value(&String::from_utf8_lossy(k), len))).collect())
        .await
        .unwrap()
        .iter()
        .all(Result::is_ok));
    // SIGTERM drains: every block queued for redis is written first.
    drop(a);
    assert!(first.sigterm_and_wait().success());

    // A fresh node: its memory is empty, every read is a read-through.
    let second = spawn();
    let b = tcp(&second, "token-b").await;
    // The second tier answers a DELETE of a key it does not hold as done
    // (builtin:resp's DEL): what B's deletes did is judged by A's blocks
    // all reading back below.
    assert_eq!(probe(&b, &names).await[..3], [0; 3], "tenant b read / saw / matched tenant a's keys through redis");
    let forgeries: Vec<Bytes> = names.iter().map(|k| forged("a", k)).collect();
    assert_eq!(probe(&b, &forgeries).await[..3], [0; 3], "a forged key reached tenant a's blocks in redis");
    let a = tcp(&second, "token-a").await;
    all_intact(&a, &names, len).await;
    let stats = a.stats().await.unwrap();
    let backend_hits = stats.iter().find(|(n, _)| n == "backend_hits").map_or(0, |(_, v)| *v);
    assert_eq!(backend_hits, names.len() as u64, "a's blocks came back from redis: {stats:?}");
    drop(second);
}

/// A cluster member with tenants: config in `dir` as `id`, one owner per key.
fn member(dir: &Path, id: &str, etcd: &[String], tenants: &Path, cluster_token: &Path) -> NodeProcess {
    let config = serde_json::json!({
        "backend": "kvplane",
        "metadata": {"etcd": etcd},
        "cluster": {"name": "tenants", "nodeId": id, "replicas": 1, "leaseTtlSeconds": 2},
    });
    let path = dir.join(format!("{id}.json"));
    std::fs::write(&path, config.to_string()).unwrap();
    let mut cmd = support::kvplane();
    cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "128MiB", "--config"])
        .arg(&path)
        .arg("--tenants-file")
        .arg(tenants)
        .arg("--cluster-token-file")
        .arg(cluster_token)
        .env("KVPLANE_CACHE_DIR", dir.join("cache"));
    NodeProcess::spawn(cmd)
}

async fn cluster_client(seed: &NodeProcess, token: &str) -> ClusterClient {
    let mut config = ClusterClientConfig::new(vec![Endpoint::Tcp(seed.endpoint.clone())]);
    config.token = Some(token.into());
    config.write_quorum = Some(1);
    config.timeout = Duration::from_secs(10);
    ClusterClient::connect(config).await.expect("the cluster client connects")
}

async fn wait_for_members(c: &ClusterClient, ids: &[&str]) {
    eventually(&format!("a table with members {ids:?}"), PATIENCE, || {
        let t = c.table();
        let mut have: Vec<&str> = t.members().iter().filter(|m| m.state.may_own()).map(|m| m.id.as_str()).collect();
        have.sort_unstable();
        (have == ids).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_stay_apart_after_a_cluster_repair_and_hand_off() {
    let etcd = EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("a", "token-a", "64Mi", "1Mi"), ("b", "token-b", "64Mi", "1Mi")]);
    let cluster_token = dir.path().join("cluster-token");
    std::fs::write(&cluster_token, "members-only\n").unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&cluster_token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let n0 = member(dir.path(), "n0", &etcd.endpoints(), &file, &cluster_token);
    let a = cluster_client(&n0, "token-a").await;
    wait_for_members(&a, &["n0"]).await;
    let names: Vec<String> = (0..200).map(|i| format!("cluster/k{i}")).collect();
    let len = 8 * KIB;
    let entries: Vec<(Bytes, Bytes)> = names.iter().map(|k| (Bytes::from(k.clone()), value(k, len))).collect();
    assert!(a.put(entries).await.unwrap().iter().all(Result::is_ok));

    // A joiner: repair moves its slots' blocks to it, placed by the key the
    // client hashed (without the tenant's tag).
    let n1 = member(dir.path(), "n1", &etcd.endpoints(), &file, &cluster_token);
    wait_for_members(&a, &["n0", "n1"]).await;
    let table = a.table();
    let on_n1 = names.iter().filter(|k| table.owner_members(k.as_bytes()).next().is_some_and(|m| m.id == "n1")).count();
    assert!(on_n1 > 0, "n1 owns some keys");
    let direct = tcp(&n1, "token-a").await;
    let moved: Vec<Bytes> = names
        .iter()
        .filter(|k| table.owner_members(k.as_bytes()).next().is_some_and(|m| m.id == "n1"))
        .map(|k| Bytes::from(k.clone()))
        .collect();
    eventually("repair copied n1's keys to it, under a's namespace", PATIENCE, || {
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current()
                .block_on(async { direct.exists(moved.clone()).await.ok().filter(|p| p.iter().all(|x| *x)).map(|_| ()) })
        })
    })
    .await;
    let keys: Vec<Bytes> = names.iter().map(|k| Bytes::from(k.clone())).collect();
    let got = a.get(keys.clone()).await.unwrap();
    for (k, r) in names.iter().zip(got) {
        assert_eq!(r.unwrap_or_else(|e| panic!("{k} after repair: {e}")), value(k, len), "{k}");
    }
    let b = cluster_client(&n0, "token-b").await;
    wait_for_members(&b, &["n0", "n1"]).await;
    let b_read = b.get(keys.clone()).await.unwrap().into_iter().filter(Result::is_ok).count();
    let b_seen_n1 = tcp(&n1, "token-b").await.exists(moved.clone()).await.unwrap().into_iter().filter(|p| *p).count();
    assert_eq!((b_read, b_seen_n1), (0, 0), "tenant b read / saw tenant a's keys after the repair");

    // n0 drains: it hands every block it holds to n1 (the cluster role,
    // keys as stored), and a reads every key from n1 alone.
    let log = std::sync::Arc::clone(&n0.log);
    let status = tokio::task::spawn_blocking(move || n0.sigterm_and_wait()).await.unwrap();
    assert!(status.success(), "{status}");
    let said = log.lock().unwrap().join("\n");
    // n0 still holds every block (repair copies): all of them go to n1.
    assert!(said.contains(&format!("handed {} blocks to their new owners (0 not taken)", names.len())), "{said}");
    let only_n1 = tcp(&n1, "token-a").await;
    all_intact(&only_n1, &keys, len).await;
    let b1 = tcp(&n1, "token-b").await;
    assert_eq!(probe(&b1, &keys).await, [0; 4], "tenant b read / saw / matched / deleted tenant a's keys after the hand-off");
    all_intact(&only_n1, &keys, len).await;
    drop(n1);
}

#[test]
fn cluster_mode_with_tenants_needs_the_cluster_token_and_a_world_readable_tenants_file_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("a", "token-a", "1Mi", "1Mi")]);
    let config = dir.path().join("node.json");
    let cluster =
        serde_json::json!({"backend": "kvplane", "metadata": {"etcd": ["http://127.0.0.1:1"]}, "cluster": {"name": "t", "nodeId": "n0"}});
    std::fs::write(&config, cluster.to_string()).unwrap();
    let out = support::run(&[
        "node",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "none",
        "--memory",
        "16MiB",
        "--tenants-file",
        file.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ]);
    let said = support::text(&out);
    assert!(!out.status.success() && said.contains("cluster mode with --tenants-file needs --cluster-token-file"), "{said}");
    let token = dir.path().join("cluster-token");
    std::fs::write(&token, "members-only").unwrap();
    let out = support::run(&["node", "--listen", "127.0.0.1:0", "--admin", "none", "--cluster-token-file", token.to_str().unwrap()]);
    let said = support::text(&out);
    assert!(!out.status.success() && said.contains("--cluster-token-file is the members' credential beside --tenants-file"), "{said}");
    // A bad file is refused at start, naming the file and the field.
    std::fs::write(&file, r#"{"tenants": [{"name": "a", "tokenSha256": "00", "memoryBytes": 1, "pinnedBytes": 1}]}"#).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out =
        support::run(&["node", "--listen", "10.0.0.1:0", "--admin", "none", "--memory", "16MiB", "--tenants-file", file.to_str().unwrap()]);
    let said = support::text(&out);
    assert!(said.contains("warning: --tenants-file") && said.contains("readable by others"), "{said}");
    assert!(said.contains(file.to_str().unwrap()) && said.contains("tenants.0.tokenSha256 (tenant \"a\")"), "{said}");
    assert!(!said.contains("reachable from other hosts"), "a tenants file is credentials: {said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_max_connections_is_refused_naming_it_and_others_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    let text = serde_json::json!({"tenants": [
        {"name": "capped", "tokenSha256": digest("token-capped"), "memoryBytes": "1Mi", "pinnedBytes": "1Mi", "maxConnections": 1},
        {"name": "free", "tokenSha256": digest("token-free"), "memoryBytes": "1Mi", "pinnedBytes": "1Mi"}]});
    std::fs::write(&file, text.to_string()).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap()]);
    let first = tcp(&node, "token-capped").await;
    let second = connect(Endpoint::Tcp(node.endpoint.clone()), Some("token-capped"), false).await.err().expect("over maxConnections");
    assert!(second.to_string().contains("tenant 'capped' already holds 1 connections, its maxConnections"), "{second}");
    let _free: Vec<Client> = uncapped_connections(&node).await;
    let m = metrics(&admin).await;
    assert_eq!(series(&m, "kvplane_tenant_refusals_total", "tenant=\"capped\",quota=\"maxConnections\""), 1, "{m}");
    assert_eq!(series(&m, "kvplane_tenant_connections", "tenant=\"capped\""), 1, "{m}");
    // Its connection closed, the slot is free again.
    drop(first);
    let again = eventually("capped may connect once its connection closed", PATIENCE, || {
        let endpoint = node.endpoint.clone();
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async { connect(Endpoint::Tcp(endpoint), Some("token-capped"), false).await.ok() })
        })
    })
    .await;
    assert!(again.ping().await.is_ok());
    drop(node);
}

/// Three connections of the uncapped tenant: none refused.
async fn uncapped_connections(node: &NodeProcess) -> Vec<Client> {
    let mut all = Vec::new();
    for _ in 0..3 {
        all.push(tcp(node, "token-free").await);
    }
    all
}

/// Found in review: a tenant was charged the bytes it sent, not the pool
/// memory its blocks take. The pool carves blocks from size classes (at
/// least 4 KiB, powers of two), so a 1-byte block holds 4 KiB of the
/// memory tier: with 1-byte blocks a tenant of `memoryBytes: 64Ki` could
/// hold 64 Mi of the pool and evict every other tenant's blocks. Now it is
/// charged each block's size class, and its 17th 1-byte block is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_is_charged_the_pool_memory_its_blocks_take_not_the_bytes_it_sent() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("tiny", "token-tiny", "64Ki", "64Ki"), ("victim", "token-victim", "8Mi", "1Mi")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap(), "--memory", "16MiB"]);
    let tiny = tcp(&node, "token-tiny").await;
    let victim = tcp(&node, "token-victim").await;
    let len = 64 * KIB;
    let victims = keys("victim", 64);
    let blocks: Vec<(Bytes, Bytes)> = victims.iter().map(|k| (k.clone(), value(&String::from_utf8_lossy(k), len))).collect();
    assert!(victim.put(blocks).await.unwrap().iter().all(Result::is_ok));
    // 16 blocks of one byte take 16 x 4 KiB = 64 KiB of the pool: they fit.
    let small = keys("tiny/fits", 16);
    assert!(tiny.put(small.iter().map(|k| (k.clone(), Bytes::from_static(b"x"))).collect()).await.unwrap().iter().all(Result::is_ok));
    let m = metrics(&admin).await;
    assert_eq!(series(&m, "kvplane_tenant_bytes", "tenant=\"tiny\""), 64 * KIB as u64, "charged by size class: {m}");
    // Then thousands more, as many as the pool has 4 KiB blocks.
    let mut stored = 0;
    for round in 0..5 {
        let batch = keys(&format!("tiny/{round}"), 1024);
        match tiny.put(batch.iter().map(|k| (k.clone(), Bytes::from_static(b"x"))).collect()).await {
            Ok(results) => stored += results.iter().filter(|r| r.is_ok()).count(),
            Err(e) => {
                let said = e.to_string();
                assert!(matches!(e, KvError::Capacity(_)), "{e:?}");
                assert!(said.contains("tenant 'tiny' holds 65536 of its memoryBytes quota 65536"), "{said}");
            }
        }
    }
    let m = metrics(&admin).await;
    assert_eq!(stored, 0, "tiny stored {stored} more 1-byte blocks past its quota: {m}");
    assert!(series(&m, "kvplane_tenant_bytes", "tenant=\"tiny\"") <= 64 * KIB as u64, "{m}");
    assert_eq!(series(&m, "kvplane_tenant_evictions_total", "tenant=\"victim\""), 0, "tiny evicted victim's blocks: {m}");
    all_intact(&victim, &victims, len).await;
    drop(node);
}

/// Found in review: a connection refused for its tenant's maxConnections
/// counted as a failed handshake of its peer, so a tenant retrying at its
/// cap (a good token, told `retry later`) locked its peer address out for a
/// minute (--max-handshake-failures), and with it every other tenant
/// connecting from there (one host's engines, one Unix-socket uid).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_retrying_at_its_max_connections_does_not_lock_its_peer_out() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    let text = serde_json::json!({"tenants": [
        {"name": "capped", "tokenSha256": digest("token-capped"), "memoryBytes": "1Mi", "pinnedBytes": "1Mi", "maxConnections": 1},
        {"name": "other", "tokenSha256": digest("token-other"), "memoryBytes": "1Mi", "pinnedBytes": "1Mi"}]});
    std::fs::write(&file, text.to_string()).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap(), "--max-handshake-failures", "3"]);
    let _held = tcp(&node, "token-capped").await;
    for _ in 0..5 {
        let e = connect(Endpoint::Tcp(node.endpoint.clone()), Some("token-capped"), false).await.err().expect("over maxConnections");
        assert!(e.to_string().contains("its maxConnections"), "{e}");
    }
    let other = connect(Endpoint::Tcp(node.endpoint.clone()), Some("token-other"), false).await;
    assert!(other.is_ok(), "another tenant on the same peer was locked out: {}", other.err().unwrap());
    let m = metrics(&admin).await;
    assert_eq!(series(&m, "kvplane_tenant_refusals_total", "tenant=\"capped\",quota=\"maxConnections\""), 5, "{m}");
    assert_eq!(series(&m, "kvplane_handshake_failures_total", ""), 0, "{m}");
    drop(node);
}

/// Found in review: memoryBytes was checked per PUT against what was
/// stored, so PUTs of one tenant in flight at once on several connections
/// each fit and together passed the quota by all they carried (16
/// connections x 1 MiB against a quota of 1 MiB). Now a PUT reserves its
/// bytes at the door until it is answered, and the next PUT counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_of_one_tenant_stay_within_its_quota() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("q", "token-q", "1Mi", "1Mi")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap(), "--memory", "64MiB"]);
    let len = 64 * KIB;
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(tcp(&node, "token-q").await);
    }
    // Each PUT alone fits the quota exactly; they are sent at once.
    let batches: Vec<Vec<(Bytes, Bytes)>> =
        (0..clients.len()).map(|c| keys(&format!("q/{c}"), 16).into_iter().map(|k| (k, value("q", len))).collect()).collect();
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(clients.len()));
    let puts: Vec<_> = clients
        .into_iter()
        .zip(batches)
        .map(|(client, batch)| {
            let start = std::sync::Arc::clone(&start);
            tokio::spawn(async move {
                start.wait().await;
                client.put(batch).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for p in puts {
        answers.push(p.await.unwrap());
    }
    let stored: usize = answers.iter().filter_map(|a| a.as_ref().ok()).map(|r| r.iter().filter(|x| x.is_ok()).count()).sum();
    for a in &answers {
        if let Err(e) = a {
            assert!(e.to_string().contains("memoryBytes quota 1048576"), "{e}");
        }
    }
    let m = metrics(&admin).await;
    let held = series(&m, "kvplane_tenant_bytes", "tenant=\"q\"");
    assert!(held <= 1 << 20, "16 concurrent PUTs took q to {held} bytes ({stored} blocks) past its quota of 1 MiB: {m}");
    assert_eq!(stored, 16, "the quota's worth, one PUT's, was stored");
    // Every reservation was given back: with its blocks deleted, q's
    // quota is all free again for one more PUT of 1 MiB.
    let q = tcp(&node, "token-q").await;
    let mine: Vec<Bytes> = (0..16).flat_map(|c| keys(&format!("q/{c}"), 16)).collect();
    assert_eq!(q.delete(mine).await.unwrap().iter().filter(|d| **d).count(), 16);
    let again: Vec<(Bytes, Bytes)> = keys("q/again", 16).into_iter().map(|k| (k, value("q", len))).collect();
    assert!(q.put(again.clone()).await.unwrap().iter().all(Result::is_ok), "a reservation of the concurrent PUTs was never released");
    // A PUT gives its reservation back when answered, not at its
    // connection's next request: q, idle after storing half of its quota,
    // leaves the other half to a second connection.
    assert_eq!(q.delete(again.iter().map(|(k, _)| k.clone()).collect()).await.unwrap().iter().filter(|d| **d).count(), 16);
    assert!(q.put(again[..8].to_vec()).await.unwrap().iter().all(Result::is_ok));
    let q2 = tcp(&node, "token-q").await;
    let other_half = q2.put(again[8..].to_vec()).await;
    assert!(other_half.as_ref().is_ok_and(|r| r.iter().all(Result::is_ok)), "{other_half:?}");
    drop(node);
}

/// The key limit at its edge: a tenant of the longest name (63 bytes, a
/// tag of 64) stores and reads a key of the node's limit less 64 (its
/// tagged form exactly the node's limit); one byte more is refused
/// `invalid` naming the tenant's limit, and nothing is stored for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_longest_key_fits_the_node_limit_with_its_tag_and_one_more_byte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    let long_name = "n".repeat(63);
    write_tenants(&file, &[(long_name.as_str(), "token-long", "1Mi", "1Mi")]);
    let (node, _admin) = start(&["--tenants-file", file.to_str().unwrap()]);
    let t = tcp(&node, "token-long").await;
    let limit = kvplane_protocol::DEFAULT_MAX_KEY_BYTES as usize - 64;
    let longest = Bytes::from(vec![b'k'; limit]);
    assert!(t.put(vec![(longest.clone(), Bytes::from_static(b"v"))]).await.unwrap()[0].is_ok());
    assert_eq!(t.get(vec![longest.clone()]).await.unwrap()[0].as_ref().unwrap(), &Bytes::from_static(b"v"));
    let over = Bytes::from(vec![b'k'; limit + 1]);
    let refused = match t.put(vec![(over.clone(), Bytes::from_static(b"v"))]).await {
        Ok(r) => r.into_iter().next().unwrap().expect_err("a key past the tenant's limit is refused"),
        Err(e) => e,
    };
    assert!(matches!(refused, KvError::Invalid(_)) && refused.to_string().contains(&limit.to_string()), "{refused:?}");
    assert!(!t.exists(vec![longest.slice(..limit - 1)]).await.unwrap()[0]);
    drop(node);
}

/// Found in review: a tenant removed from the file kept its blocks with
/// no quota, so eviction took them in the policy's order like any other
/// tenant's: blocks no connection can read any more outlived the blocks
/// of tenants still served. A removed tenant's quotas are now 0, so its
/// blocks are the first eviction takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_tenants_blocks_are_evicted_before_a_served_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("stay", "token-stay", "64Mi", "1Mi"), ("gone", "token-gone", "64Mi", "1Mi")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap(), "--memory", "16MiB", "--tenants-reload-interval", "100ms"]);
    let stay = tcp(&node, "token-stay").await;
    let gone = tcp(&node, "token-gone").await;
    let len = 64 * KIB;
    // stay's blocks first, so that in the policy's order they would go first.
    let old = keys("stay/old", 64);
    put_all(&stay, &old, "stay", len).await;
    let gone_keys = keys("gone", 64);
    put_all(&gone, &gone_keys, "gone", len).await;
    drop(gone);
    write_tenants(&file, &[("stay", "token-stay", "64Mi", "1Mi")]);
    eventually("the reload that removes gone", PATIENCE, || {
        let endpoint = node.endpoint.clone();
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current()
                .block_on(async { connect(Endpoint::Tcp(endpoint), Some("token-gone"), false).await.err().map(|_| ()) })
        })
    })
    .await;
    // stay fills the memory: room comes from gone's blocks until none is left.
    let mut i = 0;
    let mut m;
    loop {
        let put = stay.put(vec![(Bytes::from(format!("stay/new/{i}")), value("stay", len))]).await.unwrap();
        assert!(put[0].is_ok(), "{put:?}");
        i += 1;
        m = metrics(&admin).await;
        if series(&m, "kvplane_tenant_bytes", "tenant=\"gone\"") == 0 {
            break;
        }
        assert!(i < 400, "gone's blocks were never evicted: {m}");
    }
    assert_eq!(series(&m, "kvplane_tenant_evictions_total", "tenant=\"gone\""), 64, "{m}");
    assert_eq!(
        series(&m, "kvplane_tenant_evictions_total", "tenant=\"stay\""),
        0,
        "stay lost blocks while a removed tenant's remained: {m}"
    );
    assert!(stay.exists(old).await.unwrap().iter().all(|p| *p), "stay's oldest blocks are all still there");
    drop(node);
}

/// Found in review: a PUT that replaces one of the tenant's blocks is let
/// in on the difference, and it reserved only the difference: once its
/// replacement had landed (512 KiB freed) and before its new block had,
/// the next PUT fitted on that moment. 16 connections of a 1 MiB tenant
/// holding one 512 KiB block, each sending a PUT of that key (4 KiB) and
/// a new 512 KiB block, stored 1 MiB + 4 KiB (2 PUTs let in). A PUT now
/// reserves all it brings; the credit only lets it in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_cannot_each_take_the_credit_of_the_block_they_replace() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("q", "token-q", "1Mi", "1Mi")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap(), "--memory", "64MiB"]);
    let big = 512 * KIB;
    let shared = Bytes::from_static(b"q/replaced");
    let q = tcp(&node, "token-q").await;
    assert!(q.put(vec![(shared.clone(), value("q/replaced", big))]).await.unwrap()[0].is_ok());
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(tcp(&node, "token-q").await);
    }
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(clients.len()));
    let puts: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, client)| {
            let start = std::sync::Arc::clone(&start);
            let batch = vec![(shared.clone(), value("small", 4 * KIB)), (Bytes::from(format!("q/new/{c}")), value("q/new", big))];
            tokio::spawn(async move {
                start.wait().await;
                client.put(batch).await
            })
        })
        .collect();
    let mut let_in = 0;
    for p in puts {
        match p.await.unwrap() {
            Ok(r) => let_in += usize::from(r.iter().all(Result::is_ok)),
            Err(e) => assert!(matches!(e, KvError::Capacity(_)), "{e:?}"),
        }
    }
    let m = metrics(&admin).await;
    let held = series(&m, "kvplane_tenant_bytes", "tenant=\"q\"");
    assert!(held <= 1 << 20, "{let_in} PUTs that each took the credit of one replaced block took q to {held} bytes: {m}");
    assert!(let_in >= 1, "one of them fits");
    drop(node);
}

/// Found in review: pinnedBytes was checked per MATCH_PREFIX before its
/// lease, which then pinned the whole chain: a tenant of `pinnedBytes:
/// 64Ki` pinned 4 MiB (64 blocks of its own) in one request. The chain is
/// now pinned only as far as the quota has room, in memory and through a
/// real redis second tier (blocks read through are held to it too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lease_pins_a_chain_only_as_far_as_the_tenants_pinned_quota() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.json");
    write_tenants(&file, &[("q", "token-q", "4Mi", "256Ki")]);
    let (node, admin) = start(&["--tenants-file", file.to_str().unwrap()]);
    let q = tcp(&node, "token-q").await;
    let names = keys("q", 64);
    put_all(&q, &names, "q", 64 * KIB).await;
    let matched = q.match_prefix(names.clone(), Duration::from_secs(30)).await.unwrap().matched;
    let m = metrics(&admin).await;
    let pinned = series(&m, "kvplane_tenant_pinned_bytes", "tenant=\"q\"");
    assert!(pinned <= 256 * KIB as u64, "one lease pinned {pinned} bytes ({matched} blocks) against a pinnedBytes of 256 KiB: {m}");
    assert_eq!(matched, 4, "the chain as far as the quota: 4 blocks of 64 KiB");
    drop(node);

    // The same chain read through from a real redis by a fresh node.
    let redis = kvplane_tests::redis::RedisServer::start(&[]);
    let config = redis_config(dir.path(), &redis.endpoint());
    let spawn = || {
        let mut cmd = support::kvplane();
        cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--memory", "64MiB"])
            .args(["--tenants-file", file.to_str().unwrap(), "--config", config.to_str().unwrap()])
            .env("KVPLANE_CACHE_DIR", dir.path().join("cache"));
        let node = NodeProcess::spawn(cmd);
        let admin = node
            .log
            .lock()
            .unwrap()
            .iter()
            .find_map(|l| l.split("admin http://").nth(1).map(|r| r.split('/').next().unwrap().to_string()))
            .expect("the admin address");
        (node, admin)
    };
    let (first, _) = spawn();
    let q = tcp(&first, "token-q").await;
    put_all(&q, &names, "q", 64 * KIB).await;
    drop(q);
    assert!(first.sigterm_and_wait().success());
    let (second, admin) = spawn();
    let q = tcp(&second, "token-q").await;
    let matched = q.match_prefix(names.clone(), Duration::from_secs(30)).await.unwrap().matched;
    let m = metrics(&admin).await;
    let pinned = series(&m, "kvplane_tenant_pinned_bytes", "tenant=\"q\"");
    assert!(pinned <= 256 * KIB as u64, "read through, one lease pinned {pinned} bytes ({matched} blocks): {m}");
    assert_eq!(matched, 4, "read through, the chain as far as the quota");
    // The lease renewed: what is pinned is matched again, and the rest of
    // the chain, in memory now, is not read through again from redis.
    let hits = |stats: Vec<(String, u64)>| stats.iter().find(|(n, _)| n == "backend_hits").map_or(0, |(_, v)| *v);
    let before = hits(q.stats().await.unwrap());
    assert_eq!(q.match_prefix(names.clone(), Duration::from_secs(30)).await.unwrap().matched, 4);
    assert_eq!(hits(q.stats().await.unwrap()), before, "a lease cut at the quota read the rest of its chain from redis");
    drop(second);
}
