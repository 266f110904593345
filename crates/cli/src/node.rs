//! `kvplane node`: the main job.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use kvplane_node::cache::{CacheConfig, EvictionPolicy};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use prometheus_client::registry::Registry;

use super::size::parse_size;

#[derive(Args)]
pub(crate) struct NodeArgs {
    /// TCP address for clients ("none" to disable).
    #[arg(long, default_value = "127.0.0.1:9600")]
    listen: String,
    /// Unix socket path for clients on this host. It is created mode 0660:
    /// the node's user and --unix-group may connect, nobody else.
    #[arg(long)]
    unix: Option<PathBuf>,
    /// The group (a name in /etc/group, or a number) given the --unix
    /// socket, so engines running as another user connect by being in it.
    /// Default: the node's own group.
    #[arg(long, requires = "unix", value_parser = parse_group)]
    unix_group: Option<u32>,
    /// Address of /metrics and /healthz ("none" to disable).
    #[arg(long, default_value = "127.0.0.1:9601")]
    admin: String,
    /// Size of the preallocated block pool (e.g. 512MiB, 4GiB; 1G is 10^9
    /// bytes). Default: the config file's `memory`, else 1GiB.
    #[arg(long, value_parser = parse_size)]
    memory: Option<usize>,
    /// Largest block the node stores (default: 16MiB, lowered for pools under 1GiB
    /// so they keep at least 64 slab pages).
    #[arg(long, value_parser = parse_size)]
    max_block: Option<usize>,
    /// Eviction policy: s3-fifo or lru.
    #[arg(long, default_value = "s3-fifo")]
    eviction: EvictionPolicy,
    /// Back the pool with huge pages (warns and continues without when refused).
    #[arg(long)]
    huge_pages: bool,
    /// Lock the pool in RAM (warns and continues unlocked when refused).
    #[arg(long)]
    mlock: bool,
    /// Fault the whole pool in at start.
    #[arg(long)]
    prefault: bool,
    /// Require this bearer token (file contents, trailing newline ignored)
    /// from every client. Needed for a --listen address other than
    /// loopback; a file its group or others can read draws a warning.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Tenants (JSON: {"tenants": [{"name", "tokenSha256", "memoryBytes",
    /// "pinnedBytes", "maxConnections"?}]}): every client authenticates into
    /// one tenant, sees only its keys and is held to its quotas; with
    /// --token-file, that token is the tenant "default" (no quota). Read
    /// again every --tenants-reload-interval. Counts as credentials for a
    /// --listen address other than loopback.
    #[arg(long)]
    tenants_file: Option<PathBuf>,
    /// How often the tenants file is read again for added, removed or
    /// changed tenants.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    tenants_reload_interval: std::time::Duration,
    /// The token cluster members present to each other for hand-off and
    /// repair (the same file on every member). With --tenants-file it is
    /// required in cluster mode: it sees every tenant's keys, so give it
    /// to members only. Without, members present --token-file's token.
    #[arg(long)]
    cluster_token_file: Option<PathBuf>,
    /// Serve a --listen address other than loopback with no --token-file:
    /// anyone who reaches the port reads and writes every block. Off by
    /// default, since a KV cache holds what prompts computed.
    #[arg(long)]
    allow_unauthenticated: bool,
    /// Serve the TCP port over TLS with this PEM certificate chain (leaf
    /// first), e.g. a kubernetes.io/tls Secret's tls.crt. Read again every
    /// --tls-reload-interval: a rotated certificate is served to new
    /// connections without a restart. The Unix socket stays without TLS.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PKCS#8, PKCS#1 or SEC1 PEM; tls.key).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require every TCP client to present a certificate signed by a CA in
    /// this PEM file (mutual TLS). A client CA counts as credentials for a
    /// --listen address other than loopback, as a --token-file does.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// How often the TLS files are read again for a rotated certificate.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    tls_reload_interval: std::time::Duration,
    /// Time a new connection gets to complete its TLS handshake (with
    /// --tls-cert) and send its HELLO, together; past it, it is closed and
    /// counted as a failed handshake.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    handshake_timeout: std::time::Duration,
    /// Connections served at once.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Connections the admin port (/metrics, /healthz) serves at once; more
    /// are closed as they arrive. Its headers must arrive within 5 s.
    #[arg(long, default_value_t = 64)]
    admin_max_connections: usize,
    /// Connections one peer may hold at once: a TCP client by its IP
    /// address, a Unix-socket client by its uid (default: a quarter of
    /// --max-connections).
    #[arg(long)]
    max_connections_per_peer: Option<usize>,
    /// Failed handshakes (wrong token, bad HELLO, silence) one peer may make
    /// in a minute; past them its connections are refused until the minute ends.
    #[arg(long, default_value_t = 20)]
    max_handshake_failures: u32,
    /// Silence after which an authenticated connection is closed (it is told
    /// first, and requests already on their way are answered).
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    idle_timeout: std::time::Duration,
    /// Time any frame gets to arrive once its header began, besides its
    /// length at --min-receive-rate; a slower frame is answered `timeout`
    /// and its connection closed.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    frame_grace: std::time::Duration,
    /// Bytes per second a frame must average after --frame-grace.
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    min_receive_rate: usize,
    /// Memory held at once for frames still arriving (metas buffered, PUT
    /// blocks allocated before their bytes are in), apart from the cache:
    /// past it a slow or stalled sender waits instead of evicting stored
    /// blocks (default: a quarter of --memory, at least one longest meta
    /// and one largest block).
    #[arg(long, value_parser = parse_size)]
    receive_budget: Option<usize>,
    /// Most of the receive budget one peer (a TCP address, a Unix uid) may
    /// hold, so one client's stalled frames leave room for the others
    /// (default: a quarter of --receive-budget, at least one longest meta
    /// and one largest block).
    #[arg(long, value_parser = parse_size)]
    receive_budget_per_peer: Option<usize>,
    /// Node configuration written by the operator (backend, plugin
    /// declarations); every declared plugin is fetched, digest-checked and
    /// compiled before the node serves.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Largest frame accepted.
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    max_frame: usize,
    /// Longest pin lease the node grants (MATCH_PREFIX and RDMA reads);
    /// longer requests are clamped to it. Announced to clients at HELLO.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    max_lease: std::time::Duration,
    /// Memory shared with each local client on the Unix socket, through
    /// which block bytes move instead of the socket (0 turns it off).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    shm_region: usize,
    /// Local clients holding shared memory at once (later ones use the socket).
    #[arg(long, default_value_t = 64)]
    shm_max: usize,
}

