//! `builtin:eic` through the host's driver seam, against the EIC test
//! driver (`tests/fixtures/test-driver/eic_test_driver.c`), a TEST DOUBLE of
//! an EIC driver: the real one wraps Volcano Engine's closed client SDK and
//! cannot run here. The test double is loaded by the same dlopen path as a
//! real driver and models EIC's client: one store per (endpoint, instance),
//! entries keyed by (namespace, key), ttl on a clock the tests move forward
//! instead of sleeping, per-key status codes, and garbage on request.
//!
//! The backend conformance kit; 16 x 64 KiB byte for byte; namespaces on
//! every operation; ttl from the config and per call; a delete that frees
//! the entry; an AIBrix-style config accepted and a bad one refused naming
//! the key; a driver answering garbage; an undeclared driver denied.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use bytes::Bytes;
use kvplane_plugin_kit::conformance;
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{Backend, Fault, KvError, PluginDecl, PluginRuntime, PluginSource, World};

const NONE: BackendCallOptions = BackendCallOptions { ttl_ms: None, namespace: None };

/// The EIC test driver, compiled once per test process.
fn eic_test_driver() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("eic-test-driver");
        std::fs::create_dir_all(&dir).expect("creating the test driver's directory");
        kvplane_driver::test_support::build_eic_test_driver(&dir).expect("building the EIC test driver (a test double)")
    })
}

/// A unique EIC instance of the test double for one test: its store is
/// shared by every declaration naming the same `instance`.
fn instance(test: &str) -> String {
    format!("{test}-{}", std::process::id())
}

/// `builtin:eic` joining `instance` of the EIC test double, with `extra` config.
fn decl(name: &str, instance: &str, extra: &[(&str, &str)]) -> PluginDecl {
    let mut d = PluginDecl::new(name, World::Backend, PluginSource::Builtin("eic".into()));
    d.config.insert("remote_url".into(), "eic://eic.test:30001".into());
    d.config.insert("eic_instance_id".into(), instance.into());
    for (k, v) in extra {
        d.config.insert(k.to_string(), v.to_string());
    }
    d.drivers.insert("eic".into(), eic_test_driver().to_owned());
    d
}

fn load(d: PluginDecl) -> Backend {
    PluginRuntime::new(None).unwrap().load_backend(d).expect("loading builtin:eic")
}

fn ns(namespace: &str) -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: Some(namespace.into()) }
}

fn ttl(ttl_ms: u64) -> BackendCallOptions {
    BackendCallOptions { ttl_ms: Some(ttl_ms), namespace: None }
}

fn block(i: usize, len: usize) -> Bytes {
    Bytes::from((0..len).map(|j| (j as u64).wrapping_mul(131).wrapping_add(i as u64 * 7) as u8).collect::<Vec<u8>>())
}

async fn exists(b: &Backend, keys: &[&[u8]], options: BackendCallOptions) -> Vec<Result<bool, KvError>> {
    b.exists(keys.iter().map(|k| k.to_vec()).collect(), options).await.expect("exists")
}

async fn put(b: &Backend, entries: &[(&[u8], &[u8])], options: BackendCallOptions) -> Vec<Result<(), KvError>> {
    let entries = entries.iter().map(|(k, v)| (k.to_vec(), Bytes::copy_from_slice(v))).collect();
    b.put(entries, options).await.expect("put")
}

/// GET one key into a 1 KiB destination: its bytes, or the error.
async fn get(b: &Backend, key: &[u8], options: BackendCallOptions) -> Result<Vec<u8>, KvError> {
    let (mut memories, answers) = b.get(vec![(key.to_vec(), vec![0u8; 1024])], options).await;
    let len = answers.expect("get").remove(0)?;
    let mut memory = memories.remove(0);
    memory.truncate(len);
    Ok(memory)
}

#[tokio::test]
async fn eic_passes_the_backend_kit_with_the_eic_test_driver() {
    let runtime = PluginRuntime::new(None).unwrap();
    let report = conformance::backend(&runtime, &decl("eic", &instance("kit"), &[])).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
    assert!(report.checks.iter().any(|c| c.name.contains("driver outside the declaration")), "{report}");
}

