//! The node's server: listeners, connections, admin port, shutdown.
//!
//! [`Node::start`] binds everything and returns at once (tests bind port 0
//! and read the real addresses back); [`Node::shutdown`] stops accepting,
//! lets every connection finish the request it is serving, and waits for
//! them up to a drain deadline.

mod admission;
pub mod config;
mod connection;
mod descriptors;
pub(crate) mod metrics;
mod receive;
mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kvplane_admin::{AdminLimits, AdminMetrics, AdminServer, HealthCheck};
use kvplane_protocol::Limits;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::cache::{BlockCache, CacheConfig};
use crate::cluster::{ClusterNode, ClusterSetup, HandOff};
use crate::memory::{MemoryPool, PoolConfig};
use crate::rdma::{Rdma, WallClock};
use crate::store::Store;
use crate::tier::TierSetup;
use admission::{HandshakeThrottle, PeerSlots};
use metrics::Metrics;
use receive::{FrameClock, ReceiveBudget};

/// Everything a node is started with. [`NodeConfig::default`] is the
/// embedded default the README's first command runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// TCP address for clients (`None`: no TCP listener).
    pub listen: Option<SocketAddr>,
    /// Unix socket path for clients on the same host. The socket is created
    /// mode 0660: its owner (the node's user) and [`NodeConfig::unix_group`]
    /// may connect, nobody else, whatever the umask.
    pub unix: Option<PathBuf>,
    /// The group given the Unix socket (`None`: the node's own group), so
    /// engine processes of another user reach it by being in that group.
    pub unix_group: Option<u32>,
    /// Address of `/metrics`, `/livez` and `/readyz` (`None`: no admin port).
    pub admin: Option<SocketAddr>,
    /// Connections the admin port serves at once (and its timeouts).
    pub admin_limits: AdminLimits,
    pub pool: PoolConfig,
    pub cache: CacheConfig,
    /// Bearer token every connection must present in its `Hello`. With
    /// [`NodeConfig::tenants`], the tenant `default` instead (its
    /// `default_token`), and this is unused.
    pub token: Option<String>,
    /// A tenants file: every connection authenticates into a tenant, sees
    /// its keys only and is held to its quotas (see `crate::tenants`).
    pub tenants: Option<crate::tenants::TenantsConfig>,
    /// TLS on the TCP port (`None`: plaintext); the Unix socket never
    /// speaks it (see `tls.rs`).
    pub tls: Option<kvplane_config::TlsConfig>,
    pub limits: Limits,
    /// Connections served at once; more are answered `unavailable` and closed.
    pub max_connections: usize,
    /// Connections one peer may hold at once (TCP clients by IP address,
    /// Unix-socket clients by uid); `None`: a quarter of `max_connections`.
    pub max_connections_per_peer: Option<usize>,
    /// How long a new connection may take to complete its TLS handshake
    /// (with TLS) and send its `Hello`, together.
    pub handshake_timeout: Duration,
    /// Failed handshakes one peer may make in a minute before its new
    /// connections are refused for the rest of that minute.
    pub max_handshake_failures: u32,
    /// How long an authenticated connection may stay silent before the node
    /// announces it closes it. A CLUSTER_TABLE wait counts as activity (the
    /// connection is answering it).
    pub idle_timeout: Duration,
    /// How long any frame may take to arrive once its header began, besides
    /// its length at `min_receive_rate`.
    pub frame_grace: Duration,
    /// Bytes per second a frame must average after `frame_grace`.
    pub min_receive_rate: u64,
    /// Bytes held at once, node-wide, for frames still arriving (metas
    /// buffered and PUT blocks allocated before their bytes are in); `None`:
    /// a quarter of the pool, and at least one longest meta plus one
    /// largest block. See `receive.rs`.
    pub receive_budget: Option<usize>,
    /// Most of the receive budget one peer may hold; `None`: a quarter of
    /// it, and at least one longest meta plus one largest block.
    pub receive_budget_per_peer: Option<usize>,
    /// How long one answer may take to write: a client that stops reading is
    /// disconnected after this, releasing the blocks its answer holds.
    pub write_timeout: Duration,
    /// How long shutdown waits for connections to finish their request
    /// (and then for the second tier to take the blocks queued for it).
    pub drain_timeout: Duration,
    /// The second tier (a backend plugin), if any.
    pub tier: Option<TierSetup>,
    /// Cluster mode, if any.
    pub cluster: Option<ClusterSetup>,
    /// Bytes of memory shared with each local client that asks (Unix-socket
    /// connections; 0: none).
    pub shm_region_bytes: usize,
    /// Connections with shared memory at once; later ones use the socket.
    /// With `shm_region_bytes`, it bounds what clients can make the node map.
    pub shm_max_regions: usize,
    /// Sockets the declared plugins may open together (each plugin's
    /// connections per instance times its instances), for the descriptor
    /// budget.
    pub plugin_sockets: usize,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 9600))),
            unix: None,
            unix_group: None,
            admin: Some(SocketAddr::from(([127, 0, 0, 1], 9601))),
            admin_limits: AdminLimits::default(),
            pool: PoolConfig::default(),
            cache: CacheConfig::default(),
            token: None,
            tenants: None,
            tls: None,
            limits: Limits::default(),
            max_connections: 1024,
            max_connections_per_peer: None,
            handshake_timeout: Duration::from_secs(10),
            max_handshake_failures: 20,
            idle_timeout: Duration::from_secs(120),
            frame_grace: Duration::from_secs(10),
            min_receive_rate: 1 << 20,
            receive_budget: None,
            receive_budget_per_peer: None,
            write_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(10),
            tier: None,
            cluster: None,
            shm_region_bytes: 64 << 20,
            shm_max_regions: 64,
            plugin_sockets: 0,
        }
    }
}

