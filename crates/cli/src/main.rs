//! The `kvplane` binary: a thin shell that parses the command line and wires
//! the capability crates together (node, operator, plugin runtime and kit,
//! client, bench). No capability lives here.
//!
//! Exit status, for every command: 0 when it did what was asked; 1 when the
//! answer is "no" — `get` of an absent key, `exists` or `delete` with a key
//! absent, `plugin test` with a check failed — so that a script can tell a
//! miss from a failure; 2 when it failed
//! (the node unreachable or refusing, a bad file, a bad argument: clap's
//! usage errors exit 2 as well), with the reason on stderr.

mod bench;
mod kv;
mod node;
mod operator;
mod plugin;
mod size;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The process's allocator: mimalloc rather than glibc's malloc. A node
/// allocates a small key per stored block and frees the key of each block
/// it replaces or evicts, while every frame also takes a few scratch
/// vectors of more than a kilobyte; in glibc each of those larger requests
/// consolidates the small chunks freed since, and the next key allocations
/// are carved again out of the consolidated chunks (`malloc_consolidate`,
/// `unlink_chunk`): 8% of a node's CPU samples at 32 × 4 KiB PUT.
/// mimalloc's per-thread free lists by size class have no such pass (the
/// crate builds mimalloc v3, its default). Block memory is not the
/// allocator's: it is the node's own pool (`kvplane-node`'s `memory`
/// module).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "kvplane", version, about = "KV-cache platform for LLM inference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a cache node (the main job): with no flags, L1 memory only on 127.0.0.1:9600.
    // Boxed: its many flags would make every command's value as large.
    Node(Box<node::NodeArgs>),
    /// Store a file's bytes under KEY (FILE `-` reads stdin).
    Put {
        #[command(flatten)]
        conn: kv::ConnectArgs,
        key: String,
        file: std::path::PathBuf,
    },
    /// Fetch KEY to stdout or a file; exit 1 when absent, 2 on an error.
    Get {
        #[command(flatten)]
        conn: kv::ConnectArgs,
        key: String,
        #[arg(short, long)]
        output: Option<std::path::PathBuf>,
    },
    /// Say which keys are present; exit 1 if any is absent, 2 on an error.
    Exists {
        #[command(flatten)]
        conn: kv::ConnectArgs,
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Remove keys; exit 1 if any was absent, 2 on an error.
    Delete {
        #[command(flatten)]
        conn: kv::ConnectArgs,
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Print the node's counters.
    Stats {
        #[command(flatten)]
        conn: kv::ConnectArgs,
        #[arg(long)]
        json: bool,
    },
    /// Drive a node (or a raw socket or redis-server baseline) and report throughput and latency.
    Bench(bench::BenchArgs),
    /// The plain socket sink/source `kvplane bench --target raw` measures the loopback ceiling with.
    #[command(hide = true)]
    BenchRawServer(bench::RawServerArgs),
    /// Run the KVCache operator (leader-elected; KUBECONFIG or in-cluster credentials).
    Operator(operator::OperatorArgs),
    /// Print the KVCache CustomResourceDefinition (YAML).
    Crd,
    /// Run the builtin plugins through the runtime and print what they decide.
    Demo,
    /// Inspect, test and scaffold WebAssembly plugins.
    #[command(subcommand)]
    Plugin(plugin::PluginCommand),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("KVPLANE_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // Every TLS client in the process (Kubernetes API, OCI registries, plugin
    // URLs) uses ring. The block path (the node's client port, the kvplane
    // client) names aws-lc-rs itself (kvplane-tls), and with both providers
    // built rustls picks neither for a library that asks for the process's
    // default (kube does): installing ring once is that default.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return failed();
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Node(args) => node::run(*args).await,
            Command::Put { conn, key, file } => kv::put(conn, key, file).await,
            Command::Get { conn, key, output } => kv::get(conn, key, output).await,
            Command::Exists { conn, keys } => kv::exists(conn, keys).await,
            Command::Delete { conn, keys } => kv::delete(conn, keys).await,
            Command::Stats { conn, json } => kv::stats(conn, json).await,
            Command::Bench(args) => bench::run(args).await,
            Command::BenchRawServer(args) => bench::raw_server(args).await,
            Command::Operator(args) => operator::run(args).await,
            Command::Crd => operator::crd(),
            Command::Demo => kvplane_bench::demo::run().await,
            Command::Plugin(cmd) => plugin::run(cmd).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            failed()
        }
    }
}

/// The exit status of a command that failed (see the module docs); 1 is
/// [`kv::absent`].
fn failed() -> ExitCode {
    ExitCode::from(2)
}
