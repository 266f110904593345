//! `kvplane plugin new`: plugin projects that build and pass `plugin test`
//! unchanged. Each project carries its own copy of the WIT contract, so it
//! builds outside this repository.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};

use kvplane_runtime::{World, HOST_WIT_VERSION};

/// The contract, as compiled into this host.
const WIT_FILES: &[(&str, &str)] = &[
    ("types.wit", include_str!("../../../wit/types.wit")),
    ("host.wit", include_str!("../../../wit/host.wit")),
    ("worlds.wit", include_str!("../../../wit/worlds.wit")),
];

const RUST_CARGO_TOML: &str = include_str!("../templates/rust/Cargo.toml.tmpl");

/// `src/` of a Rust project: (file, contents).
fn rust_sources(world: World) -> Vec<(&'static str, String)> {
    match world {
        World::KeyPlacement => vec![("lib.rs", include_str!("../templates/rust/key-placement.rs").into())],
        World::RetryPolicy => vec![("lib.rs", include_str!("../templates/rust/retry-policy.rs").into())],
        World::PlacementRule => vec![("lib.rs", include_str!("../templates/rust/placement-rule.rs").into())],
        // A backend starts as a copy of builtin:resp, a complete RESP client
        // to adapt to another store's protocol, with the first-party
        // backends' shared core (plugins/backend-core, its WIT glue
        // included) as a module of its own, so the project stands alone.
        World::Backend => {
            let standalone = |src: &str| {
                // #[macro_export] macros live at the crate root.
                src.replace("kvplane_backend_core::export_store!", "crate::export_store!")
                    .replace("kvplane_backend_core", "crate::backend_core")
            };
            let glue = include_str!("../../../plugins/backend-core/src/component.rs")
                .replace("path: \"../../wit\"", "path: \"wit\"")
                .replace("$crate::component::", "$crate::backend_core::component::")
                .replace("\"kvplane_backend_core::component::bindings\"", "\"crate::backend_core::component::bindings\"");
            vec![
                ("lib.rs", format!("{}\npub mod backend_core;\n", include_str!("../../../plugins/resp/src/lib.rs"))),
                ("backend_core.rs", include_str!("../../../plugins/backend-core/src/lib.rs").into()),
                ("backend_core/component.rs", glue),
                ("client.rs", standalone(include_str!("../../../plugins/resp/src/client.rs"))),
                ("resp.rs", standalone(include_str!("../../../plugins/resp/src/resp.rs"))),
                ("plugin.rs", standalone(include_str!("../../../plugins/resp/src/plugin.rs"))),
            ]
        }
    }
}

/// `package.json`, `build.mjs` and `.gitignore` of a JavaScript project;
/// `{{name}}` and `{{world}}` are filled in.
const JS_PACKAGE_JSON: &str = include_str!("../templates/js/package.json.tmpl");
const JS_BUILD: &str = include_str!("../templates/js/build.mjs.tmpl");
const JS_GITIGNORE: &str = include_str!("../templates/js/gitignore");

/// The files of a JavaScript project besides `wit/` and `README.md`: (path
/// in the project, contents). componentize-js builds `src/plugin.js`.
fn js_files(world: World, name: &str) -> Vec<(&'static str, String)> {
    let fill = |template: &str| template.replace("{{name}}", name).replace("{{world}}", world.name());
    let mut files = vec![("package.json", fill(JS_PACKAGE_JSON)), ("build.mjs", fill(JS_BUILD)), (".gitignore", JS_GITIGNORE.into())];
    match world {
        World::KeyPlacement => files.push(("src/plugin.js", include_str!("../templates/js/key-placement.js").into())),
        World::RetryPolicy => files.push(("src/plugin.js", include_str!("../templates/js/retry-policy.js").into())),
        World::PlacementRule => files.push(("src/plugin.js", include_str!("../templates/js/placement-rule.js").into())),
        // A backend starts as a copy of examples/plugins/js-resp, a complete
        // RESP client to adapt to another store's protocol.
        World::Backend => files.extend([
            ("src/plugin.js", include_str!("../../../examples/plugins/js-resp/src/plugin.js").into()),
            ("src/resp.js", include_str!("../../../examples/plugins/js-resp/src/resp.js").into()),
        ]),
    }
    files
}

fn python_source(world: World) -> Option<&'static str> {
    Some(match world {
        World::KeyPlacement => include_str!("../templates/python/key-placement.py"),
        World::RetryPolicy => include_str!("../templates/python/retry-policy.py"),
        World::PlacementRule => include_str!("../templates/python/placement-rule.py"),
        World::Backend => return None,
    })
}

