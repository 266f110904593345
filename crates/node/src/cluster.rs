//! Cluster mode: this node as a member of a pool of nodes.
//!
//! A node registers in etcd under a lease ([`kvplane_cluster::Membership`]),
//! follows the membership through a watch, and recomputes the slot table on
//! every change — with the key-placement plugin when one is declared, else
//! natively with the same ring. It serves that table to clients
//! (`CLUSTER_TABLE`), which route each key to its owners themselves: nodes
//! never forward requests, so a key costs one hop.
//!
//! Leaving is a hand-off: the node marks itself draining (the table then
//! gives its slots to the others), copies every block it holds to the key's
//! owners in that table, and only then revokes its lease. A node that dies
//! instead drops out when its lease expires; its keys survive on their other
//! owners when the pool keeps more than one copy.
//!
//! Repair keeps R copies through changes nobody announced: on every new
//! slot table each node sends every block it holds to the key's owners in
//! that table that were not owners in the last table it repaired to (a dead
//! member's slots gain an owner; a joiner's slots move to it), at a bounded
//! rate (`cluster.repairBytesPerSecond`), skipping blocks the owner already
//! has. A round with failed copies is retried until one succeeds, so a key
//! is not left with fewer copies because a target blinked.
//!
//! A node whose lease lapsed (etcd unreachable for longer than the TTL)
//! keeps its memory tier and registers again by itself once etcd answers
//! (see [`kvplane_cluster::Membership`]); until then it hands out no table
//! and its readiness probe fails, so neither clients nor Kubernetes route to
//! a member the others no longer count.
//!
//! A node that starts while etcd is unreachable does not refuse to start (on
//! Kubernetes that would crash-loop through the outage): it waits up to one
//! lease TTL for its first registration, then serves unregistered — what a
//! client asks it directly is answered from its memory tier, a client asking
//! for the table is told why there is none, and `/readyz` is 503 — while its
//! keeper keeps registering in the background (100 ms doubling up to
//! [`kvplane_cluster::Options::retry_max`], 2 s; failed attempts counted in
//! `cluster_registration_attempts_failed`). Once etcd takes the record, the
//! node reads the membership, computes its table and is ready by itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Endpoint};
use kvplane_cluster::{Membership, MembershipWatcher, Registration, RegistrationCounters, Router, Routing};
use kvplane_runtime::KeyPlacement;
use kvplane_slots::{Member, MemberState, SlotTable, SLOTS};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;

use crate::cache::BlockCache;
use crate::memory::Block;
use crate::server::NodeState;

/// How long a repair round that left copies undone waits before it tries
/// again against the same table (a target that was briefly unreachable).
const REPAIR_RETRY: Duration = Duration::from_secs(1);

/// How long a holder that is not a block's lead sender waits before it
/// checks that the new owner got the block (and sends it if not): long
/// enough for the lead's pass in the usual case, so each block crosses the
/// network about once.
const REPAIR_BACKUP_DELAY: Duration = Duration::from_secs(2);

/// What a node needs to join a cluster. Built by whoever read the config
/// (the `kvplane node` command).
#[derive(Clone)]
pub struct ClusterSetup {
    /// etcd client URLs (`http://host:port`).
    pub etcd: Vec<String>,
    /// Nodes with the same name (and etcd) form one cluster.
    pub name: String,
    /// This node's record; an empty `endpoint` is filled with the TCP
    /// address the node bound.
    pub member: Member,
    pub lease_ttl: Duration,
    /// Owners per key.
    pub replicas: u32,
    /// `cluster.writeQuorum`: owners that must store a PUT before a client
    /// acknowledges it; put into every table this node serves so that
    /// clients that set none write as the cluster was configured (`None`:
    /// the table states none and clients wait for every owner).
    pub write_quorum: Option<u32>,
    /// The key-placement plugin, if one is declared.
    pub placement: Option<Arc<KeyPlacement>>,
    /// Bearer token the node's peers require (for the hand-off). With a
    /// tenants file, the cluster token (`--cluster-token-file`): it puts
    /// the peer's connection in the cluster role, which takes the stored
    /// (scoped) keys as they are (see `crate::tenants`).
    pub token: Option<String>,
    /// Whether stored keys carry a tenant's tag (a tenants file): owners
    /// are then computed from the key without it, as the pool's clients
    /// hashed it. Set by the node from its own configuration.
    pub scoped_keys: bool,
    /// `cluster.repairBytesPerSecond`: what repair may send per second, so
    /// that healing after a membership change leaves room for clients.
    pub repair_bytes_per_second: u64,
    /// `cluster.etcd`: TLS to etcd and the etcd user, as [`etcd_security`]
    /// read them.
    pub etcd_security: EtcdSecurity,
    /// `cluster.peerTls`: TLS to the other members for hand-off and repair
    /// (`None`: plain, for a pool that serves no TLS).
    pub peer_tls: Option<kvplane_config::PeerTlsConfig>,
}

