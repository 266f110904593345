//! `builtin:vineyard` against a real vineyardd (PyPI `vineyard==0.24.2`,
//! `scripts/prereqs vineyard`): the backend conformance kit, 64 KiB blocks
//! byte for byte, delete, exists, namespaces, a server killed and
//! restarted; and against a peer that answers garbage.
//!
//! vineyardd's RPC port binds every address, so each test that starts it
//! runs in a private network namespace of its own (see
//! `kvplane_tests::vineyard`): the test re-runs itself there.

use std::time::Duration;

use bytes::Bytes;
use kvplane_plugin_kit::conformance;
use kvplane_protocol::KvError;
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{Backend, Fault, PluginDecl, PluginError, PluginRuntime, PluginSource, World};
use kvplane_tests::vineyard::{in_private_network, VineyardServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NONE: BackendCallOptions = BackendCallOptions { ttl_ms: None, namespace: None };

fn in_namespace(ns: &str) -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: Some(ns.to_owned()) }
}

fn decl(endpoint: &str, extra: &[(&str, &str)]) -> PluginDecl {
    let mut d = PluginDecl::new("vineyard", World::Backend, PluginSource::Builtin("vineyard".into()));
    d.config.insert("endpoint".into(), endpoint.to_owned());
    for (k, v) in extra {
        d.config.insert(k.to_string(), v.to_string());
    }
    d.allowed_endpoints = vec![endpoint.to_owned()];
    d
}

fn load(d: PluginDecl) -> Backend {
    PluginRuntime::new(None).unwrap().load_backend(d).expect("loading builtin:vineyard")
}

/// GET `keys` into destinations of `size` bytes; each value cut to the
/// length the plugin answered.
async fn get(
    backend: &Backend,
    keys: &[Vec<u8>],
    size: usize,
    options: BackendCallOptions,
) -> Result<Vec<Result<Bytes, KvError>>, PluginError> {
    let (memories, answers) = backend.get(keys.iter().map(|k| (k.clone(), vec![0u8; size])).collect(), options).await;
    Ok(answers?.into_iter().zip(memories).map(|(r, m)| r.map(|len| Bytes::copy_from_slice(&m[..len]))).collect())
}

fn block(i: usize) -> Bytes {
    Bytes::from((0..65536usize).map(|j| (j as u64).wrapping_mul(131).wrapping_add(i as u64 * 7) as u8).collect::<Vec<u8>>())
}

