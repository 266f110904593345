//! A real three-member etcd cluster on loopback, and a TCP proxy a test can
//! cut, for the membership tests.
//!
//! etcd is the binary `scripts/control-plane/build` builds (the version in
//! `scripts/control-plane/versions`), as the control-plane tests of
//! `kvplane-tests` use it. Those helpers are not reused as a dependency:
//! that crate's build script builds every Wasm, Python and JavaScript
//! fixture, which these tests do not need.

#![allow(dead_code)] // Each test binary uses a part.

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// `dies_with_parent`: the etcd members die with the test's thread that
// starts the cluster, as kvplane-tests' servers do.
#[path = "../../../../tests/src/process.rs"]
mod process;
use process::dies_with_parent;

/// How long a cluster may take to elect a leader and answer.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts at starting a cluster whose ports another process took first.
const PORT_ATTEMPTS: usize = 5;

/// `${KVPLANE_TOOLS:-$HOME/.cache/kvplane-tools}/etcd-vVERSION/etcd`.
fn etcd_binary() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let versions_file = root.join("scripts/control-plane/versions");
    let versions = fs::read_to_string(&versions_file).unwrap_or_else(|e| panic!("reading {}: {e}", versions_file.display()));
    let version = versions
        .lines()
        .find_map(|l| l.strip_prefix("ETCD_VERSION="))
        .unwrap_or_else(|| panic!("no ETCD_VERSION= in {}", versions_file.display()))
        .trim()
        .trim_matches('"');
    let tools = match std::env::var_os("KVPLANE_TOOLS") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/kvplane-tools"),
    };
    let bin = tools.join(format!("etcd-v{version}/etcd"));
    assert!(bin.is_file(), "{} is missing: run scripts/control-plane/build (from the repository root) to build it", bin.display());
    bin
}