impl NodeConfig {
    /// One peer's share of the connections.
    pub fn connections_per_peer(&self) -> usize {
        self.max_connections_per_peer.unwrap_or(self.max_connections / 4).max(1)
    }

    /// What one connection may hold of the receive budget at once: the
    /// longest legal meta and the largest block.
    pub fn connection_receive_bytes(&self) -> usize {
        let meta = usize::try_from(self.limits.max_request_meta_bytes()).unwrap_or(usize::MAX);
        meta.saturating_add(self.pool.max_block_bytes)
    }

    /// The receive budget in force.
    pub fn receive_budget_bytes(&self) -> usize {
        self.receive_budget.unwrap_or_else(|| (self.pool.capacity_bytes / 4).max(self.connection_receive_bytes()))
    }

    /// One peer's share of the receive budget in force.
    pub fn receive_budget_per_peer_bytes(&self) -> usize {
        self.receive_budget_per_peer.unwrap_or_else(|| (self.receive_budget_bytes() / 4).max(self.connection_receive_bytes()))
    }

    /// Refuses bounds that cannot work together, naming the flags.
    fn check(&self) -> anyhow::Result<()> {
        let (budget, one) = (self.receive_budget_bytes(), self.connection_receive_bytes());
        if budget < one {
            anyhow::bail!(
                "--receive-budget {budget} bytes cannot hold one connection's longest meta and largest block together \
                 ({one} bytes, from --max-block and the batch and key limits)"
            );
        }
        let share = self.receive_budget_per_peer_bytes();
        if share < one || share > budget {
            anyhow::bail!(
                "--receive-budget-per-peer {share} bytes must hold one connection's longest meta and largest block ({one} bytes) \
                 and fit in --receive-budget ({budget} bytes)"
            );
        }
        if self.cluster.is_some() && self.idle_timeout <= Duration::from_millis(u64::from(kvplane_protocol::MAX_CLUSTER_WAIT_MS)) {
            anyhow::bail!(
                "--idle-timeout {:?} must be longer than the longest CLUSTER_TABLE wait ({} ms) on a cluster node",
                self.idle_timeout,
                kvplane_protocol::MAX_CLUSTER_WAIT_MS
            );
        }
        if let Some(c) = &self.cluster {
            // Members hand blocks off and repair through peer clients
            // (cluster.rs, peer_client): a member's TLS port refuses a plain
            // one, and keys would go unreplicated without a word.
            match (&self.tls, &c.peer_tls) {
                (Some(_), None) => anyhow::bail!(
                    "cluster mode with --tls-cert needs cluster.peerTls (in --config: caFile, the CA the members' \
                     certificates chain to): members copy blocks to each other (hand-off, repair) and a TLS port refuses a \
                     plain client"
                ),
                (None, Some(_)) => anyhow::bail!(
                    "cluster.peerTls is set but this node serves no TLS: give --tls-cert (members of one pool serve alike), \
                     or leave cluster.peerTls out"
                ),
                (Some(tls), Some(peer)) if tls.client_ca_file.is_some() && peer.cert_file.is_none() => anyhow::bail!(
                    "--tls-client-ca asks every client for a certificate, peers included: give cluster.peerTls.certFile and \
                     keyFile (the node's own certificate serves, with the client-auth usage)"
                ),
                _ => {}
            }
        }
        if self.min_receive_rate == 0 || self.idle_timeout.is_zero() {
            anyhow::bail!("--min-receive-rate and --idle-timeout must be above 0");
        }
        Ok(())
    }
}