#[tokio::test]
async fn vineyard_passes_the_backend_kit_against_vineyardd() {
    if !in_private_network(module_path!(), "vineyard_passes_the_backend_kit_against_vineyardd") {
        return;
    }
    let server = VineyardServer::start();
    let runtime = PluginRuntime::new(None).unwrap();
    let report = conformance::backend(&runtime, &decl(&server.endpoint(), &[])).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

#[tokio::test]
async fn sixteen_64k_blocks_round_trip_and_deleted_ones_are_not_found() {
    if !in_private_network(module_path!(), "sixteen_64k_blocks_round_trip_and_deleted_ones_are_not_found") {
        return;
    }
    let server = VineyardServer::start();
    let backend = load(decl(&server.endpoint(), &[]));
    let keys: Vec<Vec<u8>> = (0..16).map(|i| format!("layer/{i}").into_bytes()).collect();
    let values: Vec<Bytes> = (0..16).map(block).collect();
    let put = backend.put(keys.iter().cloned().zip(values.iter().cloned()).collect(), NONE).await.unwrap();
    assert!(put.iter().all(|r| r.is_ok()), "{put:?}");

    let got = get(&backend, &keys, 65536, NONE).await.unwrap();
    for (i, (got, want)) in got.iter().zip(&values).enumerate() {
        assert!(got.as_ref().is_ok_and(|g| g == want), "block {i}: {:?}", got.as_ref().map(Bytes::len));
    }
    let present = backend.exists(keys.clone(), NONE).await.unwrap();
    assert!(present.iter().all(|r| *r == Ok(true)), "{present:?}");

    let deleted = backend.delete(keys[..8].to_vec(), NONE).await.unwrap();
    assert!(deleted.iter().all(|r| r.is_ok()), "{deleted:?}");
    let after = get(&backend, &keys, 65536, NONE).await.unwrap();
    for (i, r) in after.iter().enumerate() {
        if i < 8 {
            assert!(matches!(r, Err(KvError::NotFound)), "deleted block {i}: {r:?}");
        } else {
            assert!(r.as_ref().is_ok_and(|g| g == &values[i]), "kept block {i}: {:?}", r.as_ref().map(Bytes::len));
        }
    }
    let exists = backend.exists(keys.clone(), NONE).await.unwrap();
    let want: Vec<Result<bool, KvError>> = (0..16).map(|i| Ok(i >= 8)).collect();
    assert_eq!(exists, want);
    // Deleting again is fine: delete is idempotent.
    let again = backend.delete(keys[..8].to_vec(), NONE).await.unwrap();
    assert!(again.iter().all(|r| r.is_ok()), "{again:?}");
    // The same key twice in one batch: both destinations filled.
    let twice = get(&backend, &[keys[9].clone(), keys[9].clone()], 65536, NONE).await.unwrap();
    assert!(twice.iter().all(|r| r.as_ref().is_ok_and(|g| g == &values[9])), "{twice:?}");

    // Seen by another vineyard client: the key's name under the default
    // prefix; an overwrite deletes the object it replaces, a delete the last.
    let mut raw = RawClient::connect(&server.endpoint()).await;
    let first = raw.named("kvplane:layer%2F9").await.expect("layer/9 is named kvplane:layer%2F9");
    assert!(raw.has_object(first).await);
    backend.put(vec![(keys[9].clone(), block(99))], NONE).await.unwrap()[0].clone().unwrap();
    let second = raw.named("kvplane:layer%2F9").await.expect("still named after an overwrite");
    assert_ne!(first, second);
    assert!(!raw.has_object(first).await, "the overwritten object {first:#x} is left behind");
    backend.delete(vec![keys[9].clone()], NONE).await.unwrap()[0].clone().unwrap();
    assert_eq!(raw.named("kvplane:layer%2F9").await, None);
    assert!(!raw.has_object(second).await, "the deleted object {second:#x} is left behind");
}

/// A bare vineyardd RPC client, to look at what the plugin stored.
struct RawClient(TcpStream);

impl RawClient {
    async fn connect(endpoint: &str) -> RawClient {
        let mut c = RawClient(TcpStream::connect(endpoint).await.unwrap());
        let reply = c
            .call(serde_json::json!({"type": "register_request", "version": "0.24.2", "store_type": 1, "session_id": 0, "username": "", "password": ""}))
            .await;
        assert_eq!(reply["type"], "register_reply", "{reply}");
        c
    }

    async fn call(&mut self, request: serde_json::Value) -> serde_json::Value {
        self.0.write_all(&framed(request.to_string().as_bytes())).await.unwrap();
        serde_json::from_slice(&read_frame(&mut self.0).await.unwrap()).unwrap()
    }

    /// The object `name` names.
    async fn named(&mut self, name: &str) -> Option<u64> {
        let reply = self.call(serde_json::json!({"type": "get_name_request", "name": name, "wait": false})).await;
        reply["object_id"].as_u64()
    }

    async fn has_object(&mut self, id: u64) -> bool {
        let reply = self.call(serde_json::json!({"type": "get_data_request", "id": [id], "sync_remote": false, "wait": false})).await;
        reply["content"].as_object().is_some_and(|c| !c.is_empty())
    }
}

/// 72 MiB in one put: more than the default `limits.queuedBytes` (64 MiB)
/// the plugin may queue before a flush.
#[tokio::test]
async fn a_batch_larger_than_the_queued_bytes_limit_is_stored() {
    if !in_private_network(module_path!(), "a_batch_larger_than_the_queued_bytes_limit_is_stored") {
        return;
    }
    let server = VineyardServer::start();
    let backend = load(decl(&server.endpoint(), &[]));
    let mib = |i: usize| Bytes::from((0..1usize << 20).map(|j| (j as u64 ^ (i as u64 * 0x9e37)) as u8).collect::<Vec<u8>>());
    let keys: Vec<Vec<u8>> = (0..72).map(|i| format!("big/{i}").into_bytes()).collect();
    let put = backend.put(keys.iter().cloned().zip((0..72).map(mib)).collect(), NONE).await.unwrap();
    assert!(put.iter().all(|r| r.is_ok()), "{:?}", put.iter().find(|r| r.is_err()));
    let got = get(&backend, &keys[..8], 1 << 20, NONE).await.unwrap();
    for (i, r) in got.iter().enumerate() {
        assert!(r.as_ref().is_ok_and(|g| g == &mib(i)), "key {i}: {:?}", r.as_ref().map(Bytes::len));
    }
    let got = get(&backend, &keys[64..], 1 << 20, NONE).await.unwrap();
    for (i, r) in got.iter().enumerate() {
        assert!(r.as_ref().is_ok_and(|g| g == &mib(64 + i)), "key {}: {:?}", 64 + i, r.as_ref().map(Bytes::len));
    }
}

/// A store without room for a value refuses it as `capacity`, stores
/// nothing, and keeps serving.
#[tokio::test]
async fn a_full_store_is_capacity_and_keeps_serving() {
    if !in_private_network(module_path!(), "a_full_store_is_capacity_and_keeps_serving") {
        return;
    }
    let server = VineyardServer::with_size("8Mi");
    let backend = load(decl(&server.endpoint(), &[]));
    let huge = Bytes::from(vec![7u8; 16 << 20]);
    let put = backend.put(vec![(b"huge".to_vec(), huge), (b"small".to_vec(), block(1))], NONE).await.unwrap();
    assert!(put.iter().all(|r| matches!(r, Err(KvError::Capacity(m)) if m.contains("create_remote_buffers_request"))), "{put:?}");
    assert_eq!(backend.exists(vec![b"huge".to_vec(), b"small".to_vec()], NONE).await.unwrap(), vec![Ok(false), Ok(false)]);
    let put = backend.put(vec![(b"small".to_vec(), block(1))], NONE).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    assert_eq!(get(&backend, &[b"small".to_vec()], 65536, NONE).await.unwrap()[0].as_ref().unwrap(), &block(1));
}

#[tokio::test]
async fn namespaces_and_prefixes_keep_keys_apart() {
    if !in_private_network(module_path!(), "namespaces_and_prefixes_keep_keys_apart") {
        return;
    }
    let server = VineyardServer::start();
    let a = load(decl(&server.endpoint(), &[("prefix", "tenant-a:")]));
    let b = load(decl(&server.endpoint(), &[("prefix", "tenant-b:")]));
    let key = b"shared".to_vec();
    a.put(vec![(key.clone(), Bytes::from_static(b"from a"))], NONE).await.unwrap()[0].clone().unwrap();
    a.put(vec![(key.clone(), Bytes::from_static(b"from a in ns1"))], in_namespace("ns1")).await.unwrap()[0].clone().unwrap();
    assert!(matches!(get(&b, std::slice::from_ref(&key), 64, NONE).await.unwrap()[0], Err(KvError::NotFound)));
    assert_eq!(get(&a, std::slice::from_ref(&key), 64, NONE).await.unwrap()[0].as_ref().unwrap(), &Bytes::from_static(b"from a"));
    assert_eq!(
        get(&a, std::slice::from_ref(&key), 64, in_namespace("ns1")).await.unwrap()[0].as_ref().unwrap(),
        &Bytes::from_static(b"from a in ns1")
    );
    assert_eq!(a.exists(vec![key.clone()], in_namespace("ns2")).await.unwrap()[0], Ok(false));
    // A namespace holding the separator is refused before any I/O.
    let bad = a.exists(vec![key.clone()], in_namespace("ns1:x")).await.unwrap();
    assert!(matches!(&bad[0], Err(KvError::Invalid(m)) if m.contains("namespace")), "{bad:?}");
    // vineyardd has no expiry: a ttl is refused, not ignored.
    let ttl =
        a.put(vec![(key.clone(), Bytes::from_static(b"x"))], BackendCallOptions { ttl_ms: Some(1000), namespace: None }).await.unwrap();
    assert!(matches!(&ttl[0], Err(KvError::Unsupported(m)) if m.contains("ttl")), "{ttl:?}");
    assert_eq!(get(&a, &[key], 64, NONE).await.unwrap()[0].as_ref().unwrap(), &Bytes::from_static(b"from a"));
}

#[tokio::test]
async fn a_killed_vineyardd_is_unavailable_and_a_restarted_one_serves_again() {
    if !in_private_network(module_path!(), "a_killed_vineyardd_is_unavailable_and_a_restarted_one_serves_again") {
        return;
    }
    let mut server = VineyardServer::start();
    let backend = load(decl(&server.endpoint(), &[]));
    let put = backend.put(vec![(b"k".to_vec(), block(1))], NONE).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    server.kill();
    match get(&backend, &[b"k".to_vec(), b"k2".to_vec()], 65536, NONE).await {
        Ok(r) => assert!(r.iter().all(|r| matches!(r, Err(KvError::Unavailable(_)))), "{r:?}"),
        Err(e) => assert!(matches!(e.fault, Fault::Returned(KvError::Unavailable(_))), "{e}"),
    }
    let put = backend.put(vec![(b"k".to_vec(), block(2))], NONE).await.unwrap();
    assert!(matches!(&put[0], Err(KvError::Unavailable(_))), "{put:?}");
    // The same plugin instance reconnects once the store is back (empty:
    // local metadata is not kept).
    server.restart();
    let put = backend.put(vec![(b"k".to_vec(), block(3))], NONE).await.unwrap();
    assert!(put[0].is_ok(), "{put:?}");
    let got = get(&backend, &[b"k".to_vec()], 65536, NONE).await.unwrap();
    assert_eq!(got[0].as_ref().unwrap(), &block(3));
}

#[tokio::test]
async fn bad_config_is_refused_naming_the_key() {
    for (extra, key) in [(&[("prefix", "a/b")][..], "prefix"), (&[("ttl-seconds", "5")][..], "ttl-seconds")] {
        let backend = load(decl("127.0.0.1:9600", extra));
        let e = backend.exists(vec![b"k".to_vec()], NONE).await.expect_err("a bad config must fail open()");
        assert!(matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.starts_with(&format!("config {key}="))), "{e}");
    }
    let mut no_endpoint = decl("127.0.0.1:9600", &[]);
    no_endpoint.config.remove("endpoint");
    let e = load(no_endpoint).exists(vec![b"k".to_vec()], NONE).await.expect_err("no endpoint");
    assert!(matches!(&e.fault, Fault::Configure(KvError::Invalid(m)) if m.starts_with("config endpoint")), "{e}");
}