struct EtcdMember {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// Three etcd processes forming one cluster, each in its own data folder
/// under a temporary folder; stopped by PID when dropped.
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Start a three-member cluster and wait until every member answers
    /// `/health` with a leader. Panics with the members' logs if it cannot.
    pub fn start() -> EtcdCluster {
        let bin = etcd_binary();
        for attempt in 1..=PORT_ATTEMPTS {
            let ports = free_ports(6);
            let mut cluster = EtcdCluster {
                members: (0..3)
                    .map(|i| EtcdMember { name: format!("etcd{i}"), client: ports[2 * i], peer: ports[2 * i + 1], child: None })
                    .collect(),
                dir: tempfile::Builder::new().prefix("kvplane-etcd-").tempdir().expect("creating a temporary folder"),
            };
            match cluster.spawn_all(&bin) {
                Ok(()) => return cluster,
                Err(why) if why.to_ascii_lowercase().contains("address already in use") && attempt < PORT_ATTEMPTS => {
                    eprintln!("etcd: a port was taken before etcd bound it; trying other ports");
                }
                Err(why) => panic!("the etcd cluster did not start: {why}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// A cluster whose ports and data folders are chosen but none of whose
    /// members runs yet: for a test that starts its clients first (they
    /// find the ports refused); [`EtcdCluster::restart`] starts it.
    pub fn unstarted() -> EtcdCluster {
        let ports = free_ports(6);
        EtcdCluster {
            members: (0..3)
                .map(|i| EtcdMember { name: format!("etcd{i}"), client: ports[2 * i], peer: ports[2 * i + 1], child: None })
                .collect(),
            dir: tempfile::Builder::new().prefix("kvplane-etcd-").tempdir().expect("creating a temporary folder"),
        }
    }

    fn spawn_all(&mut self, bin: &PathBuf) -> Result<(), String> {
        let initial = self.members.iter().map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer)).collect::<Vec<_>>().join(",");
        let token = format!("kvplane-test-{}", self.dir.path().file_name().unwrap().to_string_lossy());
        for i in 0..self.members.len() {
            let m = &self.members[i];
            let data = self.dir.path().join(&m.name);
            // Appended to: a restarted member's log follows its first run's.
            let log = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.path().join(format!("{}.log", m.name)))
                .expect("creating an etcd log file");
            let mut cmd = Command::new(bin);
            cmd.arg(format!("--name={}", m.name))
                .arg(format!("--data-dir={}", data.display()))
                .arg(format!("--listen-client-urls=http://127.0.0.1:{}", m.client))
                .arg(format!("--advertise-client-urls=http://127.0.0.1:{}", m.client))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{}", m.peer))
                .arg(format!("--initial-advertise-peer-urls=http://127.0.0.1:{}", m.peer))
                .arg(format!("--initial-cluster={initial}"))
                .arg(format!("--initial-cluster-token={token}"))
                .args(["--initial-cluster-state=new", "--unsafe-no-fsync", "--log-level=warn"])
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("an etcd log file"))
                .stderr(log);
            dies_with_parent(&mut cmd);
            let child = cmd.spawn().map_err(|e| format!("starting {}: {e}", bin.display()))?;
            self.members[i].child = Some(child);
        }
        let started = Instant::now();
        loop {
            for i in 0..self.members.len() {
                let status = self.members[i].child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                if let Some(status) = status {
                    return Err(format!("{} exited ({status}); logs:\n{}", self.members[i].name, self.logs()));
                }
            }
            if self.members.iter().all(|m| healthy(m.client)) {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(format!("not healthy within {START_TIMEOUT:?}; logs:\n{}", self.logs()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stop every member (SIGKILL, each by its PID), as an outage of the
    /// whole etcd cluster would; [`EtcdCluster::restart`] brings it back.
    pub fn stop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// Start every stopped member again on its own data folder and ports
    /// (the data folder already names the cluster, so the initial-cluster
    /// flags are ignored; an [`EtcdCluster::unstarted`] one starts new), and
    /// wait until each answers with a leader.
    /// Panics with the logs if they do not.
    pub fn restart(&mut self) {
        let bin = etcd_binary();
        assert!(self.members.iter().all(|m| m.child.is_none()), "restart only a stopped cluster");
        if let Err(why) = self.spawn_all(&bin) {
            panic!("the etcd cluster did not start again: {why}");
        }
    }

    /// `127.0.0.1:PORT` of each member's client port.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| format!("127.0.0.1:{}", m.client)).collect()
    }

    pub fn client_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.members[i].client))
    }

    /// Kill member `i` (SIGKILL, by its PID) and reap it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Every member's log, for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let path = self.dir.path().join(format!("{}.log", m.name));
            let text = fs::read_to_string(&path).unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()));
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {} (last 30 lines)\n{}\n", m.name, lines[lines.len().saturating_sub(30)..].join("\n")));
        }
        out
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// The lease `key` is attached to in etcd (`Ok(None)`: no such key; `0`: no
/// lease), read from the first member that answers `POST /v3/kv/range`
/// through its JSON gateway; `Err` names every member that did not answer.
pub fn lease_of_key(cluster: &EtcdCluster, key: &str) -> Result<Option<i64>, String> {
    let body = serde_json::json!({"key": base64(key.as_bytes())}).to_string();
    let mut failures = Vec::new();
    for m in &cluster.members {
        match post(m.client, "/v3/kv/range", &body) {
            Ok(answer) => {
                let Some(kv) = answer.get("kvs").and_then(|kvs| kvs.get(0)) else { return Ok(None) };
                let lease = match kv.get("lease") {
                    Some(serde_json::Value::String(s)) => s.parse().map_err(|e| format!("lease {s:?} of {key}: {e}"))?,
                    _ => 0,
                };
                return Ok(Some(lease));
            }
            Err(e) => failures.push(format!("{}: {e}", m.name)),
        }
    }
    Err(failures.join("; "))
}

