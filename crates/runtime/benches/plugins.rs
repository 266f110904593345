//! One decision through a Wasm plugin vs the same algorithm natively.
//!
//! `cargo bench -p kvplane-runtime --bench plugins`. Each Wasm figure includes the
//! pool checkout, the deadline arming and a `block_on`; the `native/block_on`
//! row measures that `block_on` alone so it can be subtracted.

use criterion::{black_box, criterion_group, criterion_main, Criterion};

use kvplane_runtime::bindings::WitError;
use kvplane_runtime::worlds::{Failure, Operation};
use kvplane_runtime::{Node, PluginDecl, PluginRuntime, PluginSource, World};

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let runtime = PluginRuntime::new(None).expect("plugin runtime");
    let members: Vec<Node> =
        (0..16).map(|i| Node { id: format!("cache-{i}"), endpoint: format!("10.0.0.{i}:9600"), labels: vec![] }).collect();
    let ring = runtime
        .load_key_placement(PluginDecl::new("builtin:ring", World::KeyPlacement, PluginSource::Builtin("ring".into())))
        .expect("loading builtin:ring");
    rt.block_on(ring.set_members(members.clone())).expect("set-members");
    let native =
        kvplane_ring_core::Ring::new(&members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), kvplane_ring_core::DEFAULT_VNODES)
            .expect("ring");
    let key = b"model-7b/prefix-3f9a2c/block-0042".to_vec();

    let mut g = c.benchmark_group("placement-1-key-3-replicas");
    g.bench_function("wasm/builtin:ring", |b| b.iter(|| rt.block_on(ring.owners(vec![black_box(key.clone())], 3)).expect("owners")));
    g.bench_function("native/ring-core", |b| b.iter(|| native.owners(black_box(&key), 3).expect("owners").len()));
    g.bench_function("native/block_on", |b| b.iter(|| rt.block_on(async { native.owners(black_box(&key), 3).expect("owners").len() })));
    g.finish();

    let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("model-7b/prefix-3f9a2c/block-{i:04}").into_bytes()).collect();
    let mut g = c.benchmark_group("placement-64-keys-3-replicas");
    g.bench_function("wasm/builtin:ring", |b| b.iter(|| rt.block_on(ring.owners(black_box(keys.clone()), 3)).expect("owners")));
    g.bench_function("native/ring-core", |b| b.iter(|| keys.iter().map(|k| native.owners(k, 3).expect("owners").len()).sum::<usize>()));
    g.finish();

    let backoff = runtime
        .load_retry_policy(PluginDecl::new("builtin:backoff", World::RetryPolicy, PluginSource::Builtin("backoff".into())))
        .expect("loading builtin:backoff");
    let mut g = c.benchmark_group("retry-decision");
    g.bench_function("wasm/builtin:backoff", |b| {
        b.iter(|| {
            let failure =
                Failure { operation: Operation::Get, attempt: 2, error: WitError::Timeout("t".into()), elapsed_ms: 30, jitter_seed: 12345 };
            rt.block_on(backoff.decide(black_box(failure))).expect("decide")
        })
    });
    g.finish();
}

criterion_group!(plugins, benches);
criterion_main!(plugins);