fn addr(flag: &str, value: &str) -> anyhow::Result<Option<SocketAddr>> {
    if value == "none" {
        return Ok(None);
    }
    value.parse().map(Some).with_context(|| format!("--{flag} {value:?}: expected HOST:PORT (an IP address) or none"))
}

/// The memory tier's size when neither the flag nor the file sets it.
const DEFAULT_MEMORY: usize = 1 << 30;

/// Refuses a client port reachable from other hosts when no client has to
/// authenticate: a node must never be open by accident (issue 21). Loopback
/// and the Unix socket reach only this host, so they need no token.
///
/// Credentials are a bearer token or a client CA (mutual TLS: a client
/// without a certificate that CA signed cannot even complete the TLS
/// handshake). TLS alone is not: it hides the bytes on the wire, but any
/// client that trusts the node's CA (a public one, possibly) still reads
/// and writes every block.
fn check_exposure(listen: Option<SocketAddr>, credentials: bool, allow_unauthenticated: bool) -> anyhow::Result<()> {
    let Some(addr) = listen else { return Ok(()) };
    if credentials || addr.ip().to_canonical().is_loopback() {
        return Ok(());
    }
    if allow_unauthenticated {
        eprintln!(
            "warning: --listen {addr} serves clients on other hosts without a token (--allow-unauthenticated): anyone who reaches it reads and writes every block"
        );
        return Ok(());
    }
    anyhow::bail!(
        "--listen {addr} is reachable from other hosts and no credentials are configured: give --token-file FILE (clients present its token), \
         --tenants-file FILE (clients present a tenant's token) or --tls-client-ca FILE (clients present a certificate it signed; TLS alone is not credentials), listen on loopback (127.0.0.1) or a --unix socket, or pass --allow-unauthenticated to accept that anyone who reaches the port reads and writes every block"
    )
}