#[tokio::test]
async fn sixteen_64_kib_blocks_round_trip_byte_for_byte_through_host_buffers() {
    let b = load(decl("eic", &instance("blocks"), &[]));
    let blocks: Vec<Bytes> = (0..16).map(|i| block(i, 64 * 1024)).collect();
    let keys: Vec<Vec<u8>> = (0..16).map(|i| format!("layer-{i}/block").into_bytes()).collect();
    let put = b.put(keys.iter().cloned().zip(blocks.iter().cloned()).collect(), NONE).await.unwrap();
    assert!(put.iter().all(Result::is_ok), "{put:?}");
    let (memories, got) = b.get(keys.iter().map(|k| (k.clone(), vec![0u8; 64 * 1024])).collect(), NONE).await;
    let got = got.unwrap();
    for (i, (memory, answer)) in memories.iter().zip(&got).enumerate() {
        assert_eq!(answer, &Ok(64 * 1024), "block {i}");
        assert!(memory[..] == blocks[i][..], "block {i} read back differs from the block put");
    }
    assert!(exists(&b, &[b"layer-3/block", b"layer-16/block"], NONE).await == vec![Ok(true), Ok(false)]);
}

#[tokio::test]
async fn namespaces_apply_to_every_operation_including_exists() {
    let store = instance("namespaces");
    let a = load(decl("eic-a", &store, &[("eic_kv_ns", "tenant-a")]));
    let b = load(decl("eic-b", &store, &[("eic_kv_ns", "tenant-b")]));
    assert_eq!(put(&a, &[(b"k", b"from a")], NONE).await, vec![Ok(())]);

    // Another eic_kv_ns sees nothing: not by exists, get or delete.
    assert_eq!(exists(&b, &[b"k"], NONE).await, vec![Ok(false)]);
    assert_eq!(get(&b, b"k", NONE).await, Err(KvError::NotFound));
    assert_eq!(b.delete(vec![b"k".to_vec()], NONE).await.unwrap(), vec![Ok(())]);
    assert_eq!(get(&a, b"k", NONE).await.as_deref(), Ok(&b"from a"[..]), "a delete in tenant-b removed tenant-a's key");

    // A call's namespace overrides eic_kv_ns, on every operation.
    assert_eq!(exists(&b, &[b"k"], ns("tenant-a")).await, vec![Ok(true)]);
    assert_eq!(put(&a, &[(b"k", b"a writes into b")], ns("tenant-b")).await, vec![Ok(())]);
    assert_eq!(get(&b, b"k", NONE).await.as_deref(), Ok(&b"a writes into b"[..]));
    assert_eq!(get(&a, b"k", NONE).await.as_deref(), Ok(&b"from a"[..]));
    // The empty namespace (AIBrix's default) is one of its own.
    assert_eq!(exists(&a, &[b"k"], ns("")).await, vec![Ok(false)]);
    assert_eq!(a.delete(vec![b"k".to_vec()], ns("tenant-b")).await.unwrap(), vec![Ok(())]);
    assert_eq!(exists(&b, &[b"k"], NONE).await, vec![Ok(false)]);
    assert_eq!(exists(&a, &[b"k"], NONE).await, vec![Ok(true)]);
}

/// The test double's clock only moves when a session opens with
/// `advance_clock_ms`: expiry is decided without sleeping.
#[tokio::test]
async fn ttl_from_the_config_and_per_call_is_honoured() {
    let store = instance("ttl");
    let minute = load(decl("eic-ttl", &store, &[("eic_kv_ttl", "60")]));
    let forever = load(decl("eic-forever", &store, &[("eic_kv_ns", "forever")]));
    assert_eq!(put(&minute, &[(b"config-ttl", b"1")], NONE).await, vec![Ok(())]);
    assert_eq!(put(&minute, &[(b"call-ttl", b"2")], ttl(3_600_000)).await, vec![Ok(())]);
    assert_eq!(put(&forever, &[(b"no-ttl", b"3")], NONE).await, vec![Ok(())]);
    assert_eq!(exists(&minute, &[b"config-ttl", b"call-ttl"], NONE).await, vec![Ok(true), Ok(true)]);

    // Two minutes pass: eic_kv_ttl's minute is over, the call's hour is not.
    let advance = |ms: &str| decl("eic-clock", &store, &[("driver.advance_clock_ms", ms)]);
    load(advance("120000")).plugin.warm_up().await.expect("a session that moves the clock");
    assert_eq!(exists(&minute, &[b"config-ttl", b"call-ttl"], NONE).await, vec![Ok(false), Ok(true)]);
    assert_eq!(get(&minute, b"config-ttl", NONE).await, Err(KvError::NotFound));
    assert_eq!(exists(&forever, &[b"no-ttl"], NONE).await, vec![Ok(true)]);

    // An hour more: the call's ttl is over too; a value without one stays.
    load(advance("3600000")).plugin.warm_up().await.expect("a session that moves the clock");
    assert_eq!(exists(&minute, &[b"call-ttl"], NONE).await, vec![Ok(false)]);
    assert_eq!(get(&forever, b"no-ttl", NONE).await.as_deref(), Ok(&b"3"[..]));

    // A ttl of 0 would expire the value at once: refused naming the option.
    let zero = put(&minute, &[(b"k", b"v")], ttl(0)).await;
    assert!(matches!(&zero[0], Err(KvError::Invalid(m)) if m.contains("ttl-ms=0")), "{zero:?}");
}

