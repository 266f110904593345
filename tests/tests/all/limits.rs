//! Everything a plugin can make the host spend is bounded by its
//! declaration, not only its linear memory: connections, bytes queued for
//! sending, buffer handles and the bytes behind them, resource-table
//! entries and metric series. One case per bound, with the hostile
//! fixture's `backend` world: each ends in a typed `capacity` error naming
//! the limit (counted in the plugin's limit hits), and the next call on the
//! same plugin succeeds.
//!
//! Also here: handles the host lent stop working when the call returns, a
//! connection whose read timed out mid-message is closed for good, and
//! endpoints are checked after name resolution (CIDR entries, Unix paths).

use std::time::Duration;

use kvplane_protocol::KvError;
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::{Backend, PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_tests::hostile;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn no_options() -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: None }
}

/// A loopback peer that accepts every connection, holds it open, and
/// answers anything it reads with `+PART` (5 bytes) and then nothing more:
/// enough for a plugin to connect, to queue, and to wait for a reply that
/// never completes.
async fn peer() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binding a loopback peer");
    let addr = listener.local_addr().expect("peer address").to_string();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let mut answered = false;
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if !answered {
                        answered = socket.write_all(b"+PART").await.is_ok();
                    }
                }
            });
        }
    });
    addr
}

fn decl(endpoint: &str) -> PluginDecl {
    let mut d = PluginDecl::new("hostile", World::Backend, PluginSource::File(kvplane_tests::HOSTILE.into()));
    d.limits.timeout = Duration::from_millis(500);
    d.config.insert("endpoint".into(), endpoint.into());
    d.allowed_endpoints = vec![endpoint.to_owned()];
    d
}

fn load(d: PluginDecl) -> Backend {
    PluginRuntime::new(None).expect("runtime").load_backend(d).expect("loading the hostile fixture")
}

/// Run the `get` case `case` with one destination of `dest` bytes; answer
/// the first key's result.
async fn spend(p: &Backend, case: &[u8], dest: usize) -> Result<usize, KvError> {
    let (memories, result) = p.get(vec![(case.to_vec(), vec![0u8; dest]), (b"other".to_vec(), vec![0u8; 8])], no_options()).await;
    assert_eq!(memories.len(), 2, "the destinations come back");
    let mut answers = result.expect("the call itself succeeds; the refusal is the key's answer");
    assert_eq!(answers[1], Err(KvError::NotFound));
    answers.remove(0)
}

/// The call after a refusal works, on the same plugin.
async fn still_serves(p: &Backend) {
    let (_, result) = p.get(vec![(b"fine".to_vec(), vec![0u8; 8])], no_options()).await;
    assert_eq!(result.expect("the next call succeeds"), vec![Err(KvError::NotFound)]);
}

fn assert_capacity(answer: Result<usize, KvError>, limit: &str, bound: u64) {
    match answer {
        Err(KvError::Capacity(m)) => {
            assert!(m.contains(&format!("{limit} limit reached")) && m.contains(&format!("limit {bound})")), "{m}")
        }
        other => panic!("expected capacity for {limit}, got {other:?}"),
    }
}

fn hits(p: &Backend, limit: &str) -> u64 {
    p.plugin.shared().limit_hits_snapshot().get(limit).copied().unwrap_or(0)
}

#[tokio::test]
async fn connections_are_bounded_per_instance() {
    let addr = peer().await;
    let mut d = decl(&addr);
    d.limits.connections = 3;
    let p = load(d);
    assert_capacity(spend(&p, hostile::CONNECTIONS, 8).await, "connections", 3);
    assert_eq!(hits(&p, "connections"), 1);
    still_serves(&p).await;
}

#[tokio::test]
async fn queued_write_bytes_are_bounded() {
    let addr = peer().await;
    let mut d = decl(&addr);
    d.limits.queued_bytes = 8 << 20;
    let p = load(d);
    assert_capacity(spend(&p, hostile::QUEUED, 8).await, "queued-bytes", 8 << 20);
    still_serves(&p).await;
}