/// What every connection shares.
pub(crate) struct NodeState {
    /// The memory tier and the second tier behind it (see `store.rs`).
    pub(crate) store: Store,
    pub(crate) metrics: Metrics,
    pub(crate) config: NodeConfig,
    pub(crate) cluster: Option<ClusterNode>,
    /// Connections holding shared memory now.
    pub(crate) shm_regions: std::sync::atomic::AtomicUsize,
    /// Whether RDMA is offered (feature `rdma` and a device), and the leases
    /// on described blocks.
    pub(crate) rdma: Rdma,
    /// Connections per peer (see `admission.rs`).
    pub(crate) peer_slots: Arc<PeerSlots>,
    /// Peers refused for failing handshakes.
    pub(crate) throttle: HandshakeThrottle,
    /// Bytes held for frames still arriving (see `receive.rs`).
    pub(crate) receive_budget: ReceiveBudget,
    pub(crate) frame_clock: FrameClock,
    /// The TCP port's TLS, with its certificate as last (re)loaded.
    pub(crate) tls: Option<Arc<tls::TlsServer>>,
    /// The tenants, as last (re)loaded; `None` without a tenants file.
    pub(crate) tenants: Option<Arc<crate::tenants::Tenants>>,
    draining: AtomicBool,
}

impl NodeState {
    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub(crate) fn stats(&self) -> Vec<(String, u64)> {
        let cache = self.store.cache();
        let mut out = self.metrics.snapshot(&cache.stats(), &cache.pool().stats());
        out.push(("rdma_leases".into(), self.rdma.leases.len() as u64));
        out.push(("max_block_bytes".into(), self.store.max_block_bytes() as u64));
        out.push(("receive_budget_bytes".into(), self.receive_budget.bytes() as u64));
        out.push(("receive_budget_used_bytes".into(), self.receive_budget.used_bytes() as u64));
        out.push(("receive_budget_per_peer_bytes".into(), self.receive_budget.per_peer_bytes() as u64));
        out.push(("receive_budget_waits".into(), self.receive_budget.waits.load(std::sync::atomic::Ordering::Relaxed)));
        out.extend(self.store.stats());
        if let Some(tls) = &self.tls {
            out.extend(tls.stats());
        }
        if let Some(tenants) = &self.tenants {
            out.extend(tenants.stats());
        }
        if let Some(cluster) = &self.cluster {
            out.extend(cluster.stats());
        }
        out
    }
}

