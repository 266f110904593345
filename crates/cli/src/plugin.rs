//! `kvplane plugin inspect | test | new`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Subcommand;

use kvplane_plugin_kit::conformance;
use kvplane_runtime::{builtin, FailurePolicy, PluginDecl, PluginRuntime, PluginSource, World};

#[derive(Subcommand)]
pub(crate) enum PluginCommand {
    /// Show a component's world, contract version, imports, exports, size and sha256.
    Inspect {
        /// A .wasm file or builtin:NAME.
        plugin: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run the conformance kit of the plugin's world; exit 0 only if every check passes.
    Test {
        /// A .wasm file or builtin:NAME.
        plugin: String,
        /// For backends: the store to test against, host:port (it is added to the allowed endpoints).
        #[arg(long)]
        endpoint: Option<String>,
        /// Plugin config entries, KEY=VALUE (repeatable).
        #[arg(long = "config", value_name = "KEY=VALUE")]
        config: Vec<String>,
        /// Expected sha256 of the component.
        #[arg(long)]
        sha256: Option<String>,
        /// Memory cap per instance (e.g. 64Mi, 256MiB).
        #[arg(long, default_value = "256Mi", value_parser = super::size::parse_size)]
        memory: usize,
        /// Deadline per call, in milliseconds.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
    /// Scaffold a plugin project that builds and passes `plugin test` unchanged.
    New {
        /// backend, key-placement, retry-policy or placement-rule.
        #[arg(long)]
        world: String,
        /// rust, python or js.
        #[arg(long, default_value = "rust")]
        lang: String,
        /// Project name (also its directory).
        name: String,
        /// Parent directory (default: the current one).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
}

pub(crate) async fn run(cmd: PluginCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        PluginCommand::Inspect { plugin, json } => inspect(&plugin, json),
        PluginCommand::Test { plugin, endpoint, config, sha256, memory, timeout_ms } => {
            test(&plugin, endpoint, &config, sha256, memory, timeout_ms).await
        }
        PluginCommand::New { world, lang, name, dir } => {
            let world = World::from_name(&world)
                .with_context(|| format!("--world {world:?}: expected one of backend, key-placement, retry-policy, placement-rule"))?;
            let path = kvplane_plugin_kit::scaffold::create(world, &lang, &name, &dir)?;
            println!("created {}", path.display());
            println!("{}", kvplane_plugin_kit::scaffold::next_steps(world, &lang, &name));
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn inspect(plugin: &str, json: bool) -> anyhow::Result<ExitCode> {
    let runtime = PluginRuntime::with_default_cache()?;
    let info = runtime.inspect(&PluginSource::parse(plugin))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&info)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("plugin:      {plugin}");
    println!("world:       {}", info.world.map(|w| w.to_string()).unwrap_or_else(|| "(none: exports no single kvplane world)".into()));
    println!("wit package: kvplane:plugin@{}", info.wit_version.as_deref().unwrap_or("?"));
    println!("size:        {} bytes", info.size);
    println!("sha256:      {}", info.sha256);
    println!("imports:");
    for i in &info.imports {
        println!("  {i}");
    }
    println!("exports:");
    for e in &info.exports {
        println!("  {e}");
    }
    Ok(ExitCode::SUCCESS)
}

async fn test(
    plugin: &str,
    endpoint: Option<String>,
    config: &[String],
    sha256: Option<String>,
    memory: usize,
    timeout_ms: u64,
) -> anyhow::Result<ExitCode> {
    let runtime = PluginRuntime::with_default_cache()?;
    let source = PluginSource::parse(plugin);
    let world = match &source {
        PluginSource::Builtin(name) => {
            builtin::world(name).with_context(|| format!("no builtin plugin named {name:?} (builtins: {})", builtin::NAMES.join(", ")))?
        }
        _ => runtime.inspect(&source)?.world.with_context(|| format!("{plugin} exports no single kvplane:plugin world"))?,
    };
    let mut decl = PluginDecl::new(plugin, world, source);
    decl.sha256 = sha256;
    decl.limits.memory_bytes = memory as u64;
    decl.limits.timeout = Duration::from_millis(timeout_ms);
    decl.failure_policy = FailurePolicy::FailClosed;
    for entry in config {
        let (k, v) = entry.split_once('=').with_context(|| format!("--config {entry:?}: expected KEY=VALUE"))?;
        decl.config.insert(k.to_owned(), v.to_owned());
    }
    println!("testing {plugin} (world {world})");
    let report = match world {
        World::KeyPlacement => conformance::key_placement(&runtime.load_key_placement(decl)?).await,
        World::RetryPolicy => {
            let budget = decl.config.entry("budget-ms".into()).or_insert_with(|| conformance::RETRY_BUDGET_MS.to_string()).clone();
            let budget: u64 = budget.parse().with_context(|| format!("--config budget-ms={budget}: not an integer"))?;
            conformance::retry_policy(&runtime.load_retry_policy(decl)?, budget).await
        }
        World::PlacementRule => conformance::placement_rule(&runtime.load_placement_rule(decl)?).await,
        World::Backend => {
            let Some(endpoint) = endpoint else {
                bail!("{plugin} is a backend: give the store to test against with --endpoint HOST:PORT");
            };
            decl.config.insert("endpoint".into(), endpoint.clone());
            decl.allowed_endpoints.push(endpoint);
            conformance::backend(&runtime, &decl).await
        }
    };
    println!("{report}");
    Ok(if report.passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
