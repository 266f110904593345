//! The 0.2.0 contract as a plugin sees it, end to end through the runtime:
//! older components whose world did not change keep loading and others are
//! refused naming both versions; the `driver` seam loads a native library by
//! declaration only and moves bytes between it and host buffers; a plugin
//! whose `open` fails is broken and retried with backoff, not re-created on
//! every call; a compiled component altered on disk is recompiled, never
//! run.

use std::time::Duration;

use kvplane_protocol::KvError;
use kvplane_runtime::error::Fault;
use kvplane_runtime::scheduling::PodRequest;
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{FailurePolicy, LoadError, PluginDecl, PluginRuntime, PluginSource, World};

fn runtime() -> PluginRuntime {
    PluginRuntime::new(None).expect("creating the plugin runtime")
}

fn options(namespace: Option<&str>) -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: namespace.map(str::to_owned) }
}

#[tokio::test]
async fn a_0_1_placement_rule_keeps_loading_and_answering() {
    let d = PluginDecl::new("legacy", World::PlacementRule, PluginSource::File(kvplane_tests::PLACEMENT_RULE_V0_1.into()));
    let rt = runtime();
    let p = rt.load_placement_rule(d).expect("a 0.1.0 placement-rule loads on a 0.2.0 host");
    assert_eq!(p.plugin.info.wit_version.as_deref(), Some("0.1.0"));
    let request = PodRequest { role: "cache".into(), name: "kv".into(), labels: vec![], annotations: vec![], replicas: 3 };
    let placement = p.place(request).await.expect("place");
    let affinity = placement.node_affinity.expect("the fixture's node affinity");
    let term = &affinity.required[0][0];
    assert_eq!((term.key.as_str(), term.values.clone()), ("kvplane.io/fixture", vec!["v0.1".to_owned(), "cache".to_owned()]));
    // Its 0.1.0 `metrics` import reaches the same host code.
    assert_eq!(p.plugin.shared().metrics_snapshot().get("placed"), Some(&kvplane_runtime::host::MetricValue::Counter { value: 1 }));

    // A 0.1.0 error (six cases) crosses too: `configure` refusing is broken.
    let mut refusing = PluginDecl::new("legacy", World::PlacementRule, PluginSource::File(kvplane_tests::PLACEMENT_RULE_V0_1.into()));
    refusing.config.insert("refuse".into(), "yes".into());
    let p = rt.load_placement_rule(refusing).expect("load");
    let e = p.plugin.warm_up().await.expect_err("configure refuses");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.contains("refuse=yes")), "{e}");
}

#[test]
fn a_0_1_component_of_a_changed_world_is_refused_naming_both_versions_and_the_world() {
    let d = PluginDecl::new("old-ring", World::KeyPlacement, PluginSource::File(kvplane_tests::KEY_PLACEMENT_V0_1.into()));
    let e = runtime().load_key_placement(d).err().expect("must be refused");
    let msg = e.to_string();
    assert!(matches!(e, LoadError::WorldChanged { .. }), "{msg}");
    for needle in ["old-ring", "key-placement", "kvplane:plugin@0.1.0", "kvplane:plugin@0.2.0"] {
        assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
    }
}

fn driver_decl(driver_path: &std::path::Path, declared: bool) -> PluginDecl {
    let mut d = PluginDecl::new("vendor", World::Backend, PluginSource::File(kvplane_tests::HOSTILE.into()));
    d.config.insert("driver".into(), "test".into());
    d.config.insert("driver.store".into(), format!("contract-{}", std::process::id()));
    if declared {
        d.drivers.insert("test".into(), driver_path.to_owned());
    }
    d
}

/// The seam an EIC backend uses: a declared driver round-trips bytes from
/// source buffers into destination buffers (with namespaces applied), an
/// undeclared one is `denied`.
#[tokio::test]
async fn a_declared_driver_round_trips_bytes_and_an_undeclared_one_is_denied() {
    let dir = tempfile::tempdir().unwrap();
    let lib = kvplane_driver::test_support::build_test_driver(dir.path()).expect("building the C test driver");
    let rt = runtime();

    let denied = rt.load_backend(driver_decl(&lib, false)).expect("load");
    let (_, result) = denied.get(vec![(b"k".to_vec(), vec![0u8; 4])], options(None)).await;
    match &result.expect("the call succeeds; the key is refused")[0] {
        Err(KvError::Denied(m)) => assert!(m.contains("\"test\"") && m.contains("vendor"), "{m}"),
        other => panic!("expected denied, got {other:?}"),
    }

    let p = rt.load_backend(driver_decl(&lib, true)).expect("load");
    let block: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let put = p
        .put(
            vec![(b"block-1".to_vec(), block.clone().into()), (b"block-2".to_vec(), bytes::Bytes::from_static(b"short"))],
            options(Some("a")),
        )
        .await
        .expect("put");
    assert_eq!(put, vec![Ok(()), Ok(())]);
    let (memories, got) = p
        .get(
            vec![(b"block-1".to_vec(), vec![0u8; 64 * 1024]), (b"block-2".to_vec(), vec![b'.'; 8]), (b"block-3".to_vec(), vec![0u8; 8])],
            options(Some("a")),
        )
        .await;
    assert_eq!(got.expect("get"), vec![Ok(64 * 1024), Ok(5), Err(KvError::NotFound)]);
    assert_eq!(memories[0], block, "the block read back differs");
    assert_eq!(&memories[1][..], b"short...");
    // Another namespace does not see them; a too-small destination is capacity.
    let (_, other_ns) = p.get(vec![(b"block-1".to_vec(), vec![0u8; 64 * 1024])], options(Some("b"))).await;
    assert_eq!(other_ns.unwrap(), vec![Err(KvError::NotFound)]);
    let (_, small) = p.get(vec![(b"block-1".to_vec(), vec![0u8; 16])], options(Some("a"))).await;
    assert!(matches!(&small.unwrap()[0], Err(KvError::Capacity(_))));
    let deleted = p.delete(vec![b"block-1".to_vec()], options(Some("a"))).await.unwrap();
    assert_eq!(deleted, vec![Ok(())]);
    let (_, gone) = p.get(vec![(b"block-1".to_vec(), vec![0u8; 64 * 1024])], options(Some("a"))).await;
    assert_eq!(gone.unwrap(), vec![Err(KvError::NotFound)]);
}

