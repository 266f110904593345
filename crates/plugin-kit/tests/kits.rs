//! The kits pass the builtin plugins they were written against, through the
//! same runtime `kvplane plugin test` uses.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvplane_plugin_kit::conformance;
use kvplane_runtime::{PluginDecl, PluginRuntime, PluginSource, World};

fn decl(name: &str, world: World) -> PluginDecl {
    PluginDecl::new(format!("builtin:{name}"), world, PluginSource::Builtin(name.into()))
}

fn runtime() -> PluginRuntime {
    PluginRuntime::new(None).expect("creating the plugin runtime")
}

#[tokio::test]
async fn ring_passes_the_key_placement_kit() {
    let report = conformance::key_placement(&runtime().load_key_placement(decl("ring", World::KeyPlacement)).unwrap()).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

#[tokio::test]
async fn backoff_passes_the_retry_kit() {
    let mut d = decl("backoff", World::RetryPolicy);
    d.config.insert("budget-ms".into(), conformance::RETRY_BUDGET_MS.to_string());
    let report = conformance::retry_policy(&runtime().load_retry_policy(d).unwrap(), conformance::RETRY_BUDGET_MS).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

#[tokio::test]
async fn gpu_affinity_passes_the_placement_rule_kit() {
    let report = conformance::placement_rule(&runtime().load_placement_rule(decl("gpu-affinity", World::PlacementRule)).unwrap()).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}

/// A throwaway redis-server on a free port, stopped on drop.
struct Redis {
    child: Child,
    endpoint: String,
}

impl Redis {
    fn start() -> Option<Redis> {
        let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let redis = Redis { child, endpoint: format!("127.0.0.1:{port}") };
        let started = Instant::now();
        while std::net::TcpStream::connect(&redis.endpoint).is_err() {
            assert!(started.elapsed() < Duration::from_secs(10), "redis-server did not listen on {}", redis.endpoint);
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(redis)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn resp_passes_the_backend_kit_against_redis() {
    let Some(redis) = Redis::start() else {
        eprintln!("skipped: redis-server is not installed");
        return;
    };
    let mut d = decl("resp", World::Backend);
    d.config.insert("endpoint".into(), redis.endpoint.clone());
    d.allowed_endpoints.push(redis.endpoint.clone());
    let report = conformance::backend(&runtime(), &d).await;
    println!("{report}");
    assert!(report.passed(), "{report}");
}
