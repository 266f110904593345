//! The crate map of docs/architecture.md, checked against the real
//! dependency graph (`cargo metadata`): no data-plane crate reaches the
//! operator or a Kubernetes crate, every host crate takes the workspace's
//! lint rules, and the crates that need no unsafe code allow it nowhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ lives in the workspace")
}

/// `cargo metadata` of the workspace, with `args` after the common ones.
fn cargo_metadata(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(args)
        .current_dir(workspace())
        .output()
        .expect("running cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Package name -> names of its normal (non-dev, non-build) dependencies,
/// resolved for this platform.
fn normal_graph() -> BTreeMap<String, BTreeSet<String>> {
    let meta = cargo_metadata(&["--filter-platform", "x86_64-unknown-linux-gnu"]);
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
    for krate in [
        "kvplane-protocol",
        "kvplane-slots",
        "kvplane-client",
        "kvplane-tls",
        "kvplane-config",
        "kvplane-driver",
        "kvplane-runtime",
        "kvplane-admin",
        "kvplane-node",
    ] {
        assert!(graph.contains_key(krate), "{krate} is not in the workspace");
        let deps = reachable(&graph, krate);
        for forbidden in ["kvplane-operator", "kube", "kube-client", "k8s-openapi"] {
            assert!(!deps.contains(forbidden), "{krate} depends on {forbidden}");
        }
    }
    // The runtime knows nothing of the node.
    assert!(!reachable(&graph, "kvplane-runtime").contains("kvplane-node"));
}

/// docs/architecture.md's crate map says, for every workspace crate that
/// builds for the host, its path and the workspace crates it depends on
/// (normal dependencies, by name without the `kvplane-` prefix; a note in
/// parentheses after a name, or after the whole list, is for the reader):
/// exactly what Cargo.toml declares, so the map cannot drift.
#[test]
fn the_crate_map_in_docs_matches_cargo_metadata() {
    let doc = std::fs::read_to_string(workspace().join("docs/architecture.md")).unwrap();
    let mut rows = BTreeMap::new();
    for line in doc.lines().skip_while(|l| !l.starts_with("| crate |")).skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        assert_eq!(cells.len(), 4, "docs/architecture.md: a crate-map row without four cells: {line}");
        let name = cells[0].trim_matches('`').to_owned();
        let path = cells[1].trim_matches('`').to_owned();
        rows.insert(name, (path, short_names(cells[3])));
    }
    let graph = normal_graph();
    let members = workspace_members();
    let mut listed = BTreeSet::new();
    for (name, path) in &members {
        if path.starts_with("plugins/") || path.starts_with("tests/fixtures/") {
            continue;
        }
        let (doc_path, doc_deps) = rows.get(name).unwrap_or_else(|| panic!("docs/architecture.md's crate map has no row for {name}"));
        assert_eq!(doc_path, path, "docs/architecture.md: {name}'s path");
        let deps: BTreeSet<String> =
            graph[name].iter().filter(|d| members.contains_key(*d)).map(|d| d.strip_prefix("kvplane-").unwrap_or(d).to_owned()).collect();
        assert_eq!(doc_deps, &deps, "docs/architecture.md: what {name} depends on (Cargo.toml says {deps:?})");
        listed.insert(name.clone());
    }
    let extra: Vec<_> = rows.keys().filter(|n| !listed.contains(*n)).collect();
    assert!(extra.is_empty(), "docs/architecture.md lists crates that are not host crates of the workspace: {extra:?}");
}

/// `protocol, config (the file), driver` -> {protocol, config, driver}; `—` -> {}.
fn short_names(cell: &str) -> BTreeSet<String> {
    let mut depth = 0;
    let mut plain = String::new();
    for c in cell.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    plain.split(',').map(|s| s.trim().trim_matches('`').to_owned()).filter(|s| !s.is_empty() && s != "—").collect()
}

/// Workspace member name -> its path relative to the workspace root.
fn workspace_members() -> BTreeMap<String, String> {
    let meta = cargo_metadata(&["--no-deps"]);
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let manifest = Path::new(p["manifest_path"].as_str().unwrap());
            let dir = manifest.parent().unwrap().strip_prefix(workspace()).unwrap();
            (p["name"].as_str().unwrap().to_owned(), dir.to_str().unwrap().to_owned())
        })
        .collect()
}