/// How the node reaches etcd (`cluster.etcd`), with the password read.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    pub tls: Option<kvplane_cluster::EtcdTls>,
    pub auth: Option<kvplane_cluster::EtcdAuth>,
}

impl std::fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // EtcdAuth's own Debug redacts the password.
        f.debug_struct("EtcdSecurity").field("tls", &self.tls).field("auth", &self.auth).finish()
    }
}

/// `cluster.etcd` as the cluster client takes it: the TLS files named (they
/// are read when the client is built, each error naming its file) and the
/// password read from `passwordFile`, whose trailing newline is not part of
/// it. A password file others can read draws a warning, as the token file
/// does: whoever reads it can rewrite the membership that routes clients.
pub fn etcd_security(etcd: Option<&kvplane_config::EtcdClientConfig>) -> anyhow::Result<EtcdSecurity> {
    let Some(etcd) = etcd else { return Ok(EtcdSecurity::default()) };
    let tls = etcd.tls.as_ref().map(|t| kvplane_cluster::EtcdTls {
        ca_file: t.ca_file.clone(),
        cert_file: t.cert_file.clone(),
        key_file: t.key_file.clone(),
    });
    let auth = match &etcd.auth {
        None => None,
        Some(a) => {
            use std::os::unix::fs::MetadataExt as _;
            let path = &a.password_file;
            let what = || format!("cluster.etcd.auth.passwordFile {}", path.display());
            let mode = std::fs::metadata(path).with_context(what)?.mode() & 0o777;
            if mode & 0o007 != 0 {
                tracing::warn!(file = %path.display(), mode = format!("{mode:04o}"), "the etcd password file is readable by others: chmod 600 it");
            }
            let password = std::fs::read_to_string(path).with_context(what)?.trim_end_matches(['\n', '\r']).to_string();
            if password.is_empty() {
                anyhow::bail!("{} is empty", what());
            }
            if tls.is_none() {
                tracing::warn!(user = a.username, "the etcd password is sent over plain HTTP: set cluster.etcd.tls");
            }
            Some(kvplane_cluster::EtcdAuth { username: a.username.clone(), password })
        }
    };
    Ok(EtcdSecurity { tls, auth })
}

impl std::fmt::Debug for ClusterSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSetup")
            .field("etcd", &self.etcd)
            .field("name", &self.name)
            .field("member", &self.member)
            .field("lease_ttl", &self.lease_ttl)
            .field("replicas", &self.replicas)
            .field("write_quorum", &self.write_quorum)
            .field("placement", &self.placement.as_ref().map(|p| p.plugin.decl().name.clone()))
            .field("repair_bytes_per_second", &self.repair_bytes_per_second)
            .field("etcd_security", &self.etcd_security)
            .field("peer_tls", &self.peer_tls)
            .finish()
    }
}

/// What a hand-off moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandOff {
    /// Blocks stored by at least one new owner.
    pub moved: u64,
    /// Blocks no new owner took (no owner left, or every owner refused).
    pub failed: u64,
}

/// A running member.
pub(crate) struct ClusterNode {
    id: String,
    /// The cluster's name, for the reasons this node gives.
    cluster: String,
    membership: Mutex<Option<Membership>>,
    registration: watch::Receiver<Registration>,
    counters: Arc<RegistrationCounters>,
    /// The slot table, followed from the first registration on (set once by
    /// `follower`); empty while the node never registered.
    routing: Arc<std::sync::OnceLock<Routing>>,
    /// `true` once `routing` is set, for whoever waits for it.
    routed: watch::Receiver<bool>,
    /// Starts following the membership once registered (see `follow`).
    follower: JoinHandle<()>,
    /// The bound of the pause between registration attempts.
    retry_max: Duration,
    token: Option<String>,
    /// See [`ClusterSetup::scoped_keys`].
    scoped_keys: bool,
    /// `cluster.peerTls`, read again for every peer client (see
    /// [`peer_tls`]).
    peer_tls: Option<kvplane_config::PeerTlsConfig>,
    repair_rate: u64,
    repair: RepairCounters,
}

