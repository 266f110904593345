//! The tenants file of a node (`kvplane node --tenants-file FILE`): who may
//! connect, as which tenant, and how much of the node each tenant may hold.
//!
//! ```json
//! {"tenants": [
//!   {"name": "team-a", "tokenSha256": "<hex SHA-256 of the token>",
//!    "memoryBytes": "8Gi", "pinnedBytes": "1Gi", "maxConnections": 64}
//! ]}
//! ```
//!
//! The file holds digests, never tokens: `printf %s "$TOKEN" | sha256sum`
//! makes one. Whoever reads the file learns who the tenants are, not how to
//! connect as one. A tenant's name becomes the namespace of its keys on the
//! node (see the node's `tenants` module), so it is short and plain.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::node::InvalidField;
use crate::size::ByteSize;

/// Longest tenant name. The node puts the name, after one length byte, in
/// front of every key of the tenant; 63 bytes keep that tag within the 64
/// bytes the node reserves of the key limit.
pub const MAX_TENANT_NAME: usize = 63;

/// The name `--token-file`'s tenant takes when a tenants file is in use, so
/// a file may not give it to another.
pub const DEFAULT_TENANT: &str = "default";

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantsFile {
    pub tenants: Vec<TenantSpec>,
}

/// One tenant.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantSpec {
    /// 1 to 63 of `A-Z a-z 0-9 . _ -`, starting with a letter or digit;
    /// unique in the file. Labels the tenant's series in `/metrics`.
    pub name: String,
    /// The SHA-256 of the tenant's bearer token, 64 hex digits.
    pub token_sha256: String,
    /// Bytes of the memory tier the tenant's blocks may hold; a PUT past it
    /// is refused (`capacity`).
    pub memory_bytes: ByteSize,
    /// Bytes of the tenant's blocks that prefix leases may pin at once.
    pub pinned_bytes: ByteSize,
    /// Connections the tenant may hold open at once (none: no cap but the
    /// node's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
}

fn invalid(field: String, message: impl Into<String>) -> InvalidField {
    InvalidField { field, message: message.into() }
}

/// Whether `name` may name a tenant (see [`TenantSpec::name`]).
pub fn valid_tenant_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_TENANT_NAME
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

impl TenantSpec {
    /// The digest as 32 bytes (after [`TenantsFile::validate`] passed).
    pub fn digest(&self) -> Option<[u8; 32]> {
        let mut out = [0u8; 32];
        let hex = self.token_sha256.trim().as_bytes();
        if hex.len() != 64 {
            return None;
        }
        for (i, pair) in hex.chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).ok()?;
            out[i] = u8::from_str_radix(text, 16).ok()?;
        }
        Some(out)
    }
}

impl TenantsFile {
    /// Checks what the types cannot, naming the tenant and the field:
    /// names (valid, unique, not [`DEFAULT_TENANT`] when `default_taken`),
    /// digests (64 hex digits, unique: one token authenticates into one
    /// tenant) and a `maxConnections` above 0.
    pub fn validate(&self, default_taken: bool) -> Result<(), InvalidField> {
        let mut names = std::collections::HashSet::new();
        let mut digests = std::collections::HashMap::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let at = |field: &str| format!("tenants.{i}.{field} (tenant {:?})", t.name);
            if !valid_tenant_name(&t.name) {
                return Err(invalid(
                    at("name"),
                    format!("must be 1 to {MAX_TENANT_NAME} of A-Z a-z 0-9 . _ -, starting with a letter or digit"),
                ));
            }
            if default_taken && t.name == DEFAULT_TENANT {
                return Err(invalid(at("name"), format!("{DEFAULT_TENANT:?} is the tenant of --token-file; give this one another name")));
            }
            if !names.insert(t.name.as_str()) {
                return Err(invalid(at("name"), "another tenant has this name"));
            }
            let Some(digest) = t.digest() else {
                return Err(invalid(
                    at("tokenSha256"),
                    "must be 64 hex digits, the SHA-256 of the token (printf %s \"$TOKEN\" | sha256sum)",
                ));
            };
            if let Some(other) = digests.insert(digest, t.name.as_str()) {
                return Err(invalid(
                    at("tokenSha256"),
                    format!("tenant {other:?} has the same token digest: a token must name one tenant"),
                ));
            }
            if t.max_connections == Some(0) {
                return Err(invalid(at("maxConnections"), "must be above 0 (leave it out for no cap)"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    fn file(text: &str) -> Result<TenantsFile, String> {
        let f: TenantsFile = crate::from_json_strict(text).map_err(|e| e.to_string())?;
        f.validate(true).map_err(|e| e.to_string())?;
        Ok(f)
    }

    #[test]
    fn a_tenants_file_reads_and_names_the_field_at_fault() {
        let ok =
            file(&format!(r#"{{"tenants": [{{"name": "a", "tokenSha256": "{DIGEST}", "memoryBytes": "1Mi", "pinnedBytes": 4096}}]}}"#))
                .unwrap();
        assert_eq!(ok.tenants[0].memory_bytes.bytes(), 1 << 20);
        assert_eq!(ok.tenants[0].digest().unwrap()[0], 0x9f);
        let bad_digest = file(r#"{"tenants": [{"name": "a", "tokenSha256": "abc", "memoryBytes": 1, "pinnedBytes": 1}]}"#).unwrap_err();
        assert!(bad_digest.contains("tenants.0.tokenSha256 (tenant \"a\")"), "{bad_digest}");
        let typo = file(&format!(r#"{{"tenants": [{{"name": "a", "tokenSha256": "{DIGEST}", "memoryByte": 1, "pinnedBytes": 1}}]}}"#))
            .unwrap_err();
        assert!(typo.contains("memoryBytes") || typo.contains("memoryByte"), "{typo}");
        let default =
            file(&format!(r#"{{"tenants": [{{"name": "default", "tokenSha256": "{DIGEST}", "memoryBytes": 1, "pinnedBytes": 1}}]}}"#))
                .unwrap_err();
        assert!(default.contains("--token-file"), "{default}");
        let twice = file(&format!(
            r#"{{"tenants": [{{"name": "a", "tokenSha256": "{DIGEST}", "memoryBytes": 1, "pinnedBytes": 1}},
                            {{"name": "b", "tokenSha256": "{DIGEST}", "memoryBytes": 1, "pinnedBytes": 1}}]}}"#
        ))
        .unwrap_err();
        assert!(twice.contains("tenants.1.tokenSha256") && twice.contains("same token digest"), "{twice}");
        let name = file(&format!(r#"{{"tenants": [{{"name": "a/b", "tokenSha256": "{DIGEST}", "memoryBytes": 1, "pinnedBytes": 1}}]}}"#))
            .unwrap_err();
        assert!(name.contains("tenants.0.name"), "{name}");
    }
}
