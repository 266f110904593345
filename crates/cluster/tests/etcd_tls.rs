//! Membership through a real etcd that serves TLS and requires client
//! certificates (`--client-cert-auth`), and with etcd's user authentication
//! enabled: certificates made here with rcgen, etcd on loopback.

// A test binary exports nothing: its modules' `pub` items are for each
// other, so `unreachable_pub` (denied for the workspace) would flag them all.
#![allow(unreachable_pub)]

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvplane_cluster::{EtcdAuth, EtcdTls, Membership, MembershipWatch, Options, Registration};
use kvplane_slots::Member;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use support::TlsEtcd;

/// Deadline for anything the tests wait for; generous for a loaded machine.
const PATIENCE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(5);

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    file: PathBuf,
}

struct Issued {
    cert: PathBuf,
    key: PathBuf,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let cert = params.self_signed(&key).unwrap();
        let file = dir.join(format!("{name}.pem"));
        std::fs::write(&file, cert.pem()).unwrap();
        Ca { issuer: Issuer::new(params, key), file }
    }

    /// A certificate for `names`, with the Common Name `name` unless
    /// `anonymous` (etcd's gateway with auth enabled wants none).
    fn issue(&self, dir: &Path, name: &str, names: &[&str], usages: Vec<ExtendedKeyUsagePurpose>) -> Issued {
        self.issue_as(dir, name, names, usages, false)
    }

    fn issue_as(&self, dir: &Path, name: &str, names: &[&str], usages: Vec<ExtendedKeyUsagePurpose>, anonymous: bool) -> Issued {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        if !anonymous {
            params.distinguished_name.push(DnType::CommonName, name);
        }
        params.extended_key_usages = usages;
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let issued = Issued { cert: dir.join(format!("{name}.crt")), key: dir.join(format!("{name}.key")) };
        std::fs::write(&issued.cert, cert.pem()).unwrap();
        std::fs::write(&issued.key, key.serialize_pem()).unwrap();
        issued
    }
}

/// A CA, etcd's certificate for 127.0.0.1 (with client use too: etcd's
/// JSON gateway dials etcd's own gRPC port presenting it, and
/// `--client-cert-auth` checks it as a client certificate), a client
/// certificate it signed, and one another CA signed.
struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    other_ca: Ca,
    server: Issued,
    client: Issued,
    /// A client certificate without a Common Name.
    anonymous: Issued,
    rogue: Issued,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "etcd-ca");
    let other_ca = Ca::new(dir.path(), "other-ca");
    let both = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let server = ca.issue(dir.path(), "etcd-server", &["127.0.0.1", "localhost"], both);
    let client = ca.issue(dir.path(), "kvplane-node", &[], vec![ExtendedKeyUsagePurpose::ClientAuth]);
    let anonymous = ca.issue_as(dir.path(), "anonymous", &[], vec![ExtendedKeyUsagePurpose::ClientAuth], true);
    let rogue = other_ca.issue(dir.path(), "rogue", &[], vec![ExtendedKeyUsagePurpose::ClientAuth]);
    Pki { dir, ca, other_ca, server, client, anonymous, rogue }
}

fn tls(ca: &Path, client: Option<&Issued>) -> EtcdTls {
    EtcdTls { ca_file: ca.to_path_buf(), cert_file: client.map(|c| c.cert.clone()), key_file: client.map(|c| c.key.clone()) }
}

fn options(tls: Option<EtcdTls>, auth: Option<EtcdAuth>, request_timeout: Duration) -> Options {
    Options { request_timeout, tls, auth, ..Options::default() }
}

fn member(i: usize) -> Member {
    Member::up(format!("n{i}"), format!("10.0.0.{i}:9600"))
}

/// The error of a registration expected to fail.
async fn refused(endpoint: &str, cluster: &str, options: Options) -> String {
    match Membership::register_with(&[endpoint], cluster, member(9), TTL, options).await {
        Ok(_) => panic!("registered in {cluster} where it should have been refused"),
        Err(e) => {
            // What each refusal prints, in the test's output.
            eprintln!("refused: {e}");
            e.to_string()
        }
    }
}

