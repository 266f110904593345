//! Hostile plugins cannot take the host down: every misbehaviour of the
//! guest ends in a typed error naming the plugin, the function and the
//! cause; the instance is replaced and the next call succeeds. What a plugin
//! can make the host spend is covered in `limits.rs`.

use std::time::{Duration, Instant};

use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{Backend, FailurePolicy, Fault, LoadError, PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_tests::hostile;

fn runtime() -> PluginRuntime {
    PluginRuntime::new(None).expect("creating the plugin runtime")
}

fn hostile_decl() -> PluginDecl {
    let mut d = PluginDecl::new("hostile", World::Backend, PluginSource::File(kvplane_tests::HOSTILE.into()));
    d.limits.memory_bytes = 32 << 20;
    d.limits.timeout = Duration::from_millis(300);
    d
}

fn loaded(decl: PluginDecl) -> Backend {
    runtime().load_backend(decl).expect("loading the hostile fixture")
}

fn no_options() -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: None }
}

/// After a fault the next well-behaved call must succeed on a fresh instance.
async fn still_serves(p: &Backend) {
    let answer = p.exists(vec![b"fine".to_vec(), b"also".to_vec()], no_options()).await.expect("the call after a fault must succeed");
    assert_eq!(answer, vec![Ok(false), Ok(false)]);
}

async fn provoke(p: &Backend, key: &[u8]) -> kvplane_runtime::PluginError {
    p.exists(vec![key.to_vec()], no_options()).await.expect_err("the hostile call must fail")
}

#[tokio::test]
async fn an_infinite_loop_is_stopped_at_the_deadline() {
    let p = loaded(hostile_decl());
    let started = Instant::now();
    let e = provoke(&p, hostile::LOOP).await;
    assert_eq!(e.fault, Fault::Deadline { timeout: Duration::from_millis(300) }, "{e}");
    assert_eq!((e.plugin.as_str(), e.function), ("hostile", "exists"));
    assert!(e.to_string().contains("hostile") && e.to_string().contains("exists") && e.to_string().contains("deadline"), "{e}");
    // Not a speed assertion: a loop that was never interrupted would hang
    // the test, and one stopped by the 600 s test timeout is not "contained".
    assert!(started.elapsed() < Duration::from_secs(10));
    still_serves(&p).await;
}

/// The data path needs deadlines of a few milliseconds to mean what they
/// say: a spinning plugin under a 2 ms deadline is stopped as `timeout`
/// (a deadline fault), and the very next call succeeds.
#[tokio::test]
async fn a_two_millisecond_deadline_stops_a_spin_and_the_next_call_succeeds() {
    let mut d = hostile_decl();
    d.limits.timeout = Duration::from_millis(2);
    let p = loaded(d);
    // Warm one instance under a generous deadline first: instantiating a
    // component is not what this test measures.
    p.plugin.warm_up().await.expect("warm-up");
    let e = provoke(&p, hostile::LOOP).await;
    assert_eq!(e.fault, Fault::Deadline { timeout: Duration::from_millis(2) }, "{e}");
    p.plugin.warm_up().await.expect("a fresh instance after the deadline");
    still_serves(&p).await;
}

#[tokio::test]
async fn unbounded_memory_growth_hits_the_cap() {
    let p = loaded(hostile_decl());
    let e = provoke(&p, hostile::GROW).await;
    assert_eq!(e.fault, Fault::MemoryCap { limit: 32 << 20 }, "{e}");
    assert!(e.to_string().contains("memory cap"), "{e}");
    still_serves(&p).await;
}

#[tokio::test]
async fn a_panic_is_a_trap_with_the_panic_message() {
    let p = loaded(hostile_decl());
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
    let p = loaded(hostile_decl());
    let e = provoke(&p, hostile::RECURSE).await;
    assert_eq!(e.fault, Fault::StackOverflow, "{e}");
    still_serves(&p).await;
}

#[tokio::test]
async fn an_oversized_answer_is_rejected() {
    let mut d = hostile_decl();
    d.limits.memory_bytes = 128 << 20;
    d.limits.timeout = Duration::from_secs(5);
    let p = loaded(d);
    let e = provoke(&p, hostile::HUGE).await;
    match &e.fault {
        Fault::BadOutput(why) => {
            assert!(why.contains(&hostile::HUGE_ANSWERS.to_string()) && why.contains("for 1 keys"), "{e}")
        }
        other => panic!("expected BadOutput, got {other:?}"),
    }
    still_serves(&p).await;
}

#[tokio::test]
async fn every_fault_in_a_row_leaves_the_host_serving() {
    let p = loaded(hostile_decl());
    for key in [hostile::PANIC, hostile::RECURSE, hostile::GROW, hostile::LOOP] {
        provoke(&p, key).await;
        still_serves(&p).await;
    }
}