/// `POST path` with a JSON `body` to the member on `port`; its JSON answer.
fn post(port: u16, path: &str, body: &str) -> Result<serde_json::Value, String> {
    let mut stream =
        TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_millis(500)).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    let (head, json) = answer.split_once("\r\n\r\n").ok_or_else(|| format!("no HTTP answer: {answer:?}"))?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(format!("{path}: {head:?} {json:?}"));
    }
    serde_json::from_str(json).map_err(|e| format!("{path}: not JSON ({e}): {json:?}"))
}

/// Standard base64 with padding, as the gateway wants keys (a few lines
/// instead of a dependency every includer of this file would need).
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16) | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8) | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Whether the member on `port` answers `GET /health` with `"health":"true"`
/// (it is up and its cluster has a leader).
fn healthy(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.contains("\"health\":\"true\"")
}

/// `n` distinct free loopback ports (held together while choosing). Another
/// process may take one before etcd binds it: [`EtcdCluster::start`] then
/// starts again on fresh ports.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").expect("finding a free loopback port")).collect();
    listeners.iter().map(|l| l.local_addr().expect("a bound port").port()).collect()
}

/// A TCP proxy to one upstream that a test can cut, as a network partition
/// would: open connections are closed, and new ones are accepted but never
/// answered (a peer that is silent rather than refusing).
pub struct Proxy {
    addr: SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binding the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let silent = Arc::new(Mutex::new(Vec::new()));
            loop {
                let Ok((mut client, _)) = listener.accept().await else { continue };
                if *cut_rx.borrow() {
                    silent.lock().unwrap().push(client);
                    continue;
                }
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut_rx.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Proxy { addr, cut, task }
    }

    /// `127.0.0.1:PORT` to connect to instead of the upstream.
    pub fn endpoint(&self) -> String {
        self.addr.to_string()
    }

    /// Partition everyone behind the proxy from the upstream.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Poll `check` until it gives a value, failing after `timeout` with `what`.
pub async fn eventually<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let started = tokio::time::Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(started.elapsed() < timeout, "{what}: not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Show the crate's log (`RUST_LOG`, default warnings) in a failing test's
/// output.
pub fn log_to_test_output() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "kvplane_cluster=info".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
}

/// One etcd member serving its client port over TLS on loopback
/// (`--cert-file`, `--key-file`, `--trusted-ca-file`, and with
/// `client_cert_auth` `--client-cert-auth`), in its own data folder;
/// stopped by PID when dropped, restartable on the same port and data.
pub struct TlsEtcd {
    args: Vec<String>,
    client: u16,
    /// A plain-HTTP client port on loopback for the test's own set-up
    /// ([`TlsEtcd::admin`]), when asked for.
    plain: Option<u16>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

/// The flags of a one-member etcd on loopback in `dir`, serving its
/// clients on `listen` (advertised as `https://` on `client`) and its peer
/// port `peer` over `peer_scheme`; TLS files are the caller's to add.
fn loopback_member_args(dir: &tempfile::TempDir, listen: &str, client: u16, peer: u16, peer_scheme: &str) -> Vec<String> {
    vec![
        "--name=tls0".to_string(),
        format!("--data-dir={}", dir.path().join("data").display()),
        format!("--listen-client-urls={listen}"),
        format!("--advertise-client-urls=https://127.0.0.1:{client}"),
        format!("--listen-peer-urls={peer_scheme}://127.0.0.1:{peer}"),
        format!("--initial-advertise-peer-urls={peer_scheme}://127.0.0.1:{peer}"),
        format!("--initial-cluster=tls0={peer_scheme}://127.0.0.1:{peer}"),
        "--unsafe-no-fsync".to_string(),
        "--log-level=warn".to_string(),
    ]
}

impl TlsEtcd {
    /// Start it with the PEM files given, and wait until its client port
    /// accepts connections (the caller's first call waits for the leader,
    /// which a single member elects at once).
    pub fn start(cert: &std::path::Path, key: &std::path::Path, ca: &std::path::Path, client_cert_auth: bool) -> TlsEtcd {
        TlsEtcd::start_with(cert, key, ca, client_cert_auth, false)
    }

