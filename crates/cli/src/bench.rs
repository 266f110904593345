//! `kvplane bench` and the raw socket server it compares against.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvplane_bench::{self as bench, BenchConfig, BenchOp, Target};

use super::kv::ConnectArgs;
use super::size::parse_size;

#[derive(Args)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    conn: ConnectArgs,
    /// What serves the endpoint: kvplane, cluster, raw (`kvplane
    /// bench-raw-server`, one buffer that stays in cache), raw-store (the
    /// same server keeping each block in memory of its own: one copy per
    /// block and nothing else), redis, vineyard (vineyardd's RPC port) or local
    /// (a node's Unix socket, PUT from and GET into the memory it shares). For
    /// kvplane, a comma-separated list of independent nodes splits the keys
    /// among them by hash slot (contiguous slot ranges in list order); for
    /// cluster, the list is the cluster's nodes, routed by the slot table
    /// they serve (the run waits until it lists them all).
    #[arg(long, default_value = "kvplane")]
    target: Target,
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    block_size: usize,
    /// Distinct keys (GET runs store them all first, untimed).
    #[arg(long, default_value_t = 1024)]
    blocks: usize,
    /// Blocks per request.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Concurrent clients, each with one batch in flight.
    #[arg(long, default_value_t = 2)]
    clients: usize,
    /// kvplane: connections in each client's pool, over which a large batch
    /// is split (the Python package's default is 4).
    #[arg(long, default_value_t = 1)]
    connections: usize,
    #[arg(long, default_value = "put")]
    op: BenchOp,
    /// GET: do not store the keys first; they are already where the target
    /// reads them (e.g. a node's second tier, seeded by a run against the
    /// store itself).
    #[arg(long)]
    no_seed: bool,
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
    /// kvplane over a Unix socket: keep every byte on the socket instead of
    /// the memory the node shares (the `local` target measures that path).
    #[arg(long)]
    socket_only: bool,
}

pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let show_progress = !args.json && args.seconds >= 2.0;
    let progress: Option<Arc<dyn Fn(f64, u64) + Send + Sync>> = if show_progress {
        Some(Arc::new(|done: f64, blocks: u64| {
            let width = 30;
            let filled = (done * width as f64) as usize;
            eprint!("\r[{}{}] {:>3.0}%  {blocks} blocks", "#".repeat(filled), " ".repeat(width - filled), done * 100.0);
            let _ = std::io::stderr().flush();
        }))
    } else {
        None
    };
    let report = bench::run(BenchConfig {
        target: args.target,
        endpoint: args.conn.endpoint.clone(),
        token: args.conn.token()?,
        tls: args.conn.tls()?,
        block_size: args.block_size,
        blocks: args.blocks,
        batch: args.batch,
        clients: args.clients,
        connections: args.connections.max(1),
        op: args.op,
        seed: !args.no_seed,
        duration: Duration::from_secs_f64(args.seconds.max(0.1)),
        shared_memory: !args.socket_only,
        progress,
    })
    .await?;
    if show_progress {
        eprintln!();
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} {} {} B x {} per batch, {} clients: {:.3} GB/s, {:.0} blocks/s, batch latency p50 {:.1} us p99 {:.1} us{}",
            report.target,
            report.op,
            report.block_size,
            report.batch,
            report.clients,
            report.gb_per_s,
            report.blocks_per_s,
            report.p50_us,
            report.p99_us,
            if report.misses > 0 { format!(", {} misses", report.misses) } else { String::new() }
        );
        if let Some(hits) = report.memory_hits {
            let through = report.backend_hits.map(|b| format!(", {b} read through the second tier")).unwrap_or_default();
            println!("memory-tier hits during the run: {hits}{through}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub(crate) struct RawServerArgs {
    /// TCP address.
    #[arg(long)]
    listen: Option<String>,
    /// Unix socket path.
    #[arg(long)]
    unix: Option<PathBuf>,
}

pub(crate) async fn raw_server(args: RawServerArgs) -> anyhow::Result<ExitCode> {
    bench::raw::serve(bench::raw::RawServerConfig { listen: args.listen, unix: args.unix }).await?;
    Ok(ExitCode::SUCCESS)
}