/// A project name must be a valid crate name and directory name.
fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.as_bytes()[0].is_ascii_lowercase()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !ok {
        bail!("plugin name {name:?}: use lowercase letters, digits, '-' and '_', starting with a letter");
    }
    Ok(())
}

fn write(path: &Path, contents: &str) -> anyhow::Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// Create project `name` under `parent` for `world` in `lang`; returns its
/// directory. Refuses to overwrite an existing directory.
pub fn create(world: World, lang: &str, name: &str, parent: &Path) -> anyhow::Result<PathBuf> {
    check_name(name)?;
    let python = match lang {
        "rust" | "js" => None,
        "python" => match python_source(world) {
            Some(source) => Some(source),
            None => {
                bail!("--world {world} --lang python: no Python template yet; use --lang rust or --lang js (a complete RESP backend to adapt)")
            }
        },
        other => bail!("--lang {other:?}: expected rust, python or js"),
    };
    let dir = parent.join(name);
    if dir.exists() {
        bail!("{} already exists; choose another name or remove it", dir.display());
    }
    std::fs::create_dir_all(dir.join("wit")).with_context(|| format!("creating {}", dir.display()))?;
    for (file, text) in WIT_FILES {
        write(&dir.join("wit").join(file), text)?;
    }
    match python {
        Some(source) => write(&dir.join("app.py"), source)?,
        None if lang == "js" => {
            std::fs::create_dir_all(dir.join("src")).with_context(|| format!("creating {}/src", dir.display()))?;
            for (file, text) in js_files(world, name) {
                write(&dir.join(file), &text)?;
            }
        }
        None => {
            std::fs::create_dir_all(dir.join("src")).with_context(|| format!("creating {}/src", dir.display()))?;
            write(&dir.join("Cargo.toml"), &RUST_CARGO_TOML.replace("{{name}}", name))?;
            for (file, text) in rust_sources(world) {
                let path = dir.join("src").join(file);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
                }
                write(&path, &text)?;
            }
        }
    }
    write(
        &dir.join("README.md"),
        &format!(
            "# {name}\n\nA kvplane `{world}` plugin, built against the contract `kvplane:plugin@{HOST_WIT_VERSION}` in `wit/`.\n\n{}\n",
            next_steps(world, lang, name)
        ),
    )?;
    Ok(dir)
}

