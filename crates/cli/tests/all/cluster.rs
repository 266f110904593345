//! Cluster mode end to end: a real three-member etcd, three `kvplane node`
//! processes started from config files, and the cluster client routing keys
//! over the table the nodes serve. A node killed under load loses no
//! acknowledged block (R=2, W=2); a node that drains hands its keys on; a
//! node cut off from etcd (by a TCP proxy the test cuts, nothing inside the
//! node) drops out of the table once its lease lapses; after a kill and a
//! join, repair gives every key R copies again and the joiner its slots.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{etcd, support};
use bytes::Bytes;
use etcd::{eventually, EtcdCluster, Proxy};
use kvplane_client::{ClusterClient, ClusterClientConfig, Endpoint, KvError};
use support::{run, text, NodeProcess};

/// Far longer than any state here should take to reach.
const PATIENCE: Duration = Duration::from_secs(60);
const LEASE_SECONDS: u64 = 2;

/// Writes node `id`'s config (etcd at `etcd`) and starts it.
fn node(dir: &std::path::Path, id: &str, etcd: &[String], replicas: u32) -> NodeProcess {
    let path = config(dir, id, etcd, replicas);
    // 512 MiB each (reserved, touched only as used): more than the tests
    // write, so nothing is evicted and a missing block can only be lost.
    NodeProcess::start_with_env(&["--config", path.to_str().unwrap(), "--memory", "512MiB"], &[("KVPLANE_CACHE_DIR", dir.join("cache"))])
}

/// As [`node`], with its admin port on a kernel-given loopback port; that
/// port's address too.
fn node_with_admin(dir: &std::path::Path, id: &str, etcd: &[String], replicas: u32) -> (NodeProcess, String) {
    let path = config(dir, id, etcd, replicas);
    let mut cmd = support::kvplane();
    cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--memory", "64MiB", "--config"])
        .arg(&path)
        .env("KVPLANE_CACHE_DIR", dir.join("cache"));
    let node = NodeProcess::spawn(cmd);
    let admin =
        node.log.lock().unwrap().iter().find_map(|l| l.split("admin http://").nth(1).map(|r| r.split('/').next().unwrap().to_string()));
    let admin = admin.expect("the admin address in the node's serving line");
    (node, admin)
}

/// Node `id`'s config file in `dir`.
fn config(dir: &std::path::Path, id: &str, etcd: &[String], replicas: u32) -> std::path::PathBuf {
    let config = serde_json::json!({
        "backend": "kvplane",
        "metadata": {"etcd": etcd},
        "cluster": {
            "name": "test",
            "nodeId": id,
            "replicas": replicas,
            "leaseTtlSeconds": LEASE_SECONDS,
        },
    });
    let path = dir.join(format!("{id}.json"));
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

/// `GET http://{admin}{path}`: status and body.
async fn admin_get(admin: &str, path: &str) -> (u16, String) {
    let url = format!("http://{admin}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut answer = agent.get(&url).call().unwrap_or_else(|e| panic!("{url}: {e}"));
        (answer.status().as_u16(), answer.body_mut().read_to_string().unwrap())
    })
    .await
    .unwrap()
}

/// One counter of `kvplane stats` against `node`.
fn stat(node: &NodeProcess, name: &str) -> u64 {
    let out = run(&["stats", "--endpoint", &node.endpoint, "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", text(&out)));
    stats[name].as_u64().unwrap_or_else(|| panic!("no {name} in {stats}"))
}

async fn client(seed: &NodeProcess, write_quorum: usize) -> ClusterClient {
    let mut config = ClusterClientConfig::new(vec![Endpoint::Tcp(seed.endpoint.clone())]);
    config.write_quorum = Some(write_quorum);
    config.timeout = Duration::from_secs(5);
    ClusterClient::connect(config).await.expect("the cluster client connects")
}

/// Waits until the client's table lists exactly `ids` (sorted) as members.
async fn wait_for_members(c: &ClusterClient, ids: &[&str]) {
    eventually(&format!("a table with members {ids:?}"), PATIENCE, || {
        let t = c.table();
        let mut have: Vec<&str> = t.members().iter().map(|m| m.id.as_str()).collect();
        have.sort_unstable();
        (have == ids).then_some(())
    })
    .await;
}

