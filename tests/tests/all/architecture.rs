//! The crate map of docs/architecture.md, checked against the real
//! dependency graph (`cargo metadata`): no data-plane crate reaches the
//! operator or a Kubernetes crate, and every crate that needs no unsafe code
//! forbids it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ lives in the workspace")
}

/// Package name -> names of its normal (non-dev, non-build) dependencies,
/// resolved for this platform.
fn normal_graph() -> BTreeMap<String, BTreeSet<String>> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--offline", "--filter-platform", "x86_64-unknown-linux-gnu"])
        .current_dir(workspace())
        .output()
        .expect("running cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let name_of: BTreeMap<&str, &str> =
        meta["packages"].as_array().unwrap().iter().map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap())).collect();
    let mut graph = BTreeMap::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let deps = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null()))
            .map(|d| name_of[d["pkg"].as_str().unwrap()].to_owned())
            .collect();
        graph.insert(name_of[node["id"].as_str().unwrap()].to_owned(), deps);
    }
    graph
}

fn reachable(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_owned()];
    while let Some(p) = todo.pop() {
        for d in graph.get(&p).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn no_data_plane_crate_depends_on_the_operator_or_kubernetes() {
    let graph = normal_graph();
    for krate in
        ["kvplane-protocol", "kvplane-client", "kvplane-config", "kvplane-driver", "kvplane-runtime", "kvplane-admin", "kvplane-node"]
    {
        assert!(graph.contains_key(krate), "{krate} is not in the workspace");
        let deps = reachable(&graph, krate);
        for forbidden in ["kvplane-operator", "kube", "kube-client", "k8s-openapi"] {
            assert!(!deps.contains(forbidden), "{krate} depends on {forbidden}");
        }
    }
    // The runtime knows nothing of the node.
    assert!(!reachable(&graph, "kvplane-runtime").contains("kvplane-node"));
}

/// A cluster client looks owners up natively from the table a node hands
/// it: it embeds no Wasm runtime and no etcd (HTTP) client.
#[test]
fn the_client_embeds_no_wasm_runtime_and_no_etcd_client() {
    let graph = normal_graph();
    let deps = reachable(&graph, "kvplane-client");
    for forbidden in ["wasmtime", "kvplane-runtime", "kvplane-cluster", "reqwest", "hyper"] {
        assert!(!deps.contains(forbidden), "kvplane-client depends on {forbidden}");
    }
}

#[test]
fn crates_without_unsafe_code_forbid_it() {
    for (krate, attribute) in [
        ("protocol", "#![forbid(unsafe_code)]"),
        ("client", "#![deny(unsafe_code)]"),
        ("config", "#![forbid(unsafe_code)]"),
        ("runtime", "#![deny(unsafe_code)]"),
        ("driver", "#![deny(unsafe_code)]"),
        ("admin", "#![forbid(unsafe_code)]"),
        ("operator", "#![forbid(unsafe_code)]"),
        ("plugin-kit", "#![forbid(unsafe_code)]"),
        ("bench", "#![forbid(unsafe_code)]"),
        ("cli", "#![forbid(unsafe_code)]"),
        ("cluster", "#![forbid(unsafe_code)]"),
        ("rdma", "#![deny(unsafe_code)]"),
        ("node", "#![deny(unsafe_code)]"),
        ("tests", "#![deny(unsafe_code)]"),
    ] {
        let root = if krate == "tests" { workspace().join("tests/src") } else { workspace().join("crates").join(krate).join("src") };
        let lib = if root.join("lib.rs").exists() { root.join("lib.rs") } else { root.join("main.rs") };
        let text = std::fs::read_to_string(&lib).unwrap();
        assert!(text.contains(attribute), "{} lacks {attribute}", lib.display());
    }
}
