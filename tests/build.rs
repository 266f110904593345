//! Builds the Wasm components the integration tests load, so `cargo test`
//! alone is enough: nobody has to remember a separate fixture build, and a
//! test can never run against a stale component.
//!
//! - the Rust fixtures (`fixtures/hostile`, `fixtures/future-major`,
//!   `fixtures/placement-rule-v0.1`) with a
//!   nested `cargo build` for `wasm32-wasip2`, in a target dir of their own
//!   (shared with the builtin plugins' build in crates/runtime/build.rs) so
//!   the nested cargo never waits on the lock the outer cargo holds;
//! - the Python ring (`examples/plugins/python-ring`) with componentize-py;
//! - the JavaScript RESP backend (`examples/plugins/js-resp`) with
//!   componentize-js, from the `node_modules` that `scripts/prereqs js`
//!   installs there (`npm ci`), so the build needs no network.
//!
//! Their paths reach the crate as compile-time env vars (see `src/lib.rs`).

use std::env;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The componentize-py release the Python plugin is written for. Other
/// releases name the generated bindings differently (`wit_world`, the export
/// class), so a mismatch is worth a warning before it becomes an import error.
const COMPONENTIZE_PY_VERSION: &str = "0.25.1";

/// Where the Python plugin lives, relative to the workspace root.
const PYTHON_RING_DIR: &str = "examples/plugins/python-ring";

/// The packages `examples/plugins/js-resp/package.json` pins, and their
/// versions: componentize-js, and the preview2-shim it imports at run time
/// without depending on it (0.26 cannot read the WIT folder). Another
/// version in its `node_modules` means `npm ci` has not run since the pins
/// changed.
const JS_PINS: [(&str, &str); 2] = [("@bytecodealliance/componentize-js", "0.23.0"), ("@bytecodealliance/preview2-shim", "0.17.9")];

/// Where the JavaScript plugin lives, relative to the workspace root.
const JS_RESP_DIR: &str = "examples/plugins/js-resp";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest_dir.parent().expect("the tests crate sits one level below the workspace root").to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));

    // Paths relative to this package; the nested build covers its own
    // dependencies, but a bumped wit-bindgen in Cargo.lock must reach it too.
    for path in [
        "build.rs",
        "fixtures/hostile",
        "fixtures/future-major",
        "fixtures/placement-rule-v0.1",
        "fixtures/key-placement-v0.1",
        "fixtures/sneaky-placement",
        "../wit",
        "../Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }

    let [hostile, future_major, placement_rule_v0_1, key_placement_v0_1, sneaky_placement] = build_rust_fixtures(&root);
    let python_ring = build_python_ring(&root, &out_dir);
    let js_resp = build_js_resp(&root, &out_dir);

    println!("cargo:rustc-env=KVPLANE_FIXTURE_HOSTILE={}", hostile.display());
    println!("cargo:rustc-env=KVPLANE_FIXTURE_FUTURE_MAJOR={}", future_major.display());
    println!("cargo:rustc-env=KVPLANE_FIXTURE_PLACEMENT_RULE_V0_1={}", placement_rule_v0_1.display());
    println!("cargo:rustc-env=KVPLANE_FIXTURE_KEY_PLACEMENT_V0_1={}", key_placement_v0_1.display());
    println!("cargo:rustc-env=KVPLANE_FIXTURE_SNEAKY_PLACEMENT={}", sneaky_placement.display());
    println!("cargo:rustc-env=KVPLANE_PYTHON_RING={}", python_ring.display());
    println!("cargo:rustc-env=KVPLANE_JS_RESP={}", js_resp.display());
}

/// Prints `message` where cargo shows a failed build script's output and stops.
fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}

fn build_rust_fixtures(root: &Path) -> [PathBuf; 5] {
    // The directory crates/runtime/build.rs builds the builtin plugins in,
    // so what both need is built once (a relative CARGO_TARGET_DIR is taken
    // from the workspace root, as there).
    let target_dir = root.join(env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| "target".into())).join("wasm");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .arg("build")
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .args(["--release", "--target", "wasm32-wasip2"])
        .args(["-p", "kvplane-fixture-hostile", "-p", "kvplane-fixture-future-major"])
        .args(["-p", "kvplane-fixture-placement-rule-v0-1", "-p", "kvplane-fixture-key-placement-v0-1"])
        .args(["-p", "kvplane-fixture-sneaky-placement"])
        .arg("--target-dir")
        .arg(&target_dir)
        // Flags meant for the host build (coverage, sanitizers, target-cpu)
        // are wrong for, or rejected by, the wasm target.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        // As in crates/runtime/build.rs: an outer linter is for the host
        // crates, and target/wasm stays one build.
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    match cmd.status() {
        Ok(s) if s.success() => {}
        Ok(s) => fail(&format!("building the Wasm test fixtures failed ({s}); is the target installed? `rustup target add wasm32-wasip2`")),
        Err(e) => fail(&format!("could not run cargo to build the Wasm test fixtures: {e}")),
    }
    let release = target_dir.join("wasm32-wasip2").join("release");
    let found = |name: &str| {
        let path = release.join(name);
        if !path.is_file() {
            fail(&format!("cargo succeeded but did not produce {}", path.display()));
        }
        path
    };
    [
        found("kvplane_fixture_hostile.wasm"),
        found("kvplane_fixture_future_major.wasm"),
        found("kvplane_fixture_placement_rule_v0_1.wasm"),
        found("kvplane_fixture_key_placement_v0_1.wasm"),
        found("kvplane_fixture_sneaky_placement.wasm"),
    ]
}