/// The TLS a peer client speaks, built from `cluster.peerTls`'s files as
/// they are now: a hand-off or repair pass reads them again, so a client
/// certificate that cert-manager renewed in place is what peers see next,
/// with no restart. Errors name the field (and, through [`ClientTls`], the
/// file at fault).
///
/// [`ClientTls`]: kvplane_client::ClientTls
fn peer_tls(t: &kvplane_config::PeerTlsConfig) -> Result<kvplane_client::ClientTls, kvplane_protocol::KvError> {
    let client = t.cert_file.as_deref().zip(t.key_file.as_deref());
    kvplane_client::ClientTls::new(&t.ca_file, client, t.server_name.as_deref()).map_err(|e| match e {
        kvplane_protocol::KvError::Invalid(why) => kvplane_protocol::KvError::Invalid(format!("cluster.peerTls: {why}")),
        other => kvplane_protocol::KvError::Invalid(format!("cluster.peerTls: {other}")),
    })
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// How the slot table is computed from a membership: with the key-placement
/// plugin when one is declared, else natively with the same ring.
#[derive(Clone)]
struct TableRecipe {
    placement: Option<Arc<KeyPlacement>>,
    replicas: u32,
    write_quorum: Option<u32>,
}

impl TableRecipe {
    async fn compute(self, version: u64, members: Vec<Member>) -> Result<SlotTable, String> {
        let table = match self.placement {
            Some(p) => p.compute(version, members, SLOTS, self.replicas).await.map_err(|e| e.to_string()),
            None => kvplane_runtime::worlds::native_slot_table(version, members, SLOTS, self.replicas).map_err(|e| e.to_string()),
        };
        // The placement computes owners; the quorum is the node's setting,
        // the same on every node of a cluster.
        table.map(|t| t.with_write_quorum(self.write_quorum))
    }
}

/// Waits for the member's (first) registration, then starts following the
/// membership and computing tables, retrying with the registration's
/// backoff bound while etcd does not answer the first list (or the first
/// table cannot be computed). Sets `routing` once and says so on `routed`.
async fn follow(
    id: String,
    mut registration: watch::Receiver<Registration>,
    watcher: MembershipWatcher,
    recipe: TableRecipe,
    retry_max: Duration,
    routing: Arc<std::sync::OnceLock<Routing>>,
    routed: watch::Sender<bool>,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        if registration.wait_for(|r| *r == Registration::Registered).await.is_err() {
            return;
        }
        let followed = match watcher.start().await {
            Ok(members) => {
                let recipe = recipe.clone();
                Routing::follow(members, move |version, members| recipe.clone().compute(version, members)).await
            }
            Err(e) => Err(format!("following the cluster's membership: {e}")),
        };
        match followed {
            Ok(r) => {
                tracing::info!(id, version = r.current().version(), "joined the cluster");
                let _ = routing.set(r);
                routed.send_replace(true);
                return;
            }
            Err(e) => {
                tracing::warn!(id, "no slot table yet, trying again in {pause:?}: {e}");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(retry_max);
            }
        }
    }
}

/// Repair's progress, for STATS and `/metrics`.
#[derive(Default)]
struct RepairCounters {
    /// Rounds run (one per new table, plus retries).
    rounds: AtomicU64,
    /// Blocks a new owner stored.
    copied: AtomicU64,
    bytes: AtomicU64,
    /// Blocks the new owner already held (another old owner was faster).
    present: AtomicU64,
    /// Copies that did not happen (owner unreachable or refused): retried.
    failed: AtomicU64,
    /// Copies the running round has still to make.
    pending: AtomicU64,
    /// How long the last finished round took.
    last_round_ms: AtomicU64,
}

/// Spaces sends so that they average at most `rate` bytes per second from
/// the start of a round.
struct Pacer {
    rate: u64,
    started: tokio::time::Instant,
    sent: u64,
}

impl Pacer {
    fn new(rate: u64) -> Pacer {
        Pacer { rate: rate.max(1), started: tokio::time::Instant::now(), sent: 0 }
    }

    /// Waits until `bytes` more may be sent.
    async fn take(&mut self, bytes: u64) {
        let due = self.started + Duration::from_secs_f64(self.sent as f64 / self.rate as f64);
        tokio::time::sleep_until(due).await;
        self.sent += bytes;
    }
}

/// Follows the node's slot tables and repairs after each change (see the
/// module's doc) until shutdown or the node is gone. Rounds run one after
/// another: a table that arrives during a round is repaired to next.
pub(crate) async fn repair(state: Weak<NodeState>, mut shutdown: watch::Receiver<bool>) {
    // The first table: once the node registered and computed one.
    let mut routed = match state.upgrade() {
        Some(s) => match &s.cluster {
            Some(c) => c.routed.clone(),
            None => return,
        },
        None => return,
    };
    tokio::select! {
        r = routed.wait_for(|r| *r) => if r.is_err() { return },
        _ = shutdown.changed() => return,
    }
    let (mut tables, mut done) = match state.upgrade() {
        Some(s) => match s.cluster.as_ref().and_then(|c| c.routing.get()) {
            Some(routing) => {
                let mut tables = routing.subscribe();
                let first = Arc::clone(&tables.borrow_and_update());
                (tables, first)
            }
            None => return,
        },
        None => return,
    };
    let mut retry = false;
    loop {
        tokio::select! {
            changed = tables.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(REPAIR_RETRY), if retry => {}
            _ = shutdown.changed() => return,
        }
        let next = Arc::clone(&tables.borrow_and_update());
        if next.version() == done.version() {
            retry = false;
            continue;
        }
        let Some(s) = state.upgrade() else { return };
        let Some(cluster) = &s.cluster else { return };
        let round = cluster.repair_round(s.store.cache(), done.table(), next.table());
        let failed = tokio::select! {
            failed = round => failed,
            _ = shutdown.changed() => return,
        };
        retry = failed > 0;
        if !retry {
            done = next;
        }
    }
}