#[tokio::test]
async fn delete_really_deletes() {
    let store = instance("delete");
    // The store holds at most 100 bytes of keys and values: a second 60-byte
    // value fits only once the first is gone.
    let b = load(decl("eic", &store, &[("driver.max_bytes", "100")]));
    assert_eq!(put(&b, &[(b"a", &[1; 60])], NONE).await, vec![Ok(())]);
    let full = put(&b, &[(b"b", &[2; 60])], NONE).await;
    assert!(matches!(&full[0], Err(KvError::Capacity(m)) if m.contains("eic mset key #0")), "{full:?}");
    assert_eq!(b.delete(vec![b"a".to_vec(), b"never-there".to_vec()], NONE).await.unwrap(), vec![Ok(()), Ok(())]);
    assert_eq!(exists(&b, &[b"a"], NONE).await, vec![Ok(false)]);
    assert_eq!(get(&b, b"a", NONE).await, Err(KvError::NotFound));
    assert_eq!(put(&b, &[(b"b", &[2; 60])], NONE).await, vec![Ok(())], "the deleted value's space was not freed");
    // Another client of the same instance does not see it either.
    let other = load(decl("eic-other", &store, &[]));
    assert_eq!(exists(&other, &[b"a", b"b"], NONE).await, vec![Ok(false), Ok(true)]);
}

#[tokio::test]
async fn per_key_status_codes_map_to_the_contracts_errors() {
    let store = instance("statuses");
    let b = load(decl("eic", &store, &[("driver.deny_ns", "forbidden"), ("driver.max_key_len", "16")]));
    assert_eq!(put(&b, &[(b"short", &[7; 2000])], NONE).await, vec![Ok(())]);
    let long_key = [b'k'; 17];
    let got = put(&b, &[(b"ok", b"v"), (&long_key, b"v"), (b"", b"v")], NONE).await;
    assert_eq!(got[0], Ok(()));
    assert!(matches!(&got[1], Err(KvError::Invalid(m)) if m.contains("eic mset key #1")), "{got:?}");
    assert!(matches!(&got[2], Err(KvError::Invalid(m)) if m.contains("eic mset key #2")), "{got:?}");
    // A value longer than its 1 KiB destination, and a missing key.
    assert!(matches!(get(&b, b"short", NONE).await, Err(KvError::Capacity(m)) if m.contains("2000")));
    assert_eq!(get(&b, b"missing", NONE).await, Err(KvError::NotFound));
    // A namespace the store refuses, on every operation.
    assert!(matches!(&put(&b, &[(b"k", b"v")], ns("forbidden")).await[0], Err(KvError::Denied(_))));
    assert!(matches!(&exists(&b, &[b"k"], ns("forbidden")).await[0], Err(KvError::Denied(m)) if m.contains("eic mexist")));
    assert!(matches!(&b.delete(vec![b"k".to_vec()], ns("forbidden")).await.unwrap()[0], Err(KvError::Denied(_))));
}