/// Reads the bearer token, warning when others than the node's own user
/// (and its own primary group) can read it: whoever reads the token reads
/// the cache. A group-readable file whose group is the node's own effective
/// group is not warned about, because that is how Kubernetes hands a Secret
/// to a non-root container (fsGroup makes the file 0440 in that group).
fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    read_secret("--token-file", path)
}

/// [`read_token`] for any flag's file.
fn read_secret(flag: &str, path: &std::path::Path) -> anyhow::Result<String> {
    warn_if_readable(flag, path, "read and write the cache")?;
    let token = std::fs::read_to_string(path).with_context(|| format!("reading {flag} {}", path.display()))?;
    let token = token.trim_end_matches(['\n', '\r']).to_string();
    if token.is_empty() {
        anyhow::bail!("{flag} {} is empty", path.display());
    }
    Ok(token)
}

/// Warns, as [`read_token`] says, when `path` is readable by others than
/// the node's user and own group; `what`: what such a reader could do.
fn warn_if_readable(flag: &str, path: &std::path::Path, what: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).with_context(|| format!("reading {flag} {}", path.display()))?;
    let mode = meta.mode() & 0o777;
    // /proc/self belongs to the process's effective uid and gid.
    let own_group = std::fs::metadata("/proc/self").is_ok_and(|me| me.gid() == meta.gid());
    let others = mode & 0o007 != 0;
    let group = mode & 0o070 != 0 && !own_group;
    if others || group {
        let who = match (group, others) {
            (true, true) => "its group and others",
            (true, false) => "its group",
            _ => "others",
        };
        eprintln!("warning: {flag} {} (mode {mode:04o}) is readable by {who}, who can then {what}: chmod 600 it", path.display());
    }
    Ok(())
}

