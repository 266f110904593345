//! Builds the first-party plugins for wasm32-wasip2 so the host binary can
//! embed them as `builtin:NAME`.
//!
//! The plugins are ordinary workspace crates; they are built by a nested
//! cargo with its own target directory (so it never waits on the outer
//! build's lock) and copied into OUT_DIR for `include_bytes!`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (builtin name, crate name).
const BUILTINS: &[(&str, &str)] = &[
    ("ring", "kvplane-plugin-ring"),
    ("backoff", "kvplane-plugin-backoff"),
    ("gpu-affinity", "kvplane-plugin-gpu-affinity"),
    ("resp", "kvplane-plugin-resp"),
    ("eic", "kvplane-plugin-eic"),
    ("vineyard", "kvplane-plugin-vineyard"),
];

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.ancestors().nth(2).expect("crates/runtime lives two levels inside the workspace").to_path_buf();
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // A relative CARGO_TARGET_DIR is taken from the workspace, where the
    // nested cargo below runs (this script's own directory is the crate's;
    // joining an absolute path keeps it as given). The tests crate's build
    // script builds its fixtures in the same directory (tests/build.rs), so
    // the host-side dependencies both need (wit-bindgen's macro,
    // wit-component, wasmparser) are built once: the fixtures' build took
    // 30 s alone and 22 s after the plugins' on two idle cores. When both
    // scripts run at once, one nested cargo waits for the other's lock.
    let target_dir =
        workspace.join(std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| "target".into())).join("wasm");

    for dir in ["wit", "plugins"] {
        println!("cargo:rerun-if-changed={}", workspace.join(dir).display());
    }

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&workspace)
        .args(["build", "--release", "--target", "wasm32-wasip2", "--target-dir"])
        .arg(&target_dir)
        // The outer build's flags are for the host target, not for wasm.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        // A linter the outer build runs under (`cargo clippy`, or CI's lint
        // build: scripts/lib/lint_build.py) is for the host crates; the
        // plugins are linted as components by a clippy run of their own, and
        // target/wasm stays one build whichever outer command ran.
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    for (_, krate) in BUILTINS {
        cmd.args(["-p", krate]);
    }
    let status = cmd.status().expect("running cargo to build the builtin plugins");
    if !status.success() {
        panic!(
            "building the builtin plugins for wasm32-wasip2 failed ({status}); \
             is the target installed? `rustup target add wasm32-wasip2`"
        );
    }

    let builtin_dir = out_dir.join("builtin");
    std::fs::create_dir_all(&builtin_dir).expect("creating OUT_DIR/builtin");
    for (name, krate) in BUILTINS {
        let built = target_dir.join("wasm32-wasip2/release").join(format!("{}.wasm", krate.replace('-', "_")));
        copy(&built, &builtin_dir.join(format!("{name}.wasm")));
    }
}

fn copy(from: &Path, to: &Path) {
    if let Err(e) = std::fs::copy(from, to) {
        panic!("copying {} to {}: {e}", from.display(), to.display());
    }
}