/// A block whose bytes derive from its key and a generation.
fn value(key: &str, generation: u32, len: usize) -> Bytes {
    let seed = key.bytes().fold(generation as u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    Bytes::from((0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

fn sigkill(node: &mut NodeProcess) {
    // Kill by PID, as a crash would: no drain, no hand-off, no lease revoke.
    node.child.kill().unwrap();
    node.child.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_under_load_loses_no_acknowledged_block() {
    let etcd = EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<NodeProcess> = ["n0", "n1", "n2"].iter().map(|id| node(dir.path(), id, &etcd.endpoints(), 2)).collect();
    let c = Arc::new(client(&nodes[0], 2).await);
    wait_for_members(&c, &["n0", "n1", "n2"]).await;
    let before = c.table().version;

    // Load: 2 writers PUT batches of 8 × 16 KiB, at most ROUNDS batches each
    // (2 × 1500 × 128 KiB × 2 copies / 3 nodes = 250 MiB a node, within its
    // 512 MiB: nothing is evicted); every acknowledged key is recorded with
    // the bytes it holds.
    const ROUNDS: u32 = 1500;
    let acked: Arc<Mutex<HashMap<String, Bytes>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2 {
        let (c, acked, stop) = (Arc::clone(&c), Arc::clone(&acked), Arc::clone(&stop));
        writers.push(tokio::spawn(async move {
            let mut round = 0u32;
            while !stop.load(Ordering::Relaxed) && round < ROUNDS {
                let keys: Vec<String> = (0..8).map(|i| format!("w{w}/r{round}/k{i}")).collect();
                let entries: Vec<(Bytes, Bytes)> = keys.iter().map(|k| (Bytes::from(k.clone()), value(k, round, 16 << 10))).collect();
                // A batch the cluster cannot take (the dead node's share,
                // before the table drops it) is simply not acknowledged.
                if let Ok(results) = c.put(entries.clone()).await {
                    let mut acked = acked.lock().unwrap();
                    for ((key, data), r) in entries.into_iter().zip(results) {
                        if r.is_ok() {
                            acked.insert(String::from_utf8(key.to_vec()).unwrap(), data);
                        }
                    }
                }
                round += 1;
            }
        }));
    }
    eventually("blocks acknowledged before the kill", PATIENCE, || (acked.lock().unwrap().len() > 200).then_some(())).await;
    sigkill(&mut nodes[2]);
    let at_kill = acked.lock().unwrap().len();
    // Its lease lapses; the table without it reaches the client by itself.
    wait_for_members(&c, &["n0", "n1"]).await;
    assert!(c.table().version > before);
    eventually("blocks acknowledged after the table changed", PATIENCE, || (acked.lock().unwrap().len() > at_kill + 100).then_some(()))
        .await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }

    // Every acknowledged block reads back, byte for byte.
    let acked = acked.lock().unwrap().clone();
    let keys: Vec<String> = acked.keys().cloned().collect();
    let mut lost = Vec::new();
    for chunk in keys.chunks(64) {
        let got = c.get(chunk.iter().map(|k| Bytes::from(k.clone())).collect()).await.unwrap();
        for (k, r) in chunk.iter().zip(got) {
            match r {
                Ok(b) => assert!(b == acked[k], "block {k} came back corrupted"),
                Err(e) => lost.push(format!("{k}: {e}")),
            }
        }
    }
    assert!(lost.is_empty(), "{} of {} acknowledged blocks lost: {:?}", lost.len(), keys.len(), &lost[..lost.len().min(5)]);
    for survivor in &nodes[..2] {
        let out = run(&["stats", "--endpoint", &survivor.endpoint, "--json"]);
        let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", text(&out)));
        assert_eq!(stats["evictions"], 0, "the test sized memory so nothing is evicted: {stats}");
    }
    println!("{} acknowledged blocks, none lost after a node was killed", keys.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_hands_its_keys_on_before_it_leaves() {
    let etcd = EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    // One owner per key: a key lives on its one node until that node hands it on.
    let mut nodes: Vec<NodeProcess> = ["n0", "n1", "n2"].iter().map(|id| node(dir.path(), id, &etcd.endpoints(), 1)).collect();
    let c = client(&nodes[0], 1).await;
    wait_for_members(&c, &["n0", "n1", "n2"]).await;
    let keys: Vec<String> = (0..300).map(|i| format!("drain/k{i}")).collect();
    let entries: Vec<(Bytes, Bytes)> = keys.iter().map(|k| (Bytes::from(k.clone()), value(k, 1, 8 << 10))).collect();
    assert!(c.put(entries).await.unwrap().iter().all(Result::is_ok));
    let table = c.table();
    let on_n1 = keys.iter().filter(|k| table.owner_members(k.as_bytes()).next().is_some_and(|m| m.id == "n1")).count();
    assert!(on_n1 > 0, "n1 owns some keys");

    let leaving = nodes.remove(1);
    let log = Arc::clone(&leaving.log);
    let status = tokio::task::spawn_blocking(move || leaving.sigterm_and_wait()).await.unwrap();
    assert!(status.success(), "the draining node exits cleanly: {status}");
    let said = log.lock().unwrap().join("\n");
    assert!(said.contains(&format!("handed {on_n1} blocks to their new owners (0 not taken)")), "{said}");

    wait_for_members(&c, &["n0", "n2"]).await;
    let got = c.get(keys.iter().map(|k| Bytes::from(k.clone())).collect()).await.unwrap();
    for (k, r) in keys.iter().zip(got) {
        assert_eq!(r.unwrap_or_else(|e| panic!("{k}: {e}")), value(k, 1, 8 << 10), "{k}");
    }
    drop(nodes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_etcd_leaves_the_table_when_its_lease_lapses() {
    let etcd = EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    // n2 reaches etcd only through a proxy the test can cut.
    let proxy = Proxy::start(etcd.client_addr(0)).await;
    let n0 = node(dir.path(), "n0", &etcd.endpoints(), 2);
    let n1 = node(dir.path(), "n1", &etcd.endpoints(), 2);
    let n2 = node(dir.path(), "n2", &[format!("http://{}", proxy.endpoint())], 2);
    let c = client(&n0, 1).await;
    wait_for_members(&c, &["n0", "n1", "n2"]).await;

    proxy.cut();
    wait_for_members(&c, &["n0", "n1"]).await;
    let table = c.table();
    assert!(
        (0..table.slots()).all(|s| table.slot_owners(s).iter().all(|&o| table.members()[o as usize].id != "n2")),
        "no slot is routed to the cut-off node"
    );
    // n2 knows it is out: it says so, and refuses to hand out its stale table.
    let out = run(&["stats", "--endpoint", &n2.endpoint, "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", text(&out)));
    assert_eq!(stats["cluster_registered"], 0, "{stats}");
    let mut config = ClusterClientConfig::new(vec![Endpoint::Tcp(n2.endpoint.clone())]);
    config.timeout = Duration::from_secs(5);
    match ClusterClient::connect(config).await {
        Err(KvError::Unavailable(m)) => assert!(m.contains("no longer registered"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a node cut off from etcd handed out its table"),
    }
    drop((n0, n1));
}

/// Issue 19's etcd fault test: etcd down (every member stopped by PID) for
/// three leases under three nodes (R=2), then started again on its data
/// folders and ports. While it is down every node knows it is out (STATS,
/// `/readyz` 503, `/livez` 200, no table for a new client); every one
/// registers again by itself, under a new lease, within two leases of etcd
/// answering, keeping its memory tier; a NEW client then gets the full
/// table (three members, two owners for every slot) and reads every
/// acknowledged key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_registers_again_once_etcd_answers_after_an_outage_longer_than_its_lease() {
    const KEYS: usize = 120;
    let lease = Duration::from_secs(LEASE_SECONDS);
    let mut etcd = EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let ids = ["n0", "n1", "n2"];
    let (n0, admin) = node_with_admin(dir.path(), "n0", &etcd.endpoints(), 2);
    let nodes = [n0, node(dir.path(), "n1", &etcd.endpoints(), 2), node(dir.path(), "n2", &etcd.endpoints(), 2)];
    let c = client(&nodes[0], 2).await;
    wait_for_members(&c, &ids).await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("outage/k{i}")).collect();
    let entries: Vec<(Bytes, Bytes)> = keys.iter().map(|k| (Bytes::from(k.clone()), value(k, 5, 4 << 10))).collect();
    assert!(c.put(entries).await.unwrap().iter().all(Result::is_ok), "every key acknowledged by both owners");
    drop(c);
    let key = |id: &str| format!("/kvplane/test/members/{id}");
    let first: Vec<i64> = ids.iter().map(|id| etcd::lease_of_key(&etcd, &key(id)).unwrap().expect("each record in etcd")).collect();
    assert_eq!(admin_get(&admin, "/readyz").await.0, 200);

    etcd.stop();
    let stopped = tokio::time::Instant::now();
    eventually("cluster_registered 0 on every node after etcd stopped", PATIENCE, || {
        nodes.iter().all(|n| stat(n, "cluster_registered") == 0).then_some(())
    })
    .await;
    let (status, reason) = admin_get(&admin, "/readyz").await;
    assert!(status == 503 && reason.contains("n0") && reason.contains("not registered"), "{status} {reason}");
    assert_eq!(admin_get(&admin, "/healthz").await.0, 503, "/healthz is /readyz");
    assert_eq!(admin_get(&admin, "/livez").await, (200, "ok\n".to_string()), "waiting for etcd is not being stuck");
    let mut config = ClusterClientConfig::new(nodes.iter().map(|n| Endpoint::Tcp(n.endpoint.clone())).collect());
    config.timeout = Duration::from_secs(5);
    match ClusterClient::connect(config.clone()).await {
        Err(KvError::Unavailable(m)) => assert!(m.contains("no longer registered"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a node out of its cluster handed out its table"),
    }
    // The outage itself: etcd stays down for three leases.
    tokio::time::sleep_until(stopped + 3 * lease).await;
    etcd.restart();
    let answering = tokio::time::Instant::now();

    let deadline = answering + 2 * lease;
    let mut took = vec![None; ids.len()];
    loop {
        for (i, id) in ids.iter().enumerate() {
            if took[i].is_none() {
                let in_etcd = tokio::task::block_in_place(|| etcd::lease_of_key(&etcd, &key(id)));
                if matches!(in_etcd, Ok(Some(l)) if l != first[i] && l != 0) {
                    took[i] = Some(answering.elapsed());
                }
            }
        }
        if took.iter().all(Option::is_some) {
            break;
        }
        let missing: Vec<&str> = ids.iter().zip(&took).filter(|(_, t)| t.is_none()).map(|(id, _)| *id).collect();
        assert!(tokio::time::Instant::now() < deadline, "{missing:?} not registered again within two leases of etcd answering");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eventually("cluster_registered 1 again on every node", PATIENCE, || {
        nodes.iter().all(|n| stat(n, "cluster_registered") == 1).then_some(())
    })
    .await;
    assert_eq!(admin_get(&admin, "/readyz").await, (200, "ok\n".to_string()));
    for (n, id) in nodes.iter().zip(ids) {
        let counts = (stat(n, "cluster_registration_lapses"), stat(n, "cluster_reregistrations"));
        assert_eq!(counts, (1, 1), "{id}: one lapse, one re-registration");
    }
    let (_, metrics) = admin_get(&admin, "/metrics").await;
    assert!(metrics.contains("kvplane_cluster_reregistrations_total 1"), "{metrics}");
    assert!(metrics.contains("kvplane_cluster_registered 1"), "{metrics}");

    // A new client gets the full table and is served, the memory tiers included.
    let c = ClusterClient::connect(config).await.expect("a new client connects after etcd is back");
    wait_for_members(&c, &ids).await;
    let table = c.table();
    assert!((0..table.slots()).all(|s| table.slot_owners(s).len() == 2), "every slot has two owners");
    let got = c.get(keys.iter().map(|k| Bytes::from(k.clone())).collect()).await.unwrap();
    let lost: Vec<&String> =
        keys.iter().zip(&got).filter(|(k, r)| r.as_ref().ok() != Some(&value(k, 5, 4 << 10))).map(|(k, _)| k).collect();
    assert!(lost.is_empty(), "{} of {KEYS} acknowledged keys not read back: {:?}", lost.len(), &lost[..lost.len().min(5)]);
    let fresh = value("fresh", 1, 4 << 10);
    assert!(c.put(vec![(Bytes::from("fresh"), fresh.clone())]).await.unwrap()[0].is_ok());
    assert_eq!(c.get(vec![Bytes::from("fresh")]).await.unwrap()[0].as_ref().ok(), Some(&fresh));
    println!(
        "n0, n1, n2 registered again {took:?} after etcd answered ({:?} after it stopped); {KEYS} of {KEYS} keys read back",
        stopped.elapsed()
    );
}

/// Issue 19: etcd unreachable when a node starts (its ports refuse). The
/// node starts anyway, serves what a client asks it directly from its
/// memory tier, is not ready (`/readyz` 503 naming the member and why,
/// `/livez` 200), counts its failed attempts, and tells a cluster client
/// why it has no table; once etcd starts it registers by itself within two
/// leases, is ready, and a new cluster client gets a table and reads the
/// block stored before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_while_etcd_is_unreachable_serves_its_memory_and_registers_once_etcd_answers() {
    let lease = Duration::from_secs(LEASE_SECONDS);
    let mut etcd = EtcdCluster::unstarted();
    let dir = tempfile::tempdir().unwrap();
    let (n0, admin) = node_with_admin(dir.path(), "n0", &etcd.endpoints(), 1);
    eventually("a failed registration attempt", PATIENCE, || (stat(&n0, "cluster_registration_attempts_failed") > 0).then_some(())).await;
    assert_eq!(stat(&n0, "cluster_registered"), 0);
    let (status, reason) = admin_get(&admin, "/readyz").await;
    assert!(
        status == 503 && reason.contains("member n0") && reason.contains("not registered") && reason.contains("yet"),
        "{status} {reason}"
    );
    assert_eq!(admin_get(&admin, "/livez").await, (200, "ok\n".to_string()), "waiting for etcd is not being stuck");
    let (_, metrics) = admin_get(&admin, "/metrics").await;
    for series in ["kvplane_cluster_registered 0", "kvplane_cluster_registration_retry_max_ms 2000", "kvplane_cluster_table_version 0"] {
        assert!(metrics.contains(series), "{series} in {metrics}");
    }

    // Asked directly, it serves its memory tier.
    let mut direct = kvplane_client::ClientConfig::new(Endpoint::Tcp(n0.endpoint.clone()));
    direct.timeout = Duration::from_secs(5);
    let direct = kvplane_client::Client::connect(direct).await.expect("a client of the node itself connects");
    let early = value("early", 0, 4 << 10);
    assert!(direct.put(vec![(Bytes::from("early"), early.clone())]).await.unwrap()[0].is_ok());
    assert_eq!(direct.get(vec![Bytes::from("early")]).await.unwrap()[0].as_ref().ok(), Some(&early));
    // A cluster client is told why there is no table.
    let mut config = ClusterClientConfig::new(vec![Endpoint::Tcp(n0.endpoint.clone())]);
    config.timeout = Duration::from_secs(5);
    match ClusterClient::connect(config.clone()).await {
        Err(KvError::Unavailable(m)) => assert!(m.contains("not registered in the cluster yet"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a node that never registered handed out a table"),
    }

    etcd.restart();
    let answering = tokio::time::Instant::now();
    let key = "/kvplane/test/members/n0";
    let deadline = answering + 2 * lease;
    loop {
        let in_etcd = tokio::task::block_in_place(|| etcd::lease_of_key(&etcd, key));
        if matches!(in_etcd, Ok(Some(l)) if l != 0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "n0 not registered within two leases of etcd answering: {in_etcd:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = answering.elapsed();
    eventually("cluster_registered 1", PATIENCE, || (stat(&n0, "cluster_registered") == 1).then_some(())).await;
    until("/readyz 200", PATIENCE, || async {
        let (status, body) = admin_get(&admin, "/readyz").await;
        (status == 200).then_some(()).ok_or(format!("{status} {body}"))
    })
    .await;
    // A first registration is neither a lapse nor a re-registration.
    assert_eq!((stat(&n0, "cluster_registration_lapses"), stat(&n0, "cluster_reregistrations")), (0, 0));
    let failed = stat(&n0, "cluster_registration_attempts_failed");

    let c = ClusterClient::connect(config).await.expect("a new client connects once the node registered");
    wait_for_members(&c, &["n0"]).await;
    assert_eq!(c.get(vec![Bytes::from("early")]).await.unwrap()[0].as_ref().ok(), Some(&early), "the block stored before");
    let fresh = value("fresh", 1, 4 << 10);
    assert!(c.put(vec![(Bytes::from("fresh"), fresh.clone())]).await.unwrap()[0].is_ok());
    assert_eq!(c.get(vec![Bytes::from("fresh")]).await.unwrap()[0].as_ref().ok(), Some(&fresh));
    println!("n0 registered {took:?} after etcd first answered, after {failed} failed attempts");
}

/// Starts node `id` of cluster `name` with two owners per key, the given
/// `cluster.writeQuorum` and a lease far longer than the test: a node killed
/// stays in the table, so every PUT still goes to both owners.
fn quorum_node(dir: &std::path::Path, name: &str, id: &str, etcd: &[String], write_quorum: u32) -> NodeProcess {
    let config = serde_json::json!({
        "backend": "kvplane",
        "metadata": {"etcd": etcd},
        "cluster": {"name": name, "nodeId": id, "replicas": 2, "writeQuorum": write_quorum, "leaseTtlSeconds": 120},
    });
    let path = dir.join(format!("{name}-{id}.json"));
    std::fs::write(&path, config.to_string()).unwrap();
    NodeProcess::start_with_env(&["--config", path.to_str().unwrap(), "--memory", "64MiB"], &[("KVPLANE_CACHE_DIR", dir.join("cache"))])
}

/// Sends `SIG<name>` to `node` by its PID (`kill -NAME PID`).
fn signal(node: &NodeProcess, name: &str) {
    let status = std::process::Command::new("kill").arg(format!("-{name}")).arg(node.child.id().to_string()).status().unwrap();
    assert!(status.success(), "kill -{name} {}", node.child.id());
}

/// PUTs `n` fresh keys under `prefix` through `c`: how many were acknowledged,
/// and the first error.
async fn put_fresh(c: &ClusterClient, prefix: &str, n: usize) -> (usize, Option<KvError>) {
    let entries: Vec<(Bytes, Bytes)> =
        (0..n).map(|i| format!("{prefix}/k{i}")).map(|k| (Bytes::from(k.clone()), value(&k, 7, 4 << 10))).collect();
    let results = c.put(entries).await.expect("the batch is answered");
    let acked = results.iter().filter(|r| r.is_ok()).count();
    (acked, results.into_iter().find_map(Result::err))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clusters_write_quorum_reaches_clients_that_set_none() {
    let etcd = EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    // Two clusters of two nodes in one etcd, R=2: writeQuorum 1 and 2.
    let mut one: Vec<NodeProcess> = ["n0", "n1"].iter().map(|id| quorum_node(dir.path(), "w1", id, &etcd.endpoints(), 1)).collect();
    let mut two: Vec<NodeProcess> = ["n0", "n1"].iter().map(|id| quorum_node(dir.path(), "w2", id, &etcd.endpoints(), 2)).collect();
    // Clients configured with a seed and nothing else about writes.
    let connect_with = |seed: &NodeProcess, write_quorum: Option<usize>, timeout: Duration| {
        let mut config = ClusterClientConfig::new(vec![Endpoint::Tcp(seed.endpoint.clone())]);
        config.timeout = timeout;
        config.write_quorum = write_quorum;
        ClusterClient::connect(config)
    };
    // What a frozen owner costs a W=2 PUT and a GET that asks it first.
    let connect = |seed: &NodeProcess, write_quorum: Option<usize>| connect_with(seed, write_quorum, Duration::from_secs(2));
    let c1 = connect(&one[0], None).await.expect("a client of w1 connects");
    let c2 = connect(&two[0], None).await.expect("a client of w2 connects");
    // A patient client: a W=1 PUT must not wait for the frozen owner, so
    // its answer comes well before this timeout.
    let patient_timeout = Duration::from_secs(30);
    let patient = connect_with(&one[0], None, patient_timeout).await.expect("a patient client of w1 connects");
    wait_for_members(&c1, &["n0", "n1"]).await;
    wait_for_members(&c2, &["n0", "n1"]).await;
    wait_for_members(&patient, &["n0", "n1"]).await;
    assert_eq!(put_fresh(&c1, "both-up", 32).await.0, 32);
    assert_eq!(put_fresh(&c2, "both-up", 32).await.0, 32);
    assert_eq!(put_fresh(&patient, "both-up-patient", 32).await.0, 32, "the patient client's connections to both owners are open");
    // With both owners up the slower one's write may finish after its PUT
    // was answered too: let it, and count from here.
    let before = until("the patient client's background writes answered", PATIENCE, || async {
        let b = patient.background_writes();
        (b.in_flight == 0).then_some(b).ok_or(format!("{b:?}"))
    })
    .await;

    // One owner of every key frozen (SIGSTOP by PID): it takes connections
    // and answers nothing. writeQuorum 1: acknowledged by the other owner;
    // writeQuorum 2: refused with a typed timeout, nothing acknowledged.
    for n in [&one[1], &two[1]] {
        signal(n, "STOP");
    }
    let frozen = tokio::time::Instant::now();
    let (acked, error) = put_fresh(&patient, "one-frozen", 32).await;
    assert_eq!(acked, 32, "writeQuorum 1 with one owner of two frozen: {error:?}");
    let took_w1 = frozen.elapsed();
    // Answered once the live owner stored every key, not after the frozen
    // one's timeout: a behavioural bound, not a benchmark.
    assert!(took_w1 < patient_timeout / 3, "a W=1 PUT with one owner frozen took {took_w1:?} (client timeout {patient_timeout:?})");
    // The frozen owner's write was not dropped: it goes on, counted.
    let background = patient.background_writes();
    assert!(background.in_flight >= 1 && background.in_flight_bytes > 0, "the frozen owner's write is in flight: {background:?}");
    let got = c1.get((0..32).map(|i| Bytes::from(format!("one-frozen/k{i}"))).collect()).await.unwrap();
    let read = got.iter().enumerate().filter(|(i, r)| r.as_ref().ok() == Some(&value(&format!("one-frozen/k{i}"), 7, 4 << 10))).count();
    assert_eq!(read, 32, "every block acknowledged with one owner frozen reads back");
    let (acked, error) = put_fresh(&c2, "one-frozen", 32).await;
    assert_eq!(acked, 0, "writeQuorum 2 acknowledged {acked} keys stored on one owner");
    assert!(matches!(error, Some(KvError::Timeout(_))), "a typed timeout naming the frozen owner: {error:?}");
    for n in [&one[1], &two[1]] {
        signal(n, "CONT");
    }
    // The frozen owner's writes went on in the background: once it runs
    // again it holds every block (asked on a connection to it alone).
    let thawed = kvplane_client::Client::connect(kvplane_client::ClientConfig::new(Endpoint::Tcp(one[1].endpoint.clone())))
        .await
        .expect("the thawed owner answers");
    let keys: Vec<Bytes> = (0..32).map(|i| Bytes::from(format!("one-frozen/k{i}"))).collect();
    until("the thawed owner holds every block of the W=1 PUT", PATIENCE, || async {
        let got = thawed.get(keys.clone()).await.map_err(|e| e.to_string())?;
        let held = got.iter().enumerate().filter(|(i, r)| r.as_ref().ok() == Some(&value(&format!("one-frozen/k{i}"), 7, 4 << 10))).count();
        (held == 32).then_some(()).ok_or(format!("{held} of 32"))
    })
    .await;
    let background = until("the background write answered", PATIENCE, || async {
        let b = patient.background_writes();
        (b.in_flight == 0).then_some(b).ok_or(format!("{b:?}"))
    })
    .await;
    assert_eq!(
        (background.completed - before.completed, background.failed, background.in_flight_bytes),
        (1, 0, 0),
        "the frozen owner's one write completed once it ran again: {background:?}"
    );
    println!(
        "one owner of two frozen: writeQuorum 1 acknowledged 32 of 32 (in {took_w1:?}), writeQuorum 2 0 of 32: {error:?}; background: {background:?}"
    );

    // One owner of every key killed by PID; the lease keeps it in the tables.
    sigkill(&mut one[1]);
    sigkill(&mut two[1]);
    assert_eq!(c1.table().members().len(), 2);
    assert_eq!(c2.table().members().len(), 2);

    // writeQuorum 1: acknowledged by the one owner left, and readable from it.
    let (acked, error) = put_fresh(&c1, "one-down", 32).await;
    assert_eq!(acked, 32, "writeQuorum 1 with one owner of two alive: {error:?}");
    let got = c1.get((0..32).map(|i| Bytes::from(format!("one-down/k{i}"))).collect()).await.unwrap();
    for (i, r) in got.into_iter().enumerate() {
        let k = format!("one-down/k{i}");
        assert_eq!(r.unwrap_or_else(|e| panic!("{k}: {e}")), value(&k, 7, 4 << 10), "{k}");
    }
    // writeQuorum 2: nothing acknowledged with one copy.
    let (acked, error) = put_fresh(&c2, "one-down", 32).await;
    assert_eq!(acked, 0, "writeQuorum 2 acknowledged {acked} keys stored on one owner");
    assert!(matches!(error, Some(KvError::Unavailable(_))), "a typed unavailable naming the dead owner: {error:?}");
    // A client told otherwise keeps its own setting, either way.
    let strict = connect(&one[0], Some(2)).await.expect("a strict client of w1 connects");
    assert_eq!(put_fresh(&strict, "strict", 8).await.0, 0, "a client's own write_quorum 2 overrides the table's 1");
    let lenient = connect(&two[0], Some(1)).await.expect("a lenient client of w2 connects");
    assert_eq!(put_fresh(&lenient, "lenient", 8).await.0, 8, "a client's own write_quorum 1 overrides the table's 2");
    assert_eq!((c1.table().write_quorum(), c2.table().write_quorum()), (Some(1), Some(2)), "the tables carry cluster.writeQuorum");
    println!("writeQuorum 1: 32 of 32 acknowledged with one owner of two killed; writeQuorum 2: 0 of 32");
}

#[test]
fn a_write_quorum_outside_one_to_replicas_stops_the_node_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    for w in [0, 3] {
        let config = serde_json::json!({
            "backend": "kvplane",
            "metadata": {"etcd": ["http://127.0.0.1:1"]},
            "cluster": {"name": "bad", "nodeId": "n0", "replicas": 2, "writeQuorum": w},
        });
        let path = dir.path().join(format!("w{w}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        let out = support::kvplane()
            .args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "64MiB", "--config"])
            .arg(&path)
            .env("KVPLANE_CACHE_DIR", dir.path().join("cache"))
            .output()
            .unwrap();
        let t = text(&out);
        assert!(!out.status.success(), "a node started with writeQuorum {w} of 2 replicas: {t}");
        assert!(t.contains(&format!("cluster.writeQuorum: {w} is outside 1..=2 (cluster.replicas)")), "{t}");
    }
}

/// Which of `keys` a client connected to `node` alone finds there (EXISTS,
/// in batches the node takes).
async fn present_on(node: &NodeProcess, keys: &[String]) -> Vec<bool> {
    let mut config = kvplane_client::ClientConfig::new(Endpoint::Tcp(node.endpoint.clone()));
    config.timeout = Duration::from_secs(5);
    let c = kvplane_client::Client::connect(config).await.unwrap_or_else(|e| panic!("connecting to {}: {e}", node.endpoint));
    let mut out = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(64) {
        out.extend(c.exists(chunk.iter().map(|k| Bytes::from(k.clone())).collect()).await.unwrap());
    }
    out
}

/// Polls `check` every 50 ms until it answers `Some`, failing after `limit`
/// with what its last answer said.
async fn until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let started = tokio::time::Instant::now();
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) => assert!(started.elapsed() < limit, "{what}: not within {limit:?}; last: {last}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 19's fault test: R=2 over three nodes, one SIGKILLed by PID, then
/// a fourth joining. The survivors copy the dead node's share to its slots'
/// new owners, and the older owners copy the joiner's slots to it, until
/// every acknowledged key again has two copies (counted per node, EXISTS on
/// a connection to that node alone) and the joiner holds every key the
/// table gives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_and_a_join_every_key_has_r_copies_again() {
    /// Repair of these 64 MiB (256 KiB blocks, as engines' blocks are)
    /// must finish well within this (it takes well under a second).
    const REPAIR: Duration = Duration::from_secs(30);
    const KEYS: usize = 256;
    const BLOCK: usize = 256 << 10;
    let etcd = EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<NodeProcess> = ["n0", "n1", "n2"].iter().map(|id| node(dir.path(), id, &etcd.endpoints(), 2)).collect();
    let c = client(&nodes[0], 2).await;
    wait_for_members(&c, &["n0", "n1", "n2"]).await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("repair/k{i}")).collect();
    let entries: Vec<(Bytes, Bytes)> = keys.iter().map(|k| (Bytes::from(k.clone()), value(k, 3, BLOCK))).collect();
    assert!(c.put(entries).await.unwrap().iter().all(Result::is_ok), "every key stored on both owners");
    let on_n2 = keys.iter().filter(|k| c.table().owner_members(k.as_bytes()).any(|m| m.id == "n2")).count();
    assert!(on_n2 > 0, "n2 owns some keys");

    sigkill(&mut nodes[2]);
    let killed = tokio::time::Instant::now();
    wait_for_members(&c, &["n0", "n1"]).await;
    let dropped = tokio::time::Instant::now();
    // Two members and R=2: each survivor must hold every key.
    let survivors = &nodes[..2];
    until("each survivor holding every key after the kill", REPAIR, || async {
        let mut missing = Vec::new();
        for n in survivors {
            missing.push(present_on(n, &keys).await.iter().filter(|p| !**p).count());
        }
        missing.iter().all(|m| *m == 0).then_some(()).ok_or(format!("keys missing on n0, n1: {missing:?}"))
    })
    .await;
    let healed = dropped.elapsed();
    println!(
        "kill: {on_n2} of {KEYS} keys had a copy on n2; every key on both survivors {healed:?} after the table dropped n2 \
         ({:?} after the kill)",
        killed.elapsed()
    );

    nodes.pop();
    nodes.push(node(dir.path(), "n3", &etcd.endpoints(), 2));
    wait_for_members(&c, &["n0", "n1", "n3"]).await;
    let joined = tokio::time::Instant::now();
    let table = c.table();
    let for_n3: Vec<String> = keys.iter().filter(|k| table.owner_members(k.as_bytes()).any(|m| m.id == "n3")).cloned().collect();
    assert!(!for_n3.is_empty(), "the table gives n3 some keys");
    let copies = until("n3 holding its keys, and every key two copies", REPAIR, || async {
        let on_n3 = present_on(&nodes[2], &for_n3).await.iter().filter(|p| **p).count();
        let mut copies = vec![0usize; KEYS];
        for n in &nodes {
            for (i, p) in present_on(n, &keys).await.into_iter().enumerate() {
                copies[i] += usize::from(p);
            }
        }
        let short = copies.iter().filter(|c| **c < 2).count();
        (on_n3 == for_n3.len() && short == 0)
            .then(|| copies.clone())
            .ok_or(format!("n3 holds {on_n3} of its {} keys; {short} keys with fewer than 2 copies", for_n3.len()))
    })
    .await;
    let took = joined.elapsed();
    // The joiner serves its slots: a client connected to it alone reads them.
    let mut config = kvplane_client::ClientConfig::new(Endpoint::Tcp(nodes[2].endpoint.clone()));
    config.timeout = Duration::from_secs(5);
    let n3 = kvplane_client::Client::connect(config).await.unwrap();
    for chunk in for_n3.chunks(64) {
        let got = n3.get(chunk.iter().map(|k| Bytes::from(k.clone())).collect()).await.unwrap();
        for (k, r) in chunk.iter().zip(got) {
            assert_eq!(r.unwrap_or_else(|e| panic!("{k} on n3: {e}")), value(k, 3, BLOCK), "{k} on n3");
        }
    }
    let copied: u64 = nodes.iter().map(|n| stat(n, "cluster_repair_blocks_copied")).sum();
    let bytes: u64 = nodes.iter().map(|n| stat(n, "cluster_repair_bytes_copied")).sum();
    let failed: u64 = nodes.iter().map(|n| stat(n, "cluster_repair_copies_failed")).sum();
    assert_eq!(failed, 0, "no repair copy failed");
    let total: usize = copies.iter().sum();
    println!(
        "join: n3 holds all {} keys the table gives it {took:?} after the table listed it; {KEYS} keys, {total} copies on 3 nodes \
         (min {}); repair copied {copied} blocks, {bytes} bytes, 0 failed",
        for_n3.len(),
        copies.iter().min().unwrap()
    );
}