/// What the hostile peer answers.
#[derive(Clone, Copy)]
enum Garbage {
    /// To the first message, text that is no vineyard frame ("HTTP/1.1"
    /// read as a length is far too large).
    Http,
    /// To the first message, a frame whose body is not JSON.
    NotJson,
    /// A proper register reply, then to the next message a frame that
    /// announces 100 bytes and holds 10 before the peer closes.
    ShortAfterRegister,
    /// A proper register reply, then JSON of the wrong type.
    WrongTypeAfterRegister,
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

async fn read_frame(sock: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut header = [0u8; 8];
    sock.read_exact(&mut header).await?;
    let mut body = vec![0u8; u64::from_le_bytes(header).min(1 << 20) as usize];
    sock.read_exact(&mut body).await?;
    Ok(body)
}

async fn answer_garbage(mut sock: TcpStream, how: Garbage) -> std::io::Result<()> {
    read_frame(&mut sock).await?;
    let register =
        framed(br#"{"type":"register_reply","instance_id":0,"ipc_socket":"","rpc_endpoint":"","session_id":0,"version":"0.24.2"}"#);
    match how {
        Garbage::Http => sock.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n").await?,
        Garbage::NotJson => sock.write_all(&framed(b"+OK this is not vineyard")).await?,
        Garbage::ShortAfterRegister => {
            sock.write_all(&register).await?;
            read_frame(&mut sock).await?;
            let mut short = 100u64.to_le_bytes().to_vec();
            short.extend_from_slice(b"{\"type\":\"c");
            sock.write_all(&short).await?;
            // And hangs up, 90 bytes short.
            return Ok(());
        }
        Garbage::WrongTypeAfterRegister => {
            sock.write_all(&register).await?;
            read_frame(&mut sock).await?;
            sock.write_all(&framed(br#"{"type":"get_name_reply","object_id":1}"#)).await?;
        }
    }
    // Whatever the plugin sends next goes unanswered until it hangs up.
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut rest)).await;
    Ok(())
}

/// A peer that answers garbage gets a typed error naming what was wrong,
/// and nothing is reported stored.
#[tokio::test]
async fn a_server_answering_garbage_is_a_typed_error_and_nothing_is_stored() {
    for (how, expect) in [
        (Garbage::Http, "more than"),
        (Garbage::NotJson, "not JSON"),
        (Garbage::ShortAfterRegister, ""),
        (Garbage::WrongTypeAfterRegister, "expected a create_buffers_reply"),
    ] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = listener.local_addr().unwrap().to_string();
        let peer = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(answer_garbage(sock, how));
            }
        });
        let backend = load(decl(&endpoint, &[]));
        let put = backend.put(vec![(b"k".to_vec(), block(1)), (b"k2".to_vec(), Bytes::from_static(b"v"))], NONE).await;
        match (how, put) {
            // The register reply is the one at fault: open() fails.
            (Garbage::Http | Garbage::NotJson, Err(e)) => {
                assert!(
                    matches!(&e.fault, Fault::Configure(KvError::Internal(m)) if m.contains("register_request") && m.contains(expect)),
                    "{e}"
                );
            }
            (Garbage::ShortAfterRegister, Ok(r)) => {
                assert!(r.iter().all(|r| matches!(r, Err(KvError::Unavailable(_)))), "{r:?}");
            }
            (Garbage::WrongTypeAfterRegister, Ok(r)) => {
                assert!(
                    r.iter().all(
                        |r| matches!(r, Err(KvError::Internal(m)) if m.contains("create_remote_buffers_request") && m.contains(expect))
                    ),
                    "{r:?}"
                );
            }
            (_, other) => panic!("unexpected answer: {other:?}"),
        }
        peer.abort();
    }
}
