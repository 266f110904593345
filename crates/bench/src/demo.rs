//! `kvplane demo`: the builtin plugins at work, through the same runtime,
//! limits and validation the node and operator use.

use std::process::ExitCode;

use kvplane_runtime::scheduling::PodRequest;
use kvplane_runtime::worlds::{Decision, Failure, Operation};
use kvplane_runtime::{KvError, PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_slots::{Member, MemberState, SlotTable, SLOTS};

/// The ids of `key`'s owners in `table`, primary first, for printing.
fn owner_ids(table: &SlotTable, key: &[u8]) -> Vec<String> {
    table.owner_members(key).map(|m| m.id.clone()).collect()
}

pub async fn run() -> anyhow::Result<ExitCode> {
    let runtime = PluginRuntime::with_default_cache()?;
    let builtin = |name: &str, world| PluginDecl::new(format!("builtin:{name}"), world, PluginSource::Builtin(name.into()));

    let ring = runtime.load_key_placement(builtin("ring", World::KeyPlacement))?;
    println!(
        "== key placement (builtin:ring, loaded from {})",
        if ring.plugin.from_cache { "the compile cache" } else { "a fresh compile" }
    );
    let mut members: Vec<Member> = (0..4).map(|i| Member::up(format!("cache-{i}"), format!("10.0.0.{}:9600", 10 + i))).collect();
    // The plugin computes the slot table once per membership change; every
    // key is then looked up natively (crc32c, a modulo and a slice index).
    let started = std::time::Instant::now();
    let table = ring.compute(1, members.clone(), SLOTS, 2).await?;
    println!("  slot table v{}: {} slots x {} owners, computed in {:?}", table.version, table.slots(), table.replicas(), started.elapsed());
    let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("prompt-7f3a/block-{i}").into_bytes()).collect();
    for k in &keys {
        println!("  {:<24} -> {}", String::from_utf8_lossy(k), owner_ids(&table, k).join(", "));
    }
    members[3].state = MemberState::Draining;
    let after = ring.compute(2, members, SLOTS, 2).await?;
    let moved = keys.iter().filter(|k| owner_ids(&table, k) != owner_ids(&after, k)).count();
    println!(
        "  cache-3 drains: {moved} of {} keys change owners; {:.1}% of slots change primary",
        keys.len(),
        table.moved_fraction(&after) * 100.0
    );

    let backoff = runtime.load_retry_policy(builtin("backoff", World::RetryPolicy))?;
    println!("== retry policy (builtin:backoff)");
    let deadline_ms = 1_000;
    let mut elapsed = 0;
    for attempt in 1..=8 {
        let failure = Failure {
            operation: Operation::Get,
            idempotent: true,
            target: "cache-1".into(),
            replica: 0,
            attempt,
            error: KvError::Timeout("peer slow".into()),
            elapsed_ms: elapsed,
            deadline_left_ms: deadline_ms - elapsed.min(deadline_ms),
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
    println!("{}", serde_json::to_string_pretty(&kvplane_operator::scheduling::to_pod_spec_json(&placement))?);
    Ok(ExitCode::SUCCESS)
}