impl ClusterNode {
    /// Registers `setup.member` (its endpoint defaulting to `bound`) and
    /// computes the first table, waiting up to one lease TTL for etcd;
    /// past that the node goes on unregistered and registers in the
    /// background (see the module's doc). `Err` only for what no retry
    /// fixes: no address to advertise, a bad name or etcd endpoint.
    pub(crate) async fn join(mut setup: ClusterSetup, bound: Option<std::net::SocketAddr>) -> anyhow::Result<ClusterNode> {
        if setup.member.endpoint.is_empty() {
            let addr = bound.context("cluster mode needs a TCP listener (or cluster.advertise) for peers and clients to reach")?;
            setup.member.endpoint = if addr.ip().is_unspecified() {
                // Listening on every address: the pod's own is the one to tell.
                let ip = std::env::var("POD_IP")
                    .context("the node listens on an unspecified address; set cluster.advertise or POD_IP to the address peers reach")?;
                format!("{ip}:{}", addr.port())
            } else {
                addr.to_string()
            };
        }
        let id = setup.member.id.clone();
        if let Some(t) = &setup.peer_tls {
            // Read once here so that a missing or bad file stops the node
            // now, not at its first hand-off.
            peer_tls(t)?;
        }
        let options = kvplane_cluster::Options {
            tls: setup.etcd_security.tls.clone(),
            auth: setup.etcd_security.auth.clone(),
            ..kvplane_cluster::Options::default()
        };
        let retry_max = options.retry_max;
        let membership = Membership::start(&setup.etcd, &setup.name, setup.member, setup.lease_ttl, options)
            .with_context(|| format!("registering member {id} of cluster {} in etcd {:?}", setup.name, setup.etcd))?;
        let registration = membership.subscribe();
        let counters = membership.counters();
        let routing = Arc::new(std::sync::OnceLock::new());
        let (routed_tx, mut routed) = watch::channel(false);
        let recipe = TableRecipe { placement: setup.placement, replicas: setup.replicas, write_quorum: setup.write_quorum };
        let watcher = membership.watcher();
        let follower = tokio::spawn(follow(id.clone(), registration.clone(), watcher, recipe, retry_max, Arc::clone(&routing), routed_tx));
        let node = ClusterNode {
            id,
            cluster: setup.name,
            membership: Mutex::new(Some(membership)),
            registration,
            counters,
            routing,
            routed: routed.clone(),
            follower,
            retry_max,
            token: setup.token,
            scoped_keys: setup.scoped_keys,
            peer_tls: setup.peer_tls,
            repair_rate: setup.repair_bytes_per_second,
            repair: RepairCounters::default(),
        };
        // etcd answers within milliseconds when it is up: wait for it, so
        // that a node is ready when it says it serves. Not past one lease:
        // an outage must not keep the node from serving its memory tier.
        let wait = setup.lease_ttl.max(Duration::from_secs(1));
        if tokio::time::timeout(wait, routed.wait_for(|r| *r)).await.is_err() {
            let why = node.registered().err().unwrap_or_default();
            tracing::warn!(id = node.id, ?wait, "serving unregistered, registering in the background: {why}");
        }
        Ok(node)
    }

    /// The table this node serves; `None` until it first registered and
    /// read the membership.
    pub(crate) fn table(&self) -> Option<Arc<Router>> {
        self.routing.get().map(Routing::current)
    }

