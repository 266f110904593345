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
//!
//! A PUT is answered as soon as every key of the batch is decided: stored by
//! its quorum, or certain to miss it because too many of its owners failed.
//! The owners that have not answered yet (one frozen, or just slower) keep
//! their writes going in the background, up to the client's timeout, rather
//! than being cancelled: a request dropped while its frame is half written
//! would leave the rest of a pooled connection's stream unreadable to the
//! node. Those writes are bounded by
//! [`ClusterClientConfig::max_background_bytes`]; past it, a PUT waits for
//! its slow owners as it would without background writes. What they do is
//! counted in [`ClusterClient::background_writes`] and each failure is
//! logged naming the owner and the first key it did not store.
//!
//! The caller's memory is not read after a PUT returns: an owner's batch is
//! handed to its write only once that owner's connection is ready, and a
//! write still waiting for its connection when the PUT returns gets an owned
//! copy instead (counted in `copied_bytes`). A write already under way keeps
//! its `Bytes` (refcounted: whatever owns them, such as the Python client's
//! exported buffers, stays alive until it is done) and its blocks' CRC-32C
//! is computed before its frame is sent, so a buffer the caller changes
//! afterwards is refused by the node (`bad_checksum`), never stored under the
//! key. The one window left: a write whose pooled connection had closed and
//! is opened again computes the checksums only once it is open.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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

/// Default of [`ClusterClientConfig::max_background_bytes`]: a few hundred
/// blocks of an engine's KV cache, a small share of a client host's memory.
pub const DEFAULT_MAX_BACKGROUND_BYTES: usize = 256 << 20;

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
    /// Bytes (keys and values) of owner writes that may go on after their
    /// PUT was answered, across the client (default
    /// [`DEFAULT_MAX_BACKGROUND_BYTES`]). A PUT whose slow owners' share does
    /// not fit waits for them (counted as `waited`); 0: every PUT waits for
    /// every owner it asked.
    pub max_background_bytes: usize,
}

/// What the owner writes that outlive their PUT did, since the client was
/// made ([`ClusterClient::background_writes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackgroundWrites {
    /// Owner writes going on after their PUT was answered.
    pub in_flight: u64,
    /// Their keys' and values' bytes (bounded by `max_background_bytes`).
    pub in_flight_bytes: u64,
    /// Owner writes that stored every key they carried.
    pub completed: u64,
    /// Owner writes that failed, whole or for some keys (each logged).
    pub failed: u64,
    /// Keys those failed writes did not store on their owner.
    pub failed_keys: u64,
    /// PUTs that waited for their slow owners because the bound was reached.
    pub waited: u64,
    /// Bytes copied so that a write still waiting for its connection does not
    /// read the caller's memory after the PUT returned.
    pub copied_bytes: u64,
}

/// The counters behind [`BackgroundWrites`].
#[derive(Default)]
struct Background {
    in_flight: AtomicU64,
    bytes: AtomicUsize,
    completed: AtomicU64,
    failed: AtomicU64,
    failed_keys: AtomicU64,
    waited: AtomicU64,
    copied_bytes: AtomicU64,
}

impl ClusterClientConfig {
    pub fn new(seeds: Vec<Endpoint>) -> ClusterClientConfig {
        ClusterClientConfig {
            seeds,
            token: None,
            tls: None,
            connections: 2,
            timeout: Duration::from_secs(10),
            write_quorum: None,
            max_background_bytes: DEFAULT_MAX_BACKGROUND_BYTES,
        }
    }
}

/// Connections to the members, opened on first use.
struct Nodes {
    config: ClusterClientConfig,
    clients: Mutex<HashMap<String, Arc<Client>>>,
    background: Background,
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
        let nodes = Arc::new(Nodes { config: config.clone(), clients: Mutex::new(HashMap::new()), background: Background::default() });
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

    /// What the owner writes that outlived their PUT did so far.
    pub fn background_writes(&self) -> BackgroundWrites {
        let b = &self.nodes.background;
        BackgroundWrites {
            in_flight: b.in_flight.load(Ordering::Relaxed),
            in_flight_bytes: b.bytes.load(Ordering::Relaxed) as u64,
            completed: b.completed.load(Ordering::Relaxed),
            failed: b.failed.load(Ordering::Relaxed),
            failed_keys: b.failed_keys.load(Ordering::Relaxed),
            waited: b.waited.load(Ordering::Relaxed),
            copied_bytes: b.copied_bytes.load(Ordering::Relaxed),
        }
    }