#[tokio::test]
async fn buffer_handles_are_bounded() {
    let mut d = decl("127.0.0.1:9");
    d.limits.buffers = 64;
    let p = load(d);
    assert_capacity(spend(&p, hostile::BUFFERS, 8).await, "buffers", 64);
    still_serves(&p).await;
}

#[tokio::test]
async fn resource_table_entries_are_bounded() {
    let mut d = decl("127.0.0.1:9");
    d.limits.buffers = 10_000;
    d.limits.handles = 40;
    let p = load(d);
    assert_capacity(spend(&p, hostile::BUFFERS, 8).await, "handles", 40);
    still_serves(&p).await;
}

/// `read-buffer` of 1 GiB is refused before a byte is allocated: the length
/// came off the wire, the budget is the declaration's.
#[tokio::test]
async fn host_buffer_bytes_are_bounded_before_allocating() {
    let addr = peer().await;
    let mut d = decl(&addr);
    d.limits.buffer_bytes = 16 << 20;
    let p = load(d);
    assert_capacity(spend(&p, hostile::BUFFER_BYTES, 8).await, "buffer-bytes", 16 << 20);
    still_serves(&p).await;
}

#[tokio::test]
async fn metric_series_are_bounded() {
    let mut d = decl("127.0.0.1:9");
    d.limits.metric_series = 50;
    let p = load(d);
    p.exists(vec![hostile::METRICS.to_vec()], no_options()).await.expect("reporting metrics never fails the call");
    let series = p.plugin.shared().metrics_snapshot();
    assert_eq!(series.len(), 50, "series beyond the limit were kept");
    assert!(hits(&p, "metric-series") >= 99_000, "dropped series were not counted: {}", hits(&p, "metric-series"));
    still_serves(&p).await;
}

/// A handle the host lent for one call is dead once the call returns: the
/// plugin kept a view of its destination, and using it later is `invalid`,
/// never a write into memory the caller has taken back.
#[tokio::test]
async fn a_destination_kept_past_its_call_cannot_be_written() {
    let addr = peer().await;
    let p = load(decl(&addr));
    let (memories, result) = p.get(vec![(hostile::KEEP.to_vec(), vec![7u8; 16])], no_options()).await;
    assert_eq!(result.unwrap(), vec![Err(KvError::NotFound)]);
    assert_eq!(memories[0], vec![7u8; 16]);
    match spend(&p, hostile::STALE, 8).await {
        Err(KvError::Invalid(m)) => assert!(m.contains("released"), "{m}"),
        other => panic!("expected invalid for a stale handle, got {other:?}"),
    }
    still_serves(&p).await;
}

