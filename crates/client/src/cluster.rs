//! A client of a whole cluster: routes every key to its owners itself.
//!
//! Given any node of a cluster, [`ClusterClient`] fetches the slot table
//! (`CLUSTER_TABLE`) and from then on keeps one `CLUSTER_TABLE` outstanding
//! on a connection of its own, so a membership change reaches it as soon as
//! the nodes know it — no polling, no etcd client, no plugin runtime: a key's
//! owners are a CRC-32C, a modulo and a slice index
//! ([`kvplane_slots`]).
//!
//! A batch is split by owner, sent to the owners in parallel and merged back
//! into request order. A PUT is acknowledged once `write_quorum` owners
//! stored it; a GET asks the next owner when one fails or lacks the key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvplane_protocol::{KvError, Request, Response};
use kvplane_slots::{MemberState, SlotTable};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::client::{Client, ClientConfig, PrefixMatch};
use crate::endpoint::Endpoint;
use crate::tls::ClientTls;

/// How long one CLUSTER_TABLE may wait for a change before it is asked again.
const TABLE_WAIT: Duration = Duration::from_secs(30);

/// How to reach a cluster.
#[derive(Debug, Clone)]
pub struct ClusterClientConfig {
    /// Nodes to ask for the first table (any one that answers will do).
    pub seeds: Vec<Endpoint>,
    /// Bearer token the nodes require.
    pub token: Option<String>,
    /// TLS to every node (seeds and the members the table lists). The
    /// table names members by `host:port` as they advertise themselves
    /// (often a pod IP): their certificates must carry that address, or
    /// the TLS server name must be set to a name they all carry.
    pub tls: Option<ClientTls>,
    /// Connections per node.
    pub connections: usize,
    /// Limit on connecting and on waiting for any one answer.
    pub timeout: Duration,
    /// Owners that must store a PUT before it is acknowledged; `None`: the
    /// write quorum the cluster's table carries (the nodes'
    /// `cluster.writeQuorum`), and where the table states none (nodes
    /// configured without one, or older than the field) every owner the
    /// table lists for the key and not down.
    pub write_quorum: Option<usize>,
}

impl ClusterClientConfig {
    pub fn new(seeds: Vec<Endpoint>) -> ClusterClientConfig {
        ClusterClientConfig { seeds, token: None, tls: None, connections: 2, timeout: Duration::from_secs(10), write_quorum: None }
    }
}

/// Connections to the members, opened on first use.
struct Nodes {
    config: ClusterClientConfig,
    clients: Mutex<HashMap<String, Arc<Client>>>,
}

impl Nodes {
    async fn client(&self, endpoint: &str) -> Result<Arc<Client>, KvError> {
        if let Some(c) = self.clients.lock().unwrap_or_else(|p| p.into_inner()).get(endpoint) {
            return Ok(Arc::clone(c));
        }
        let mut config = ClientConfig::new(Endpoint::Tcp(endpoint.to_string()));
        config.token.clone_from(&self.config.token);
        config.tls.clone_from(&self.config.tls);
        config.connections = self.config.connections;
        config.timeout = self.config.timeout;
        let client = Arc::new(Client::connect(config).await?);
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        Ok(Arc::clone(clients.entry(endpoint.to_string()).or_insert(client)))
    }

    /// Forgets a node whose connection failed, so the next use reconnects.
    fn forget(&self, endpoint: &str) {
        self.clients.lock().unwrap_or_else(|p| p.into_inner()).remove(endpoint);
    }
}

/// A client of every node of a cluster.
pub struct ClusterClient {
    nodes: Arc<Nodes>,
    table: watch::Receiver<Arc<SlotTable>>,
    follower: JoinHandle<()>,
    /// The seed's largest block and longest lease (members are configured
    /// alike by the operator; the seed stands for them).
    max_block: Option<usize>,
    max_lease_ms: u32,
}

