//! What a component is: its world, the contract version it was built for,
//! what it imports and exports. Read from the compiled component's type, so
//! it reflects exactly what wasmtime will link.

use wasmtime::component::Component;
use wasmtime::Engine;

use super::decl::World;

/// The `kvplane:plugin` version this host implements.
pub const HOST_WIT_VERSION: &str = "0.2.0";
const PACKAGE: &str = "kvplane:plugin/";

/// A summary of a component, as printed by `kvplane plugin inspect`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ComponentInfo {
    /// The world whose interface the component exports, if exactly one.
    pub world: Option<World>,
    /// `kvplane:plugin` version found in its imports and exports.
    pub wit_version: Option<String>,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
    pub size: u64,
    pub sha256: String,
}

/// Split `kvplane:plugin/IFACE@VERSION` into (IFACE, VERSION).
fn contract_item(name: &str) -> Option<(&str, &str)> {
    name.strip_prefix(PACKAGE)?.split_once('@')
}

/// Major version in the semver sense: for 0.x releases the minor number is
/// the breaking one.
fn major(version: &str) -> Option<(u64, u64)> {
    let mut parts = version.split('.');
    let major: u64 = parts.next()?.parse().ok()?;
    let minor: u64 = parts.next()?.parse().ok()?;
    Some(if major == 0 { (0, minor) } else { (major, 0) })
}

/// Whether a plugin built for `plugin_version` can run on this host.
pub(crate) fn compatible(plugin_version: &str) -> bool {
    matches!((major(plugin_version), major(HOST_WIT_VERSION)), (Some(a), Some(b)) if a == b)
}

/// Whether a plugin of `world` built for `plugin_version` can run here:
/// the host's own version, or an older one whose world did not change
/// (0.1.0's placement-rule, see `compat`).
pub(crate) fn compatible_world(plugin_version: &str, world: Option<World>) -> bool {
    compatible(plugin_version) || (major(plugin_version) == Some((0, 1)) && world == Some(World::PlacementRule))
}

/// Whether `plugin_version` is an older release of this major line's
/// predecessors that this host knows (so a refusal can say the world changed).
pub(crate) fn is_known_older(plugin_version: &str) -> bool {
    major(plugin_version) == Some((0, 1))
}

impl ComponentInfo {
    pub fn of(engine: &Engine, component: &Component, size: u64, sha256: String) -> ComponentInfo {
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_owned()).collect();
        let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_owned()).collect();
        let mut worlds: Vec<World> = exports
            .iter()
            .filter_map(|e| contract_item(e))
            .filter_map(|(iface, _)| World::ALL.into_iter().find(|w| w.export_interface() == iface))
            .collect();
        worlds.dedup();
        let wit_version = exports
            .iter()
            .chain(imports.iter())
            .filter_map(|n| contract_item(n))
            .map(|(_, v)| v.to_owned())
            // A version this host cannot run is the one worth reporting.
            .max_by_key(|v| !compatible(v));
        ComponentInfo { world: if worlds.len() == 1 { Some(worlds[0]) } else { None }, wit_version, imports, exports, size, sha256 }
    }

    /// Describe the exports for a wrong-world error.
    pub fn describe_exports(&self) -> String {
        match self.world {
            Some(w) => format!("exports world {w} (kvplane:plugin/{}@…)", w.export_interface()),
            None if self.exports.is_empty() => "exports nothing".to_owned(),
            None => format!("exports {}, which is no single kvplane plugin world", self.exports.join(", ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_by_semver_major() {
        assert!(compatible("0.2.0"));
        assert!(compatible("0.2.7"));
        assert!(!compatible("0.1.0"));
        assert!(compatible_world("0.1.0", Some(World::PlacementRule)));
        assert!(!compatible_world("0.1.0", Some(World::Backend)));
        assert!(!compatible_world("0.3.0", Some(World::PlacementRule)));
        assert!(!compatible("1.0.0"));
        assert!(!compatible("garbage"));
        assert_eq!(contract_item("kvplane:plugin/placement@1.0.0"), Some(("placement", "1.0.0")));
        assert_eq!(contract_item("wasi:cli/environment@0.2.0"), None);
    }
}
