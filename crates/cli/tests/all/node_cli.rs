//! `kvplane node` and the client commands as a user runs them: a real node
//! process, driven by `kvplane put | get | exists | delete | stats | bench`,
//! stopped with SIGTERM. Also the bench drivers against their real baselines
//! (the raw socket server and Debian's redis-server).

#![allow(unsafe_code)] // prctl(PR_SET_PDEATHSIG) in pre_exec, so servers die with the test.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use crate::{etcd, support};
use support::{kvplane, run, tcp_addr, text, wait_for_line, NodeProcess};

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

    // A failure is not a miss: with the node gone, `get` exits 2 (1 is
    // "absent") and says why.
    let out = run(&["get", "--endpoint", &e, "layer0/block7"]);
    assert_eq!(out.status.code(), Some(2), "node down: exit 2\n{}", text(&out));
    assert!(text(&out).contains("error:") && !text(&out).contains("not found"), "{}", text(&out));
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
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("raw.sock");
    let mut raw = kvplane()
        .args(["bench-raw-server", "--listen", "127.0.0.1:0", "--unix", sock.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .expect("raw server");
    // Printed once both listeners are bound.
    let stderr = raw.stderr.take().expect("piped stderr");
    let tcp = tcp_addr(&wait_for_line(&mut raw, stderr, "kvplane bench-raw-server serving", "kvplane bench-raw-server"));
    for endpoint in [tcp, format!("unix://{}", sock.display())] {
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
        // Port 0: the server binds a free port itself and prints it, once
        // listening, as "Serving HTTP on 127.0.0.1 port PORT (...) ..."
        // (unbuffered, -u, so the line comes out at once).
        let mut cmd = Command::new("python3");
        cmd.args(["-u", "-m", "http.server", "--bind", "127.0.0.1", "0", "--directory"])
            .arg(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; the server dies with the test.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("python3 -m http.server");
        let stdout = child.stdout.take().expect("piped stdout");
        let line = wait_for_line(&mut child, stdout, "Serving HTTP on", "python3 -m http.server");
        let port = line
            .split_once(" port ")
            .and_then(|(_, rest)| rest.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no port in {line:?}"));
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
    let sha = kvplane_runtime::sha256_hex(ring);
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
        .args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "64MiB", "--config"])
        .arg(&bad)
        .env("KVPLANE_CACHE_DIR", dir.path().join("cache"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "a node started with a plugin whose digest does not match");
    let t = text(&out);
    assert!(t.contains("plugin ring") && t.contains(&sha) && t.contains("pins 0000"), "{t}");
}

/// `kvplane node --config` starts one instance of every declared plugin and
/// runs its `open` / `configure` before it serves: a config the plugin
/// refuses stops the start, naming the plugin and the key at fault.
#[test]
fn a_plugin_config_the_plugin_refuses_stops_the_node_naming_plugin_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "backend": "kvplane",
        "plugins": [
            {"name": "backoff", "kind": "retry", "source": {"builtin": "backoff"}},
            {"name": "placement", "kind": "keyPlacement", "source": {"builtin": "ring"}, "config": {"vnodes": "lots"}},
        ],
    });
    let path = dir.path().join("node.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let out = kvplane()
        .args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "64MiB", "--config"])
        .arg(&path)
        .env("KVPLANE_CACHE_DIR", dir.path().join("cache"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "a node started although a plugin refused its config");
    let t = text(&out);
    assert!(t.contains("plugin placement") && t.contains("vnodes") && t.contains("lots"), "{t}");
    assert!(!t.contains("kvplane node serving"), "the node served before its plugins started: {t}");
}

