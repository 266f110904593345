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
pub struct BenchArgs {
    #[command(flatten)]
    conn: ConnectArgs,
    /// What serves the endpoint: kvplane, raw (`kvplane bench-raw-server`) or redis.
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
    /// Concurrent connections, each with one batch in flight.
    #[arg(long, default_value_t = 2)]
    clients: usize,
    #[arg(long, default_value = "put")]
    op: BenchOp,
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
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
        block_size: args.block_size,
        blocks: args.blocks,
        batch: args.batch,
        clients: args.clients,
        op: args.op,
        duration: Duration::from_secs_f64(args.seconds.max(0.1)),
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
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct RawServerArgs {
    /// TCP address.
    #[arg(long)]
    listen: Option<String>,
    /// Unix socket path.
    #[arg(long)]
    unix: Option<PathBuf>,
}

pub async fn raw_server(args: RawServerArgs) -> anyhow::Result<ExitCode> {
    bench::raw::serve(bench::raw::RawServerConfig { listen: args.listen, unix: args.unix }).await?;
    Ok(ExitCode::SUCCESS)
}
