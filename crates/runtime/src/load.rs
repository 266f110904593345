//! From a declaration to a compiled, type-checked, linkable component.
//!
//! Order matters: bytes are checked against the declared sha256 before any
//! compiling, and the world and contract version are checked before linking,
//! so each failure gets the specific message a person can act on.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, InstancePre};

use super::builtin;
use super::decl::{PluginDecl, PluginSource};
use super::engine::PluginEngine;
use super::error::LoadError;
use super::host::HostState;
use super::inspect::{compatible_world, is_known_older, ComponentInfo, HOST_WIT_VERSION};

/// A component ready to instantiate for one declaration.
pub(crate) struct Loaded {
    pub pre: InstancePre<HostState>,
    pub info: ComponentInfo,
    /// Whether compiled code came from the on-disk cache.
    pub from_cache: bool,
}

/// The raw bytes of a source.
pub(crate) fn read_source(plugin: &str, source: &PluginSource) -> Result<Arc<[u8]>, LoadError> {
    match source {
        PluginSource::Builtin(name) => builtin::bytes(name).map(Arc::from).ok_or_else(|| LoadError::Source {
            plugin: plugin.to_owned(),
            source_name: source.to_string(),
            reason: format!("no builtin plugin named {name:?} (builtins: {})", builtin::NAMES.join(", ")),
        }),
        PluginSource::File(path) => std::fs::read(path).map(Arc::from).map_err(|e| LoadError::Source {
            plugin: plugin.to_owned(),
            source_name: path.display().to_string(),
            reason: e.to_string(),
        }),
        PluginSource::Bytes { bytes, .. } => Ok(bytes.clone()),
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Refuse anything that is not a component before handing it to the compiler,
/// whose messages for these cases are obscure.
fn check_format(plugin: &str, source_name: &str, bytes: &[u8]) -> Result<(), LoadError> {
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(LoadError::NotWasm { plugin: plugin.to_owned(), source_name: source_name.to_owned() });
    }
    // Bytes 4..8: version + layer. Core modules are layer 0, components 1.
    if bytes[6..8] == [0, 0] {
        return Err(LoadError::CoreModule { plugin: plugin.to_owned(), source_name: source_name.to_owned() });
    }
    Ok(())
}

/// Compile (or fetch from cache) and inspect `bytes` without a declaration's
/// world check: what `kvplane plugin inspect` shows.
pub(crate) fn compile_and_inspect(
    engine: &PluginEngine,
    plugin: &str,
    source_name: &str,
    bytes: &[u8],
) -> Result<(Component, ComponentInfo, bool), LoadError> {
    check_format(plugin, source_name, bytes)?;
    let sha = sha256_hex(bytes);
    let (component, from_cache) = engine.compile(bytes, &sha).map_err(|e| LoadError::Compile {
        plugin: plugin.to_owned(),
        source_name: source_name.to_owned(),
        reason: format!("{e:#}"),
    })?;
    let info = ComponentInfo::of(&engine.engine, &component, bytes.len() as u64, sha);
    Ok((component, info, from_cache))
}

/// Load the component a declaration names.
pub(crate) fn load(engine: &PluginEngine, decl: &PluginDecl) -> Result<Loaded, LoadError> {
    let plugin = decl.name.as_str();
    let source_name = decl.source.to_string();
    let bytes = read_source(plugin, &decl.source)?;
    if let Some(declared) = &decl.sha256 {
        let declared = declared.trim().to_ascii_lowercase();
        let declared = declared.strip_prefix("sha256:").unwrap_or(&declared).to_owned();
        if declared.len() != 64 || !declared.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(LoadError::BadSha256 { plugin: plugin.to_owned(), declared });
        }
        let actual = sha256_hex(&bytes);
        if actual != declared {
            return Err(LoadError::Sha256Mismatch { plugin: plugin.to_owned(), declared, actual });
        }
    }
    let (component, info, from_cache) = compile_and_inspect(engine, plugin, &source_name, &bytes)?;
    if let Some(v) = info.wit_version.as_deref().filter(|v| !compatible_world(v, info.world)) {
        if is_known_older(v) {
            return Err(LoadError::WorldChanged {
                plugin: plugin.to_owned(),
                world: info.world.map_or_else(|| "(none)".to_owned(), |w| w.to_string()),
                plugin_version: v.to_owned(),
                host_version: HOST_WIT_VERSION.to_owned(),
            });
        }
        return Err(LoadError::VersionMismatch {
            plugin: plugin.to_owned(),
            plugin_version: v.to_owned(),
            host_version: HOST_WIT_VERSION.to_owned(),
        });
    }
    if info.world != Some(decl.world) {
        return Err(LoadError::WrongWorld { plugin: plugin.to_owned(), declared: decl.world.to_string(), found: info.describe_exports() });
    }
    let pre = engine
        .linker(decl.world)
        .instantiate_pre(&component)
        .map_err(|e| LoadError::Link { plugin: plugin.to_owned(), reason: format!("{e:#}") })?;
    Ok(Loaded { pre, info, from_cache })
}
