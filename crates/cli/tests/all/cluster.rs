//! Cluster mode end to end: a real three-member etcd, three `kvplane node`
//! processes started from config files, and the cluster client routing keys
//! over the table the nodes serve. A node killed under load loses no
//! acknowledged block (R=2, W=2); a node that drains hands its keys on; a
//! node cut off from etcd (by a TCP proxy the test cuts, nothing inside the
//! node) drops out of the table once its lease lapses.

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
    // 512 MiB each (reserved, touched only as used): more than the tests
    // write, so nothing is evicted and a missing block can only be lost.
    NodeProcess::start_with_env(&["--config", path.to_str().unwrap(), "--memory", "512MiB"], &[("KVPLANE_CACHE_DIR", dir.join("cache"))])
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
