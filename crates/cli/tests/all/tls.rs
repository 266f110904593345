//! TLS on a real `kvplane node` process's TCP port (issue 21, item 1):
//! certificates made here with rcgen (a CA, server certificates for
//! 127.0.0.1 and localhost, an expired one, one for another name, client
//! certificates), the Rust client and the CLI as users run them. Each
//! refusal must reach the caller as its own readable message.

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, ClientTls, Endpoint, KvError};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};

use crate::support::{run, text, NodeProcess};

const PATIENCE: Duration = Duration::from_secs(30);

/// A certificate authority of the test's own (the operator tests' too).
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

/// A certificate and its key, as PEM files in the test's directory.
struct Issued {
    cert: PathBuf,
    key: PathBuf,
}

pub enum Use {
    Server,
    Client,
    /// A cluster member's: it serves, and presents it to its peers.
    Both,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("generating a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let cert = params.self_signed(&key).expect("self-signing the CA");
        Ca { pem: cert.pem(), issuer: Issuer::new(params, key) }
    }

    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(format!("{name}.pem"));
        std::fs::write(&path, &self.pem).unwrap();
        path
    }

    /// A certificate for `names` (DNS names or IP addresses), expired a
    /// year ago when `expired`, written as `NAME.crt` and `NAME.key`.
    fn issue(&self, dir: &Path, name: &str, names: &[&str], usage: Use, expired: bool) -> Issued {
        let (cert, key) = self.sign(names, Some(name), usage, expired);
        let issued = Issued { cert: dir.join(format!("{name}.crt")), key: dir.join(format!("{name}.key")) };
        std::fs::write(&issued.cert, cert).unwrap();
        std::fs::write(&issued.key, key).unwrap();
        issued
    }

    /// A certificate for `names` with Common Name `cn` (none: an empty
    /// subject, as etcd's gateway wants of a user's client certificate),
    /// as PEM: the certificate and its key.
    pub fn sign(&self, names: &[&str], cn: Option<&str>, usage: Use, expired: bool) -> (String, String) {
        let key = KeyPair::generate().expect("generating a key");
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(cn) = cn {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        params.extended_key_usages = match usage {
            Use::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
            Use::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
            Use::Both => vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
        };
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.issuer).expect("signing");
        (cert.pem(), key.serialize_pem())
    }
}