#[tokio::test]
async fn fail_open_turns_a_breakage_into_the_documented_default() {
    let mut d = hostile_decl();
    d.failure_policy = FailurePolicy::FailOpen;
    let p = loaded(d);
    // `exists` falls open to "absent".
    let answer = p.exists(vec![hostile::PANIC.to_vec(), b"k".to_vec()], no_options()).await.expect("fail-open hides the trap");
    assert_eq!(answer, vec![Ok(false), Ok(false)]);
    still_serves(&p).await;
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
    let e = runtime().load_backend(d).err().expect("must be refused");
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
    runtime().load_backend(ok).expect("the matching sha256 loads");
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
        runtime().load_backend(PluginDecl::new("bad", World::Backend, PluginSource::File(path.into()))).err().expect("must be refused")
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
    assert!(msg.contains("kvplane:plugin@1.0.0") && msg.contains("kvplane:plugin@0.2.0"), "{msg}");
}

/// A plugin gets no environment, arguments, files, sockets, clock or
/// randomness from the host through WASI: the fixture tries each and
/// reports what it got. WASI's wall clock reads 0, and its random seed is
/// the same fixed value in every instance.
#[tokio::test]
async fn no_ambient_authority_reaches_a_plugin() {
    use kvplane_runtime::host::MetricValue::Gauge;
    let probe = || async {
        let p = loaded(hostile_decl());
        p.exists(vec![hostile::AMBIENT.to_vec()], no_options()).await.expect("the probe answers normally");
        p.plugin.shared().metrics_snapshot()
    };
    let metrics = probe().await;
    for probe in [
        "ambient-env-vars",
        "ambient-args",
        "ambient-read-root-dir",
        "ambient-read-file",
        "ambient-write-file",
        "ambient-tcp-connect",
        "ambient-wall-clock-seconds",
    ] {
        assert_eq!(metrics.get(probe), Some(&Gauge { value: 0.0 }), "{probe}: {metrics:?}");
    }
    assert_eq!(metrics.get("granted-read"), Some(&Gauge { value: 0.0 }));
    let again = probe().await;
    assert_eq!(metrics.get("ambient-random-probe"), again.get("ambient-random-probe"), "WASI randomness differs between instances");
}

/// A granted directory is readable at /data, read-only, and nothing else
/// opens up.
#[tokio::test]
async fn a_granted_directory_is_readable_and_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hello"), b"hello").unwrap();
    let mut d = hostile_decl();
    d.granted_dir = Some(dir.path().into());
    let p = loaded(d);
    p.exists(vec![hostile::AMBIENT.to_vec()], no_options()).await.expect("the probe answers normally");
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
    let p = rt.load_backend(d).expect("loading the hostile fixture");
    p.exists(vec![hostile::PANIC.to_vec()], no_options()).await.expect("fail-open hides the trap");
    p.exists(vec![hostile::AMBIENT.to_vec()], no_options()).await.expect("the probe answers normally");
    let m = rt.metrics();
    assert_eq!(m.fault_count("hostile", "exists", "trap"), 1);
    assert_eq!(m.fail_open_count("hostile"), 1);
    assert_eq!(m.call_count("hostile", "exists"), 2);

    let mut registry = prometheus_client::registry::Registry::default();
    m.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        r#"kvplane_plugin_faults_total{plugin="hostile",function="exists",fault="trap"} 1"#,
        r#"kvplane_plugin_fail_open_total{plugin="hostile"} 1"#,
        r#"kvplane_plugin_reported_gauge{plugin="hostile",name="ambient-env-vars"} 0"#,
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    // Nothing the host counts lands among the plugin's own series.
    assert!(!p.plugin.shared().metrics_snapshot().keys().any(|k| k.contains("fail_open")));
}

/// WASI's own handles (pollables, streams) were capped only by wasmtime's
/// 100,000; now they count against the declared `handles` with the host's.
/// A WASI call has no error to answer, so the one that does not fit traps,
/// and the next call gets a fresh instance.
#[tokio::test]
async fn wasi_handles_count_against_the_declared_handles() {
    let mut d = hostile_decl();
    d.limits.handles = 64;
    d.limits.timeout = Duration::from_secs(10);
    let p = loaded(d);
    let e = p.exists(vec![hostile::WASI_HANDLES.to_vec()], no_options()).await.expect_err("200,000 pollables do not fit in 64 handles");
    assert!(matches!(e.fault, Fault::Trap { .. }), "{e}");
    use kvplane_runtime::host::MetricValue::Gauge;
    let made = match p.plugin.shared().metrics_snapshot().get("wasi-handles") {
        Some(Gauge { value }) => *value,
        other => panic!("the fixture reported no progress: {other:?}"),
    };
    assert!(made <= 64.0, "{made} WASI handles were made against a limit of 64");
    // The trapped instance is gone; a fresh one serves.
    p.exists(vec![b"other".to_vec()], no_options()).await.expect("a fresh instance answers");
}