/// A read that timed out mid-message leaves the stream at an unknown
/// position: the host closes the connection, and every later use of it is
/// `unavailable` instead of reading the tail of the old reply.
#[tokio::test]
async fn a_connection_whose_read_timed_out_is_never_reused() {
    let addr = peer().await;
    let mut d = decl(&addr);
    d.limits.timeout = Duration::from_millis(200);
    let p = load(d);
    match spend(&p, hostile::HALF_READ, 8).await {
        Err(KvError::Timeout(m)) => assert!(m.contains(&addr), "{m}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    match spend(&p, hostile::REUSE, 8).await {
        Err(KvError::Unavailable(m)) => assert!(m.contains("closed after an earlier failure"), "{m}"),
        other => panic!("expected the connection to be closed, got {other:?}"),
    }
    still_serves(&p).await;
}

#[tokio::test]
async fn endpoints_are_checked_after_resolution() {
    let addr = peer().await;
    let port = addr.rsplit_once(':').unwrap().1.to_owned();
    let connect = |target: String| target.into_bytes();

    // Not declared at all: denied, naming what it resolved to.
    let p = load(decl("127.0.0.1:9"));
    match spend(&p, &connect(format!("tcp:localhost:{port}")), 8).await {
        Err(KvError::Denied(m)) => assert!(m.contains("localhost") && m.contains("127.0.0.1"), "{m}"),
        other => panic!("expected denied, got {other:?}"),
    }
    // A CIDR entry admits a name that resolves into it.
    let mut d = decl("127.0.0.1:9");
    d.allowed_endpoints = vec![format!("127.0.0.0/8:{port}")];
    let p = load(d);
    assert_eq!(spend(&p, &connect(format!("tcp:localhost:{port}")), 8).await, Ok(0));
    // ...and nothing on another port.
    let mut d = decl("127.0.0.1:9");
    d.allowed_endpoints = vec!["127.0.0.0/8:1".to_owned()];
    let p = load(d);
    assert!(matches!(spend(&p, &connect(format!("tcp:127.0.0.1:{port}")), 8).await, Err(KvError::Denied(_))));
    still_serves(&p).await;
}

/// Unix-domain sockets are reachable by declared path only, and block bytes
/// read from one land in the caller's destination.
#[tokio::test]
async fn unix_sockets_are_allowed_by_path_and_read_into_the_destination() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peer.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("binding a unix socket");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut line = [0u8; 5];
            if socket.read_exact(&mut line).await.is_ok() {
                let _ = socket.write_all(b"11\nhello block").await;
            }
        }
    });
    let target = format!("unix:{}", path.display()).into_bytes();

    let p = load(decl("127.0.0.1:9"));
    match spend(&p, &target, 32).await {
        Err(KvError::Denied(m)) => assert!(m.contains("unix socket") && m.contains("peer.sock"), "{m}"),
        other => panic!("expected denied, got {other:?}"),
    }

    let mut d = decl("127.0.0.1:9");
    d.allowed_endpoints = vec![format!("unix:{}", path.display())];
    let p = load(d);
    let (memories, result) = p.get(vec![(target, vec![b'.'; 16])], no_options()).await;
    assert_eq!(result.unwrap(), vec![Ok(11)]);
    assert_eq!(&memories[0][..], b"hello block.....", "the value landed at the front of the destination, the rest untouched");
}

/// A loopback peer that answers every connection with `total` bytes that
/// hold no line end, as fast as the socket takes them, then holds the
/// connection open without a word more: a line that never ends. `total`
/// bounds what a host that buffered it all would spend, so the test fails
/// on such a host instead of taking the machine's memory.
async fn endless_line_peer(total: usize) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binding a loopback peer");
    let addr = listener.local_addr().expect("peer address").to_string();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let chunk = vec![b'x'; 64 << 10];
                let mut sent = 0;
                while sent < total && socket.write_all(&chunk).await.is_ok() {
                    sent += chunk.len();
                }
                let mut sink = [0u8; 1024];
                while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

/// Resident set size of this process, from `/proc/self/status`.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("reading /proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib << 10
}

/// Runs the test `name` alone in a child process of this test binary and
/// asserts that it passed, so that what it reads of the process's RSS is
/// its own and not that of tests running beside it. Answers `true` in the
/// child, where the test body should run.
fn alone(name: &str) -> bool {
    const CHILD: &str = "KVPLANE_TEST_ALONE";
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("the path of this test binary");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running the test alone");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{name}, run alone, failed:\n{text}");
    assert!(text.contains("1 passed"), "{name} did not run in the child:\n{text}");
    eprintln!("{text}");
    false
}

