//! Hostile plugins cannot take the host down: every misbehaviour ends in a
//! typed error naming the plugin, the function and the cause; the instance is
//! replaced and the next call succeeds.

use std::time::{Duration, Instant};

use kvplane_runtime::{FailurePolicy, Fault, KeyPlacement, LoadError, Node, PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_tests::hostile;

fn runtime() -> PluginRuntime {
    PluginRuntime::new(None).expect("creating the plugin runtime")
}

fn hostile_decl() -> PluginDecl {
    let mut d = PluginDecl::new("hostile", World::KeyPlacement, PluginSource::File(kvplane_tests::HOSTILE.into()));
    d.limits.memory_bytes = 32 << 20;
    d.limits.timeout = Duration::from_millis(300);
    d
}

fn members() -> Vec<Node> {
    (0..3).map(|i| Node { id: format!("m{i}"), endpoint: format!("10.0.0.{i}:9600"), labels: vec![] }).collect()
}

async fn loaded(decl: PluginDecl) -> KeyPlacement {
    let p = runtime().load_key_placement(decl).expect("loading the hostile fixture");
    p.set_members(members()).await.expect("set-members");
    p
}

/// After a fault the next well-behaved call must succeed on a fresh instance.
async fn still_serves(p: &KeyPlacement) {
    let owners = p.owners(vec![b"fine".to_vec()], 2).await.expect("the call after a fault must succeed");
    assert_eq!(owners, vec![vec!["m0".to_owned(), "m1".to_owned()]]);
}

async fn provoke(p: &KeyPlacement, key: &[u8]) -> kvplane_runtime::PluginError {
    p.owners(vec![key.to_vec()], 2).await.expect_err("the hostile call must fail")
}

#[tokio::test]
async fn an_infinite_loop_is_stopped_at_the_deadline() {
    let p = loaded(hostile_decl()).await;
    let started = Instant::now();
    let e = provoke(&p, hostile::LOOP).await;
    assert_eq!(e.fault, Fault::Deadline { timeout: Duration::from_millis(300) }, "{e}");
    assert_eq!((e.plugin.as_str(), e.function), ("hostile", "owners"));
    assert!(e.to_string().contains("hostile") && e.to_string().contains("owners") && e.to_string().contains("deadline"), "{e}");
    // Not a speed assertion: a loop that was never interrupted would hang
    // the test, and one stopped by the 600 s test timeout is not "contained".
    assert!(started.elapsed() < Duration::from_secs(10));
    still_serves(&p).await;
}

#[tokio::test]
async fn unbounded_memory_growth_hits_the_cap() {
    let p = loaded(hostile_decl()).await;
    let e = provoke(&p, hostile::GROW).await;
    assert_eq!(e.fault, Fault::MemoryCap { limit: 32 << 20 }, "{e}");
    assert!(e.to_string().contains("memory cap"), "{e}");
    still_serves(&p).await;
}

#[tokio::test]
async fn a_panic_is_a_trap_with_the_panic_message() {
    let p = loaded(hostile_decl()).await;
    let e = provoke(&p, hostile::PANIC).await;
    match &e.fault {
        Fault::Trap { message } => {
            assert!(message.contains("hostile fixture: asked to panic"), "{e}")
        }
        other => panic!("expected a trap, got {other:?}"),
    }
    still_serves(&p).await;
}

#[tokio::test]
async fn deep_recursion_overflows_the_stack_cleanly() {
    let p = loaded(hostile_decl()).await;
    let e = provoke(&p, hostile::RECURSE).await;
    assert_eq!(e.fault, Fault::StackOverflow, "{e}");
    still_serves(&p).await;
}

#[tokio::test]
async fn an_oversized_answer_is_rejected() {
    let mut d = hostile_decl();
    // Room for the guest to build its 12.8 MB answer, so the host's check
    // (not the memory cap) is what stops it.
    d.limits.memory_bytes = 128 << 20;
    d.limits.timeout = Duration::from_secs(5);
    let p = loaded(d).await;
    let e = provoke(&p, hostile::HUGE).await;
    match &e.fault {
        Fault::BadOutput(why) => {
            assert!(why.contains(&hostile::HUGE_OWNERS.to_string()) && why.contains("expected 2"), "{e}")
        }
        other => panic!("expected BadOutput, got {other:?}"),
    }
    still_serves(&p).await;
}

#[tokio::test]
async fn every_fault_in_a_row_leaves_the_host_serving() {
    let p = loaded(hostile_decl()).await;
    for key in [hostile::PANIC, hostile::RECURSE, hostile::GROW, hostile::LOOP] {
        provoke(&p, key).await;
        still_serves(&p).await;
    }
}

#[tokio::test]
async fn fail_open_gives_the_native_ring_instead_of_the_error() {
    let mut d = hostile_decl();
    d.failure_policy = FailurePolicy::FailOpen;
    let p = loaded(d).await;
    let owners = p.owners(vec![hostile::PANIC.to_vec()], 2).await.expect("fail-open hides the trap");
    let native = kvplane_runtime::worlds::native_owners(&members(), &[hostile::PANIC.to_vec()], 2).unwrap();
    assert_eq!(owners, native);
    // A contract error is an answer, not a breakage: it still reaches the caller.
    let e = p.owners(vec![b"fine".to_vec()], 0).await.expect_err("zero replicas");
    assert!(matches!(e.fault, Fault::Returned(kvplane_protocol::KvError::Invalid(_))), "{e}");
}

#[test]
fn a_plugin_declared_for_another_world_is_refused() {
    let d = PluginDecl::new("backoff-as-placement", World::KeyPlacement, PluginSource::Builtin("backoff".into()));
    let e = runtime().load_key_placement(d).err().expect("must be refused");
    assert!(matches!(e, LoadError::WrongWorld { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("key-placement") && msg.contains("retry-policy"), "{msg}");
}

#[test]
fn a_sha256_mismatch_is_refused_before_compiling() {
    let mut d = hostile_decl();
    d.sha256 = Some("0".repeat(64));
    let e = runtime().load_key_placement(d).err().expect("must be refused");
    match &e {
        LoadError::Sha256Mismatch { declared, actual, .. } => {
            assert_eq!(declared, &"0".repeat(64));
            let bytes = std::fs::read(kvplane_tests::HOSTILE).unwrap();
            assert_eq!(actual, &kvplane_runtime::sha256_hex(&bytes));
        }
        other => panic!("expected Sha256Mismatch, got {other}"),
    }
    // The right digest loads.
    let mut ok = hostile_decl();
    ok.sha256 = Some(kvplane_runtime::sha256_hex(&std::fs::read(kvplane_tests::HOSTILE).unwrap()));
    runtime().load_key_placement(ok).expect("the matching sha256 loads");
}

#[test]
fn files_that_are_not_components_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.wasm");
    std::fs::write(&text, b"this is not wasm at all").unwrap();
    let core = dir.path().join("core.wasm");
    // The smallest core module: header, version 1, no sections.
    std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
    let truncated = dir.path().join("truncated.wasm");
    let bytes = std::fs::read(kvplane_tests::HOSTILE).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();

    let load = |path: &std::path::Path| {
        runtime()
            .load_key_placement(PluginDecl::new("bad", World::KeyPlacement, PluginSource::File(path.into())))
            .err()
            .expect("must be refused")
    };
    assert!(matches!(load(&text), LoadError::NotWasm { .. }));
    let e = load(&core);
    assert!(matches!(e, LoadError::CoreModule { .. }) && e.to_string().contains("not a component"), "{e}");
    let e = load(&truncated);
    assert!(matches!(e, LoadError::Compile { .. }) && e.to_string().contains("truncated.wasm"), "{e}");
    let e = load(&dir.path().join("missing.wasm"));
    assert!(matches!(e, LoadError::Source { .. }) && e.to_string().contains("missing.wasm"), "{e}");
}

#[test]
fn a_plugin_for_another_major_version_is_refused_naming_both() {
    let d = PluginDecl::new("future", World::KeyPlacement, PluginSource::File(kvplane_tests::FUTURE_MAJOR.into()));
    let e = runtime().load_key_placement(d).err().expect("must be refused");
    let msg = e.to_string();
    assert!(matches!(e, LoadError::VersionMismatch { .. }), "{msg}");
    assert!(msg.contains("kvplane:plugin@1.0.0") && msg.contains("kvplane:plugin@0.1.0"), "{msg}");
}

/// A plugin gets no environment, arguments, files or sockets from the host:
/// the fixture tries each and reports what it got.
#[tokio::test]
async fn no_ambient_authority_reaches_a_plugin() {
    let p = loaded(hostile_decl()).await;
    p.owners(vec![hostile::AMBIENT.to_vec()], 1).await.expect("the probe answers normally");
    let metrics = p.plugin.shared().metrics_snapshot();
    for probe in
        ["ambient-env-vars", "ambient-args", "ambient-read-root-dir", "ambient-read-file", "ambient-write-file", "ambient-tcp-connect"]
    {
        assert_eq!(metrics.get(probe), Some(&kvplane_runtime::host::MetricValue::Gauge { value: 0.0 }), "{probe}: {metrics:?}");
    }
    assert_eq!(metrics.get("granted-read"), Some(&kvplane_runtime::host::MetricValue::Gauge { value: 0.0 }));
}

/// A granted directory is readable at /data, read-only, and nothing else
/// opens up.
#[tokio::test]
async fn a_granted_directory_is_readable_and_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hello"), b"hello").unwrap();
    let mut d = hostile_decl();
    d.granted_dir = Some(dir.path().into());
    let p = loaded(d).await;
    p.owners(vec![hostile::AMBIENT.to_vec()], 1).await.expect("the probe answers normally");
    let metrics = p.plugin.shared().metrics_snapshot();
    let gauge = |name: &str| metrics.get(name).cloned();
    use kvplane_runtime::host::MetricValue::Gauge;
    assert_eq!(gauge("granted-read"), Some(Gauge { value: 1.0 }), "{metrics:?}");
    assert_eq!(gauge("granted-write"), Some(Gauge { value: 0.0 }), "{metrics:?}");
    assert_eq!(gauge("ambient-read-file"), Some(Gauge { value: 0.0 }), "{metrics:?}");
    assert!(!dir.path().join("escape").exists());
}

/// The host counts every call, fault and fail-open fallback itself, under
/// its own series; what a plugin records through the `metrics` interface is
/// exposed apart (`kvplane_plugin_reported*`), so a plugin cannot hide a
/// fault or forge the host's counts.
#[tokio::test]
async fn the_host_counts_calls_faults_and_fail_open_apart_from_what_the_plugin_reports() {
    let rt = runtime();
    let mut d = hostile_decl();
    d.failure_policy = FailurePolicy::FailOpen;
    let p = rt.load_key_placement(d).expect("loading the hostile fixture");
    p.set_members(members()).await.expect("set-members");
    p.owners(vec![hostile::PANIC.to_vec()], 2).await.expect("fail-open hides the trap");
    p.owners(vec![hostile::AMBIENT.to_vec()], 1).await.expect("the probe answers normally");
    let m = rt.metrics();
    assert_eq!(m.fault_count("hostile", "owners", "trap"), 1);
    assert_eq!(m.fail_open_count("hostile"), 1);
    assert_eq!(m.call_count("hostile", "owners"), 2);

    let mut registry = prometheus_client::registry::Registry::default();
    m.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        r#"kvplane_plugin_faults_total{plugin="hostile",function="owners",fault="trap"} 1"#,
        r#"kvplane_plugin_fail_open_total{plugin="hostile"} 1"#,
        r#"kvplane_plugin_reported_gauge{plugin="hostile",name="ambient-env-vars"} 0"#,
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    // Nothing the host counts lands among the plugin's own series.
    assert!(!p.plugin.shared().metrics_snapshot().keys().any(|k| k.contains("fail_open")));
}
