//! Typed failures of loading and calling plugins. Every message names the
//! plugin, and for calls the function, so an operator reading a KVCache
//! status or a log line knows which declaration to fix.

use std::time::Duration;

use kvplane_protocol::KvError;

/// A plugin could not be loaded; nothing was instantiated.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("plugin {plugin}: cannot read {source_name}: {reason}")]
    Source { plugin: String, source_name: String, reason: String },
    #[error("plugin {plugin}: sha256 mismatch: declared {declared}, the component's bytes hash to {actual}")]
    Sha256Mismatch { plugin: String, declared: String, actual: String },
    #[error("plugin {plugin}: declared sha256 {declared:?} is not 64 hex digits")]
    BadSha256 { plugin: String, declared: String },
    #[error("plugin {plugin}: {source_name} is not a WebAssembly file (no \\0asm header)")]
    NotWasm { plugin: String, source_name: String },
    #[error(
        "plugin {plugin}: {source_name} is a core WebAssembly module, not a component; build it for wasm32-wasip2 (or wrap it with `wasm-tools component new`)"
    )]
    CoreModule { plugin: String, source_name: String },
    #[error("plugin {plugin}: compiling {source_name} failed: {reason}")]
    Compile { plugin: String, source_name: String, reason: String },
    #[error("plugin {plugin}: built for kvplane:plugin@{plugin_version}, but this host speaks kvplane:plugin@{host_version}; the major versions differ, so rebuild the plugin against the host's WIT")]
    VersionMismatch { plugin: String, plugin_version: String, host_version: String },
    #[error("plugin {plugin}: built for world {world} of kvplane:plugin@{plugin_version}, which changed in kvplane:plugin@{host_version} (this host); rebuild the plugin against the host's WIT (docs/plugins.md lists the changes)")]
    WorldChanged { plugin: String, world: String, plugin_version: String, host_version: String },
    #[error("plugin {plugin}: declared as world {declared}, but the component {found}")]
    WrongWorld { plugin: String, declared: String, found: String },
    #[error("plugin {plugin}: cannot be linked: {reason}")]
    Link { plugin: String, reason: String },
}

/// What went wrong inside one plugin call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Fault {
    /// The guest trapped (panic, unreachable, out-of-bounds access, ...).
    #[error("trapped: {message}")]
    Trap { message: String },
    /// The call ran past its deadline and was interrupted.
    #[error("ran past its {timeout:?} deadline and was stopped")]
    Deadline { timeout: Duration },
    /// The instance tried to grow its memory past the declared cap.
    #[error("hit its memory cap of {limit} bytes")]
    MemoryCap { limit: u64 },
    /// Recursion ran past the wasm stack.
    #[error("overflowed its stack (recursion too deep)")]
    StackOverflow,
    /// The result breaks the contract (too many owners, a wrong count, ...).
    #[error("returned an invalid result: {0}")]
    BadOutput(String),
    /// A fresh instance could not be created or configured.
    #[error("could not start an instance: {0}")]
    Instantiate(String),
    /// `open` / `configure` refused the declaration's config: the plugin
    /// is broken until a retry (with backoff) succeeds.
    #[error("open/configure failed: {0}")]
    Configure(KvError),
    /// A recent `open` / `configure` failed; no instance is tried until the
    /// backoff has passed.
    #[error("is broken ({cause}); next try in {retry_in:?}")]
    Broken { cause: Box<Fault>, retry_in: Duration },
    /// The plugin answered with an error of the contract.
    #[error("returned {0}")]
    Returned(KvError),
}

impl Fault {
    /// Whether this is the plugin breaking rather than an answer by contract.
    /// Only breakage is subject to the fail-open policy.
    pub fn is_breakage(&self) -> bool {
        !matches!(self, Fault::Returned(_))
    }
}

/// A failed plugin call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("plugin {plugin}: {function}: {fault}")]
pub struct PluginError {
    pub plugin: String,
    pub function: &'static str,
    pub fault: Fault,
}