fn assert_names(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(message.contains(needle), "{needle:?} is not in: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_registers_over_tls_with_a_client_certificate_and_other_clients_are_refused_saying_why() {
    support::log_to_test_output();
    let p = pki();
    let etcd = TlsEtcd::start(&p.server.cert, &p.server.key, &p.ca.file, true);
    let endpoint = etcd.endpoint();

    // The first call also waits for etcd's leader: a long timeout.
    let good = options(Some(tls(&p.ca.file, Some(&p.client))), None, PATIENCE);
    let m = Membership::register_with(&[endpoint.as_str()], "tls", member(0), TTL, good.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}; etcd's log:\n{}", etcd.log()));
    assert_eq!(m.registration(), Registration::Registered);
    // A bare host:port means https:// once TLS is set.
    let bare = endpoint.trim_start_matches("https://").to_string();
    let watch = MembershipWatch::start_with(&[bare.as_str()], "tls", good.clone()).await.unwrap();
    assert_eq!(watch.current().members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["n0"]);

    let short = Duration::from_millis(1500);
    // A client certificate another CA signed: etcd refuses the handshake.
    let err = refused(&endpoint, "tls", options(Some(tls(&p.ca.file, Some(&p.rogue))), None, short)).await;
    assert_names(&err, &[&endpoint, "TLS: etcd refused the connection", "rogue.crt"]);
    // No client certificate at all.
    let err = refused(&endpoint, "tls", options(Some(tls(&p.ca.file, None)), None, short)).await;
    assert_names(&err, &[&endpoint, "TLS: etcd refused the connection", "no client certificate (set certFile and keyFile)"]);
    // etcd's certificate checked against another CA.
    let err = refused(&endpoint, "tls", options(Some(tls(&p.other_ca.file, Some(&p.client))), None, short)).await;
    assert_names(&err, &[&endpoint, "TLS: etcd's certificate is not signed by a CA in", "other-ca.pem", "unknown issuer"]);
    // Plain HTTP to the TLS port.
    let plain = format!("http://{bare}");
    let err = refused(&plain, "tls", options(None, None, short)).await;
    assert_names(&err, &[&plain, "connection closed", "an etcd serving TLS on this port", "cluster.etcd.tls"]);
    // Settings that contradict each other are refused before any call.
    let err = refused(&plain, "tls", good.clone()).await;
    assert_names(&err, &["http:// with TLS configured"]);
    let err = refused(&endpoint, "tls", options(None, None, short)).await;
    assert_names(&err, &["https:// needs TLS settings", "cluster.etcd.tls.caFile"]);
    let missing = p.dir.path().join("missing.pem");
    let err = refused(&endpoint, "tls", options(Some(tls(&missing, None)), None, short)).await;
    assert_names(&err, &["etcd TLS file", "missing.pem", "cannot be read"]);

    m.leave().await.unwrap();
}

/// `POST path` as the test's set-up client, for the test's own set-up.
async fn admin(http: &reqwest::Client, endpoint: &str, path: &str, body: serde_json::Value, token: Option<&str>) -> serde_json::Value {
    let mut request = http.post(format!("{endpoint}{path}")).body(body.to_string());
    if let Some(token) = token {
        request = request.header("Authorization", token);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("{path}: {e:?}"));
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{path}: HTTP {status}: {text}");
    serde_json::from_str(&text).unwrap()
}

fn b64(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// etcd with `auth enable`, as `etcdctl user add / role grant-permission /
/// auth enable` would set it up (the tools here build no etcdctl, so the
/// same calls go through etcd's gateway): user `kvplane` may read and
/// write `/kvplane/auth/` only. Clients present a certificate without a
/// Common Name: etcd's gateway with auth enabled refuses one with a CN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_authenticates_as_an_etcd_user_and_again_after_etcd_forgot_its_token() {
    support::log_to_test_output();
    let p = pki();
    let mut etcd = TlsEtcd::start(&p.server.cert, &p.server.key, &p.ca.file, true);
    let endpoint = etcd.endpoint();
    let good_tls = tls(&p.ca.file, Some(&p.anonymous));
    let http = reqwest::Client::builder().tls_backend_preconfigured(admin_tls(&p)).timeout(Duration::from_secs(5)).build().unwrap();
    // The first call waits for etcd's leader.
    let started = std::time::Instant::now();
    loop {
        match http.post(format!("{endpoint}/v3/auth/status")).body("{}").send().await {
            Ok(r) if r.status().is_success() => break,
            other => assert!(started.elapsed() < PATIENCE, "etcd did not answer: {other:?}; log:\n{}", etcd.log()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    admin(&http, &endpoint, "/v3/auth/user/add", serde_json::json!({"name": "root", "password": "root-pw"}), None).await;
    admin(&http, &endpoint, "/v3/auth/role/add", serde_json::json!({"name": "root"}), None).await;
    admin(&http, &endpoint, "/v3/auth/user/grant", serde_json::json!({"user": "root", "role": "root"}), None).await;
    admin(&http, &endpoint, "/v3/auth/user/add", serde_json::json!({"name": "kvplane", "password": "kv-pw"}), None).await;
    admin(&http, &endpoint, "/v3/auth/role/add", serde_json::json!({"name": "kvplane-auth"}), None).await;
    let perm = serde_json::json!({"name": "kvplane-auth", "perm": {"permType": "READWRITE", "key": b64("/kvplane/auth/"), "range_end": b64("/kvplane/auth0")}});
    admin(&http, &endpoint, "/v3/auth/role/grant", perm, None).await;
    admin(&http, &endpoint, "/v3/auth/user/grant", serde_json::json!({"user": "kvplane", "role": "kvplane-auth"}), None).await;
    admin(&http, &endpoint, "/v3/auth/enable", serde_json::json!({}), None).await;

    let user = EtcdAuth { username: "kvplane".into(), password: "kv-pw".into() };
    let good = options(Some(good_tls.clone()), Some(user.clone()), PATIENCE);
    let m = Membership::register_with(&[endpoint.as_str()], "auth", member(0), TTL, good.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}; etcd's log:\n{}", etcd.log()));
    let watch = MembershipWatch::start_with(&[endpoint.as_str()], "auth", good.clone()).await.unwrap();
    assert_eq!(watch.current().members.len(), 1);
    assert!(!format!("{good:?}").contains("kv-pw"), "the password is in a Debug output: {good:?}");

    let short = Duration::from_millis(1500);
    let err = refused(&endpoint, "auth", options(Some(good_tls.clone()), None, short)).await;
    assert_names(&err, &["/v3/lease/grant", "user name is empty", "cluster.etcd.auth"]);
    let wrong = EtcdAuth { password: "not-it".into(), ..user.clone() };
    let err = refused(&endpoint, "auth", options(Some(good_tls.clone()), Some(wrong), short)).await;
    assert_names(&err, &["/v3/auth/authenticate", "authentication failed", "etcd refused user \"kvplane\""]);
    // A client certificate with a Common Name: the gateway refuses it.
    let err = refused(&endpoint, "auth", options(Some(tls(&p.ca.file, Some(&p.client))), Some(user.clone()), short)).await;
    assert_names(&err, &["/v3/auth/authenticate", "HTTP 400", "refuses client certificates with a Common Name"]);
    // Outside the role's prefix: the lease is granted, the record is not put.
    let err = refused(&endpoint, "elsewhere", options(Some(good_tls.clone()), Some(user.clone()), short)).await;
    assert_names(&err, &["/v3/kv/put", "permission denied", "/kvplane/<cluster>/"]);

    // etcd's simple tokens live in the member's memory: after a restart
    // the member's token is unknown, and leaving (a lease revoke) works
    // only if the client authenticates again.
    etcd.restart();
    tokio::time::timeout(PATIENCE, m.leave()).await.expect("leave within the deadline").unwrap_or_else(|e| panic!("{e}"));
    let after = MembershipWatch::start_with(&[endpoint.as_str()], "auth", good).await.unwrap();
    assert!(after.current().members.is_empty(), "{:?}", after.current());
}

/// The set-up client's TLS: etcd's CA and a client certificate it accepts
/// (the set-up runs before auth is enabled, as no user is needed yet).
fn admin_tls(p: &Pki) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(&p.ca.file).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let chain = rustls::pki_types::CertificateDer::pem_file_iter(&p.anonymous.cert).unwrap().collect::<Result<Vec<_>, _>>().unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&p.anonymous.key).unwrap();
    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap()
}