/// The `node.json` the operator renders for `kv`, with the address of the
/// etcd it would run swapped for a real one (the pool forms a cluster in
/// it), written into `dir`.
fn rendered_with_etcd(kv: &kvplane_operator::KVCache, etcd: &etcd::EtcdCluster, dir: &std::path::Path) -> std::path::PathBuf {
    let mut config: serde_json::Value = serde_json::from_str(&kvplane_operator::rendered_node_config(kv).unwrap()).unwrap();
    assert!(config["cluster"].is_object(), "the pool's nodes form a cluster: {config}");
    config["metadata"]["etcd"] = serde_json::json!(etcd.endpoints());
    let path = dir.join("node.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

/// The ConfigMap the operator renders for `examples/kvcache/redis.yaml`
/// (the store's address swapped for a real redis-server with a password,
/// which the pods get from the Secret through `KVPLANE_BACKEND_SECRET`),
/// started as `kvplane node --config`: a block PUT to one node process
/// reaches the store, and a fresh node process reads it back from there.
#[test]
fn the_config_rendered_for_the_redis_example_serves_with_that_second_tier() {
    let redis = kvplane_tests::redis::RedisServer::start(&["--requirepass", "s3cret"]);
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kvcache/redis.yaml");
    let yaml = std::fs::read_to_string(example).unwrap().replace("redis.cache.svc:6379", &redis.endpoint());
    let kv: kvplane_operator::KVCache = serde_yaml::from_str(&yaml).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let etcd = etcd::EtcdCluster::start();
    let config = rendered_with_etcd(&kv, &etcd, dir.path());
    let env =
        [("KVPLANE_BACKEND_SECRET", "s3cret".into()), ("KVPLANE_CACHE_DIR", dir.path().join("cache")), ("POD_NAME", "redis-kv-0".into())];

    let block = dir.path().join("block.bin");
    let data: Vec<u8> = (0..65_536u32).map(|i| (i % 241) as u8).collect();
    std::fs::write(&block, &data).unwrap();
    let first = NodeProcess::start_with_env(&["--config", config.to_str().unwrap()], &env);
    let out = run(&["put", "--endpoint", &first.endpoint, "layer0/block7", block.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    // SIGTERM drains: the block queued for the store is written first.
    assert!(first.sigterm_and_wait().success());

    let second = NodeProcess::start_with_env(&["--config", config.to_str().unwrap()], &env);
    let back = dir.path().join("back.bin");
    let out = run(&["get", "--endpoint", &second.endpoint, "layer0/block7", "-o", back.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read(&back).unwrap(), data, "the block read back from the second tier differs");
    let out = run(&["stats", "--endpoint", &second.endpoint, "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["backend_hits"], 1, "{stats}");
}

/// The same for `examples/kvcache/vineyard-tier.yaml`: kvplane nodes with a
/// real vineyardd (PyPI vineyard 0.24.2) as the second tier. vineyardd binds
/// every address, so the test runs inside a private network namespace.
#[test]
fn the_config_rendered_for_the_vineyard_tier_example_serves_with_that_second_tier() {
    use kvplane_tests::vineyard::{in_private_network, VineyardServer};
    if !in_private_network(module_path!(), "the_config_rendered_for_the_vineyard_tier_example_serves_with_that_second_tier") {
        return;
    }
    let vineyardd = VineyardServer::start();
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kvcache/vineyard-tier.yaml");
    let yaml = std::fs::read_to_string(example).unwrap().replace("vineyard.cache.svc:9600", &vineyardd.endpoint());
    let kv: kvplane_operator::KVCache = serde_yaml::from_str(&yaml).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let etcd = etcd::EtcdCluster::start();
    let config = rendered_with_etcd(&kv, &etcd, dir.path());
    let env = [("KVPLANE_CACHE_DIR", dir.path().join("cache")), ("POD_NAME", "vineyard-tier-0".into())];

    let block = dir.path().join("block.bin");
    let data: Vec<u8> = (0..65_536u32).map(|i| (i % 239) as u8).collect();
    std::fs::write(&block, &data).unwrap();
    let first = NodeProcess::start_with_env(&["--config", config.to_str().unwrap()], &env);
    let out = run(&["put", "--endpoint", &first.endpoint, "layer0/block9", block.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(first.sigterm_and_wait().success());

    let second = NodeProcess::start_with_env(&["--config", config.to_str().unwrap()], &env);
    let back = dir.path().join("back.bin");
    let out = run(&["get", "--endpoint", &second.endpoint, "layer0/block9", "-o", back.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read(&back).unwrap(), data, "the block read back from vineyardd differs");
    let out = run(&["stats", "--endpoint", &second.endpoint, "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["backend_hits"], 1, "{stats}");
}

/// Runs `kvplane ARGS` expecting it to exit within 20 s, as a node that
/// refuses to start does; one that serves instead is killed by PID and the
/// test fails saying so.
fn run_refused(args: &[&str]) -> std::process::Output {
    let mut child = kvplane().args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting kvplane");
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("kvplane {args:?} started instead of refusing:\n{}", text(&out));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Issue 21, item 3: a node whose client port other hosts can reach refuses
/// to start without credentials, naming the flags that would let it; with a
/// token, or with --allow-unauthenticated (and a warning), it serves. It
/// binds every address, so it runs inside a private network namespace.
#[test]
fn a_node_reachable_from_other_hosts_refuses_to_start_without_a_token() {
    use kvplane_tests::vineyard::in_private_network;
    if !in_private_network(module_path!(), "a_node_reachable_from_other_hosts_refuses_to_start_without_a_token") {
        return;
    }
    for listen in ["0.0.0.0:0", "[::]:0", "10.1.2.3:9600"] {
        let out = run_refused(&["node", "--listen", listen, "--admin", "none", "--memory", "64MiB"]);
        let log = text(&out);
        assert!(!out.status.success(), "{log}");
        for needle in [&format!("--listen {listen}") as &str, "--token-file", "--allow-unauthenticated"] {
            assert!(log.contains(needle), "the refusal does not name {needle}: {log}");
        }
    }
    // The operator's rendered arguments, less the token: refused before the
    // config file is even read.
    let out = run_refused(&["node", "--listen=0.0.0.0:9600", "--admin=0.0.0.0:9601", "--config=/nonexistent/node.json"]);
    assert!(!out.status.success() && text(&out).contains("--allow-unauthenticated"), "{}", text(&out));

    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    for extra in [&["--token-file", token.to_str().unwrap()][..], &["--allow-unauthenticated"][..]] {
        let mut node = kvplane()
            .args(["node", "--listen", "0.0.0.0:0", "--admin", "none", "--memory", "64MiB"])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting kvplane node");
        let stderr = node.stderr.take().unwrap();
        let log = Arc::default();
        let line = support::wait_for_line_logged(&mut node, stderr, "kvplane node serving", "kvplane node", Arc::clone(&log));
        assert!(line.contains("tcp 0.0.0.0:"), "{line}");
        let warned =
            log.lock().unwrap().iter().any(|l| l.contains("warning: --listen 0.0.0.0:0 serves clients on other hosts without a token"));
        assert_eq!(warned, extra == ["--allow-unauthenticated"], "{extra:?}: {:?}", log.lock().unwrap());
        let _ = node.kill();
        let _ = node.wait();
    }
}

/// A token file its group or others can read draws a warning at start
/// (whoever reads it reads the cache); a 0600 one does not.
#[test]
fn a_token_file_others_can_read_draws_a_warning() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    // 0640 in the node's own group is how Kubernetes mounts a Secret for a
    // non-root pod (fsGroup): not warned about.
    for (mode, warned) in [(0o644, true), (0o604, true), (0o600, false), (0o400, false), (0o640, false)] {
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(mode)).unwrap();
        let node = NodeProcess::start(&["--token-file", token.to_str().unwrap()]);
        let log = node.log.lock().unwrap().join("\n");
        let warning = format!("warning: --token-file {} (mode {mode:04o}) is readable by", token.display());
        assert_eq!(log.contains(&warning), warned, "mode {mode:o}: {log}");
    }
}

#[test]
fn the_unix_socket_is_created_0660_for_the_unix_group_whatever_the_umask() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("node.sock");
    // Root may give the socket any group; anyone else only one of their own.
    // SAFETY: getuid/getgid only read the process's ids.
    let gid = if unsafe { libc::getuid() } == 0 { 4242 } else { unsafe { libc::getgid() } };
    let gid_arg = gid.to_string();
    let mut cmd = kvplane();
    cmd.args(["node", "--listen", "127.0.0.1:0", "--admin", "none", "--memory", "64MiB"]).args([
        "--unix",
        sock.to_str().unwrap(),
        "--unix-group",
        &gid_arg,
    ]);
    // SAFETY: umask(2) in the child between fork and exec, nothing else: a
    // umask of 0 would make a socket bound naively world-connectable.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    let node = NodeProcess::spawn(cmd);
    let meta = std::fs::symlink_metadata(&sock).expect("the socket exists once the node serves");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o660, "mode of {}", sock.display());
    assert_eq!(meta.gid(), gid, "group of {}", sock.display());
    // Only the socket is left beside it (the staging directory is gone),
    // and it serves.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, [std::ffi::OsString::from("node.sock")]);
    let stats = run(&["stats", "--endpoint", &format!("unix://{}", sock.display())]);
    assert!(stats.status.success(), "stats over the socket: {}", text(&stats));
    assert!(node.sigterm_and_wait().success());

    let bad = run_refused(&["node", "--unix", sock.to_str().unwrap(), "--unix-group", "no-such-group-here"]);
    assert!(text(&bad).contains("no group named \"no-such-group-here\" in /etc/group"), "{}", text(&bad));
}
