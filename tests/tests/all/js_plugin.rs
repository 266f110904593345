//! The JavaScript RESP backend (`examples/plugins/js-resp`, built with
//! componentize-js) against Debian's real redis-server: the backend
//! conformance kit, 16 blocks of 64 KiB byte for byte, a server killed and
//! restarted under the same instance, AUTH, and config and namespace errors
//! that name what is wrong; and the plugin's own protocol tests under Node.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_plugin_kit::conformance;
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{Backend, Fault, KvError, PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_tests::redis::RedisServer;

/// One runtime for every test here, compiling through an on-disk cache: the
/// component embeds SpiderMonkey (about 12 MB of Wasm), which takes tens of
/// seconds to compile in a debug build on two cores, so it is compiled once
/// (see [`runtime`]) and every later load reads the compiled code back.
fn runtime() -> &'static PluginRuntime {
    static RUNTIME: OnceLock<PluginRuntime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("js-plugin-compile-cache");
        let runtime = PluginRuntime::new(Some(cache)).expect("creating the plugin runtime");
        let started = Instant::now();
        // Loading compiles (or finds the cached code); the instance and its
        // `open` come with the first call, which this load never makes.
        let warm = runtime.load_backend(decl("127.0.0.1:1", &[])).expect("loading the JS backend");
        println!(
            "js-resp: {} bytes, loaded in {:?} ({})",
            warm.plugin.info.size,
            started.elapsed(),
            if warm.plugin.from_cache { "from the compile cache" } else { "compiled" }
        );
        runtime
    })
}

fn decl(endpoint: &str, extra: &[(&str, &str)]) -> PluginDecl {
    let mut d = PluginDecl::new("js-resp", World::Backend, PluginSource::File(kvplane_tests::JS_RESP.into()));
    d.config.insert("endpoint".into(), endpoint.to_owned());
    for (k, v) in extra {
        d.config.insert(k.to_string(), v.to_string());
    }
    d.allowed_endpoints = vec![endpoint.to_owned()];
    // A call makes a handful of host calls; the default 2 s is plenty even
    // for an unoptimised host, but a loaded CI machine gets slack.
    d.limits.timeout = Duration::from_secs(10);
    d
}

fn load(server: &RedisServer, extra: &[(&str, &str)]) -> Backend {
    runtime().load_backend(decl(&server.endpoint(), extra)).expect("loading the JS backend")
}

fn plain() -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: None }
}

fn in_namespace(ns: &str) -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: Some(ns.to_owned()) }
}

/// Block `i`: 64 KiB in which every byte value appears, CR and LF included,
/// and no two blocks are alike.
fn block(i: usize) -> Bytes {
    Bytes::from((0..64 * 1024).map(|j: usize| (j.wrapping_mul(7) ^ (j >> 8) ^ i.wrapping_mul(131)) as u8).collect::<Vec<u8>>())
}

