//! Operator benchmark against a real API server (etcd + kube-apiserver from
//! scripts/control-plane/build; no scheduler, so "converged" means every
//! child exists and the status was written for the current generation).
//!
//!   cargo bench -p kvplane --bench operator            # 100 trials, 500 KVCaches
//!   TRIALS=20 MANY=100 cargo bench -p kvplane --bench operator
//!
//! Measures, with the release `kvplane operator` process:
//! 1. create → all children created, p50/p99 over TRIALS KVCaches;
//! 2. child deleted → recreated, p50/p99 over TRIALS deletions (rotating
//!    through every kind of child);
//! 3. MANY KVCaches created at once → all converged: total time, and the
//!    operator's peak RSS (VmHWM).

#![allow(unsafe_code)] // prctl(PR_SET_PDEATHSIG) in pre_exec, so the operator dies with the bench.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvplane_tests::control_plane::{ControlPlane, Options};
use serde_json::json;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Reconcile times in microseconds, from 1 µs up to 10 minutes, to three
/// significant digits.
fn histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

fn record(h: &mut hdrhistogram::Histogram<u64>, d: Duration) {
    h.saturating_record(d.as_micros().try_into().unwrap_or(u64::MAX));
}

fn pct(h: &hdrhistogram::Histogram<u64>, p: f64) -> Duration {
    Duration::from_micros(h.value_at_quantile(p))
}

fn kvcache(ns: &str, name: &str) -> serde_json::Value {
    json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache", "metadata": {"name": name, "namespace": ns}, "spec": {"cache": {"replicas": 1}}})
}

fn children(ns: &str, name: &str) -> Vec<String> {
    vec![
        format!("/api/v1/namespaces/{ns}/configmaps/{name}-config"),
        format!("/api/v1/namespaces/{ns}/services/{name}-etcd"),
        format!("/api/v1/namespaces/{ns}/services/{name}-etcd-client"),
        format!("/apis/apps/v1/namespaces/{ns}/statefulsets/{name}-etcd"),
        format!("/api/v1/namespaces/{ns}/services/{name}-cache-headless"),
        format!("/api/v1/namespaces/{ns}/services/{name}"),
        format!("/apis/apps/v1/namespaces/{ns}/statefulsets/{name}-cache"),
    ]
}

fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // `cargo test --all-targets` runs this without `--bench`: a smoke run
    // that proves the benchmark works, in seconds.
    let full = std::env::args().any(|a| a == "--bench");
    let trials = env_usize("TRIALS", if full { 100 } else { 3 });
    let many = env_usize("MANY", if full { 500 } else { 10 });
    let version = std::env::var("K8S_VERSION").unwrap_or_else(|_| "1.34".into());
    let cp = ControlPlane::start(Options { version: &version, scheduling: false });
    eprintln!("control plane {} up in {:?}", cp.version(), cp.started_in());
    let log = std::fs::File::create(cp.dir().join("operator.log")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvplane"));
    cmd.args(["operator", "--install-crd", "--admin", "none", "--leader-lease", "none"])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("KVPLANE_CACHE_DIR", cp.dir().join("plugin-cache"))
        .stdout(Stdio::null())
        .stderr(log);
    // SAFETY: prctl is async-signal-safe; the operator dies with the bench.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut op = cmd.spawn().expect("kvplane operator");
    cp.wait_for("the CRD", Duration::from_secs(60), || cp.request("GET", "/apis/kvplane.io/v1alpha1/kvcaches", None).ok());
    cp.create_namespace("bench");

    // 1. create -> all children.
    let mut create = histogram();
    for i in 0..trials {
        let name = format!("c{i}");
        let start = Instant::now();
        cp.create("/apis/kvplane.io/v1alpha1/namespaces/bench/kvcaches", &kvcache("bench", &name));
        for path in children("bench", &name) {
            cp.wait_for(&path, Duration::from_secs(60), || cp.request("GET", &path, None).ok());
        }
        record(&mut create, start.elapsed());
        if (i + 1) % 10 == 0 {
            eprint!("\rcreate trials {}/{trials}", i + 1);
        }
    }
    eprintln!();

    // 2. delete a child -> recreated.
    let mut repair = histogram();
    for i in 0..trials {
        let kv = format!("c{}", i % trials.max(1));
        let paths = children("bench", &kv);
        let path = &paths[i % paths.len()];
        let uid = cp.get(path)["metadata"]["uid"].clone();
        let start = Instant::now();
        cp.request("DELETE", path, None).expect("delete");
        cp.wait_for(path, Duration::from_secs(60), || {
            cp.request("GET", path, None).ok().filter(|o| o["metadata"]["uid"] != uid && o["metadata"]["deletionTimestamp"].is_null())
        });
        record(&mut repair, start.elapsed());
        if (i + 1) % 10 == 0 {
            eprint!("\rrepair trials {}/{trials}", i + 1);
        }
    }
    eprintln!();

    // 3. many at once.
    cp.create_namespace("many");
    let start = Instant::now();
    for i in 0..many {
        cp.create("/apis/kvplane.io/v1alpha1/namespaces/many/kvcaches", &kvcache("many", &format!("m{i}")));
    }
    let created_in = start.elapsed();
    // Polled once a second: listing 500 KVCaches more often would load the
    // API server (which shares the two cores with the operator) and slow
    // down what is being measured.
    let mut last = usize::MAX;
    let mut poll = || -> Option<()> {
        let list = cp.request("GET", "/apis/kvplane.io/v1alpha1/namespaces/many/kvcaches", None).ok()?;
        let items = list["items"].as_array()?;
        let done = items
            .iter()
            .filter(|kv| {
                kv["status"]["observedGeneration"] == kv["metadata"]["generation"]
                    && kv["status"]["conditions"].as_array().is_some_and(|c| c.iter().any(|c| c["type"] == "CacheReady"))
            })
            .count();
        if done != last {
            eprint!("\rconverged {done}/{many}");
            last = done;
        }
        (done == many).then_some(())
    };
    while poll().is_none() {
        assert!(start.elapsed() < Duration::from_secs(600), "not converged after 600 s");
        std::thread::sleep(Duration::from_secs(1));
    }
    let converged = start.elapsed();
    eprintln!();
    let sts = cp.get("/apis/apps/v1/namespaces/many/statefulsets")["items"].as_array().map(Vec::len).unwrap_or(0);
    assert_eq!(sts, many * 2, "every KVCache has its two StatefulSets");
    let rss_mib = peak_rss_kib(op.id()) as f64 / 1024.0;
    let _ = op.kill();
    let _ = op.wait();

    println!("operator benchmark on Kubernetes {} ({trials} trials, {many} KVCaches)", cp.version());
    println!("  create -> all 7 children: p50 {:?}  p99 {:?}", pct(&create, 0.5), pct(&create, 0.99));
    println!("  child deleted -> repaired: p50 {:?}  p99 {:?}", pct(&repair, 0.5), pct(&repair, 0.99));
    println!("  {many} KVCaches: submitted in {created_in:?}, all converged in {converged:?}; operator peak RSS {rss_mib:.1} MiB");
}