pub(crate) async fn run(args: NodeArgs) -> anyhow::Result<ExitCode> {
    // Exposure first, before plugins compile (seconds) or anything is bound.
    let listen = addr("listen", &args.listen)?;
    let admin = addr("admin", &args.admin)?;
    let credentials = args.token_file.is_some() || args.tenants_file.is_some() || args.tls_client_ca.is_some();
    check_exposure(listen, credentials, args.allow_unauthenticated)?;
    let token = args.token_file.as_deref().map(read_token).transpose()?;
    if args.cluster_token_file.is_some() && args.tenants_file.is_none() {
        anyhow::bail!(
            "--cluster-token-file is the members' credential beside --tenants-file; without tenants, members present \
             --token-file's token to each other: leave --cluster-token-file out, or give --tenants-file"
        );
    }
    let cluster_token = args.cluster_token_file.as_deref().map(|p| read_secret("--cluster-token-file", p)).transpose()?;
    let tenants = match &args.tenants_file {
        Some(file) => {
            // Digests, not tokens: a reader learns the tenants' names and
            // quotas, and may try tokens offline against the digests.
            warn_if_readable("--tenants-file", file, "learn the tenants and try tokens against their digests")?;
            Some(kvplane_node::tenants::TenantsConfig {
                file: file.clone(),
                reload_interval: args.tenants_reload_interval,
                default_token: token.clone(),
                cluster_token: cluster_token.clone(),
            })
        }
        None => None,
    };
    // The file first: its plugins are verified before anything is bound,
    // and its settings are the defaults the flags override.
    let mut registry = Registry::default();
    let mut file_memory = None;
    // Declared plugins, each with one configured instance, kept while the
    // node serves.
    let mut plugins = Vec::new();
    let mut tier = None;
    let mut cluster_file = None;
    if let Some(path) = &args.config {
        let file = kvplane_node::server::config::read(path)?;
        let runtime = kvplane_runtime::PluginRuntime::with_default_cache()?;
        let verified = kvplane_node::server::config::verify_plugins(&file, path, &runtime).await?;
        for p in &verified {
            eprintln!("plugin {} ({}) started: {} sha256 {}", p.name, p.world, p.origin, p.sha256);
        }
        tier = kvplane_node::server::config::tier_setup(&file, &verified);
        match &tier {
            Some(t) => eprintln!(
                "backend {}: second tier through plugin {} (ingest {:?}, at most {} in flight, {} at the bound, deadline {} ms)",
                file.backend.name(),
                t.name,
                t.settings.mode,
                t.settings.max_in_flight,
                match t.settings.at_bound {
                    kvplane_config::AtBound::Block => "wait",
                    kvplane_config::AtBound::Skip => "skip",
                },
                t.settings.deadline_ms
            ),
            None => eprintln!("backend {}: no backend plugin declared; the memory tier serves alone", file.backend.name()),
        }
        cluster_file = Some(file.clone());
        plugins = verified;
        runtime.metrics().register(&mut registry);
        file_memory = file
            .memory
            .map(|m| usize::try_from(m.bytes()))
            .transpose()
            .context("the config file's memory does not fit in this machine's address space")?;
    }
    let memory = args.memory.or(file_memory).unwrap_or(DEFAULT_MEMORY);
    let tls = match (args.tls_cert, args.tls_key) {
        (Some(cert_file), Some(key_file)) => {
            let reload = args.tls_reload_interval.as_secs();
            if reload == 0 {
                anyhow::bail!("--tls-reload-interval must be at least 1s");
            }
            Some(kvplane_config::TlsConfig { cert_file, key_file, client_ca_file: args.tls_client_ca, reload_interval_seconds: reload })
        }
        _ => None,
    };
    if tls.is_some() && listen.is_none() {
        anyhow::bail!("--tls-cert applies to the TCP port, and --listen is none");
    }
    // With tenants, --token-file's token is the tenant "default" there.
    let node_token = if tenants.is_some() { None } else { token.clone() };
    let mut config = NodeConfig {
        listen,
        admin,
        unix: args.unix,
        unix_group: args.unix_group,
        token: node_token,
        tenants,
        tls,
        ..NodeConfig::default()
    };
    config.handshake_timeout = args.handshake_timeout;
    config.pool = PoolConfig { huge_pages: args.huge_pages, mlock: args.mlock, prefault: args.prefault, ..PoolConfig::new(memory) };
    if let Some(max_block) = args.max_block {
        let class = max_block.max(1).next_power_of_two();
        if class > memory {
            anyhow::bail!("--max-block {max_block} (a {class}-byte size class) does not fit in --memory {memory}");
        }
        config.pool.max_block_bytes = class.max(config.pool.min_block_bytes);
    }
    config.cache = CacheConfig { policy: args.eviction, ..CacheConfig::default() };
    config.max_connections = args.max_connections;
    config.max_connections_per_peer = args.max_connections_per_peer;
    config.admin_limits.max_connections = args.admin_max_connections;
    config.max_handshake_failures = args.max_handshake_failures;
    config.idle_timeout = args.idle_timeout;
    config.frame_grace = args.frame_grace;
    config.min_receive_rate = args.min_receive_rate as u64;
    config.receive_budget = args.receive_budget;
    config.receive_budget_per_peer = args.receive_budget_per_peer;
    config.tier = tier;
    config.plugin_sockets = plugins.iter().map(|p| p.loaded.sockets()).sum();
    config.shm_region_bytes = args.shm_region;
    config.shm_max_regions = args.shm_max;
    config.limits.max_frame_bytes = u32::try_from(args.max_frame).context("--max-frame must be below 4GiB")?;
    config.limits.max_lease_ms = u32::try_from(args.max_lease.as_millis()).context("--max-lease must be below 49 days")?;
    if let Some(file) = &cluster_file {
        if file.cluster.is_some() && config.tenants.is_some() && cluster_token.is_none() {
            anyhow::bail!(
                "cluster mode with --tenants-file needs --cluster-token-file FILE (the same token on every member): members copy \
                 every tenant's blocks to each other (hand-off, repair) and authenticate with it"
            );
        }
        let peer_token = cluster_token.clone().or_else(|| token.clone());
        config.cluster = kvplane_node::server::config::cluster_setup(file, &plugins, peer_token)?;
        if let (Some(c), Some(f)) = (&config.cluster, &file.cluster) {
            eprintln!(
                "cluster {}: member {} (etcd {}), {} owners per key, lease {} s, placement {}",
                c.name,
                c.member.id,
                c.etcd.join(","),
                c.replicas,
                f.lease_ttl_seconds,
                c.placement.as_ref().map_or("native ring".to_string(), |p| format!("plugin {}", p.plugin.decl().name))
            );
        }
    }
    let policy = config.cache.policy;
    let tls_mode = match &config.tls {
        Some(t) if t.client_ca_file.is_some() => "TLS, client certificates required",
        Some(_) => "TLS",
        None => "",
    };
    // The handlers go in before the node serves: a SIGTERM that came once
    // the port answered but before they were installed would kill the node
    // (the default action) instead of draining it.
    let stop = StopSignals::install()?;
    let node = Node::start_with_registry(config, registry).await?;
    let mut parts = Vec::new();
    if let Some(a) = node.tcp_addr() {
        parts.push(format!("tcp {a}{}", if tls_mode.is_empty() { String::new() } else { format!(" ({tls_mode})") }));
    }
    if let Some(p) = node.unix_path() {
        parts.push(format!("unix {}", p.display()));
    }
    if let Some(a) = node.admin_addr() {
        parts.push(format!("admin http://{a}/metrics"));
    }
    eprintln!(
        "kvplane node serving: {} | memory {} MiB, eviction {policy} | Ctrl-C or SIGTERM drains and stops",
        parts.join(", "),
        memory >> 20
    );
    stop.wait().await?;
    eprintln!("kvplane node: draining");
    if cluster_file.as_ref().is_some_and(|f| f.cluster.is_some()) {
        match node.hand_off().await {
            Ok(h) => eprintln!("kvplane node: handed {} blocks to their new owners ({} not taken); left the cluster", h.moved, h.failed),
            Err(e) => eprintln!("kvplane node: hand-off failed: {e:#}"),
        }
    }
    let drained = node.shutdown().await;
    eprintln!("kvplane node: stopped{}", if drained { "" } else { " (drain deadline passed)" });
    drop(plugins);
    Ok(ExitCode::SUCCESS)
}

/// SIGTERM and SIGINT, caught from the moment [`StopSignals::install`]
/// returns.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> anyhow::Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(StopSignals {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    async fn wait(mut self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        Ok(())
    }
}

/// `--unix-group`: a group id, or a group's name looked up in /etc/group
/// (names only a directory service knows are given by number).
fn parse_group(value: &str) -> Result<u32, String> {
    if let Ok(gid) = value.parse::<u32>() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group")
        .map_err(|e| format!("reading /etc/group to find group {value:?}: {e} (give the group's number instead)"))?;
    groups
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let gid = fields.nth(1)?.parse::<u32>().ok()?;
            (name == value).then_some(gid)
        })
        .next()
        .ok_or_else(|| format!("no group named {value:?} in /etc/group (give the group's number instead)"))
}