/// The test double set to answer garbage: statuses outside the header,
/// statuses left unwritten, lengths past the destination. Each is a typed
/// error, and nothing is reported stored.
#[tokio::test]
async fn a_driver_answering_garbage_gets_a_typed_error_and_nothing_is_reported_stored() {
    let store = instance("garbage");
    let sane = load(decl("eic", &store, &[]));
    assert_eq!(put(&sane, &[(b"present", b"value")], NONE).await, vec![Ok(())]);

    for mode in ["status", "unset"] {
        let g = load(decl(&format!("eic-garbage-{mode}"), &store, &[("driver.garbage", mode)]));
        let put = put(&g, &[(b"x", b"1"), (b"y", b"2")], NONE).await;
        assert!(put.iter().all(|r| matches!(r, Err(KvError::Internal(_)))), "{mode}: {put:?}");
        let (_, got) = g.get(vec![(b"present".to_vec(), vec![0u8; 64])], NONE).await;
        assert!(matches!(&got.unwrap()[0], Err(KvError::Internal(_))), "{mode}");
        let found = exists(&g, &[b"present"], NONE).await;
        assert!(matches!(&found[0], Err(KvError::Internal(_))), "{mode}: {found:?}");
        assert_eq!(exists(&sane, &[b"x", b"y"], NONE).await, vec![Ok(false), Ok(false)], "{mode}: a key was stored");
    }
    let bogus = put(&load(decl("eic-bogus", &store, &[("driver.garbage", "status")])), &[(b"x", b"1")], NONE).await;
    assert!(matches!(&bogus[0], Err(KvError::Internal(m)) if m.contains("not in kvplane_driver.h")), "{bogus:?}");

    // A length past the destination: an error, never a length to trust.
    let g = load(decl("eic-garbage-length", &store, &[("driver.garbage", "length")]));
    let (_, got) = g.get(vec![(b"present".to_vec(), vec![0u8; 64]), (b"missing".to_vec(), vec![0u8; 64])], NONE).await;
    let got = got.unwrap();
    assert!(got.iter().all(|r| matches!(r, Err(KvError::Internal(_)))), "{got:?}");
}

/// The config of an AIBrix EIC connector (its YAML file's keys and values),
/// as the `config` of a plugin declaration parsed like a KVCache's.
#[tokio::test]
async fn an_aibrix_style_config_is_accepted_and_a_bad_one_refused_naming_the_key() {
    let store = instance("aibrix");
    let spec = |config: &str| {
        let json = format!(
            r#"{{"name": "eic", "kind": "backend", "source": {{"builtin": "eic"}},
                 "drivers": [{{"name": "eic", "path": {path:?}}}],
                 "config": {{{config}}}}}"#,
            path = eic_test_driver().display().to_string()
        );
        kvplane_config::from_json_strict::<kvplane_config::PluginSpec>(&json).expect("a well-formed declaration")
    };
    let load_spec = |spec: kvplane_config::PluginSpec| async move {
        let options = kvplane_runtime::source::FetchOptions { insecure_registries: vec![] };
        let fetched = kvplane_runtime::source::fetch_with(&spec.name, &spec.source, &options).await.unwrap().expect("builtin:eic");
        load(kvplane_runtime::source::decl(&spec, fetched).unwrap())
    };
    let aibrix = format!(
        r#""remote_url": "eic://eic.test:30001", "eic_instance_id": "{store}", "eic_thread_num": "6",
           "eic_log_dir": "/var/log/eic", "eic_log_level": "1", "eic_trans_type": "3", "eic_kv_ttl": "-1",
           "eic_kv_ns": "llama", "eic_flag_file": "/etc/eic/flags""#
    );
    let b = load_spec(spec(&aibrix)).await;
    b.plugin.warm_up().await.expect("the AIBrix config is accepted");
    assert_eq!(put(&b, &[(b"k", b"v")], NONE).await, vec![Ok(())]);
    assert_eq!(exists(&b, &[b"k"], ns("llama")).await, vec![Ok(true)], "eic_kv_ns is not the default namespace");

    for (bad, key) in [
        (aibrix.replace(r#""eic_kv_ttl": "-1""#, r#""eic_kv_ttl": "soon""#), "eic_kv_ttl"),
        (aibrix.replace(r#""eic_log_level": "1""#, r#""eic_log_level": "loud""#), "eic_log_level"),
        (aibrix.replace("eic://eic.test:30001", "http://eic.test"), "remote_url"),
        (format!(r#"{aibrix}, "eic_kv_tll": "60""#), "eic_kv_tll"),
        (aibrix.replace(&format!(r#""eic_instance_id": "{store}", "#), ""), "eic_instance_id"),
    ] {
        let e = load_spec(spec(&bad)).await.plugin.warm_up().await.expect_err(key);
        assert!(matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.contains(key)), "{key}: {e}");
    }
}

#[tokio::test]
async fn an_undeclared_driver_is_denied() {
    let mut d = decl("eic-undeclared", &instance("undeclared"), &[]);
    d.drivers.clear();
    let e = load(d).plugin.warm_up().await.expect_err("an undeclared driver");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Denied(m)) if m.contains("\"eic\"") && m.contains("eic-undeclared")), "{e}");

    // `driver` names one the declaration does not: denied as well.
    let e =
        load(decl("eic-other-driver", &instance("undeclared"), &[("driver", "eic-rdma")])).plugin.warm_up().await.expect_err("undeclared");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Denied(m)) if m.contains("\"eic-rdma\"")), "{e}");
}