/// `kvplane ARGS` expected to exit, as a node that refuses to start does,
/// within [`PATIENCE`]; one that serves instead is killed by PID and the
/// test fails saying so.
fn refused(args: &[&str]) -> std::process::Output {
    let mut child = crate::support::kvplane()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting kvplane");
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > PATIENCE {
            let _ = child.kill();
            panic!("kvplane {args:?} started instead of refusing: {}", text(&child.wait_with_output().unwrap()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn tls_node(cert: &Issued, extra: &[&str]) -> NodeProcess {
    let mut args = vec!["--memory", "16MiB", "--tls-cert", s(&cert.cert), "--tls-key", s(&cert.key)];
    args.extend_from_slice(extra);
    NodeProcess::start(&args)
}

async fn connect(node: &NodeProcess, tls: Option<ClientTls>) -> Result<Client, KvError> {
    let mut config = ClientConfig::new(Endpoint::Tcp(node.endpoint.clone()));
    config.connections = 1;
    config.timeout = PATIENCE;
    config.tls = tls;
    Client::connect(config).await
}

fn trusting(ca: &Path) -> ClientTls {
    ClientTls::new(ca, None, None).expect("a CA file")
}

/// The error a connect got, as the user reads it.
async fn refusal(node: &NodeProcess, tls: Option<ClientTls>) -> String {
    match connect(node, tls).await {
        Ok(_) => panic!("{} accepted the connection", node.endpoint),
        Err(e) => {
            // What each refusal prints, in the test's output.
            eprintln!("refused: {e}");
            e.to_string()
        }
    }
}

fn assert_names(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(message.contains(needle), "{needle:?} is not in the error: {message}");
    }
}

async fn stat(client: &Client, name: &str) -> u64 {
    let stats = client.stats().await.expect("STATS");
    stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap_or_else(|| panic!("no stat {name} in {stats:?}"))
}

async fn round_trip(client: &Client, key: &str) {
    let value = Bytes::from(vec![7u8; 64 << 10]);
    client.put(vec![(Bytes::from(key.to_string()), value.clone())]).await.unwrap().pop().unwrap().expect("PUT over TLS");
    let got = client.get(vec![Bytes::from(key.to_string())]).await.unwrap().pop().unwrap().expect("GET over TLS");
    assert_eq!(got, value);
}

/// A TLS node serves a client that trusts its CA (by its IP address, and by
/// a name its certificate carries), and the Unix socket beside it keeps its
/// shared memory without TLS. Each refusal is a message of its own: another
/// CA, an expired certificate, a certificate for another name, a plaintext
/// client on the TLS port, a TLS client on a plaintext port; the node
/// counts what it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_and_names_each_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvplane-test-ca");
    let ca_file = ca.write(dir.path(), "ca");
    let other_ca = Ca::new("another-ca").write(dir.path(), "other-ca");
    let good = ca.issue(dir.path(), "node", &["127.0.0.1", "localhost"], Use::Server, false);
    let sock = dir.path().join("node.sock");
    let node = tls_node(&good, &["--unix", s(&sock)]);
    assert!(node.log.lock().unwrap().iter().any(|l| l.contains("(TLS)")), "the serving line says TLS: {:?}", node.log.lock().unwrap());

    let client = connect(&node, Some(trusting(&ca_file))).await.expect("a client trusting the CA connects");
    round_trip(&client, "over-tls").await;
    let by_name = ClientTls::new(&ca_file, None, Some("localhost")).unwrap();
    round_trip(&connect(&node, Some(by_name)).await.expect("the server name localhost is on the certificate"), "by-name").await;

    // The same-host path is unchanged: no TLS, shared memory.
    let local = Client::connect(ClientConfig::new(Endpoint::Unix(sock.clone()))).await.expect("the unix socket serves");
    assert!(local.connection().await.unwrap().shared_memory().is_some(), "the unix socket shares memory");
    assert_eq!(local.get(vec![Bytes::from("over-tls")]).await.unwrap()[0].as_ref().map(|b| b.len()), Ok(64 << 10));

    let e = refusal(&node, Some(trusting(&other_ca))).await;
    assert_names(&e, &["TLS: the certificate of", "is not signed by a CA in", s(&other_ca), "(unknown issuer)"]);

    let e = refusal(&node, Some(ClientTls::new(&ca_file, None, Some("cache.example")).unwrap())).await;
    assert_names(&e, &["TLS: the certificate of", "is not valid for the name \"cache.example\"", "127.0.0.1", "localhost"]);

    let e = refusal(&node, None).await;
    assert_names(&e, &["refused the handshake", "this port requires TLS (the node runs with --tls-cert)"]);

    assert_eq!(stat(&client, "tls_handshake_failures_plaintext").await, 1);
    assert_eq!(stat(&client, "tls_handshake_failures_client_refused").await, 2, "the client refused the node's certificate twice");
    assert!(stat(&client, "tls_handshakes").await >= 2);
    // The open connection's TLS buffers are counted: its receive buffer of
    // 256 KiB and the send buffer that carried the 64 KiB answer.
    let held = stat(&client, "tls_buffer_bytes").await;
    assert!(held >= (256 + 64) << 10, "tls_buffer_bytes {held} with a connection open that read 64 KiB");

    // An expired certificate, and one for another name only.
    let expired = tls_node(&ca.issue(dir.path(), "expired", &["127.0.0.1"], Use::Server, true), &[]);
    let e = refusal(&expired, Some(trusting(&ca_file))).await;
    assert_names(&e, &["TLS: the certificate of", "has expired (", "days ago): the node needs a renewed certificate"]);
    let elsewhere = tls_node(&ca.issue(dir.path(), "elsewhere", &["elsewhere.example"], Use::Server, false), &[]);
    let e = refusal(&elsewhere, Some(trusting(&ca_file))).await;
    assert_names(&e, &["is not valid for the name \"127.0.0.1\"", "(it is for elsewhere.example)"]);

    // A TLS client on a port without TLS.
    let plain = NodeProcess::start(&["--memory", "16MiB"]);
    let e = refusal(&plain, Some(trusting(&ca_file))).await;
    assert_names(&e, &["TLS:", "does not speak TLS on this port", "the node runs without --tls-cert"]);
    let plain_client = connect(&plain, None).await.expect("a plaintext client");
    assert_eq!(stat(&plain_client, "protocol_errors").await, 1, "the node counted the ClientHello");

    // The CLI, with its flags.
    let data = dir.path().join("data.bin");
    std::fs::write(&data, b"written by the CLI over TLS").unwrap();
    let out = run(&["put", "--endpoint", &node.endpoint, "--tls-ca", s(&ca_file), "cli-key", s(&data)]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&["get", "--endpoint", &node.endpoint, "--tls-ca", s(&ca_file), "cli-key"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(out.stdout, b"written by the CLI over TLS");
    let out = run(&["stats", "--endpoint", &node.endpoint, "--tls-ca", s(&other_ca)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert_names(&text(&out), &["error: connecting to the node at", "(unknown issuer)"]);
    let out = run(&["stats", "--endpoint", &node.endpoint, "--tls-ca", s(&dir.path().join("missing.pem"))]);
    assert_names(&text(&out), &["--tls-ca", "missing.pem"]);
}

/// With --tls-client-ca every client must present a certificate that CA
/// signed: none, one from another CA and an expired one are refused, each
/// saying so, and a good one is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_clients_without_a_good_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvplane-test-ca");
    let ca_file = ca.write(dir.path(), "ca");
    let clients = Ca::new("clients-ca");
    let clients_file = clients.write(dir.path(), "clients-ca");
    let rogue = Ca::new("rogue-ca");
    let server = ca.issue(dir.path(), "node", &["127.0.0.1"], Use::Server, false);
    let node = tls_node(&server, &["--tls-client-ca", s(&clients_file)]);
    let with = |issued: &Issued| ClientTls::new(&ca_file, Some((&issued.cert, &issued.key)), None).unwrap();

    let engine = clients.issue(dir.path(), "engine", &["engine"], Use::Client, false);
    let client = connect(&node, Some(with(&engine))).await.expect("a client with a certificate the client CA signed");
    round_trip(&client, "mtls").await;

    let e = refusal(&node, Some(trusting(&ca_file))).await;
    assert_names(&e, &["TLS:", "requires a client certificate (mutual TLS: the node runs with --tls-client-ca)"]);
    let e = refusal(&node, Some(with(&rogue.issue(dir.path(), "rogue", &["rogue"], Use::Client, false)))).await;
    assert_names(&e, &["TLS:", "refused this client's certificate", "rogue.crt", "(alert UnknownCA)"]);
    let e = refusal(&node, Some(with(&clients.issue(dir.path(), "old", &["old"], Use::Client, true)))).await;
    assert_names(&e, &["TLS:", "refused this client's certificate", "old.crt", "(alert CertificateExpired)"]);
    let e = refusal(&node, None).await;
    assert_names(&e, &["this port requires TLS with a client certificate"]);

    assert_eq!(stat(&client, "tls_handshake_failures_no_client_cert").await, 1);
    assert_eq!(stat(&client, "tls_handshake_failures_bad_client_cert").await, 2);
    assert_eq!(stat(&client, "tls_handshake_failures_plaintext").await, 1);
}

/// The files are read again while the node serves: a connection opened
/// before a rotation keeps working, a new one gets the new certificate (a
/// client trusting only the old CA is refused, one trusting the new CA is
/// served); a key that does not match its certificate is refused, counted
/// and logged, and the certificate before keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_reaches_new_connections_and_spares_open_ones() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = Ca::new("old-ca");
    let old_ca_file = old_ca.write(dir.path(), "old-ca");
    let new_ca = Ca::new("new-ca");
    let new_ca_file = new_ca.write(dir.path(), "new-ca");
    let served = old_ca.issue(dir.path(), "served", &["127.0.0.1"], Use::Server, false);
    let node = tls_node(&served, &["--tls-reload-interval", "1s"]);
    let open = connect(&node, Some(trusting(&old_ca_file))).await.expect("connected before the rotation");
    round_trip(&open, "before").await;
    assert!(connect(&node, Some(trusting(&new_ca_file))).await.is_err(), "the new CA is not served yet");

    // A rotation as a Secret volume does it: new files moved into place.
    let rotated = new_ca.issue(dir.path(), "rotated", &["127.0.0.1"], Use::Server, false);
    std::fs::rename(&rotated.cert, &served.cert).unwrap();
    std::fs::rename(&rotated.key, &served.key).unwrap();
    let deadline = Instant::now() + PATIENCE;
    while stat(&open, "tls_reloads").await < 1 {
        assert!(Instant::now() < deadline, "the node did not reload within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    round_trip(&open, "after").await;
    let e = refusal(&node, Some(trusting(&old_ca_file))).await;
    assert_names(&e, &["(unknown issuer)"]);
    let fresh = connect(&node, Some(trusting(&new_ca_file))).await.expect("a new connection gets the new certificate");
    round_trip(&fresh, "fresh").await;

    // A key of another certificate: refused, the certificate before serves.
    let stray = new_ca.issue(dir.path(), "stray", &["127.0.0.1"], Use::Server, false);
    std::fs::rename(&stray.key, &served.key).unwrap();
    while stat(&open, "tls_reload_failures").await < 1 {
        assert!(Instant::now() < deadline, "the failed reload was not counted within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    connect(&node, Some(trusting(&new_ca_file))).await.expect("the certificate loaded before still serves");
    // The node logs the failure twice (tracing, then its own line to
    // stderr): wait for the line the assertion reads.
    let log = node.said_eventually("TLS reload failed, the certificate loaded before keeps serving", PATIENCE);
    assert_names(&log, &["TLS reload failed, the certificate loaded before keeps serving", "--tls-key"]);
    assert_eq!(stat(&open, "tls_reloads").await, 1);
    // Reported once, not every period.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(stat(&open, "tls_reload_failures").await, 1);
}

/// A client that opens a TLS handshake and stalls, or sends nothing, is
/// cut at --handshake-timeout and counted; the node serves others
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tls_handshake_is_cut_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvplane-test-ca");
    let ca_file = ca.write(dir.path(), "ca");
    let node = tls_node(&ca.issue(dir.path(), "node", &["127.0.0.1"], Use::Server, false), &["--handshake-timeout", "1s"]);
    let client = connect(&node, Some(trusting(&ca_file))).await.unwrap();
    for first in [&[0x16u8, 0x03, 0x01][..], &[][..]] {
        let started = Instant::now();
        let mut stalled = std::net::TcpStream::connect(&node.endpoint).unwrap();
        stalled.set_read_timeout(Some(PATIENCE)).unwrap();
        stalled.write_all(first).unwrap();
        round_trip(&client, "meanwhile").await;
        let mut rest = Vec::new();
        let closed = match stalled.read_to_end(&mut rest) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        let took = started.elapsed();
        assert!(closed, "the stalled handshake was not closed within {PATIENCE:?}");
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(10), "closed after {took:?}");
    }
    assert_eq!(stat(&client, "tls_handshake_failures_timeout").await, 2);
    assert_eq!(stat(&client, "handshake_failures").await, 2);
}

/// A client CA counts as credentials for a port other hosts can reach; a
/// certificate alone does not (TLS hides the bytes, it does not say who
/// may read them). Binds every address: runs in a private network namespace.
#[test]
fn tls_alone_is_not_credentials_for_a_port_others_reach_a_client_ca_is() {
    use kvplane_tests::vineyard::in_private_network;
    if !in_private_network(module_path!(), "tls_alone_is_not_credentials_for_a_port_others_reach_a_client_ca_is") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvplane-test-ca");
    let ca_file = ca.write(dir.path(), "ca");
    let cert = ca.issue(dir.path(), "node", &["127.0.0.1"], Use::Server, false);
    let base =
        ["node", "--listen", "0.0.0.0:0", "--admin", "none", "--memory", "16MiB", "--tls-cert", s(&cert.cert), "--tls-key", s(&cert.key)];
    let out = refused(&base);
    assert!(!out.status.success(), "{}", text(&out));
    assert_names(&text(&out), &["--listen 0.0.0.0:0", "--tls-client-ca", "TLS alone is not credentials", "--allow-unauthenticated"]);

    let mut node =
        crate::support::kvplane().args(base).args(["--tls-client-ca", s(&ca_file)]).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let stderr = node.stderr.take().unwrap();
    let line = crate::support::wait_for_line(&mut node, stderr, "kvplane node serving", "kvplane node");
    let _ = node.kill();
    let _ = node.wait();
    assert!(line.contains("tcp 0.0.0.0:") && line.contains("(TLS, client certificates required)"), "{line}");
}

/// Cluster members copy blocks to each other (hand-off, repair): a
/// cluster node with TLS refuses to start without `cluster.peerTls`, the
/// TLS its peer clients speak, naming the field, rather than leave keys
/// unreplicated; so does one with `peerTls` but no TLS of its own, and one
/// whose `--tls-client-ca` would refuse its peers' certificate-less clients.
#[test]
fn a_cluster_node_with_tls_refuses_to_start_without_peer_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvplane-test-ca");
    let ca_file = ca.write(dir.path(), "ca");
    let cert = ca.issue(dir.path(), "node", &["127.0.0.1"], Use::Server, false);
    let config = |name: &str, peer_tls: serde_json::Value| {
        let mut cluster = serde_json::json!({"nodeId": "n0"});
        if !peer_tls.is_null() {
            cluster["peerTls"] = peer_tls;
        }
        let file = serde_json::json!({"backend": "kvplane", "metadata": {"etcd": ["http://127.0.0.1:9"]}, "cluster": cluster});
        let path = dir.path().join(name);
        std::fs::write(&path, file.to_string()).unwrap();
        path
    };
    let node = |config: &Path, tls: &[&str]| {
        let mut args = vec!["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "16MiB", "--config", s(config)];
        args.extend_from_slice(tls);
        let out = refused(&args);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        eprintln!("refused: {}", text(&out).lines().last().unwrap_or_default());
        text(&out)
    };
    let tls = ["--tls-cert", s(&cert.cert), "--tls-key", s(&cert.key)];
    let without = config("without.json", serde_json::Value::Null);
    assert_names(&node(&without, &tls), &["cluster mode with --tls-cert needs cluster.peerTls", "caFile", "hand-off, repair"]);
    let with = config("with.json", serde_json::json!({"caFile": s(&ca_file)}));
    assert_names(&node(&with, &[]), &["cluster.peerTls is set but this node serves no TLS", "--tls-cert"]);
    let mut mutual = tls.to_vec();
    mutual.extend(["--tls-client-ca", s(&ca_file)]);
    assert_names(&node(&with, &mutual), &["--tls-client-ca", "cluster.peerTls.certFile"]);
}

/// The name every member's certificate carries and peers and clients check
/// (members are reached by address, which changes with each restart).
const MEMBER_NAME: &str = "kvplane-cache.test.svc";

/// A member of cluster `tls` (one owner per key) serving mutual TLS with
/// `cert`, its peer clients presenting the same certificate
/// (`cluster.peerTls`).
fn tls_member(dir: &Path, id: &str, etcd: &[String], ca: &Path, cert: &Issued) -> NodeProcess {
    let config = serde_json::json!({
        "backend": "kvplane",
        "metadata": {"etcd": etcd},
        "cluster": {
            "name": "tls",
            "nodeId": id,
            "replicas": 1,
            "leaseTtlSeconds": 2,
            "peerTls": {"caFile": s(ca), "certFile": s(&cert.cert), "keyFile": s(&cert.key), "serverName": MEMBER_NAME},
        },
    });
    let path = dir.join(format!("{id}.json"));
    std::fs::write(&path, config.to_string()).unwrap();
    NodeProcess::start_with_env(
        &["--config", s(&path), "--memory", "64MiB", "--tls-cert", s(&cert.cert), "--tls-key", s(&cert.key), "--tls-client-ca", s(ca)],
        &[("KVPLANE_CACHE_DIR", dir.join("cache"))],
    )
}

/// Two members with mutual TLS and `cluster.peerTls` (real etcd, real node
/// processes, certificates for [`MEMBER_NAME`] only, as cert-manager would
/// issue them): the member that drains hands every block it holds to the
/// other over TLS, and a TLS cluster client then reads every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_member_hands_its_keys_off_to_its_peer_over_tls() {
    let etcd = crate::etcd::EtcdCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("kvplane-test-ca");
    let ca_file = ca.write(dir.path(), "ca");
    let cert = ca.issue(dir.path(), "member", &[MEMBER_NAME], Use::Both, false);
    let n0 = tls_member(dir.path(), "n0", &etcd.endpoints(), &ca_file, &cert);
    let n1 = tls_member(dir.path(), "n1", &etcd.endpoints(), &ca_file, &cert);

    let mut config = kvplane_client::ClusterClientConfig::new(vec![Endpoint::Tcp(n0.endpoint.clone())]);
    config.tls = Some(ClientTls::new(&ca_file, Some((&cert.cert, &cert.key)), Some(MEMBER_NAME)).unwrap());
    config.write_quorum = Some(1);
    config.timeout = PATIENCE;
    let c = kvplane_client::ClusterClient::connect(config).await.expect("the TLS cluster client connects");
    crate::etcd::eventually("a table with members n0 and n1", Duration::from_secs(60), || {
        let mut have: Vec<String> = c.table().members().iter().map(|m| m.id.clone()).collect();
        have.sort_unstable();
        (have == ["n0", "n1"]).then_some(())
    })
    .await;
    let value = |k: &str| Bytes::from(k.repeat(512));
    let keys: Vec<String> = (0..200).map(|i| format!("tls-drain/k{i}")).collect();
    let entries: Vec<(Bytes, Bytes)> = keys.iter().map(|k| (Bytes::from(k.clone()), value(k))).collect();
    assert!(c.put(entries).await.unwrap().iter().all(Result::is_ok));
    let table = c.table();
    let on_n1 = keys.iter().filter(|k| table.owner_members(k.as_bytes()).next().is_some_and(|m| m.id == "n1")).count();
    assert!(on_n1 > 0, "n1 owns some keys");

    let log = std::sync::Arc::clone(&n1.log);
    let status = tokio::task::spawn_blocking(move || n1.sigterm_and_wait()).await.unwrap();
    assert!(status.success(), "the draining member exits cleanly: {status}");
    let said = log.lock().unwrap().join("\n");
    assert!(said.contains(&format!("handed {on_n1} blocks to their new owners (0 not taken)")), "{said}");

    crate::etcd::eventually("a table with n0 alone", Duration::from_secs(60), || {
        (c.table().members().iter().map(|m| m.id.as_str()).collect::<Vec<_>>() == ["n0"]).then_some(())
    })
    .await;
    let got = c.get(keys.iter().map(|k| Bytes::from(k.clone())).collect()).await.unwrap();
    for (k, r) in keys.iter().zip(got) {
        assert_eq!(r.unwrap_or_else(|e| panic!("{k}: {e}")), value(k), "{k}");
    }
    drop(n0);
}
