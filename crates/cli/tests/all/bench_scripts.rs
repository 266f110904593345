//! The benchmark scripts keep working: each runs in its smoke mode (every
//! path once, briefly, tiny shapes) against this build's binary. Their
//! figures mean nothing here; the scripts are run by hand for those.

use std::path::Path;
use std::process::Command;

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

#[test]
fn bench_node_runs_every_cell_and_prints_its_tables() {
    let out = Command::new(workspace().join("scripts/bench-node"))
        .current_dir(workspace())
        .env("SMOKE", "1")
        .env("KVPLANE_BIN", env!("CARGO_BIN_EXE_kvplane"))
        .output()
        .expect("running scripts/bench-node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scripts/bench-node failed: {}\n{stdout}\n{stderr}", out.status);
    for expected in ["node/raw", "spread over 1 run(s)", "64 KiB  get |", "single 4 KiB GET p50", "TLS on the TCP port", "tls/tcp"] {
        assert!(stdout.contains(expected), "no {expected:?} in its output:\n{stdout}");
    }
}

#[test]
fn bench_instructions_counts_both_ops_on_both_sides_and_prints_the_table() {
    let bin = env!("CARGO_BIN_EXE_kvplane");
    let out = Command::new(workspace().join("scripts/bench-instructions"))
        .current_dir(workspace())
        .env("SMOKE", "1")
        .arg(bin)
        .output()
        .expect("running scripts/bench-instructions");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scripts/bench-instructions failed: {}\n{stdout}\n{stderr}", out.status);
    for expected in ["user-space instructions per request", " put   node |", " put client |", " get   node |", " get client |", "binary 1:"]
    {
        assert!(stdout.contains(expected), "no {expected:?} in its output:\n{stdout}");
    }
}
