//! The Python twin of `builtin:ring` (componentize-py) passes the same kit,
//! computes the same slot table as the Rust ring, and loads from the
//! compile cache on a second start.

use std::time::{Duration, Instant};

use kvplane_plugin_kit::conformance;
use kvplane_runtime::{PluginDecl, PluginRuntime, PluginSource, World};
use kvplane_slots::{Member, MemberState, SLOTS};

fn decl() -> PluginDecl {
    let mut d = PluginDecl::new("python-ring", World::KeyPlacement, PluginSource::File(kvplane_tests::PYTHON_RING.into()));
    d.limits.memory_bytes = 256 << 20;
    d.limits.timeout = Duration::from_secs(10);
    d
}

#[tokio::test]
async fn python_ring_passes_the_kit_agrees_with_rust_and_is_cached() {
    let cache = tempfile::tempdir().unwrap();

    let started = Instant::now();
    let first = PluginRuntime::new(Some(cache.path().into())).unwrap().load_key_placement(decl()).unwrap();
    let compile_time = started.elapsed();
    assert!(!first.plugin.from_cache, "a new cache directory cannot hold it yet");

    let report = conformance::key_placement(&first).await;
    println!("{report}");
    assert!(report.passed(), "{report}");

    let mut members: Vec<Member> = (0..6).map(|i| Member::up(format!("node-{i}"), format!("10.1.0.{i}:9600"))).collect();
    members[2].state = MemberState::Draining;
    members[4].weight = 200;
    let python = first.compute(1, members.clone(), SLOTS, 3).await.unwrap();
    let rust = kvplane_runtime::worlds::native_slot_table(1, members.clone(), SLOTS, 3).unwrap();
    assert_eq!(python, rust, "the Python ring must agree with the Rust ring slot for slot");

    // A second process (here: a second runtime) finds the compiled code.
    let started = Instant::now();
    let second = PluginRuntime::new(Some(cache.path().into())).unwrap().load_key_placement(decl()).unwrap();
    let cached_time = started.elapsed();
    assert!(second.plugin.from_cache, "the second load must come from the compile cache");
    assert_eq!(second.compute(1, members, SLOTS, 3).await.unwrap(), python);
    println!("python-ring: compile {compile_time:?}, load from cache {cached_time:?}");
}
