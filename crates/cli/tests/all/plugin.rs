//! The `kvplane plugin` commands as a user runs them.

use std::path::Path;
use std::process::{Command, Output};

fn kvplane(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvplane")).args(args).env("KVPLANE_CACHE_DIR", cache).output().expect("running kvplane")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn plugin_test_passes_for_every_non_backend_builtin() {
    let cache = tempfile::tempdir().unwrap();
    for builtin in ["builtin:ring", "builtin:backoff", "builtin:gpu-affinity"] {
        let out = kvplane(&["plugin", "test", builtin], cache.path());
        let t = text(&out);
        assert!(out.status.success(), "{builtin}:\n{t}");
        assert!(t.contains("0 failed") && !t.contains("FAIL"), "{builtin}:\n{t}");
    }
}

#[test]
fn plugin_test_of_a_backend_demands_an_endpoint() {
    let cache = tempfile::tempdir().unwrap();
    let out = kvplane(&["plugin", "test", "builtin:resp"], cache.path());
    assert!(!out.status.success());
    assert!(text(&out).contains("--endpoint"), "{}", text(&out));
}

#[test]
fn plugin_inspect_shows_world_version_and_digest() {
    let cache = tempfile::tempdir().unwrap();
    let out = kvplane(&["plugin", "inspect", "builtin:resp"], cache.path());
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for want in ["world:       backend", "kvplane:plugin@0.2.0", "kvplane:plugin/transport@0.2.0", "kvplane:plugin/store@0.2.0", "sha256:"]
    {
        assert!(t.contains(want), "missing {want:?} in:\n{t}");
    }
    let json = kvplane(&["plugin", "inspect", "--json", "builtin:ring"], cache.path());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("inspect --json prints JSON");
    assert_eq!(v["world"], "key-placement");
    assert_eq!(v["sha256"].as_str().map(str::len), Some(64));
}

#[test]
fn unknown_builtins_and_missing_files_are_named() {
    let cache = tempfile::tempdir().unwrap();
    let out = kvplane(&["plugin", "inspect", "builtin:nope"], cache.path());
    assert!(!out.status.success());
    assert!(text(&out).contains("nope") && text(&out).contains("ring"), "{}", text(&out));
    let out = kvplane(&["plugin", "test", "/nonexistent/plugin.wasm"], cache.path());
    assert!(!out.status.success());
    assert!(text(&out).contains("/nonexistent/plugin.wasm"), "{}", text(&out));
}

/// Builds a scaffolded Rust project for wasm32-wasip2 without the network:
/// with the workspace's Cargo.lock copied in, cargo picks the versions the
/// workspace already locked (and fetched), so the test passes offline and
/// does not change when crates.io publishes something new.
fn offline_build(project: &Path, target: &Path) -> Output {
    let lock = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    std::fs::copy(&lock, project.join("Cargo.lock")).expect("copying the workspace's Cargo.lock");
    Command::new(env!("CARGO"))
        .args(["build", "--offline", "--release", "--target", "wasm32-wasip2", "--target-dir"])
        .arg(target)
        .current_dir(project)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        // CI runs the tests under a lint wrapper for the workspace's crates
        // (scripts/lib/lint_build.py): not for the plugin a user scaffolds.
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .output()
        .unwrap()
}

/// Scaffolded projects build with the language's own tool chain and pass
/// `plugin test` without a single edit.
#[test]
fn scaffolded_plugins_build_and_pass_plugin_test() {
    let cache = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    // Share one target directory between the Rust projects so wit-bindgen
    // compiles once.
    let target = work.path().join("target");
    for world in ["key-placement", "retry-policy", "placement-rule"] {
        let name = format!("my-{world}");
        let out =
            kvplane(&["plugin", "new", "--world", world, "--lang", "rust", &name, "--dir", work.path().to_str().unwrap()], cache.path());
        assert!(out.status.success(), "{}", text(&out));
        let build = offline_build(&work.path().join(&name), &target);
        assert!(build.status.success(), "building the {world} scaffold:\n{}", text(&build));
        let wasm = target.join("wasm32-wasip2/release").join(format!("{}.wasm", name.replace('-', "_")));
        let test = kvplane(&["plugin", "test", wasm.to_str().unwrap()], cache.path());
        assert!(test.status.success(), "plugin test of the rust {world} scaffold:\n{}", text(&test));

        let py = format!("py-{world}");
        let out =
            kvplane(&["plugin", "new", "--world", world, "--lang", "python", &py, "--dir", work.path().to_str().unwrap()], cache.path());
        assert!(out.status.success(), "{}", text(&out));
        let dir = work.path().join(&py);
        let build = Command::new("componentize-py")
            .args(["-d", "wit", "-w", world, "componentize", "app", "-o", "plugin.wasm"])
            .current_dir(&dir)
            .output()
            .expect("running componentize-py (pip install componentize-py==0.25.1)");
        assert!(build.status.success(), "building the python {world} scaffold:\n{}", text(&build));
        let test = kvplane(&["plugin", "test", dir.join("plugin.wasm").to_str().unwrap()], cache.path());
        assert!(test.status.success(), "plugin test of the python {world} scaffold:\n{}", text(&test));
    }
    // A backend scaffold is a complete RESP client: it passes the backend kit
    // against a real redis-server as generated.
    let redis = kvplane_tests::redis::RedisServer::start(&[]);
    let out = kvplane(&["plugin", "new", "--world", "backend", "my-backend", "--dir", work.path().to_str().unwrap()], cache.path());
    assert!(out.status.success(), "{}", text(&out));
    let build = offline_build(&work.path().join("my-backend"), &target);
    assert!(build.status.success(), "building the backend scaffold:\n{}", text(&build));
    let wasm = target.join("wasm32-wasip2/release/my_backend.wasm");
    let test = kvplane(&["plugin", "test", wasm.to_str().unwrap(), "--endpoint", &redis.endpoint()], cache.path());
    assert!(test.status.success(), "plugin test of the backend scaffold:\n{}", text(&test));
    let out = kvplane(
        &["plugin", "new", "--world", "backend", "--lang", "python", "py-backend", "--dir", work.path().to_str().unwrap()],
        cache.path(),
    );
    assert!(!out.status.success() && text(&out).contains("--lang rust"), "{}", text(&out));

    let out =
        kvplane(&["plugin", "new", "--world", "key-placement", "my-key-placement", "--dir", work.path().to_str().unwrap()], cache.path());
    assert!(!out.status.success() && text(&out).contains("already exists"), "{}", text(&out));
}