/// `open` failing makes the plugin broken: the failure policy applies, and
/// the host does not create a new instance on every call but waits out a
/// backoff first.
#[tokio::test]
async fn a_plugin_whose_open_fails_is_broken_and_retried_with_backoff() {
    let mut d = PluginDecl::new("broken", World::Backend, PluginSource::File(kvplane_tests::HOSTILE.into()));
    d.config.insert("fail-open".into(), "yes".into());
    let p = runtime().load_backend(d).expect("load");
    let e = p.exists(vec![b"k".to_vec()], options(None)).await.expect_err("fail-closed reports the breakage");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.contains("fail-open=yes")), "{e}");
    for _ in 0..20 {
        let e = p.exists(vec![b"k".to_vec()], options(None)).await.expect_err("still broken");
        assert!(matches!(e.fault, Fault::Broken { .. }), "{e}");
    }
    assert_eq!(p.plugin.instantiations(), 1, "a broken plugin was re-instantiated on every call");

    // Past the backoff one new instance is tried (and fails again).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while p.plugin.instantiations() < 2 {
        assert!(std::time::Instant::now() < deadline, "no retry within 10 s of a 100 ms backoff");
        let _ = p.exists(vec![b"k".to_vec()], options(None)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Fail-open: the breakage becomes the default answer.
    let mut d = PluginDecl::new("broken-open", World::Backend, PluginSource::File(kvplane_tests::HOSTILE.into()));
    d.config.insert("fail-open".into(), "yes".into());
    d.failure_policy = FailurePolicy::FailOpen;
    let p = runtime().load_backend(d).expect("load");
    assert_eq!(p.exists(vec![b"k".to_vec()], options(None)).await.unwrap(), vec![Ok(false)]);
}

/// The on-disk cache of compiled code is an accelerator: an entry whose
/// bytes no longer match their recorded digest is recompiled, never loaded.
#[test]
fn a_flipped_byte_in_a_cached_compiled_component_means_recompiling() {
    let dir = tempfile::tempdir().unwrap();
    let decl = || PluginDecl::new("ring", World::KeyPlacement, PluginSource::Builtin("ring".into()));
    let first = PluginRuntime::new(Some(dir.path().into())).unwrap().load_key_placement(decl()).unwrap();
    assert!(!first.plugin.from_cache);
    let second = PluginRuntime::new(Some(dir.path().into())).unwrap().load_key_placement(decl()).unwrap();
    assert!(second.plugin.from_cache, "the second load should come from the cache");

    let entry = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|e| e == "cwasm"));
    let entry = entry.expect("a cache entry was written");
    let mut bytes = std::fs::read(&entry).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&entry, &bytes).unwrap();

    let third = PluginRuntime::new(Some(dir.path().into())).unwrap().load_key_placement(decl()).unwrap();
    assert!(!third.plugin.from_cache, "an altered cache entry was loaded");
    // ...and the rewritten entry is good again.
    let fourth = PluginRuntime::new(Some(dir.path().into())).unwrap().load_key_placement(decl()).unwrap();
    assert!(fourth.plugin.from_cache);
}

/// Worlds get only their own imports: a key-placement plugin that imports
/// `transport` does not link (it would otherwise get sockets), and the
/// error names the plugin and the import.
#[test]
fn each_world_links_only_its_own_imports() {
    let d = PluginDecl::new("sneaky", World::KeyPlacement, PluginSource::File(kvplane_tests::SNEAKY_PLACEMENT.into()));
    let e = runtime().load_key_placement(d).err().expect("a key-placement importing transport must not load");
    let msg = e.to_string();
    assert!(matches!(e, LoadError::Link { .. }), "{msg}");
    assert!(msg.contains("sneaky") && msg.contains("kvplane:plugin/transport@0.2.0"), "{msg}");
    // The same import is fine in the world that offers it.
    let rt = runtime();
    let info = rt.inspect(&PluginSource::File(kvplane_tests::HOSTILE.into())).unwrap();
    assert!(info.imports.iter().any(|i| i.starts_with("kvplane:plugin/transport@0.2.0")), "{:?}", info.imports);
    rt.load_backend(PluginDecl::new("hostile", World::Backend, PluginSource::File(kvplane_tests::HOSTILE.into()))).expect("backend links");
}