/// How to build and test a scaffolded project.
pub fn next_steps(world: World, lang: &str, name: &str) -> String {
    match lang {
        "python" => format!(
            "Build and test (needs `pip install componentize-py==0.25.1`):\n\n    cd {name}\n    componentize-py -d wit -w {world} componentize app -o {name}.wasm\n    kvplane plugin test {name}.wasm\n"
        ),
        "js" => format!(
            "Build and test (needs Node.js >= 20 and npm; `npm install` fetches componentize-js 0.23.0, and the build is offline after it):\n\n    cd {name}\n    npm install\n    npm run build\n    kvplane plugin test {name}.wasm{}\n",
            if world == World::Backend { " --endpoint HOST:PORT" } else { "" }
        ),
        _ => format!(
            "Build and test (needs `rustup target add wasm32-wasip2`):\n\n    cd {name}\n    cargo build --release --target wasm32-wasip2\n    kvplane plugin test target/wasm32-wasip2/release/{}.wasm{}\n",
            name.replace('-', "_"),
            if world == World::Backend { " --endpoint HOST:PORT" } else { "" }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dir: &Path, file: &str) -> String {
        std::fs::read_to_string(dir.join(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"))
    }

    /// The projects carry the host's contract and templates written for it:
    /// the 0.2.0 `compute` and the 0.2.0 failure, not 0.1.0's calls.
    #[test]
    fn projects_carry_the_current_contract() {
        let parent = tempfile::tempdir().unwrap();
        for world in [World::KeyPlacement, World::RetryPolicy, World::PlacementRule] {
            for lang in ["rust", "python"] {
                let name = format!("{lang}-{world}");
                let dir = create(world, lang, &name, parent.path()).unwrap();
                for (file, text) in WIT_FILES {
                    assert_eq!(&read(&dir, &format!("wit/{file}")), text);
                    assert!(text.contains(&format!("package kvplane:plugin@{HOST_WIT_VERSION};")), "{file}");
                }
                assert!(read(&dir, "README.md").contains(&format!("kvplane:plugin@{HOST_WIT_VERSION}")));
                let source = if lang == "rust" { read(&dir, "src/lib.rs") } else { read(&dir, "app.py") };
                for gone in
                    ["set_members", "set-members", "fn owners", "def owners", "types.Node", ", Node}", "import clock", "plugin::clock"]
                {
                    assert!(!source.contains(gone), "{name} still mentions {gone:?}");
                }
                let wanted: &[&str] = match (world, lang) {
                    (World::KeyPlacement, "rust") => {
                        &["fn compute(members: Vec<Member>, slots: u32, replicas: u32) -> Result<SlotTable, Error>", "MemberState::Up"]
                    }
                    (World::KeyPlacement, _) => &[
                        "def compute(self, members: List[types.Member], slots: int, replicas: int) -> placement.SlotTable",
                        "types.MemberState.UP",
                    ],
                    (World::RetryPolicy, "rust") => {
                        &["deadline_left_ms", "idempotent", "E::Busy(busy)", "E::Unsupported(_)", "E::Denied(_)"]
                    }
                    (World::RetryPolicy, _) => {
                        &["deadline_left_ms", "idempotent", "types.Error_Busy", "types.Error_Unsupported", "types.Error_Denied"]
                    }
                    _ => &["place"],
                };
                for want in wanted {
                    assert!(source.contains(want), "{name} lacks {want:?}");
                }
                if lang == "rust" {
                    let cargo = read(&dir, "Cargo.toml");
                    assert!(cargo.contains(&format!("name = \"{name}\"")) && cargo.contains("wit-bindgen"), "{cargo}");
                    assert!(source.contains("path: \"wit\""), "{name}: the bindings must read the project's own wit/");
                }
            }
        }
        // A backend starts from builtin:resp, its glue pointed at the project's wit/.
        let dir = create(World::Backend, "rust", "my-backend", parent.path()).unwrap();
        assert!(read(&dir, "src/backend_core/component.rs").contains("path: \"wit\""));
        assert!(read(&dir, "src/plugin.rs").contains("crate::export_store!"));
        assert!(create(World::Backend, "python", "py-backend", parent.path()).unwrap_err().to_string().contains("--lang rust"));
        assert!(create(World::KeyPlacement, "rust", "my-backend", parent.path()).unwrap_err().to_string().contains("already exists"));
    }

    /// A JavaScript project of every world: the contract, a package pinning
    /// componentize-js, a build for its world, and a `src/plugin.js` that
    /// exports the world's interface (a backend: the js-resp client).
    #[test]
    fn js_projects_build_their_world_with_the_pinned_componentize_js() {
        let parent = tempfile::tempdir().unwrap();
        for world in World::ALL {
            let name = format!("js-{world}");
            let dir = create(world, "js", &name, parent.path()).unwrap();
            for (file, text) in WIT_FILES {
                assert_eq!(&read(&dir, &format!("wit/{file}")), text);
            }
            let package = read(&dir, "package.json");
            assert!(package.contains(&format!("\"name\": \"{name}\"")), "{package}");
            assert!(package.contains("\"@bytecodealliance/componentize-js\": \"0.23.0\""), "{package}");
            let build = read(&dir, "build.mjs");
            assert!(build.contains(&format!("worldName: '{world}'")) && build.contains(&format!("'{name}.wasm'")), "{build}");
            assert!(!build.contains("{{") && !package.contains("{{"), "{name}: a placeholder was left unfilled");
            assert!(read(&dir, ".gitignore").contains("node_modules/"));
            let source = read(&dir, "src/plugin.js");
            let export = match world {
                World::Backend => "export const store = {",
                World::KeyPlacement => "export const placement = {",
                World::RetryPolicy => "export const retry = {",
                World::PlacementRule => "export const scheduling = {",
            };
            assert!(source.contains(export), "{name} lacks {export:?}");
            if world == World::Backend {
                assert!(read(&dir, "src/resp.js").contains("export class Client"));
            }
            let readme = read(&dir, "README.md");
            assert!(readme.contains("npm run build") && readme.contains(&format!("kvplane plugin test {name}.wasm")), "{readme}");
        }
    }

    #[test]
    fn python_build_steps_use_the_pinned_componentize_py() {
        let steps = next_steps(World::KeyPlacement, "python", "p");
        assert!(steps.contains("componentize-py==0.25.1") && steps.contains("-w key-placement componentize app"), "{steps}");
    }
}