#[tokio::test]
async fn js_resp_passes_the_backend_kit_against_redis() {
    let server = RedisServer::start(&[]);
    let report = conformance::backend(runtime(), &decl(&server.endpoint(), &[])).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

/// 16 × 64 KiB in one pipelined PUT and one pipelined GET into destinations
/// of exactly their size (read straight into them), compared byte for byte;
/// then into larger destinations (read into a slice of each).
#[tokio::test]
async fn sixteen_blocks_of_64_kib_round_trip_byte_for_byte() {
    let server = RedisServer::start(&[]);
    let backend = load(&server, &[]);
    let keys: Vec<Vec<u8>> = (0..16u8).map(|i| [b"js-round-trip/".as_slice(), &[i, 0, b'\r', b'\n', 0xff]].concat()).collect();
    let blocks: Vec<Bytes> = (0..16).map(block).collect();

    let started = Instant::now();
    let put = backend.put(keys.iter().cloned().zip(blocks.iter().cloned()).collect(), plain()).await.expect("put");
    let put_time = started.elapsed();
    assert!(put.iter().all(Result::is_ok), "{put:?}");

    let started = Instant::now();
    let (memories, got) = backend.get(keys.iter().map(|k| (k.clone(), vec![0u8; 64 * 1024])).collect(), plain()).await;
    let get_time = started.elapsed();
    let got = got.expect("get");
    for (i, (memory, result)) in memories.iter().zip(&got).enumerate() {
        assert_eq!(result.as_ref().ok(), Some(&(64 * 1024)), "key #{i}: {result:?}");
        assert!(memory[..] == blocks[i][..], "key #{i}: the bytes read differ from the bytes written");
    }
    println!("js-resp: 16 x 64 KiB put in {put_time:?}, get in {get_time:?}");

    let (memories, got) = backend.get(keys.iter().map(|k| (k.clone(), vec![0x5au8; 64 * 1024 + 100])).collect(), plain()).await;
    let got = got.expect("get into larger destinations");
    for (i, (memory, result)) in memories.iter().zip(&got).enumerate() {
        assert_eq!(result.as_ref().ok(), Some(&(64 * 1024)), "key #{i}: {result:?}");
        assert!(memory[..64 * 1024] == blocks[i][..], "key #{i}: the bytes read differ from the bytes written");
        assert!(memory[64 * 1024..].iter().all(|&b| b == 0x5a), "key #{i}: written past the value");
    }
    let deleted = backend.delete(keys, plain()).await.expect("delete");
    assert!(deleted.iter().all(Result::is_ok), "{deleted:?}");
}

/// The host closes a connection whose read failed part-way; the plugin drops
/// it and connects again on a later call, in the same instance.
#[tokio::test]
async fn a_killed_server_is_unavailable_and_a_restarted_one_serves_again() {
    let mut server = RedisServer::start(&[]);
    let backend = load(&server, &[]);
    let put = backend.put(vec![(b"k".to_vec(), Bytes::from_static(b"v"))], plain()).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    server.kill();
    let (_, got) = backend.get(vec![(b"k".to_vec(), vec![0u8; 8]), (b"k2".to_vec(), vec![0u8; 8])], plain()).await;
    match got {
        Ok(r) => assert!(r.iter().all(|r| matches!(r, Err(KvError::Unavailable(_)))), "{r:?}"),
        Err(e) => assert!(matches!(e.fault, Fault::Returned(KvError::Unavailable(_))), "{e}"),
    }
    server.restart();
    let put = backend.put(vec![(b"k".to_vec(), Bytes::from_static(b"again"))], plain()).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    let (memories, got) = backend.get(vec![(b"k".to_vec(), vec![0u8; 8])], plain()).await;
    assert_eq!(got.unwrap()[0], Ok(5));
    assert_eq!(&memories[0][..5], b"again");
}

#[tokio::test]
async fn auth_is_sent_and_a_refused_password_is_denied_without_showing_it() {
    let server = RedisServer::start(&["--requirepass", "s3cret"]);
    let good = load(&server, &[("password", "s3cret")]);
    let put = good.put(vec![(b"a".to_vec(), Bytes::from_static(b"1"))], plain()).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");

    let wrong = load(&server, &[("password", "nope")]);
    let e = wrong.exists(vec![b"a".to_vec()], plain()).await.expect_err("a wrong password must fail open");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Denied(m)) if m.contains("AUTH")), "{e}");
    assert!(!e.to_string().contains("nope"), "the password leaked into an error: {e}");

    let none = load(&server, &[]);
    let e = none.exists(vec![b"a".to_vec()], plain()).await.expect_err("no password must fail open");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Denied(m)) if m.contains("NOAUTH")), "{e}");
}

