//! `builtin:resp` against Debian's real redis-server: the backend
//! conformance kit, a server killed mid-session, AUTH, namespaces and TTL.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_plugin_kit::conformance;
use kvplane_protocol::KvError;
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{Backend, Fault, PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_tests::redis::RedisServer;

const NONE: BackendCallOptions = BackendCallOptions { ttl_ms: None, namespace: None };

/// GET `keys` into 1 KiB destinations; each value cut to the length the
/// plugin answered.
async fn get(backend: &Backend, keys: &[&[u8]]) -> Result<Vec<Result<Bytes, KvError>>, kvplane_runtime::PluginError> {
    let (memories, answers) = backend.get(keys.iter().map(|k| (k.to_vec(), vec![0u8; 1024])).collect(), NONE).await;
    Ok(answers?.into_iter().zip(memories).map(|(r, m)| r.map(|len| Bytes::copy_from_slice(&m[..len]))).collect())
}

fn decl(server: &RedisServer, extra: &[(&str, &str)]) -> PluginDecl {
    let mut d = PluginDecl::new("resp", World::Backend, PluginSource::Builtin("resp".into()));
    d.config.insert("endpoint".into(), server.endpoint());
    for (k, v) in extra {
        d.config.insert(k.to_string(), v.to_string());
    }
    d.allowed_endpoints = vec![server.endpoint()];
    d
}

fn load(d: PluginDecl) -> Backend {
    PluginRuntime::new(None).unwrap().load_backend(d).expect("loading builtin:resp")
}

#[tokio::test]
async fn resp_passes_the_backend_kit_against_redis() {
    let server = RedisServer::start(&[]);
    let runtime = PluginRuntime::new(None).unwrap();
    let report = conformance::backend(&runtime, &decl(&server, &[])).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

#[tokio::test]
async fn a_killed_server_is_unavailable_and_a_restarted_one_serves_again() {
    let mut server = RedisServer::start(&[]);
    let backend = load(decl(&server, &[]));
    let put = backend.put(vec![(b"k".to_vec(), Bytes::from_static(b"v"))], NONE).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    server.kill();
    let got = get(&backend, &[b"k", b"k2"]).await;
    match got {
        Ok(r) => assert!(r.iter().all(|r| matches!(r, Err(KvError::Unavailable(_)))), "{r:?}"),
        Err(e) => assert!(matches!(e.fault, Fault::Returned(KvError::Unavailable(_))), "{e}"),
    }
    // The same plugin instance reconnects once the store is back (empty: it
    // keeps nothing on disk).
    server.restart();
    let put = backend.put(vec![(b"k".to_vec(), Bytes::from_static(b"again"))], NONE).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    let got = get(&backend, &[b"k"]).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &Bytes::from_static(b"again"));
}

#[tokio::test]
async fn auth_is_required_and_honoured() {
    let server = RedisServer::start(&["--requirepass", "s3cret"]);
    let ok = load(decl(&server, &[("password", "s3cret")]));
    let r = ok.put(vec![(b"a".to_vec(), Bytes::from_static(b"1"))], NONE).await.unwrap();
    assert!(r[0].is_ok(), "{r:?}");

    let wrong = load(decl(&server, &[("password", "nope")]));
    let e = wrong.exists(vec![b"a".to_vec()], NONE).await.expect_err("a wrong password must fail open()");
    assert!(matches!(e.fault, Fault::Configure(KvError::Denied(_))), "{e}");
    assert!(!e.to_string().contains("nope"), "the password leaked into an error: {e}");
}

#[tokio::test]
async fn prefixes_isolate_namespaces_and_ttl_expires_keys() {
    let server = RedisServer::start(&[]);
    let a = load(decl(&server, &[("prefix", "tenant-a/")]));
    let b = load(decl(&server, &[("prefix", "tenant-b/")]));
    a.put(vec![(b"shared".to_vec(), Bytes::from_static(b"from a"))], NONE).await.unwrap()[0].clone().unwrap();
    let seen_by_b = get(&b, &[b"shared"]).await.unwrap();
    assert!(matches!(seen_by_b[0], Err(KvError::NotFound)), "{seen_by_b:?}");
    assert_eq!(get(&a, &[b"shared"]).await.unwrap()[0].as_ref().unwrap(), &Bytes::from_static(b"from a"));

    let short = load(decl(&server, &[("ttl-seconds", "1")]));
    let put_at = Instant::now();
    short.put(vec![(b"fleeting".to_vec(), Bytes::from_static(b"x"))], NONE).await.unwrap()[0].clone().unwrap();
    assert_eq!(short.exists(vec![b"fleeting".to_vec()], NONE).await.unwrap()[0], Ok(true));
    // Redis expires it on its own clock: poll until it is gone, giving it
    // far longer than the 1 s TTL before calling it a failure.
    let gone = loop {
        let present = short.exists(vec![b"fleeting".to_vec()], NONE).await.unwrap().remove(0);
        if present != Ok(true) {
            break present;
        }
        assert!(put_at.elapsed() < Duration::from_secs(10), "the key outlived its 1 s TTL by 9 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(gone, Ok(false));
    // Not before its time (the clock started before the PUT was sent).
    assert!(put_at.elapsed() >= Duration::from_millis(900), "the key expired after {:?}, before its 1 s TTL", put_at.elapsed());
    // A key stored without a TTL stays.
    assert_eq!(a.exists(vec![b"shared".to_vec()], NONE).await.unwrap()[0], Ok(true), "a key without a TTL expired");
}

/// A key of the wrong type fails alone; the rest of the batch is served
/// and the pipeline stays in sync.
#[tokio::test]
async fn a_per_key_server_error_does_not_spoil_the_batch() {
    let server = RedisServer::start(&[]);
    // Make "list" a Redis list, so GET on it answers -WRONGTYPE.
    let mut sock = tokio::net::TcpStream::connect(server.endpoint()).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    sock.write_all(b"*3\r\n$5\r\nLPUSH\r\n$4\r\nlist\r\n$1\r\nx\r\n").await.unwrap();
    let mut reply = [0u8; 16];
    let _ = sock.read(&mut reply).await.unwrap();

    let backend = load(decl(&server, &[]));
    backend.put(vec![(b"good".to_vec(), Bytes::from_static(b"payload"))], NONE).await.unwrap()[0].clone().unwrap();
    let r = get(&backend, &[b"good", b"list", b"good"]).await.unwrap();
    assert_eq!(r[0].as_ref().unwrap(), &Bytes::from_static(b"payload"));
    assert!(matches!(&r[1], Err(KvError::Internal(m)) if m.contains("WRONGTYPE")), "{:?}", r[1]);
    assert_eq!(r[2].as_ref().unwrap(), &Bytes::from_static(b"payload"));
    let put = backend.put(vec![(b"list".to_vec(), Bytes::from_static(b"overwrite"))], NONE).await.unwrap();
    assert!(put[0].is_ok(), "SET replaces a list: {put:?}");
}