/// Every dependency a host crate declares is used: its name appears in the
/// crate's code (`name::`, `use name`, `name!`), the normal ones in `src/`,
/// the dev ones in `src/`, `tests/`, `benches/` or `examples/`, the build
/// ones in `build.rs`. A dependency left behind after a refactor costs every
/// build its compile time and every reader a wrong idea of the crate.
#[test]
fn every_declared_dependency_is_used() {
    // Named only in code outside the crate's folders.
    let needed_without_a_name: &[(&str, &str)] = &[
        // Named in tests/src/process.rs, which its tests include by path.
        ("kvplane-cluster", "libc"),
    ];
    let meta = cargo_metadata(&["--no-deps"]);
    let mut unused = Vec::new();
    for package in meta["packages"].as_array().unwrap() {
        let name = package["name"].as_str().unwrap();
        let dir = Path::new(package["manifest_path"].as_str().unwrap()).parent().unwrap().to_path_buf();
        if dir.starts_with(workspace().join("plugins")) || dir.starts_with(workspace().join("tests/fixtures")) {
            continue;
        }
        let read_all = |folders: &[&str]| -> String {
            let mut text = String::new();
            for folder in folders {
                let path = dir.join(folder);
                if path.is_dir() {
                    for file in rust_files(&path) {
                        text.push_str(&std::fs::read_to_string(file).unwrap());
                    }
                } else if path.is_file() {
                    text.push_str(&std::fs::read_to_string(path).unwrap());
                }
            }
            text
        };
        let normal = read_all(&["src"]);
        let dev = read_all(&["src", "tests", "benches", "examples"]);
        let build = read_all(&["build.rs"]);
        for dep in package["dependencies"].as_array().unwrap() {
            let declared = dep["rename"].as_str().unwrap_or_else(|| dep["name"].as_str().unwrap());
            let ident = declared.replace('-', "_");
            let code = match dep["kind"].as_str() {
                None => &normal,
                Some("dev") => &dev,
                Some(_) => &build,
            };
            let named = [format!("{ident}::"), format!("use {ident}"), format!("{ident}!"), format!("extern crate {ident}")]
                .iter()
                .any(|pattern| code.contains(pattern.as_str()));
            if !named && !needed_without_a_name.iter().any(|(p, d)| *p == name && *d == declared) {
                unused.push(format!("{name}: {declared} ({})", dep["kind"].as_str().unwrap_or("normal")));
            }
        }
    }
    assert!(unused.is_empty(), "declared in Cargo.toml, never named in the code:\n  {}", unused.join("\n  "));
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

/// The lint rules live once, in the root Cargo.toml's `[workspace.lints]`,
/// at deny, and every host crate opts in (a crate cannot then loosen them in
/// its manifest; only a module can allow unsafe code, by name).
#[test]
fn every_host_crate_takes_the_workspace_lints() {
    let root = std::fs::read_to_string(workspace().join("Cargo.toml")).unwrap();
    for rule in [
        "unsafe_code = \"deny\"",
        "unsafe_op_in_unsafe_fn = \"deny\"",
        "unreachable_pub = \"deny\"",
        "undocumented_unsafe_blocks = \"deny\"",
    ] {
        assert!(root.contains(rule), "the root Cargo.toml's [workspace.lints] lacks {rule}");
    }
    for manifest in host_manifests() {
        let text = std::fs::read_to_string(&manifest).unwrap();
        assert!(text.contains("\n[lints]\nworkspace = true\n"), "{} does not take the workspace lints", manifest.display());
    }
}

/// The manifests of the workspace members that build for the host (the
/// plugins and fixtures build as Wasm components, with generated bindings).
fn host_manifests() -> Vec<std::path::PathBuf> {
    let manifests: Vec<_> = workspace_members()
        .into_values()
        .filter(|path| !path.starts_with("plugins/") && !path.starts_with("tests/fixtures/"))
        .map(|path| workspace().join(path).join("Cargo.toml"))
        .collect();
    assert!(manifests.len() >= 15, "too few host crates found: {manifests:?}");
    manifests
}

/// Crates that need no unsafe code have none: no module of theirs allows it
/// (the workspace denies it everywhere else).
#[test]
fn crates_without_unsafe_code_allow_it_nowhere() {
    for krate in ["protocol", "slots", "config", "admin", "operator", "plugin-kit", "bench", "cli", "cluster", "tls"] {
        let src = workspace().join("crates").join(krate).join("src");
        for file in rust_files(&src) {
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(!text.contains("unsafe_code"), "{} mentions unsafe_code: {krate} is to have no unsafe code", file.display());
        }
    }
}

/// The runtime's wasmtime-generated bindings stay its own, a private `mod
/// bindings`: every other crate calls the typed handles of
/// `kvplane_runtime::worlds` with the host's own types, converted at that
/// boundary, so that what the bindings generator emits never reaches their
/// code. The compiler already refuses a path into a private module; this
/// also catches the module being made public again, and says why it is not.
/// The runtime's own benches and tests are crates of their own: scanned too.
#[test]
fn no_crate_but_the_runtime_names_its_generated_bindings() {
    let lib = std::fs::read_to_string(workspace().join("crates/runtime/src/lib.rs")).unwrap();
    assert!(
        lib.lines().any(|l| l == "mod bindings;"),
        "crates/runtime/src/lib.rs: the generated bindings are to be a private `mod bindings;`, other crates use the host's own types"
    );
    let krate = "kvplane_runtime";
    assert!(names_runtime_bindings(&format!("use {krate}::bindings::CallOptions;")), "the scan misses a path");
    assert!(names_runtime_bindings(&format!("use {krate}::{{bindings::CallOptions, Backend}};")), "the scan misses a group");
    assert!(!names_runtime_bindings(&format!("use {krate}::{{worlds::BackendCallOptions, Backend}};")), "the scan sees what is not there");
    let mut named = Vec::new();
    for (name, dir) in workspace_members() {
        for folder in ["src", "tests", "benches", "examples", "build.rs"] {
            if name == "kvplane-runtime" && folder == "src" {
                continue;
            }
            let path = workspace().join(&dir).join(folder);
            let files = if path.is_dir() {
                rust_files(&path)
            } else if path.is_file() {
                vec![path]
            } else {
                Vec::new()
            };
            for file in files {
                if names_runtime_bindings(&std::fs::read_to_string(&file).unwrap()) {
                    named.push(file.strip_prefix(workspace()).unwrap().display().to_string());
                }
            }
        }
    }
    assert!(
        named.is_empty(),
        "these files name the runtime's generated bindings; use the types of kvplane_runtime::worlds and kvplane_runtime::scheduling instead:\n  {}",
        named.join("\n  ")
    );
}

/// Whether `code` names the runtime's `bindings` module, as a path or in a
/// grouped `use kvplane_runtime::{..}`. The needle is put together here so
/// that this file does not name it.
fn names_runtime_bindings(code: &str) -> bool {
    let krate = "kvplane_runtime";
    code.contains(&format!("{krate}::bindings"))
        || code.match_indices(&format!("{krate}::{{")).any(|(at, _)| {
            let group = code[at..].split(';').next().unwrap_or_default();
            group.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|word| word == "bindings")
        })
}

fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The node's server speaks the protocol and asks its `Store`; which tier
/// holds a key is the store's business (crates/node/src/store.rs). So no
/// file of `server/` names the second tier or its types, but for
/// `TierSetup`, the declaration a node is started with.
#[test]
fn the_node_server_names_no_tier() {
    let server = workspace().join("crates/node/src/server");
    let mut found = Vec::new();
    for file in rust_files(&server) {
        let code = std::fs::read_to_string(&file).unwrap();
        for (n, line) in code.lines().enumerate() {
            let code_part = line.split("//").next().unwrap_or("");
            let names_tier = code_part.contains("SecondTier")
                || code_part.contains(".tier(")
                || (code_part.contains("tier::") && !code_part.contains("tier::TierSetup"));
            if names_tier {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "server/ names the second tier; ask the Store instead:\n{}", found.join("\n"));
}