/// `read-until` with a 4 GiB maximum against a peer whose line never ends:
/// the host buffers the line against the instance's `bufferBytes` and
/// answers `capacity` at that bound (counted as a `buffer-bytes` hit)
/// instead of holding the whole line until the deadline. The RSS sampled
/// throughout the call stays within the bound plus 64 MiB.
#[tokio::test]
async fn a_line_that_never_ends_is_bounded_by_buffer_bytes() {
    if !alone("limits::a_line_that_never_ends_is_bounded_by_buffer_bytes") {
        return;
    }
    const BOUND: u64 = 32 << 20;
    const SLACK: u64 = 64 << 20;
    let addr = endless_line_peer(512 << 20).await;
    let mut d = decl(&addr);
    d.limits.buffer_bytes = BOUND;
    d.limits.timeout = Duration::from_secs(2);
    let p = load(d);
    p.plugin.warm_up().await.expect("warm-up");
    let before = rss_bytes();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(before));
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let answer = spend(&p, hostile::READ_UNTIL, 8).await;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    sampler.join().expect("the RSS sampler");
    let grown = peak.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(before);
    eprintln!("read-until against an endless line: answer {answer:?}, RSS grew {} MiB at peak", grown >> 20);
    assert_capacity(answer, "buffer-bytes", BOUND);
    assert_eq!(hits(&p, "buffer-bytes"), 1, "the refusal is counted");
    assert!(grown < BOUND + SLACK, "RSS grew {grown} bytes, more than bufferBytes {BOUND} + {SLACK}");
    still_serves(&p).await;
}

/// A plugin that logs as fast as it can writes no more than its log rate
/// allows: the burst, then the rate; every record beyond is dropped and
/// counted (in `/metrics` too), and each record written is cut to the
/// longest the host writes. The fixture's flood is itself bounded (20 000
/// records), and this test installs no log subscriber, so a host without
/// the limit fails the counts without writing gigabytes anywhere.
#[tokio::test]
async fn a_log_flood_is_rate_limited_and_the_drops_counted() {
    const RATE: u32 = 50;
    const BURST: u32 = 200;
    let rt = PluginRuntime::new(None).expect("runtime");
    let mut d = decl("127.0.0.1:9");
    d.limits.log_records_per_second = RATE;
    d.limits.log_burst = BURST;
    d.limits.timeout = Duration::from_secs(30);
    let p = rt.load_backend(d).expect("loading the hostile fixture");
    let started = std::time::Instant::now();
    p.exists(vec![hostile::LOG_FLOOD.to_vec()], no_options()).await.expect("logging never fails the call");
    let elapsed = started.elapsed();
    let logs = p.plugin.shared().log_counts();
    eprintln!("log flood of {} records in {elapsed:?}: {logs:?}", hostile::LOG_FLOOD_RECORDS);
    let allowed = u64::from(BURST) + (elapsed.as_secs_f64() * f64::from(RATE)).ceil() as u64;
    assert!(logs.written <= allowed, "{} records written, more than burst {BURST} + {RATE}/s over {elapsed:?}", logs.written);
    assert!(logs.written >= u64::from(BURST), "the burst was not let through: {logs:?}");
    assert_eq!(logs.written + logs.dropped, hostile::LOG_FLOOD_RECORDS as u64, "every record is written or counted dropped");
    assert_eq!(logs.truncated, logs.written, "every 64 KiB record is cut");
    let longest = (kvplane_runtime::host::MAX_LOG_RECORD + " [truncated]".len()) as u64;
    assert!(logs.written_bytes <= logs.written * longest, "{logs:?}");
    assert_eq!(hits(&p, "log-rate"), logs.dropped);

    let mut registry = prometheus_client::registry::Registry::default();
    rt.metrics().register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        format!(r#"kvplane_plugin_log_records_dropped_total{{plugin="hostile"}} {}"#, logs.dropped),
        format!(r#"kvplane_plugin_log_records_total{{plugin="hostile"}} {}"#, logs.written),
        format!(r#"kvplane_plugin_limit_hits_total{{plugin="hostile",limit="log-rate"}} {}"#, logs.dropped),
    ] {
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
    still_serves(&p).await;
}

/// Every key of the docs' table of limits (`docs/plugins.md`, "Limits a
/// declaration sets") is one a declaration may write, is in the CRD's
/// schema, and reaches the instance's limits: declared at another value
/// than its documented default, it changes them. A key the docs promise and
/// the config refuses (`maxInstances` was) fails here.
#[test]
fn every_documented_limit_is_declarable_and_reaches_the_instance() {
    use kvplane_config::plugin::PluginSpec;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("docs/plugins.md")).expect("reading docs/plugins.md");
    let crd = std::fs::read_to_string(root.join("crds/kvcache.yaml")).expect("reading crds/kvcache.yaml");
    let section = doc.split("## Limits a declaration sets").nth(1).expect("the limits section").split("\n## ").next().unwrap();
    let rows: Vec<(String, String)> = section
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.trim().trim_matches('|').split('|').map(str::trim).collect();
            let key = cells.first()?.strip_prefix('`')?.strip_suffix('`').filter(|k| !k.ends_with('.'))?;
            Some((key.to_owned(), cells.get(1)?.to_string()))
        })
        .collect();
    assert!(rows.len() >= 8, "the limits table: {rows:?}");
    let defaults = kvplane_runtime::InstanceLimits::default();
    for (key, default) in rows {
        // Another value than the default, in the default's spelling.
        let other = match default.parse::<u64>() {
            Ok(n) => serde_json::json!(n + 1),
            Err(_) => {
                let digits: String = default.chars().take_while(char::is_ascii_digit).collect();
                let unit = &default[digits.len()..];
                serde_json::json!(format!("{}{unit}", digits.parse::<u64>().expect("a number and a unit") + 1))
            }
        };
        let spec = serde_json::json!({"name": "p", "kind": "backend", "source": {"builtin": "resp"}, "limits": {key.as_str(): other}});
        let spec: PluginSpec =
            kvplane_config::from_json_strict(&spec.to_string()).unwrap_or_else(|e| panic!("limits.{key}, documented, is refused: {e}"));
        let fetched = kvplane_runtime::source::Fetched { origin: "test".into(), bytes: std::sync::Arc::from(&b""[..]) };
        let d = kvplane_runtime::source::decl(&spec, fetched).unwrap_or_else(|e| panic!("limits.{key}: {e}"));
        assert_ne!(d.limits, defaults, "limits.{key} = {other} changed no instance limit");
        assert!(crd.contains(&format!("\n                        {key}:\n")), "limits.{key} is not in crds/kvcache.yaml");
    }
    let spec: PluginSpec = kvplane_config::from_json_strict(
        r#"{"name":"p","kind":"backend","source":{"builtin":"resp"},"limits":{"maxInstances":7,"logRecordsPerSecond":9,"logBurst":11}}"#,
    )
    .expect("parses");
    let fetched = kvplane_runtime::source::Fetched { origin: "test".into(), bytes: std::sync::Arc::from(&b""[..]) };
    let d = kvplane_runtime::source::decl(&spec, fetched).expect("a declaration");
    assert_eq!((d.limits.max_instances, d.limits.log_records_per_second, d.limits.log_burst), (7, 9, 11));
}