    /// The table once it is newer than `after`, or when `wait` passed (or
    /// `stop` fired), whichever is first. `Err` once this node lost its
    /// registration: its table no longer follows the cluster (it may be cut
    /// off from etcd), so a client must ask another member.
    pub(crate) async fn table_after(&self, after: u64, wait: Duration, stop: &mut watch::Receiver<bool>) -> Result<Arc<Router>, String> {
        let Some(routing) = self.routing.get() else {
            return Err(match &*self.registration.borrow() {
                Registration::Pending { reason } => format!("member {} is not registered in the cluster yet: {reason}", self.id),
                _ => format!("member {} has not read the cluster's membership yet", self.id),
            });
        };
        let mut tables = routing.subscribe();
        let mut registration = self.registration.clone();
        let lost = |r: &Registration| *r != Registration::Registered;
        let newer = tables.wait_for(|r| r.version() > after);
        tokio::select! {
            _ = newer => {}
            _ = registration.wait_for(lost) => {}
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => {}
        }
        match &*self.registration.borrow() {
            Registration::Lost { reason } => Err(format!("member {} is no longer registered in the cluster: {reason}", self.id)),
            Registration::Pending { reason } => Err(format!("member {} is not registered in the cluster yet: {reason}", self.id)),
            Registration::Registered => Ok(routing.current()),
        }
    }

    /// `Err` naming this member, its cluster and why while it is not
    /// registered (its lease lapsed and etcd has not taken it back yet):
    /// what the readiness probe answers.
    pub(crate) fn registered(&self) -> Result<(), String> {
        match &*self.registration.borrow() {
            Registration::Registered if self.routing.get().is_none() => {
                Err(format!("member {} of cluster {} is registered and has not read the membership yet", self.id, self.cluster))
            }
            Registration::Registered => Ok(()),
            Registration::Lost { reason } => {
                Err(format!("member {} is not registered in cluster {} (registering again): {reason}", self.id, self.cluster))
            }
            Registration::Pending { reason } => Err(format!(
                "member {} is not registered in cluster {} yet (registering in the background): {reason}",
                self.id, self.cluster
            )),
        }
    }

    /// The table's version and member count, 0 and 0 before the first.
    fn table_summary(&self) -> (u64, u64) {
        self.table().map_or((0, 0), |r| (r.version(), r.table().members().len() as u64))
    }

    /// The cluster's series on `/metrics` (read at scrape time, by the
    /// node's collector).
    pub(crate) fn encode_metrics(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let (version, members) = self.table_summary();
        let gauge = |e: &mut DescriptorEncoder, name: &str, help: &str, value: u64| {
            let metric = ConstGauge::<i64>::new(i64::try_from(value).unwrap_or(i64::MAX));
            metric.encode(e.encode_descriptor(name, help, None, metric.metric_type())?)
        };
        let counter = |e: &mut DescriptorEncoder, name: &str, help: &str, value: u64| {
            let metric = ConstCounter::new(value);
            metric.encode(e.encode_descriptor(name, help, None, metric.metric_type())?)
        };
        let registered = u64::from(self.registered().is_ok());
        gauge(e, "kvplane_cluster_registered", "1 while this node's record is in etcd under a live lease", registered)?;
        let lapses = self.counters.lapses();
        counter(e, "kvplane_cluster_registration_lapses", "Times this node's lease lapsed (etcd unreachable past its TTL)", lapses)?;
        let again = self.counters.reregistrations();
        counter(e, "kvplane_cluster_reregistrations", "Times this node registered again after a lapse", again)?;
        let failed = self.counters.failed_attempts();
        counter(
            e,
            "kvplane_cluster_registration_attempts_failed",
            "Attempts to register (at start, or again after a lapse) that etcd did not answer or refused",
            failed,
        )?;
        let retry_ms = self.retry_max.as_millis() as u64;
        gauge(e, "kvplane_cluster_registration_retry_max_ms", "Longest pause between attempts to register", retry_ms)?;
        gauge(e, "kvplane_cluster_table_version", "Version of the slot table this node serves (0: none yet)", version)?;
        gauge(e, "kvplane_cluster_members", "Members in that table", members)?;
        let r = &self.repair;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        gauge(e, "kvplane_cluster_repair_bytes_per_second", "cluster.repairBytesPerSecond: the bound on repair's sends", self.repair_rate)?;
        counter(e, "kvplane_cluster_repair_rounds", "Repair rounds run after membership changes (and their retries)", load(&r.rounds))?;
        counter(e, "kvplane_cluster_repair_blocks_copied", "Blocks repair copied to a key's new owner", load(&r.copied))?;
        counter(e, "kvplane_cluster_repair_bytes_copied", "Bytes repair copied to new owners", load(&r.bytes))?;
        counter(e, "kvplane_cluster_repair_blocks_present", "Blocks repair found their new owner already held", load(&r.present))?;
        counter(e, "kvplane_cluster_repair_copies_failed", "Copies repair could not make (retried)", load(&r.failed))?;
        gauge(e, "kvplane_cluster_repair_pending", "Copies the running repair round has still to make", load(&r.pending))?;
        gauge(e, "kvplane_cluster_repair_last_round_ms", "How long the last repair round took", load(&r.last_round_ms))
    }