impl Drop for ClusterClient {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// Asks `endpoint` for a table newer than `after`, waiting up to `wait`.
/// The client that fetched it comes back too, for its limits.
async fn fetch_table(
    config: &ClusterClientConfig,
    endpoint: &Endpoint,
    after: u64,
    wait: Duration,
) -> Result<(SlotTable, Client), KvError> {
    let mut c = ClientConfig::new(endpoint.clone());
    c.token.clone_from(&config.token);
    c.tls.clone_from(&config.tls);
    c.connections = 1;
    c.timeout = config.timeout + wait;
    let client = Client::connect(c).await?;
    let table = fetch_on(&client, after, wait).await?;
    Ok((table, client))
}

async fn fetch_on(client: &Client, after: u64, wait: Duration) -> Result<SlotTable, KvError> {
    let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
    match client.call(Request::ClusterTable { after_version: after, wait_ms }).await? {
        Response::ClusterTable(t) => Ok(*t),
        Response::Error { code, message } => Err(code.into_kv_error(message)),
        other => Err(KvError::Internal(format!("node answered CLUSTER_TABLE with {other:?}"))),
    }
}

impl ClusterClient {
    /// Fetches the table from the first seed that answers and starts
    /// following it.
    pub async fn connect(config: ClusterClientConfig) -> Result<ClusterClient, KvError> {
        if config.write_quorum == Some(0) {
            // Zero owners would acknowledge a PUT no owner stored.
            return Err(KvError::Invalid("write_quorum must be at least 1 (None: the cluster's writeQuorum)".into()));
        }
        let mut last = KvError::Invalid("no seed nodes given".into());
        let mut first = None;
        for seed in &config.seeds {
            match fetch_table(&config, seed, 0, Duration::ZERO).await {
                Ok(t) => {
                    first = Some(t);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let (first, seed) = first.ok_or(last)?;
        let (max_block, max_lease_ms) = (seed.max_block_bytes(), seed.limits().max_lease_ms);
        let (tx, table) = watch::channel(Arc::new(first));
        let nodes = Arc::new(Nodes { config: config.clone(), clients: Mutex::new(HashMap::new()) });
        let follower = tokio::spawn(follow(config, tx));
        Ok(ClusterClient { nodes, table, follower, max_block, max_lease_ms })
    }

    /// The largest block the seed node stores, when it says.
    pub fn max_block_bytes(&self) -> Option<usize> {
        self.max_block
    }

    /// The longest pin lease the seed node grants.
    pub fn max_lease_ms(&self) -> u32 {
        self.max_lease_ms
    }

    /// The slot table in use.
    pub fn table(&self) -> Arc<SlotTable> {
        Arc::clone(&self.table.borrow())
    }

    /// Waits until the table's version is above `version` (for tests and
    /// tools that act on a membership change).
    pub async fn table_after(&self, version: u64) -> Arc<SlotTable> {
        let mut rx = self.table.clone();
        let t = rx.wait_for(|t| t.version > version).await.map(|t| Arc::clone(&t));
        t.unwrap_or_else(|_| self.table())
    }

    /// Stores each block on the key's owners; `Ok` once the write quorum of
    /// them stored it (the config's `write_quorum`, else the table's).
    pub async fn put(&self, entries: Vec<(Bytes, Bytes)>) -> Result<Vec<Result<(), KvError>>, KvError> {
        let table = self.table();
        let n = entries.len();
        let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
        let mut needed = vec![0usize; n];
        // The client's own setting wins; then the cluster's, from the table.
        let quorum = self.nodes.config.write_quorum.or(table.write_quorum().map(|w| w as usize));
        for (i, (key, _)) in entries.iter().enumerate() {
            let mut owners = 0;
            for o in table.writable_owners(key) {
                groups.entry(o).or_default().push(i);
                owners += 1;
            }
            needed[i] = quorum.unwrap_or(owners).max(1);
        }
        let mut stored = vec![0usize; n];
        let mut errors: Vec<Option<KvError>> = vec![None; n];
        let mut calls = JoinSet::new();
        for (owner, indices) in groups {
            let endpoint = table.members()[owner as usize].endpoint.clone();
            let nodes = Arc::clone(&self.nodes);
            let batch: Vec<(Bytes, Bytes)> = indices.iter().map(|&i| entries[i].clone()).collect();
            calls.spawn(async move {
                let result = match nodes.client(&endpoint).await {
                    Ok(c) => c.put(batch).await,
                    Err(e) => Err(e),
                };
                if result.is_err() {
                    nodes.forget(&endpoint);
                }
                (indices, result)
            });
        }
        while let Some(done) = calls.join_next().await {
            let (indices, result) = done.map_err(|e| KvError::Internal(format!("a PUT task failed: {e}")))?;
            match result {
                Ok(results) => {
                    for (i, r) in indices.into_iter().zip(results) {
                        match r {
                            Ok(()) => stored[i] += 1,
                            Err(e) => {
                                errors[i].get_or_insert(e);
                            }
                        }
                    }
                }
                Err(e) => {
                    for i in indices {
                        errors[i].get_or_insert(e.clone());
                    }
                }
            }
        }
        Ok((0..n)
            .map(|i| {
                if stored[i] >= needed[i] {
                    Ok(())
                } else {
                    Err(errors[i].take().unwrap_or_else(|| {
                        KvError::Unavailable(format!("{} of the {} owners needed stored the key", stored[i], needed[i]))
                    }))
                }
            })
            .collect())
    }

    /// Fetches each key from its first owner that has it.
    pub async fn get(&self, keys: Vec<Bytes>) -> Result<Vec<Result<Bytes, KvError>>, KvError> {
        let table = self.table();
        let mut out: Vec<Result<Bytes, KvError>> = (0..keys.len()).map(|_| Err(KvError::NotFound)).collect();
        // Per key: how many owners failed, and the first failure.
        let mut failed = vec![0usize; keys.len()];
        let mut failure: Vec<Option<KvError>> = vec![None; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut round = 0;
        while !pending.is_empty() {
            let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
            for &i in &pending {
                if let Some(o) = table.readable_owners(&keys[i]).nth(round) {
                    groups.entry(o).or_default().push(i);
                }
            }
            if groups.is_empty() {
                break;
            }
            let mut calls = JoinSet::new();
            for (owner, indices) in groups {
                let endpoint = table.members()[owner as usize].endpoint.clone();
                let nodes = Arc::clone(&self.nodes);
                let batch: Vec<Bytes> = indices.iter().map(|&i| keys[i].clone()).collect();
                calls.spawn(async move {
                    let result = match nodes.client(&endpoint).await {
                        Ok(c) => c.get(batch).await,
                        Err(e) => Err(e),
                    };
                    if result.is_err() {
                        nodes.forget(&endpoint);
                    }
                    (indices, result)
                });
            }
            let mut next = Vec::new();
            while let Some(done) = calls.join_next().await {
                let (indices, result) = done.map_err(|e| KvError::Internal(format!("a GET task failed: {e}")))?;
                let results: Vec<Result<Bytes, KvError>> = match result {
                    Ok(r) => r,
                    Err(e) => indices.iter().map(|_| Err(e.clone())).collect(),
                };
                for (i, r) in indices.into_iter().zip(results) {
                    match r {
                        Ok(b) => out[i] = Ok(b),
                        Err(KvError::NotFound) => next.push(i),
                        Err(e) => {
                            failed[i] += 1;
                            failure[i].get_or_insert(e);
                            next.push(i);
                        }
                    }
                }
            }
            pending = next;
            round += 1;
        }
        // Not found anywhere: not-found when an owner said so, else the
        // first owner's failure.
        for i in pending {
            let answered_absent = table.readable_owners(&keys[i]).count() > failed[i];
            if !answered_absent {
                if let Some(e) = failure[i].take() {
                    out[i] = Err(e);
                }
            }
        }
        Ok(out)
    }

    /// [`Client::get_into`](crate::Client::get_into) across the cluster:
    /// each value fetched as [`get`](Self::get) does (the owners are called
    /// in parallel, so the reads cannot borrow the destinations), then copied
    /// into its destination.
    pub async fn get_into(&self, keys: Vec<Bytes>, dests: &mut [&mut [u8]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        if keys.len() != dests.len() {
            return Err(KvError::Invalid(format!("get_into: {} keys but {} destinations", keys.len(), dests.len())));
        }
        let values = self.get(keys).await?;
        Ok(values.into_iter().zip(dests.iter_mut()).map(|(v, dest)| v.and_then(|v| crate::client::copy_into(&v, dest))).collect())
    }

    /// Whether any owner holds each key.
    pub async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, KvError> {
        let table = self.table();
        let mut found = vec![false; keys.len()];
        let most = table.replicas() as usize;
        for round in 0..most {
            let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
            for (i, k) in keys.iter().enumerate() {
                if let (false, Some(o)) = (found[i], table.readable_owners(k).nth(round)) {
                    groups.entry(o).or_default().push(i);
                }
            }
            for (owner, indices) in groups {
                let endpoint = &table.members()[owner as usize].endpoint;
                let Ok(client) = self.nodes.client(endpoint).await else {
                    self.nodes.forget(endpoint);
                    continue;
                };
                if let Ok(results) = client.presence_each(indices.iter().map(|&i| keys[i].clone()).collect(), true).await {
                    for (i, r) in indices.into_iter().zip(results) {
                        found[i] |= matches!(r, Ok(true));
                    }
                }
            }
        }
        Ok(found)
    }

    /// Deletes each key from every owner; `true` where an owner held it.
    pub async fn delete(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, KvError> {
        let table = self.table();
        let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            for o in table.writable_owners(k) {
                groups.entry(o).or_default().push(i);
            }
        }
        let mut deleted = vec![false; keys.len()];
        for (owner, indices) in groups {
            let endpoint = &table.members()[owner as usize].endpoint;
            let client = self.nodes.client(endpoint).await?;
            let results = client.presence_each(indices.iter().map(|&i| keys[i].clone()).collect(), false).await?;
            for (i, r) in indices.into_iter().zip(results) {
                deleted[i] |= r?;
            }
        }
        Ok(deleted)
    }

    /// How many leading blocks of a chain the cluster holds: each run of
    /// consecutive keys with the same owner is matched (and pinned) on that
    /// owner, until the first gap.
    pub async fn match_prefix(&self, keys: Vec<Bytes>, lease: Duration) -> Result<PrefixMatch, KvError> {
        let table = self.table();
        let mut matched = 0;
        let mut granted: Option<Duration> = None;
        while matched < keys.len() {
            let Some(owner) = table.readable_owners(&keys[matched]).next() else { break };
            let run = keys[matched..].iter().take_while(|k| table.readable_owners(k).next() == Some(owner)).count();
            let client = self.nodes.client(&table.members()[owner as usize].endpoint).await?;
            let m = client.match_prefix(keys[matched..matched + run].to_vec(), lease).await?;
            matched += m.matched;
            if m.matched > 0 {
                granted = Some(granted.map_or(m.lease, |g| g.min(m.lease)));
            }
            if m.matched < run {
                break;
            }
        }
        Ok(PrefixMatch { matched, lease: granted.unwrap_or_default() })
    }
}

/// Keeps one CLUSTER_TABLE outstanding at a time, moving to another member
/// when the one asked fails, and publishes every newer table.
async fn follow(config: ClusterClientConfig, tx: watch::Sender<Arc<SlotTable>>) {
    let mut turn = 0usize;
    let mut client: Option<(String, Client)> = None;
    loop {
        let current = Arc::clone(&tx.borrow());
        let (endpoint, c) = match client.take() {
            Some(c) => c,
            None => {
                // Members of the last table, then the seeds.
                let mut candidates: Vec<String> =
                    current.members().iter().filter(|m| m.state != MemberState::Down).map(|m| m.endpoint.clone()).collect();
                candidates.extend(config.seeds.iter().filter_map(|s| match s {
                    Endpoint::Tcp(a) => Some(a.clone()),
                    Endpoint::Unix(_) => None,
                }));
                if candidates.is_empty() {
                    return;
                }
                let endpoint = candidates[turn % candidates.len()].clone();
                turn += 1;
                let mut c = ClientConfig::new(Endpoint::Tcp(endpoint.clone()));
                c.token.clone_from(&config.token);
                c.tls.clone_from(&config.tls);
                c.connections = 1;
                // The answer may take the whole wait; a silent node is given
                // up on once the timeout passes beyond it.
                c.timeout = config.timeout + TABLE_WAIT;
                match Client::connect(c).await {
                    Ok(c) => (endpoint, c),
                    Err(e) => {
                        tracing::debug!(endpoint, error = %e, "cluster table: member unreachable; trying another");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                }
            }
        };
        match fetch_on(&c, current.version, TABLE_WAIT).await {
            Ok(t) => {
                if t.version > current.version {
                    tracing::debug!(version = t.version, endpoint, "cluster table changed");
                    tx.send_replace(Arc::new(t));
                }
                client = Some((endpoint, c));
            }
            Err(e) => {
                tracing::debug!(endpoint, error = %e, "cluster table: asking another member");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        if tx.is_closed() {
            return;
        }
    }
}
