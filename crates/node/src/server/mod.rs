//! The node's server: listeners, connections, admin port, shutdown.
//!
//! [`Node::start`] binds everything and returns at once (tests bind port 0
//! and read the real addresses back); [`Node::shutdown`] stops accepting,
//! lets every connection finish the request it is serving, and waits for
//! them up to a drain deadline.

pub mod config;
mod connection;
pub(crate) mod metrics;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kvplane_admin::{AdminServer, HealthCheck};
use kvplane_protocol::Limits;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::cache::{BlockCache, CacheConfig};
use crate::cluster::{ClusterNode, ClusterSetup, HandOff};
use crate::memory::{MemoryPool, PoolConfig};
use crate::rdma::{Rdma, WallClock};
use crate::tier::{SecondTier, TierSetup};
use metrics::Metrics;

/// Everything a node is started with. [`NodeConfig::default`] is the
/// embedded default the README's first command runs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// TCP address for clients (`None`: no TCP listener).
    pub listen: Option<SocketAddr>,
    /// Unix socket path for clients on the same host.
    pub unix: Option<PathBuf>,
    /// Address of `/metrics` and `/healthz` (`None`: no admin port).
    pub admin: Option<SocketAddr>,
    pub pool: PoolConfig,
    pub cache: CacheConfig,
    /// Bearer token every connection must present in its `Hello`.
    pub token: Option<String>,
    pub limits: Limits,
    /// Connections served at once; more are answered `unavailable` and closed.
    pub max_connections: usize,
    /// How long a new connection may take to send its `Hello`.
    pub handshake_timeout: Duration,
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
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 9600))),
            unix: None,
            admin: Some(SocketAddr::from(([127, 0, 0, 1], 9601))),
            pool: PoolConfig::default(),
            cache: CacheConfig::default(),
            token: None,
            limits: Limits::default(),
            max_connections: 1024,
            handshake_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(10),
            tier: None,
            cluster: None,
            shm_region_bytes: 64 << 20,
            shm_max_regions: 64,
        }
    }
}

/// What every connection shares.
pub(crate) struct NodeState {
    pub(crate) cache: BlockCache,
    pub(crate) metrics: Metrics,
    pub(crate) config: NodeConfig,
    pub(crate) tier: Option<SecondTier>,
    pub(crate) cluster: Option<ClusterNode>,
    /// Connections holding shared memory now.
    pub(crate) shm_regions: std::sync::atomic::AtomicUsize,
    /// Whether RDMA is offered (feature `rdma` and a device), and the leases
    /// on described blocks.
    pub(crate) rdma: Rdma,
    draining: AtomicBool,
}

impl NodeState {
    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub(crate) fn stats(&self) -> Vec<(String, u64)> {
        let mut out = self.metrics.snapshot(&self.cache.stats(), &self.cache.pool().stats());
        out.push(("rdma_leases".into(), self.rdma.leases.len() as u64));
        if let Some(tier) = &self.tier {
            out.extend(tier.stats());
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
        let pool = MemoryPool::new(config.pool.clone()).context("reserving the memory pool (--memory, or memory in the config file)")?;
        let cache = BlockCache::new(pool, config.cache.clone());
        let rdma = Rdma::start(&cache, WallClock::new(config.cache.clock.clone(), WallClock::system_unix_ms()));
        let (shutdown, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let tcp = match config.listen {
            Some(addr) => Some(TcpListener::bind(addr).await.with_context(|| format!("binding the client port {addr} (--listen)"))?),
            None => None,
        };
        let unix = match &config.unix {
            Some(path) => Some(bind_unix(path)?),
            None => None,
        };
        let tcp_addr = tcp.as_ref().map(TcpListener::local_addr).transpose()?;
        let unix_path = config.unix.clone();
        let admin_at = config.admin;
        let tier = config.tier.clone().map(|t| SecondTier::start(t, cache.pool().capacity_bytes()));
        // Registered once the listener is bound: the record names the port.
        let cluster = match config.cluster.clone() {
            Some(setup) => Some(ClusterNode::join(setup, tcp_addr).await.context("joining the cluster (cluster in the config file)")?),
            None => None,
        };
        let state = Arc::new(NodeState {
            cache,
            metrics: Metrics::default(),
            config,
            tier,
            cluster,
            shm_regions: Default::default(),
            rdma,
            draining: AtomicBool::new(false),
        });
        if state.rdma.offered() {
            tasks.spawn(sweep_leases(Arc::downgrade(&state), shutdown.subscribe()));
        }
        state.metrics.register(&mut registry, Arc::downgrade(&state));
        let admin = match admin_at {
            Some(addr) => {
                let weak = Arc::downgrade(&state);
                let health: HealthCheck = Arc::new(move || match weak.upgrade() {
                    Some(s) if !s.is_draining() => Ok(()),
                    _ => Err("draining".into()),
                });
                Some(AdminServer::start(addr, Arc::new(registry), health).await.context("starting the admin server (--admin)")?)
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
        tracing::info!(tcp = ?tcp_addr, unix = ?unix_path, admin = ?admin_addr, "node serving");
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
        let handed = cluster.hand_off(&self.state.cache, self.state.config.drain_timeout).await?;
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
        let mut drained = drained;
        if let Some(tier) = &self.state.tier {
            if !tier.drain(deadline).await {
                tracing::warn!(
                    ?deadline,
                    bytes = tier.in_flight_bytes(),
                    "drain deadline passed; blocks queued for the second tier are not written"
                );
                drained = false;
            }
        }
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

/// Binds a Unix socket, replacing a stale socket file left by a node that
/// died, but never a file that is not a socket.
fn bind_unix(path: &std::path::Path) -> anyhow::Result<UnixListener> {
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
    UnixListener::bind(path).with_context(|| format!("binding the unix socket {} (--unix)", path.display()))
}