    /// The cluster's counters, as a STATS answer lists them.
    pub(crate) fn stats(&self) -> Vec<(String, u64)> {
        let (version, members) = self.table_summary();
        vec![
            ("cluster_registered".to_string(), u64::from(self.registered().is_ok())),
            ("cluster_registration_lapses".into(), self.counters.lapses()),
            ("cluster_reregistrations".into(), self.counters.reregistrations()),
            ("cluster_registration_attempts_failed".into(), self.counters.failed_attempts()),
            ("cluster_registration_retry_max_ms".into(), self.retry_max.as_millis() as u64),
            ("cluster_table_version".into(), version),
            ("cluster_members".into(), members),
            ("cluster_repair_bytes_per_second".into(), self.repair_rate),
            ("cluster_repair_rounds".into(), self.repair.rounds.load(Ordering::Relaxed)),
            ("cluster_repair_blocks_copied".into(), self.repair.copied.load(Ordering::Relaxed)),
            ("cluster_repair_bytes_copied".into(), self.repair.bytes.load(Ordering::Relaxed)),
            ("cluster_repair_blocks_present".into(), self.repair.present.load(Ordering::Relaxed)),
            ("cluster_repair_copies_failed".into(), self.repair.failed.load(Ordering::Relaxed)),
            ("cluster_repair_pending".into(), self.repair.pending.load(Ordering::Relaxed)),
            ("cluster_repair_last_round_ms".into(), self.repair.last_round_ms.load(Ordering::Relaxed)),
        ]
    }

    /// Copies every block of `cache` to its key's owners in `next` that
    /// were not owners in `prev` (nor this node), at most
    /// `repair_bytes_per_second`: the owners `prev` already had hold it, or
    /// were repaired to by the round for `prev`. Answers the copies not made.
    async fn repair_round(&self, cache: &BlockCache, prev: &SlotTable, next: &SlotTable) -> u64 {
        let me = next.members().iter().find(|m| m.id == self.id);
        if me.is_none_or(|m| m.state != MemberState::Up) {
            // Draining (the hand-off copies everything) or not in the table.
            return 0;
        }
        let started = tokio::time::Instant::now();
        self.repair.rounds.fetch_add(1, Ordering::Relaxed);
        // Per new owner (by index in `next`): the blocks it lacks. A block
        // is sent first by one holder only, the first of its old owners
        // still up (`lead`); its other holders send theirs after
        // REPAIR_BACKUP_DELAY, skipping what the owner then has, so a key
        // the lead did not hold still arrives and the rest cost an EXISTS.
        let up = |id: &str| next.members().iter().any(|m| m.id == id && m.state == MemberState::Up);
        let mut lead: HashMap<u32, Vec<(Bytes, Block)>> = HashMap::new();
        let mut backup: HashMap<u32, Vec<(Bytes, Block)>> = HashMap::new();
        for (key, block) in cache.entries() {
            // Placed by the key the client hashed: without the tenant's tag.
            let placed = crate::tenants::placement_key(&key, self.scoped_keys);
            let had: Vec<&str> = prev.owner_members(placed).map(|m| m.id.as_str()).collect();
            let leads = had.iter().find(|id| up(id)).is_none_or(|id| *id == self.id);
            for &o in next.owners_of(placed) {
                let id = next.members()[o as usize].id.as_str();
                if id != self.id && !had.contains(&id) {
                    let list = if leads { &mut lead } else { &mut backup };
                    list.entry(o).or_default().push((key.clone(), block.clone()));
                }
            }
        }
        let planned: u64 = lead.values().chain(backup.values()).map(|v| v.len() as u64).sum();
        self.repair.pending.store(planned, Ordering::Relaxed);
        let mut pacer = Pacer::new(self.repair_rate);
        let mut failed = 0;
        for (pass, targets) in [lead, backup].into_iter().enumerate() {
            if pass == 1 && !targets.is_empty() {
                tokio::time::sleep(REPAIR_BACKUP_DELAY).await;
            }
            for (o, blocks) in targets {
                let member = &next.members()[o as usize];
                let undone = self.repair_to(member, &blocks, &mut pacer).await;
                if undone > 0 {
                    tracing::warn!(member = member.id, undone, of = blocks.len(), "repair: copies not made; retrying");
                }
                failed += undone;
            }
        }
        self.repair.pending.store(0, Ordering::Relaxed);
        let took = started.elapsed();
        self.repair.last_round_ms.store(took.as_millis() as u64, Ordering::Relaxed);
        if planned > 0 {
            tracing::info!(version = next.version, planned, failed, ?took, "repair round done");
        }
        failed
    }

