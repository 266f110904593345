//! First-party plugins embedded in the host binary (`builtin:NAME`), built
//! from `plugins/` by `build.rs`.

macro_rules! builtin {
    ($name:literal) => {
        include_bytes!(concat!(env!("OUT_DIR"), "/builtin/", $name, ".wasm"))
    };
}

/// Names of the builtin plugins.
pub const NAMES: &[&str] = &["ring", "backoff", "gpu-affinity", "resp", "eic", "vineyard"];

/// The component bytes of builtin `name`.
pub fn bytes(name: &str) -> Option<&'static [u8]> {
    Some(match name {
        "ring" => builtin!("ring"),
        "backoff" => builtin!("backoff"),
        "gpu-affinity" => builtin!("gpu-affinity"),
        "resp" => builtin!("resp"),
        "eic" => builtin!("eic"),
        "vineyard" => builtin!("vineyard"),
        _ => return None,
    })
}

/// The world each builtin implements.
pub fn world(name: &str) -> Option<super::decl::World> {
    use super::decl::World;
    Some(match name {
        "ring" => World::KeyPlacement,
        "backoff" => World::RetryPolicy,
        "gpu-affinity" => World::PlacementRule,
        "resp" | "eic" | "vineyard" => World::Backend,
        _ => return None,
    })
}