/// `open` checks the whole config and names the key; a bad namespace or
/// ttl-ms fails every key of the call, naming it, without a round trip.
#[tokio::test]
async fn bad_config_and_bad_options_are_invalid_naming_the_key() {
    let server = RedisServer::start(&[]);
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("ttl-seconds", "0")], "config ttl-seconds=0: expected a whole number of seconds"),
        (&[("database", "-1")], "config database=-1: expected a database index"),
        (&[("colour", "blue")], "config colour=blue: unknown setting (known: endpoint, password"),
        (&[("username", "alice")], "config username: needs password as well"),
        (&[("password", "")], "config password=<redacted>: must not be empty"),
    ];
    for (extra, want) in cases {
        let backend = load(&server, extra);
        let e = backend.exists(vec![b"k".to_vec()], plain()).await.expect_err("a bad config must fail open");
        assert!(matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.contains(want)), "{extra:?}: {e}");
    }
    let mut no_endpoint = decl(&server.endpoint(), &[]);
    no_endpoint.config.remove("endpoint");
    let e = runtime().load_backend(no_endpoint).unwrap().exists(vec![b"k".to_vec()], plain()).await.expect_err("no endpoint");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.contains("config endpoint: required")), "{e}");
    let e = load(&server, &[("endpoint", "localhost")]).exists(vec![b"k".to_vec()], plain()).await.expect_err("no port");
    assert!(
        matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.contains("config endpoint=localhost: expected host:port")),
        "{e}"
    );

    let backend = load(&server, &[]);
    for ns in ["", "a:b"] {
        let r = backend.exists(vec![b"k1".to_vec(), b"k2".to_vec()], in_namespace(ns)).await.unwrap();
        let want = format!("namespace {ns:?}: must be non-empty and contain no ':'");
        assert!(r.iter().all(|r| matches!(r, Err(KvError::Invalid(m)) if *m == want)), "{ns:?}: {r:?}");
    }
    let r = backend
        .put(vec![(b"k".to_vec(), Bytes::from_static(b"v"))], BackendCallOptions { ttl_ms: Some(0), namespace: None })
        .await
        .unwrap();
    assert!(matches!(&r[0], Err(KvError::Invalid(m)) if m.starts_with("ttl-ms 0: Redis accepts PX 1..=")), "{r:?}");
    // Nothing was sent: the key is absent and the connection still in step.
    assert_eq!(backend.exists(vec![b"k".to_vec()], plain()).await.unwrap(), vec![Ok(false)]);
}

/// A per-call namespace applies to every operation; a per-call ttl-ms
/// (SET PX) overrides the config's ttl-seconds.
#[tokio::test]
async fn namespaces_and_ttl_ms_apply_per_call() {
    let server = RedisServer::start(&[]);
    let backend = load(&server, &[("prefix", "js/"), ("ttl-seconds", "3600")]);
    let put = backend.put(vec![(b"k".to_vec(), Bytes::from_static(b"in a"))], in_namespace("a")).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    assert_eq!(backend.exists(vec![b"k".to_vec()], in_namespace("b")).await.unwrap(), vec![Ok(false)]);
    assert_eq!(backend.exists(vec![b"k".to_vec()], plain()).await.unwrap(), vec![Ok(false)]);
    let (memories, got) = backend.get(vec![(b"k".to_vec(), vec![0u8; 16])], in_namespace("a")).await;
    assert_eq!(got.unwrap(), vec![Ok(4)]);
    assert_eq!(&memories[0][..4], b"in a");

    // Where the keys went, seen by a plain Redis client: prefix + namespace + ":".
    let raw = load(&server, &[]);
    assert_eq!(raw.exists(vec![b"js/a:k".to_vec()], plain()).await.unwrap(), vec![Ok(true)]);

    let started = Instant::now();
    let put = backend
        .put(vec![(b"short".to_vec(), Bytes::from_static(b"x"))], BackendCallOptions { ttl_ms: Some(300), namespace: None })
        .await
        .unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    // Polled, never slept on for a fixed time: Redis expires it on its clock.
    let mut tick = tokio::time::interval(Duration::from_millis(25));
    loop {
        tick.tick().await;
        match backend.exists(vec![b"short".to_vec()], plain()).await.unwrap()[..] {
            [Ok(false)] => break,
            [Ok(true)] => assert!(started.elapsed() < Duration::from_secs(10), "a key put with ttl-ms 300 outlived 10 s"),
            ref other => panic!("exists answered {other:?}"),
        }
    }
    assert!(started.elapsed() >= Duration::from_millis(250), "expired after {:?}, before its 300 ms", started.elapsed());
}

/// `examples/plugins/js-resp/test/`: framing byte for byte, strict reply
/// parsing, config errors and broken batches, against scripted connections
/// under Node's test runner (the Node that build.rs built the plugin with).
#[test]
fn the_protocol_tests_pass_under_node() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/plugins/js-resp");
    let out = Command::new("node").args(["--test", "test/"]).current_dir(&dir).output().expect("running node --test (Node.js >= 20)");
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "node --test in {}:\n{report}", dir.display());
    let passed = report.lines().find_map(|l| l.strip_prefix("# pass ")).unwrap_or("?");
    println!("js-resp protocol tests under node: {passed} passed");
}