/// An instance that spent its handles and never gave them back is
/// recycled: the call that exhausted them answers `capacity` naming
/// `handles`, and the calls after it are served by a fresh instance instead
/// of failing for good on the one that cannot take another handle.
#[tokio::test]
async fn an_instance_whose_handles_are_exhausted_is_recycled() {
    let mut d = decl("127.0.0.1:9");
    d.limits.buffers = 10_000;
    d.limits.handles = 40;
    d.limits.max_instances = 1;
    let p = load(d);
    assert_capacity(spend(&p, hostile::LEAK, 8).await, "handles", 40);
    let before = p.plugin.instantiations();
    for _ in 0..3 {
        // A batch needs a handle per destination: more than the leaked
        // instance has left.
        let batch: Vec<(Vec<u8>, Vec<u8>)> = (0..8).map(|i| (format!("fine-{i}").into_bytes(), vec![0u8; 8])).collect();
        let (_, result) = p.get(batch, no_options()).await;
        assert_eq!(result.expect("a batch after the leak is served"), vec![Err(KvError::NotFound); 8]);
    }
    assert_eq!(p.plugin.instantiations(), before + 1, "one fresh instance replaced the exhausted one");
    assert_eq!(hits(&p, "handles-recycled"), 1, "the retirement is counted");
}