/// A running node.
pub struct Node {
    state: Arc<NodeState>,
    tcp_addr: Option<SocketAddr>,
    admin: Option<AdminServer>,
    unix_path: Option<PathBuf>,
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Node {
    /// Reserves memory, binds every listener and starts serving.
    pub async fn start(config: NodeConfig) -> anyhow::Result<Node> {
        Self::start_with_registry(config, Registry::default()).await
    }

    /// As [`Node::start`], serving on `/metrics` whatever `registry` already
    /// holds (the plugin runtime's series) next to the node's own.
    pub async fn start_with_registry(config: NodeConfig, mut registry: Registry) -> anyhow::Result<Node> {
        config.check()?;
        descriptors::settle(descriptors::DescriptorNeed::of(&config))?;
        // The certificate before anything is bound: a node asked for TLS
        // that cannot serve it does not start.
        let tls = config.tls.clone().map(tls::TlsServer::load).transpose()?.map(Arc::new);
        // The tenants file too: a node asked for tenants serves none
        // without them.
        let tenants = config.tenants.clone().map(crate::tenants::Tenants::load).transpose()?.map(Arc::new);
        let pool = MemoryPool::new(config.pool.clone()).context("reserving the memory pool (--memory, or memory in the config file)")?;
        let cache_config = CacheConfig { tenants: tenants.as_ref().map(|t| Arc::clone(t.accounts())), ..config.cache.clone() };
        let cache = BlockCache::new(pool, cache_config);
        let rdma = Rdma::start(&cache, WallClock::new(config.cache.clock.clone(), WallClock::system_unix_ms()));
        let (shutdown, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let tcp = match config.listen {
            Some(addr) => Some(TcpListener::bind(addr).await.with_context(|| format!("binding the client port {addr} (--listen)"))?),
            None => None,
        };
        let unix = match &config.unix {
            Some(path) => Some(bind_unix(path, config.unix_group)?),
            None => None,
        };
        let tcp_addr = tcp.as_ref().map(TcpListener::local_addr).transpose()?;
        let unix_path = config.unix.clone();
        let admin_at = config.admin;
        // Registered once the listener is bound: the record names the port.
        let cluster = match config.cluster.clone() {
            Some(setup) => {
                // With tenants, stored keys carry a tag that placement skips.
                let setup = ClusterSetup { scoped_keys: config.tenants.is_some(), ..setup };
                Some(ClusterNode::join(setup, tcp_addr).await.context("joining the cluster (cluster in the config file)")?)
            }
            None => None,
        };
        let state = Arc::new(NodeState {
            store: Store::start(cache, config.tier.clone()),
            metrics: Metrics::default(),
            peer_slots: PeerSlots::new(config.connections_per_peer()),
            throttle: HandshakeThrottle::new(config.max_handshake_failures),
            receive_budget: ReceiveBudget::new(config.receive_budget_bytes(), config.receive_budget_per_peer_bytes()),
            frame_clock: FrameClock { grace: config.frame_grace, min_rate: config.min_receive_rate },
            tls,
            tenants,
            config,
            cluster,
            shm_regions: Default::default(),
            rdma,
            draining: AtomicBool::new(false),
        });
        if state.rdma.offered() {
            tasks.spawn(sweep_leases(Arc::downgrade(&state), shutdown.subscribe()));
        }
        if let Some(tls) = &state.tls {
            tasks.spawn(Arc::clone(tls).watch(shutdown.subscribe()));
        }
        if let Some(tenants) = &state.tenants {
            tasks.spawn(Arc::clone(tenants).watch(shutdown.subscribe()));
            registry.register_collector(Box::new(crate::tenants::Collector(Arc::downgrade(tenants))));
        }
        if state.cluster.is_some() {
            tasks.spawn(crate::cluster::repair(Arc::downgrade(&state), shutdown.subscribe()));
        }
        state.metrics.register(&mut registry, Arc::downgrade(&state));
        let admin = match admin_at {
            Some(addr) => {
                // Readiness (`/readyz`): not while draining, nor while out
                // of the cluster (a lapsed lease, registering again), when
                // clients could get no table from this node.
                let weak = Arc::downgrade(&state);
                let health: HealthCheck = Arc::new(move || match weak.upgrade() {
                    Some(s) if !s.is_draining() => {
                        s.cluster.as_ref().map_or(Ok(()), ClusterNode::registered)?;
                        s.store.ready()
                    }
                    _ => Err("draining".into()),
                });
                let metrics = AdminMetrics::register(&mut registry);
                let limits = state.config.admin_limits;
                Some(
                    AdminServer::start_with(addr, Arc::new(registry), health, limits, metrics)
                        .await
                        .context("starting the admin server (--admin)")?,
                )
            }
            None => None,
        };
        let admin_addr = admin.as_ref().map(AdminServer::addr);
        let slots = Arc::new(Semaphore::new(state.config.max_connections));
        if let Some(l) = tcp {
            tasks.spawn(connection::accept_tcp(l, Arc::clone(&state), Arc::clone(&slots), shutdown.subscribe()));
        }
        if let Some(l) = unix {
            tasks.spawn(connection::accept_unix(l, Arc::clone(&state), Arc::clone(&slots), shutdown.subscribe()));
        }
        tracing::info!(tcp = ?tcp_addr, tls = state.tls.is_some(), unix = ?unix_path, admin = ?admin_addr, "node serving");
        Ok(Node { state, tcp_addr, admin, unix_path, shutdown, tasks })
    }

    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(AdminServer::addr)
    }

    pub fn unix_path(&self) -> Option<&std::path::Path> {
        self.unix_path.as_deref()
    }

    /// The node's counters (what a STATS request answers).
    pub fn stats(&self) -> Vec<(String, u64)> {
        self.state.stats()
    }

    /// Leaves the cluster by handing every block on to the owners of its
    /// key in the table without this node (which keeps serving meanwhile),
    /// then revoking its registration. Call before [`Node::shutdown`].
    pub async fn hand_off(&self) -> anyhow::Result<HandOff> {
        let cluster = self.state.cluster.as_ref().context("this node is not in a cluster")?;
        let handed = cluster.hand_off(self.state.store.cache(), self.state.config.drain_timeout).await?;
        tracing::info!(moved = handed.moved, failed = handed.failed, "handed blocks on");
        Ok(handed)
    }

    /// Stops accepting, lets in-flight requests finish and closes. Returns
    /// false when the drain deadline passed with connections still busy.
    pub async fn shutdown(mut self) -> bool {
        self.state.draining.store(true, Ordering::Release);
        let _ = self.shutdown.send(true);
        let deadline = self.state.config.drain_timeout;
        let drained = tokio::time::timeout(deadline, async { while self.tasks.join_next().await.is_some() {} }).await.is_ok();
        if !drained {
            tracing::warn!(?deadline, "drain deadline passed; closing the remaining connections");
            self.tasks.abort_all();
        }
        let drained = self.state.store.drain(deadline).await && drained;
        if let Some(path) = &self.unix_path {
            let _ = std::fs::remove_file(path);
        }
        if let Some(admin) = self.admin.take() {
            admin.stop().await;
        }
        drained
    }
}

/// Lets go of ended RDMA leases (and so of their blocks) as they end, at
/// least every second, until shutdown or the node is gone.
async fn sweep_leases(state: std::sync::Weak<NodeState>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let wait = match state.upgrade() {
            Some(s) => {
                s.rdma.leases.sweep();
                s.rdma.leases.next_sweep_in().max(Duration::from_millis(1))
            }
            None => return,
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// The mode of the Unix socket: read and write (connect) for its owner and
/// its group, nothing for others.
const UNIX_SOCKET_MODE: u32 = 0o660;

/// Binds a Unix socket, replacing a stale socket file left by a node that
/// died, but never a file that is not a socket; then gives it
/// [`UNIX_SOCKET_MODE`] and `group`.
///
/// So that the socket is never reachable with a looser mode, whatever the
/// umask, it is bound inside a new directory of mode 0700 beside `path`,
/// given its mode and group there, and then renamed into place (a rename
/// keeps the bound socket; the directory is removed). Changing the umask
/// instead would change it for every thread of the process.
fn bind_unix(path: &std::path::Path, group: Option<u32>) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            anyhow::bail!("{} exists and is not a socket; refusing to replace it (--unix)", path.display());
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("{} is in use by a running process (--unix)", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    let name = path.file_name().with_context(|| format!("{} names no file (--unix)", path.display()))?;
    let staging = parent.join(format!(".{}.binding-{}", name.to_string_lossy(), std::process::id()));
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&staging)
        .with_context(|| format!("creating {} to bind the unix socket in (--unix)", staging.display()))?;
    let bound = bind_private(&staging.join("s"), path, group);
    let _ = std::fs::remove_dir(&staging);
    bound
}

/// [`bind_unix`]'s steps inside its private directory: bind at `inner`,
/// set the mode and group, rename to `path`.
fn bind_private(inner: &std::path::Path, path: &std::path::Path, group: Option<u32>) -> anyhow::Result<UnixListener> {
    let listener = UnixListener::bind(inner).with_context(|| format!("binding the unix socket {} (--unix)", path.display()))?;
    let ready = (|| {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(inner, std::fs::Permissions::from_mode(UNIX_SOCKET_MODE))
            .with_context(|| format!("setting mode {UNIX_SOCKET_MODE:o} on the unix socket {} (--unix)", path.display()))?;
        if let Some(gid) = group {
            std::os::unix::fs::chown(inner, None, Some(gid)).with_context(|| {
                format!("giving the unix socket {} to group {gid} (--unix-group: the node's user must be a member of it)", path.display())
            })?;
        }
        std::fs::rename(inner, path).with_context(|| format!("moving the unix socket into place at {} (--unix)", path.display()))
    })();
    if ready.is_err() {
        let _ = std::fs::remove_file(inner);
    }
    ready.map(|()| listener)
}
