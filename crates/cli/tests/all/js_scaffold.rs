//! `kvplane plugin new --lang js` for every world, as a user runs it: the
//! project builds into a component with componentize-js and passes `plugin
//! test` (the backend against a real redis-server) without an edit.
//!
//! Offline: instead of `npm install`, each project links the `node_modules`
//! that `scripts/prereqs js` installed into `examples/plugins/js-resp` (the
//! same componentize-js the scaffold's package.json pins), which
//! `kvplane-tests`' build script has already built a component with.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

fn kvplane(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvplane")).args(args).env("KVPLANE_CACHE_DIR", cache).output().expect("running kvplane")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn js_scaffolds_of_every_world_build_with_componentize_js_and_pass_plugin_test() {
    let node_modules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/plugins/js-resp/node_modules");
    assert!(
        node_modules.join("@bytecodealliance/componentize-js").is_dir(),
        "{} has no componentize-js: run `scripts/prereqs js`",
        node_modules.display()
    );
    let cache = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let redis = kvplane_tests::redis::RedisServer::start(&[]);
    for world in ["key-placement", "retry-policy", "placement-rule", "backend"] {
        let name = format!("js-{world}");
        let out =
            kvplane(&["plugin", "new", "--world", world, "--lang", "js", &name, "--dir", work.path().to_str().unwrap()], cache.path());
        assert!(out.status.success(), "{}", text(&out));
        assert!(text(&out).contains("npm run build"), "the next steps should say how to build:\n{}", text(&out));
        let dir = work.path().join(&name);
        std::os::unix::fs::symlink(&node_modules, dir.join("node_modules")).expect("linking node_modules");

        let started = Instant::now();
        let build = Command::new("node").arg("build.mjs").current_dir(&dir).output().expect("running node (Node.js >= 20)");
        assert!(build.status.success(), "building the js {world} scaffold:\n{}", text(&build));
        let wasm = dir.join(format!("{name}.wasm"));
        let size = std::fs::metadata(&wasm).map(|m| m.len()).unwrap_or_else(|e| panic!("{}: {e}", wasm.display()));
        let built = started.elapsed();

        let started = Instant::now();
        let mut args = vec!["plugin", "test", wasm.to_str().unwrap()];
        let endpoint = redis.endpoint();
        if world == "backend" {
            args.extend(["--endpoint", &endpoint]);
        }
        let test = kvplane(&args, cache.path());
        let t = text(&test);
        assert!(test.status.success() && t.contains(" 0 failed") && !t.contains("FAIL"), "plugin test of the js {world} scaffold:\n{t}");
        println!("js {world}: {size} bytes, built in {built:?}, plugin test (compile included) in {:?}", started.elapsed());
    }
}
