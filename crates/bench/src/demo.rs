//! `kvplane demo`: the builtin plugins at work, through the same runtime,
//! limits and validation the node and operator use.

use std::process::ExitCode;

use kvplane_runtime::bindings::WitError;
use kvplane_runtime::worlds::{Decision, Failure, Operation, PodRequest};
use kvplane_runtime::{Node, PluginDecl, PluginRuntime, PluginSource, World};

pub async fn run() -> anyhow::Result<ExitCode> {
    let runtime = PluginRuntime::with_default_cache()?;
    let builtin = |name: &str, world| PluginDecl::new(format!("builtin:{name}"), world, PluginSource::Builtin(name.into()));

    let ring = runtime.load_key_placement(builtin("ring", World::KeyPlacement))?;
    println!(
        "== key placement (builtin:ring, loaded from {})",
        if ring.plugin.from_cache { "the compile cache" } else { "a fresh compile" }
    );
    let members: Vec<Node> =
        (0..4).map(|i| Node { id: format!("cache-{i}"), endpoint: format!("10.0.0.{}:9600", 10 + i), labels: vec![] }).collect();
    ring.set_members(members.clone()).await?;
    let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("prompt-7f3a/block-{i}").into_bytes()).collect();
    let owners = ring.owners(keys.clone(), 2).await?;
    for (k, o) in keys.iter().zip(&owners) {
        println!("  {:<24} -> {}", String::from_utf8_lossy(k), o.join(", "));
    }
    ring.set_members(members[..3].to_vec()).await?;
    let after = ring.owners(keys.clone(), 2).await?;
    let moved = owners.iter().zip(&after).filter(|(a, b)| a[0] != b[0]).count();
    println!("  cache-3 leaves: {moved} of {} primaries move", keys.len());

    let backoff = runtime.load_retry_policy(builtin("backoff", World::RetryPolicy))?;
    println!("== retry policy (builtin:backoff)");
    let mut elapsed = 0;
    for attempt in 1..=8 {
        let failure = Failure {
            operation: Operation::Get,
            attempt,
            error: WitError::Timeout("peer slow".into()),
            elapsed_ms: elapsed,
            jitter_seed: fastrand::u64(..),
        };
        let d = backoff.decide(failure).await?;
        println!("  attempt {attempt} after {elapsed} ms: {d:?}");
        match d {
            Decision::RetryAfter(ms) => elapsed += ms,
            _ => break,
        }
    }

    let gpu = runtime.load_placement_rule(builtin("gpu-affinity", World::PlacementRule))?;
    println!("== placement rule (builtin:gpu-affinity) for the AIBrix example's annotations");
    let request = PodRequest {
        role: "cache".into(),
        name: "aibrix-deepseek-33b-kvcache".into(),
        labels: vec![("kvplane.io/name".into(), "aibrix-deepseek-33b-kvcache".into())],
        annotations: vec![
            ("kvcache.orchestration.aibrix.ai/node-affinity-gpu-type".into(), "NVIDIA-L20".into()),
            ("kvcache.orchestration.aibrix.ai/pod-affinity-workload".into(), "deepseek-coder-33b-instruct".into()),
        ],
        replicas: 1,
    };
    let placement = gpu.place(request).await?;
    println!("{}", serde_json::to_string_pretty(&kvplane_operator::placement::to_pod_spec_json(&placement))?);
    Ok(ExitCode::SUCCESS)
}
