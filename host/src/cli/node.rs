//! `kvplane node`: the main job.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use kvplane::cache::{CacheConfig, EvictionPolicy};
use kvplane::memory::PoolConfig;
use kvplane::server::{Node, NodeConfig};

use super::size::parse_size;

#[derive(Args)]
pub struct NodeArgs {
    /// TCP address for clients ("none" to disable).
    #[arg(long, default_value = "127.0.0.1:9600")]
    listen: String,
    /// Unix socket path for clients on this host.
    #[arg(long)]
    unix: Option<PathBuf>,
    /// Address of /metrics and /healthz ("none" to disable).
    #[arg(long, default_value = "127.0.0.1:9601")]
    admin: String,
    /// Size of the preallocated block pool (e.g. 512MiB, 4GiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    memory: usize,
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
    /// Require this bearer token (file contents, trailing newline ignored) from every client.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Connections served at once.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Node configuration written by the operator (backend, plugin
    /// declarations); every declared plugin is fetched, digest-checked and
    /// compiled before the node serves.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Largest frame accepted.
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    max_frame: usize,
}

fn addr(flag: &str, value: &str) -> anyhow::Result<Option<SocketAddr>> {
    if value == "none" {
        return Ok(None);
    }
    value.parse().map(Some).with_context(|| format!("--{flag} {value:?}: expected HOST:PORT (an IP address) or none"))
}

pub async fn run(args: NodeArgs) -> anyhow::Result<ExitCode> {
    let mut config = NodeConfig { listen: addr("listen", &args.listen)?, admin: addr("admin", &args.admin)?, unix: args.unix, ..NodeConfig::default() };
    config.pool = PoolConfig { huge_pages: args.huge_pages, mlock: args.mlock, prefault: args.prefault, ..PoolConfig::new(args.memory) };
    if let Some(max_block) = args.max_block {
        let class = max_block.max(1).next_power_of_two();
        if class > args.memory {
            anyhow::bail!("--max-block {max_block} (a {class}-byte size class) does not fit in --memory {}", args.memory);
        }
        config.pool.max_block_bytes = class.max(config.pool.min_block_bytes);
    }
    config.cache = CacheConfig { policy: args.eviction, ..CacheConfig::default() };
    config.max_connections = args.max_connections;
    config.limits.max_frame_bytes = u32::try_from(args.max_frame).context("--max-frame must be below 4GiB")?;
    if let Some(path) = &args.token_file {
        let token = std::fs::read_to_string(path).with_context(|| format!("reading --token-file {}", path.display()))?;
        let token = token.trim_end_matches(['\n', '\r']).to_string();
        if token.is_empty() {
            anyhow::bail!("--token-file {} is empty", path.display());
        }
        config.token = Some(token);
    }
    if let Some(path) = &args.config {
        let file = kvplane::server::config::read(path)?;
        let runtime = kvplane::plugin::PluginRuntime::with_default_cache()?;
        let verified = kvplane::server::config::verify_plugins(&file, path, &runtime).await?;
        for p in &verified {
            eprintln!("plugin {} ({}) verified: {} sha256 {}", p.name, p.world, p.origin, p.sha256);
        }
        eprintln!("backend {} (second tier not yet served by this node build; the memory tier serves alone)", file.backend);
    }
    let policy = config.cache.policy;
    let node = Node::start(config).await?;
    let mut parts = Vec::new();
    if let Some(a) = node.tcp_addr() {
        parts.push(format!("tcp {a}"));
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
        args.memory >> 20
    );
    wait_for_signal().await?;
    eprintln!("kvplane node: draining");
    let drained = node.shutdown().await;
    eprintln!("kvplane node: stopped{}", if drained { "" } else { " (drain deadline passed)" });
    Ok(ExitCode::SUCCESS)
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("installing the SIGINT handler")?,
    }
    Ok(())
}