    /// As [`TlsEtcd::start`], with `plain_admin` a second client port that
    /// speaks plain HTTP (advertised to no one), for set-up calls a test
    /// makes without a TLS client of its own.
    pub fn start_with(
        cert: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
        client_cert_auth: bool,
        plain_admin: bool,
    ) -> TlsEtcd {
        let dir = tempfile::Builder::new().prefix("kvplane-etcd-tls-").tempdir().expect("creating a temporary folder");
        let ports = free_ports(3);
        let (client, peer) = (ports[0], ports[1]);
        let plain = plain_admin.then_some(ports[2]);
        let listen = match plain {
            Some(p) => format!("https://127.0.0.1:{client},http://127.0.0.1:{p}"),
            None => format!("https://127.0.0.1:{client}"),
        };
        let mut args = loopback_member_args(&dir, &listen, client, peer, "http");
        args.extend([
            format!("--cert-file={}", cert.display()),
            format!("--key-file={}", key.display()),
            format!("--trusted-ca-file={}", ca.display()),
        ]);
        if client_cert_auth {
            args.push("--client-cert-auth".to_string());
        }
        let mut etcd = TlsEtcd { args, client, plain, child: None, dir };
        etcd.spawn();
        etcd
    }

    /// One member on loopback with the TLS flags given (files, and
    /// `--client-cert-auth` / `--peer-*` as a rendered etcd pod has them):
    /// the client port is `https://`, the peer port too when the flags
    /// give the peer a certificate. For the operator's rendered members.
    pub fn start_with_flags(tls_flags: &[String]) -> TlsEtcd {
        let dir = tempfile::Builder::new().prefix("kvplane-etcd-tls-").tempdir().expect("creating a temporary folder");
        let ports = free_ports(2);
        let (client, peer) = (ports[0], ports[1]);
        let peer_scheme = if tls_flags.iter().any(|f| f.starts_with("--peer-cert-file=")) { "https" } else { "http" };
        let mut args = loopback_member_args(&dir, &format!("https://127.0.0.1:{client}"), client, peer, peer_scheme);
        args.extend(tls_flags.iter().cloned());
        let mut etcd = TlsEtcd { args, client, plain: None, child: None, dir };
        etcd.spawn();
        etcd
    }

    fn spawn(&mut self) {
        let log = fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("etcd.log")).expect("an etcd log file");
        let mut cmd = Command::new(etcd_binary());
        cmd.args(&self.args).stdin(Stdio::null()).stdout(log.try_clone().expect("an etcd log file")).stderr(log);
        dies_with_parent(&mut cmd);
        self.child = Some(cmd.spawn().expect("starting etcd"));
        let started = Instant::now();
        while TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], self.client)), Duration::from_millis(200)).is_err() {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("etcd exited ({status}); log:\n{}", self.log());
            }
            assert!(started.elapsed() < START_TIMEOUT, "etcd's client port did not open within {START_TIMEOUT:?}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `https://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.client)
    }

    /// `POST path` with `body` through the plain set-up port, waiting (up
    /// to a minute) for etcd's leader; the JSON answer, or why none came.
    pub fn admin(&self, path: &str, body: &serde_json::Value) -> Result<serde_json::Value, String> {
        let port = self.plain.expect("started with plain_admin");
        let started = Instant::now();
        loop {
            match post(port, path, &body.to_string()) {
                Ok(answer) => return Ok(answer),
                Err(e) if started.elapsed() > START_TIMEOUT => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// SIGKILL (by PID) and start again on the same port and data folder:
    /// every token the member issued is gone, leases and keys are not.
    pub fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn();
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for TlsEtcd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