fn build_python_ring(root: &Path, out_dir: &Path) -> PathBuf {
    let install_hint = format!("run `pip install componentize-py=={COMPONENTIZE_PY_VERSION}`");
    match Command::new("componentize-py").arg("--version").stderr(Stdio::inherit()).output() {
        Ok(o) if o.status.success() => {
            let version = String::from_utf8_lossy(&o.stdout);
            if !version.split_whitespace().any(|w| w == COMPONENTIZE_PY_VERSION) {
                println!(
                    "cargo:warning=found {}, the Python plugin is written for componentize-py {COMPONENTIZE_PY_VERSION}",
                    version.trim()
                );
            }
        }
        Ok(o) => fail(&format!("componentize-py is not usable ({}); it builds the Python plugin the tests load: {install_hint}", o.status)),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            fail(&format!("componentize-py was not found on PATH; it builds the Python plugin the tests load: {install_hint}"))
        }
        Err(e) => fail(&format!("could not run componentize-py: {e}; {install_hint}")),
    }

    // componentize-py imports the app with the build machine's Python, which
    // drops __pycache__ next to the sources; working on a copy keeps the
    // source tree clean and stops those writes from retriggering this script.
    let source = root.join(PYTHON_RING_DIR);
    let staged = out_dir.join("python-ring-src");
    if staged.exists() {
        fs::remove_dir_all(&staged).unwrap_or_else(|e| fail(&format!("clearing {}: {e}", staged.display())));
    }
    fs::create_dir_all(&staged).unwrap_or_else(|e| fail(&format!("creating {}: {e}", staged.display())));
    let entries = fs::read_dir(&source).unwrap_or_else(|e| fail(&format!("reading {}: {e}", source.display())));
    for entry in entries {
        let path = entry.unwrap_or_else(|e| fail(&format!("reading {}: {e}", source.display()))).path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        // Files, not the directory: pytest's __pycache__ there must not
        // trigger a rebuild.
        if name.ends_with(".py") && !name.starts_with("test_") {
            println!("cargo:rerun-if-changed={}", path.display());
            fs::copy(&path, staged.join(&name)).unwrap_or_else(|e| fail(&format!("copying {}: {e}", path.display())));
        }
    }

    let output = out_dir.join("python-ring.wasm");
    let status = Command::new("componentize-py")
        .current_dir(&staged)
        .arg("-d")
        .arg(root.join("wit"))
        .args(["-w", "key-placement", "componentize", "app", "-p"])
        .arg(&staged)
        .arg("-o")
        .arg(&output)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status();
    match status {
        Ok(s) if s.success() && output.is_file() => output,
        Ok(s) => fail(&format!("componentize-py failed to build {PYTHON_RING_DIR} ({s})")),
        Err(e) => fail(&format!("could not run componentize-py: {e}; {install_hint}")),
    }
}

fn build_js_resp(root: &Path, out_dir: &Path) -> PathBuf {
    let source = root.join(JS_RESP_DIR);
    let install_hint =
        format!("run `scripts/prereqs js` (it runs `npm ci` in {JS_RESP_DIR}; needs Node.js >= 20 and npm, and the npm registry once)");
    match Command::new("node").arg("--version").stderr(Stdio::inherit()).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => fail(&format!("node is not usable ({}); it builds the JavaScript plugin the tests load: {install_hint}", o.status)),
        Err(e) if e.kind() == ErrorKind::NotFound => fail(&format!(
            "node was not found on PATH; it builds the JavaScript plugin the tests load with componentize-js: {install_hint}"
        )),
        Err(e) => fail(&format!("could not run node: {e}; {install_hint}")),
    }
    let package = source.join("package.json");
    let package = fs::read_to_string(&package).unwrap_or_else(|e| fail(&format!("reading {}: {e}", package.display())));
    for (name, version) in JS_PINS {
        if !package.contains(&format!("\"{name}\": \"{version}\"")) {
            fail(&format!("{JS_RESP_DIR}/package.json does not pin {name} {version}; change JS_PINS in tests/build.rs with it"));
        }
        let installed = source.join("node_modules").join(name).join("package.json");
        let manifest = match fs::read_to_string(&installed) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => fail(&format!(
                "{name} is not installed in {JS_RESP_DIR}/node_modules; componentize-js builds the JavaScript plugin the tests load: {install_hint}"
            )),
            Err(e) => fail(&format!("reading {}: {e}; {install_hint}", installed.display())),
        };
        // npm writes `"version": "X.Y.Z",` on a line of its own.
        let found = manifest
            .lines()
            .find_map(|line| line.trim().strip_prefix("\"version\": \"")?.split('"').next())
            .unwrap_or_else(|| fail(&format!("{} names no version; {install_hint}", installed.display())));
        if found != version {
            fail(&format!("{JS_RESP_DIR}/node_modules holds {name} {found}, its package.json pins {version}: {install_hint}"));
        }
    }

    for file in ["build.mjs", "package.json", "package-lock.json", "node_modules/.package-lock.json"] {
        println!("cargo:rerun-if-changed={}", source.join(file).display());
    }
    let src = source.join("src");
    let entries = fs::read_dir(&src).unwrap_or_else(|e| fail(&format!("reading {}: {e}", src.display())));
    for entry in entries {
        let path = entry.unwrap_or_else(|e| fail(&format!("reading {}: {e}", src.display()))).path();
        if path.extension().is_some_and(|x| x == "js") {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }

    let output = out_dir.join("js-resp.wasm");
    let status =
        Command::new("node").current_dir(&source).arg("build.mjs").arg("--wit").arg(root.join("wit")).arg("--out").arg(&output).status();
    match status {
        Ok(s) if s.success() && output.is_file() => output,
        Ok(s) => fail(&format!("componentize-js failed to build {JS_RESP_DIR} ({s}); its output is above")),
        Err(e) => fail(&format!("could not run node: {e}; {install_hint}")),
    }
}