    /// A one-connection client of another member, with the cluster's token
    /// and, on a pool that serves TLS, `cluster.peerTls` (what a hand-off
    /// and a repair send blocks through).
    async fn peer_client(&self, member: &Member) -> Result<Client, kvplane_protocol::KvError> {
        let mut config = ClientConfig::new(Endpoint::Tcp(member.endpoint.clone()));
        config.token.clone_from(&self.token);
        config.tls = self.peer_tls.as_ref().map(peer_tls).transpose()?;
        config.connections = 1;
        Client::connect(config).await
    }

    /// Sends `blocks` that `member` does not hold yet to it, in batches
    /// within its limits and the pace. Answers the copies not made.
    async fn repair_to(&self, member: &Member, blocks: &[(Bytes, Block)], pacer: &mut Pacer) -> u64 {
        let r = &self.repair;
        let fail = |n: usize| {
            r.failed.fetch_add(n as u64, Ordering::Relaxed);
            r.pending.fetch_sub(n as u64, Ordering::Relaxed);
            n as u64
        };
        let client = match self.peer_client(member).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(member = member.id, error = %e, "repair: new owner unreachable");
                return fail(blocks.len());
            }
        };
        let limits = client.limits();
        let max_keys = limits.max_batch_keys.max(1) as usize;
        // A batch is also one pace step: no larger than a second's worth.
        let max_bytes = (limits.max_frame_bytes as usize / 2).min(usize::try_from(self.repair_rate).unwrap_or(usize::MAX)).max(1);
        let mut undone = 0;
        let mut rest = blocks;
        while !rest.is_empty() {
            let mut n = 0;
            let mut bytes = 0;
            while n < rest.len() && n < max_keys && (n == 0 || bytes + rest[n].1.len() <= max_bytes) {
                bytes += rest[n].1.len();
                n += 1;
            }
            let (batch, after) = rest.split_at(n);
            rest = after;
            let held = match client.exists(batch.iter().map(|(k, _)| k.clone()).collect()).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(member = member.id, error = %e, "repair: EXISTS refused");
                    undone += fail(batch.len());
                    continue;
                }
            };
            let missing: Vec<&(Bytes, Block)> = batch.iter().zip(&held).filter(|(_, h)| !**h).map(|(b, _)| b).collect();
            let present = (batch.len() - missing.len()) as u64;
            r.present.fetch_add(present, Ordering::Relaxed);
            r.pending.fetch_sub(present, Ordering::Relaxed);
            if missing.is_empty() {
                continue;
            }
            let bytes: usize = missing.iter().map(|(_, b)| b.len()).sum();
            pacer.take(bytes as u64).await;
            let put: Vec<(Bytes, Bytes)> = missing.iter().map(|(k, b)| (k.clone(), b.clone().into_bytes())).collect();
            match client.put(put).await {
                Ok(results) => {
                    for ((_, b), res) in missing.iter().zip(results) {
                        match res {
                            Ok(()) => {
                                r.copied.fetch_add(1, Ordering::Relaxed);
                                r.bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
                                r.pending.fetch_sub(1, Ordering::Relaxed);
                            }
                            Err(_) => undone += fail(1),
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(member = member.id, error = %e, "repair: a batch was refused");
                    undone += fail(missing.len());
                }
            }
        }
        undone
    }

    /// Marks this node draining, waits for the table without it, copies
    /// every block of `cache` to the key's owners there, and leaves.
    pub(crate) async fn hand_off(&self, cache: &BlockCache, deadline: Duration) -> anyhow::Result<HandOff> {
        let started = tokio::time::Instant::now();
        let others = self.table().is_some_and(|t| t.table().members().iter().any(|m| m.id != self.id && m.state.may_own()));
        if !others {
            // The last member (or one that never registered): no table can
            // exist without it, and there is nobody to hand blocks to (a
            // second tier keeps what it took).
            tracing::info!("no other member to hand blocks to");
            if let Some(m) = self.membership.lock().await.take() {
                m.leave().await.context("leaving the cluster")?;
            }
            return Ok(HandOff { moved: 0, failed: cache.stats().entries });
        }
        {
            let membership = self.membership.lock().await;
            let m = membership.as_ref().context("this node already left the cluster")?;
            m.set_state(MemberState::Draining).await.context("announcing that this node drains")?;
        }
        let mut tables = self.routing.get().context("no slot table")?.subscribe();
        let id = self.id.clone();
        let drained = tables.wait_for(move |r| r.table().members().iter().any(|m| m.id == id && m.state != MemberState::Up));
        let router = match tokio::time::timeout(deadline, drained).await {
            Ok(Ok(r)) => Arc::clone(&r),
            _ => anyhow::bail!("no slot table without this node within {deadline:?}"),
        };
        let left = deadline.saturating_sub(started.elapsed());
        let moved = tokio::time::timeout(left, self.copy_out(cache, router.table())).await.unwrap_or_else(|_| {
            tracing::warn!(?deadline, "hand-off deadline passed");
            HandOff { moved: 0, failed: cache.stats().entries }
        });
        if let Some(m) = self.membership.lock().await.take() {
            m.leave().await.context("leaving the cluster")?;
        }
        Ok(moved)
    }

    /// PUTs every block to each of its owners in `table` other than this
    /// node, one batch per owner at a time.
    async fn copy_out(&self, cache: &BlockCache, table: &SlotTable) -> HandOff {
        let entries = cache.entries();
        // Per owner: indices of the entries it should receive.
        let mut per_owner: Vec<Vec<usize>> = vec![Vec::new(); table.members().len()];
        for (i, (key, _)) in entries.iter().enumerate() {
            // Placed by the key the client hashed: without the tenant's tag.
            for &o in table.owners_of(crate::tenants::placement_key(key, self.scoped_keys)) {
                if table.members()[o as usize].id != self.id {
                    per_owner[o as usize].push(i);
                }
            }
        }
        let mut stored = vec![false; entries.len()];
        for (o, indices) in per_owner.iter().enumerate() {
            if indices.is_empty() {
                continue;
            }
            let member = &table.members()[o];
            let client = match self.peer_client(member).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(member = member.id, error = %e, "hand-off: owner unreachable");
                    continue;
                }
            };
            let limits = client.limits();
            let max_keys = limits.max_batch_keys.max(1) as usize;
            let max_bytes = (limits.max_frame_bytes as usize / 2).max(1);
            let mut batch: Vec<usize> = Vec::new();
            let mut bytes = 0usize;
            for (n, &i) in indices.iter().enumerate() {
                batch.push(i);
                bytes += entries[i].1.len();
                let last = n + 1 == indices.len();
                let next_too_big = !last && bytes + entries[indices[n + 1]].1.len() > max_bytes;
                if last || batch.len() == max_keys || next_too_big {
                    let put: Vec<(Bytes, Bytes)> =
                        batch.iter().map(|&i| (entries[i].0.clone(), entries[i].1.clone().into_bytes())).collect();
                    match client.put(put).await {
                        Ok(results) => {
                            for (&i, r) in batch.iter().zip(results) {
                                stored[i] |= r.is_ok();
                            }
                        }
                        Err(e) => tracing::warn!(member = member.id, error = %e, "hand-off: a batch was refused"),
                    }
                    batch.clear();
                    bytes = 0;
                }
            }
        }
        let moved = stored.iter().filter(|s| **s).count() as u64;
        HandOff { moved, failed: entries.len() as u64 - moved }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_pacer_holds_sends_to_its_rate() {
        // 10 000 B/s: the first 2 000 go at once, the next two wait for
        // 0.2 s each.
        let mut pacer = Pacer::new(10_000);
        let started = tokio::time::Instant::now();
        for _ in 0..3 {
            pacer.take(2_000).await;
        }
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(400) && took < Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn the_etcd_section_becomes_the_cluster_clients_tls_and_user() {
        let dir = tempfile::tempdir().unwrap();
        let password = dir.path().join("password");
        std::fs::write(&password, "s3cret\n").unwrap();
        let tls =
            kvplane_config::EtcdTlsConfig { ca_file: "/ca.pem".into(), cert_file: Some("/c.crt".into()), key_file: Some("/c.key".into()) };
        let auth = kvplane_config::EtcdAuthConfig { username: "kvplane".into(), password_file: password.clone() };
        let config = kvplane_config::EtcdClientConfig { tls: Some(tls), auth: Some(auth) };
        let security = etcd_security(Some(&config)).unwrap();
        let t = security.tls.as_ref().unwrap();
        assert_eq!(
            (t.ca_file.to_str(), t.cert_file.as_deref(), t.key_file.as_deref()),
            (Some("/ca.pem"), Some("/c.crt".as_ref()), Some("/c.key".as_ref()))
        );
        assert_eq!(security.auth.as_ref().map(|a| (a.username.as_str(), a.password.as_str())), Some(("kvplane", "s3cret")));
        assert!(!format!("{security:?}").contains("s3cret"));
        std::fs::write(&password, "\n").unwrap();
        let e = etcd_security(Some(&config)).unwrap_err().to_string();
        assert!(e.contains("cluster.etcd.auth.passwordFile") && e.contains("is empty"), "{e}");
        std::fs::remove_file(&password).unwrap();
        let e = format!("{:#}", etcd_security(Some(&config)).unwrap_err());
        assert!(e.contains("cluster.etcd.auth.passwordFile") && e.contains("No such file"), "{e}");
        assert!(etcd_security(None).unwrap().tls.is_none());
    }
}
