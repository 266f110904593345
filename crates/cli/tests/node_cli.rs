//! `kvplane node` and the client commands as a user runs them: a real node
//! process, driven by `kvplane put | get | exists | delete | stats | bench`,
//! stopped with SIGTERM. Also the bench drivers against their real baselines
//! (the raw socket server and Debian's redis-server).

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn kvplane() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvplane"));
    // SAFETY: prctl is async-signal-safe; the child dies with the test.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    c
}

fn run(args: &[&str]) -> Output {
    kvplane().args(args).output().expect("running kvplane")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A `kvplane node` child process, killed by PID when dropped.
struct NodeProcess {
    child: Child,
    endpoint: String,
}

impl NodeProcess {
    fn start(extra: &[&str]) -> NodeProcess {
        NodeProcess::start_with_env(extra, &[])
    }

    fn start_with_env(extra: &[&str], env: &[(&str, std::path::PathBuf)]) -> NodeProcess {
        let port = free_port();
        let endpoint = format!("127.0.0.1:{port}");
        let mut child = kvplane()
            .args(["node", "--listen", &endpoint, "--admin", "none", "--memory", "64MiB"])
            .args(extra)
            .envs(env.iter().map(|(k, v)| (*k, v.as_os_str())))
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting kvplane node");
        // The node says where it serves once every listener is bound.
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let started = Instant::now();
        loop {
            let line = lines.next().expect("node exited before serving").expect("reading node output");
            if line.contains("kvplane node serving") {
                assert!(line.contains(&endpoint), "{line}");
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "node did not start");
        }
        // Keep draining its output so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        NodeProcess { child, endpoint }
    }

    fn sigterm_and_wait(mut self) -> std::process::ExitStatus {
        // SAFETY: plain kill(2) on our own child's PID.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(started.elapsed() < Duration::from_secs(15), "node ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_client_commands_drive_a_node_process_that_stops_on_sigterm() {
    let node = NodeProcess::start(&[]);
    let e = node.endpoint.clone();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("block.bin");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(&file, &data).unwrap();

    let out = run(&["put", "--endpoint", &e, "layer0/block7", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let back = dir.path().join("back.bin");
    let out = run(&["get", "--endpoint", &e, "layer0/block7", "-o", back.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read(&back).unwrap(), data, "bytes changed on the way");

    let out = run(&["exists", "--endpoint", &e, "layer0/block7", "nope"]);
    assert_eq!(out.status.code(), Some(1), "one key absent: exit 1");
    assert!(text(&out).contains("layer0/block7\tpresent") && text(&out).contains("nope\tabsent"), "{}", text(&out));

    let out = run(&["get", "--endpoint", &e, "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("not found"), "{}", text(&out));

    let out = run(&[
        "bench",
        "--endpoint",
        &e,
        "--block-size",
        "64KiB",
        "--blocks",
        "64",
        "--batch",
        "8",
        "--clients",
        "2",
        "--op",
        "mixed",
        "--seconds",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench prints JSON");
    assert!(report["blocks"].as_u64().unwrap() > 0 && report["gb_per_s"].as_f64().unwrap() > 0.0, "{report}");
    assert_eq!(report["misses"], 0);

    let out = run(&["stats", "--endpoint", &e, "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(stats["hits"].as_u64().unwrap() >= 1 && stats["requests_put"].as_u64().unwrap() >= 1, "{stats}");

    let out = run(&["delete", "--endpoint", &e, "layer0/block7"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&["exists", "--endpoint", &e, "layer0/block7"]);
    assert_eq!(out.status.code(), Some(1));

    let status = node.sigterm_and_wait();
    assert!(status.success(), "node exit after SIGTERM: {status}");
}

#[test]
fn a_node_with_a_token_file_refuses_the_cli_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t0ken\n").unwrap();
    let node = NodeProcess::start(&["--token-file", token.to_str().unwrap()]);
    let out = run(&["stats", "--endpoint", &node.endpoint]);
    assert!(!out.status.success());
    assert!(text(&out).contains("requires a bearer token"), "{}", text(&out));
    let out = run(&["stats", "--endpoint", &node.endpoint, "--token-file", token.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn bad_node_flags_are_named() {
    let out = run(&["node", "--memory", "lots"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("\"lots\" is not a size"), "{}", text(&out));
    let out = run(&["node", "--eviction", "random", "--listen", "none", "--admin", "none"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("random"), "{}", text(&out));
}

fn bench(args: &[&str]) -> serde_json::Value {
    let out = run(&[&["bench", "--seconds", "0.5", "--blocks", "32", "--batch", "8", "--clients", "2", "--json"], args].concat());
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)))
}

#[test]
fn the_bench_drivers_move_blocks_through_the_raw_socket_and_redis_baselines() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("raw.sock");
    let mut raw = kvplane()
        .args(["bench-raw-server", "--listen", &format!("127.0.0.1:{port}"), "--unix", sock.to_str().unwrap()])
        .spawn()
        .expect("raw server");
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() || !sock.exists() {
        assert!(started.elapsed() < Duration::from_secs(10), "raw server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    for endpoint in [format!("127.0.0.1:{port}"), format!("unix://{}", sock.display())] {
        for op in ["put", "get"] {
            let r = bench(&["--target", "raw", "--endpoint", &endpoint, "--op", op, "--block-size", "64KiB"]);
            assert!(r["blocks"].as_u64().unwrap() > 0, "{r}");
        }
    }
    let _ = raw.kill();
    let _ = raw.wait();

    let redis = kvplane_tests::redis::RedisServer::start(&[]);
    for op in ["put", "get"] {
        let r = bench(&["--target", "redis", "--endpoint", &redis.endpoint(), "--op", op, "--block-size", "4KiB"]);
        assert!(r["blocks"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["misses"], 0, "{r}");
    }
}

/// A plain HTTP server (Python's http.server) on loopback, killed by PID.
struct HttpServer {
    child: Child,
    port: u16,
}

impl HttpServer {
    fn serve(dir: &std::path::Path) -> HttpServer {
        let port = free_port();
        let mut cmd = Command::new("python3");
        cmd.args(["-m", "http.server", "--bind", "127.0.0.1", &port.to_string(), "--directory"])
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; the server dies with the test.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("python3 -m http.server");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(started.elapsed() < Duration::from_secs(10), "http.server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        HttpServer { child, port }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_node_verifies_the_plugins_of_its_config_and_refuses_a_digest_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let www = dir.path().join("www");
    std::fs::create_dir(&www).unwrap();
    let ring = kvplane_runtime::builtin::bytes("ring").expect("builtin ring");
    std::fs::write(www.join("ring.wasm"), ring).unwrap();
    let sha = kvplane_runtime::load::sha256_hex(ring);
    let http = HttpServer::serve(&www);
    let url = format!("http://127.0.0.1:{}/ring.wasm", http.port);
    let config = |sha256: &str| {
        serde_json::json!({
            "backend": "kvplane",
            "plugins": [
                {"name": "backoff", "kind": "retry", "source": {"builtin": "backoff"}},
                {"name": "ring", "kind": "keyPlacement", "source": {"url": url}, "sha256": sha256},
            ],
        })
        .to_string()
    };
    let good = dir.path().join("good.json");
    std::fs::write(&good, config(&sha)).unwrap();
    let node = NodeProcess::start_with_env(&["--config", good.to_str().unwrap()], &[("KVPLANE_CACHE_DIR", dir.path().join("cache"))]);
    let out = run(&["stats", "--endpoint", &node.endpoint]);
    assert!(out.status.success(), "{}", text(&out));
    drop(node);

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, config(&"0".repeat(64))).unwrap();
    let out = kvplane()
        .args(["node", "--listen", &format!("127.0.0.1:{}", free_port()), "--admin", "none", "--memory", "64MiB", "--config"])
        .arg(&bad)
        .env("KVPLANE_CACHE_DIR", dir.path().join("cache"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "a node started with a plugin whose digest does not match");
    let t = text(&out);
    assert!(t.contains("plugin ring") && t.contains(&sha) && t.contains("pins 0000"), "{t}");
}