    /// Stores each block on the key's owners; `Ok` once the write quorum of
    /// them stored it (the config's `write_quorum`, else the table's).
    /// Answered once every key is decided; owners that have not answered by
    /// then go on in the background (see the module's comment).
    pub async fn put(&self, entries: Vec<(Bytes, Bytes)>) -> Result<Vec<Result<(), KvError>>, KvError> {
        let table = self.table();
        let n = entries.len();
        let mut groups: HashMap<u32, Vec<usize>> = HashMap::new();
        let mut needed = vec![0usize; n];
        // Per key: owners asked that have not answered yet.
        let mut pending = vec![0usize; n];
        // The client's own setting wins; then the cluster's, from the table.
        let quorum = self.nodes.config.write_quorum.or(table.write_quorum().map(|w| w as usize));
        for (i, (key, _)) in entries.iter().enumerate() {
            let mut owners = 0;
            for o in table.writable_owners(key) {
                groups.entry(o).or_default().push(i);
                owners += 1;
            }
            pending[i] = owners;
            needed[i] = quorum.unwrap_or(owners).max(1);
        }
        let mut stored = vec![0usize; n];
        let mut errors: Vec<Option<KvError>> = vec![None; n];
        let mut calls = JoinSet::new();
        let mut outstanding: Vec<Option<OwnerWrite>> = Vec::with_capacity(groups.len());
        for (owner, indices) in groups {
            let endpoint = table.members()[owner as usize].endpoint.clone();
            let nodes = Arc::clone(&self.nodes);
            let bytes = indices.iter().map(|&i| entries[i].0.len() + entries[i].1.len()).sum();
            let keys: Vec<Bytes> = indices.iter().map(|&i| entries[i].0.clone()).collect();
            let batch = Arc::new(Mutex::new(Some(indices.iter().map(|&i| entries[i].clone()).collect::<Vec<_>>())));
            let slot = outstanding.len();
            outstanding.push(Some(OwnerWrite { endpoint: endpoint.clone(), bytes, keys, batch: Arc::clone(&batch) }));
            calls.spawn(async move {
                let result = match nodes.client(&endpoint).await {
                    Ok(c) => {
                        // Taken only now: until the connection is ready, a
                        // PUT that returns may swap in a copy of its own.
                        let batch = batch.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
                        c.put(batch).await
                    }
                    Err(e) => Err(e),
                };
                if result.is_err() {
                    nodes.forget(&endpoint);
                }
                (slot, indices, result)
            });
        }
        let decided = |i: usize, stored: &[usize], pending: &[usize]| stored[i] >= needed[i] || stored[i] + pending[i] < needed[i];
        let mut waiting = false;
        loop {
            if calls.is_empty() {
                break;
            }
            if !waiting && (0..n).all(|i| decided(i, &stored, &pending)) {
                match self.hand_off(calls, outstanding) {
                    Ok(()) => break,
                    Err((c, o)) => {
                        (calls, outstanding) = (c, o);
                        waiting = true;
                    }
                }
            }
            let Some(done) = calls.join_next().await else { break };
            let (slot, indices, result) = done.map_err(|e| KvError::Internal(format!("a PUT task failed: {e}")))?;
            outstanding[slot] = None;
            for &i in &indices {
                pending[i] -= 1;
            }
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

    /// Lets the owner writes still in `calls` finish in the background when
    /// their bytes fit under `max_background_bytes`; hands both back when
    /// they do not, and the PUT waits for them.
    fn hand_off(
        &self,
        mut calls: JoinSet<OwnerResult>,
        outstanding: Vec<Option<OwnerWrite>>,
    ) -> Result<(), (JoinSet<OwnerResult>, Vec<Option<OwnerWrite>>)> {
        let background = &self.nodes.background;
        let max = self.nodes.config.max_background_bytes;
        let bytes: usize = outstanding.iter().flatten().map(|o| o.bytes).sum();
        let reserved =
            background.bytes.fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| b.checked_add(bytes).filter(|&total| total <= max));
        if reserved.is_err() {
            background.waited.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                bytes,
                max_background_bytes = max,
                "cluster PUT: background writes at their bound; waiting for the slow owners"
            );
            return Err((calls, outstanding));
        }
        let mut outstanding = outstanding;
        let mut copied = 0usize;
        for o in outstanding.iter_mut().flatten() {
            // The caller's keys may be borrowed too: the log keeps copies.
            o.keys = o.keys.iter().map(|k| Bytes::copy_from_slice(k)).collect();
            let mut batch = o.batch.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(b) = batch.as_mut() {
                for (k, v) in b.iter_mut() {
                    copied += k.len() + v.len();
                    *k = Bytes::copy_from_slice(k);
                    *v = Bytes::copy_from_slice(v);
                }
            }
        }
        let writes = outstanding.iter().flatten().count() as u64;
        background.in_flight.fetch_add(writes, Ordering::Relaxed);
        background.copied_bytes.fetch_add(copied as u64, Ordering::Relaxed);
        tracing::debug!(writes, bytes, copied, "cluster PUT answered; its slow owners' writes go on in the background");
        let nodes = Arc::clone(&self.nodes);
        tokio::spawn(async move {
            let background = &nodes.background;
            let finish = |o: &OwnerWrite| {
                background.bytes.fetch_sub(o.bytes, Ordering::AcqRel);
                background.in_flight.fetch_sub(1, Ordering::Relaxed);
            };
            while let Some(done) = calls.join_next().await {
                let Ok((slot, _, result)) = done else {
                    // A panicked write: counted with the rest left below.
                    continue;
                };
                let Some(o) = outstanding[slot].take() else { continue };
                finish(&o);
                let failed: Vec<(usize, KvError)> = match result {
                    Ok(results) => results.into_iter().enumerate().filter_map(|(i, r)| r.err().map(|e| (i, e))).collect(),
                    Err(e) => (0..o.keys.len()).map(|i| (i, e.clone())).collect(),
                };
                if failed.is_empty() {
                    background.completed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                background.failed.fetch_add(1, Ordering::Relaxed);
                background.failed_keys.fetch_add(failed.len() as u64, Ordering::Relaxed);
                let (first, error) = &failed[0];
                tracing::warn!(
                    owner = %o.endpoint,
                    keys = failed.len(),
                    first_key = %String::from_utf8_lossy(&o.keys[*first]),
                    error = %error,
                    "cluster PUT: a background write to an owner failed after its PUT was answered; the owner lacks these keys"
                );
            }
            for o in outstanding.iter().flatten() {
                finish(o);
                background.failed.fetch_add(1, Ordering::Relaxed);
                background.failed_keys.fetch_add(o.keys.len() as u64, Ordering::Relaxed);
                tracing::warn!(owner = %o.endpoint, keys = o.keys.len(), "cluster PUT: a background write to an owner ended without an answer");
            }
        });
        Ok(())
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
        let mut parts: Vec<&mut [&mut [u8]]> = dests.iter_mut().map(std::slice::from_mut).collect();
        self.get_into_parts(keys, &mut parts).await
    }

    /// [`Client::get_into_parts`](crate::Client::get_into_parts) across the
    /// cluster, as [`get_into`](Self::get_into): each value fetched, then
    /// copied into its destination's parts.
    pub async fn get_into_parts(&self, keys: Vec<Bytes>, dests: &mut [&mut [&mut [u8]]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
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

/// What one owner's write answers: its slot in the PUT's list of owner
/// writes, the batch's indices of its keys, and its per-key results.
type OwnerResult = (usize, Vec<usize>, Result<Vec<Result<(), KvError>>, KvError>);

/// One owner's write of a PUT, while it has not answered.
struct OwnerWrite {
    endpoint: String,
    /// Keys' and values' bytes it carries.
    bytes: usize,
    /// Its keys, to name them if it fails in the background.
    keys: Vec<Bytes>,
    /// Its batch until its connection is ready (see the module's comment).
    batch: Arc<Mutex<Option<Batch>>>,
}

/// Keys and values of one owner's write.
type Batch = Vec<(Bytes, Bytes)>;

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
