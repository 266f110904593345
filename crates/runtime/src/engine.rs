//! The process-wide wasmtime `Engine`, its epoch clock and the on-disk cache
//! of compiled components.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine};

use super::host::HostState;

/// How often the epoch advances. Deadlines are rounded up to this; a
/// runaway guest is stopped at most one tick after its deadline.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Wasm stack per call. Deep recursion past this traps as a stack overflow.
const MAX_WASM_STACK: usize = 1 << 20;

pub(crate) fn monotonic_origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// The engine every plugin of this process runs on, with a linker holding
/// the host interfaces and an empty WASI.
pub struct PluginEngine {
    pub engine: Engine,
    pub linker: Linker<HostState>,
    cache_dir: Option<PathBuf>,
    /// The host's per-plugin series (calls, faults, fail-open, latency).
    pub metrics: Arc<crate::metrics::RuntimeMetrics>,
}

impl PluginEngine {
    /// Build an engine and start its epoch ticker. `cache_dir` keeps compiled
    /// components between runs (`None`: compile every time).
    pub fn new(cache_dir: Option<PathBuf>) -> anyhow::Result<Arc<PluginEngine>> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        config.max_wasm_stack(MAX_WASM_STACK);
        config.async_stack_size(MAX_WASM_STACK + (1 << 20));
        let engine = Engine::new(&config).map_err(anyhow::Error::from).context("creating the wasmtime engine")?;

        let mut linker = Linker::new(&engine);
        // Guests built by wasm32-wasip2 Rust, componentize-py or
        // componentize-js import parts of WASI even when they never use them;
        // HostState's WasiCtx grants nothing, so linking it is safe.
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(anyhow::Error::from).context("linking WASI")?;
        super::bindings::PluginHost::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking the kvplane host interfaces")?;

        let plugin_engine = Arc::new(PluginEngine { engine, linker, cache_dir, metrics: Default::default() });
        start_epoch_ticker(Arc::downgrade(&plugin_engine)).context("starting the epoch thread")?;
        Ok(plugin_engine)
    }

    /// The default cache directory: `$KVPLANE_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/kvplane/components`, else `~/.cache/kvplane/components`.
    pub fn default_cache_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("KVPLANE_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("kvplane").join("components"))
    }

    /// Deadline in epoch ticks, rounded up, at least one tick.
    pub fn ticks_for(timeout: Duration) -> u64 {
        (timeout.as_nanos() / EPOCH_TICK.as_nanos()).max(1) as u64 + 1
    }

    /// A digest of everything that makes compiled code valid for this engine
    /// (wasmtime version, target, settings), part of every cache file name.
    fn compatibility_tag(&self) -> String {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut h);
        format!("{:016x}", h.finish())
    }

    fn cache_path(&self, sha256: &str) -> Option<PathBuf> {
        let dir = self.cache_dir.as_ref()?;
        Some(dir.join(format!("{sha256}-{}.cwasm", self.compatibility_tag())))
    }

    /// Compile `bytes` (whose sha256 is `sha256`), or load the compiled code
    /// from the cache. Returns the component and whether it came from cache.
    ///
    /// A cache file that fails to load is recompiled and overwritten: the
    /// cache is an accelerator, never a source of truth.
    #[allow(unsafe_code)] // Loading cached native code; see the SAFETY comment.
    pub fn compile(&self, bytes: &[u8], sha256: &str) -> anyhow::Result<(Component, bool)> {
        let path = self.cache_path(sha256);
        if let Some(path) = path.as_deref().filter(|p| p.exists()) {
            // SAFETY: the file was written by `Component::serialize` of an
            // engine with the same compatibility hash (it is in the name),
            // into a cache directory owned by this user.
            match unsafe { Component::deserialize_file(&self.engine, path) } {
                Ok(component) => return Ok((component, true)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), "ignoring unusable compiled-component cache entry: {e}")
                }
            }
        }
        let component = Component::new(&self.engine, bytes)?;
        if let Some(path) = path {
            if let Err(e) = write_cache_entry(&path, &component) {
                tracing::warn!(path = %path.display(), "could not cache compiled component: {e:#}");
            }
        }
        Ok((component, false))
    }
}

fn write_cache_entry(path: &Path, component: &Component) -> anyhow::Result<()> {
    let dir = path.parent().context("cache path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let bytes = component.serialize()?;
    // Write then rename, so a concurrent reader never sees half a file.
    let tmp = dir.join(format!(".{}.{}.tmp", std::process::id(), fastrand::u64(..)));
    std::fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    Ok(())
}

/// Advance the engine's epoch every tick until the engine is dropped.
fn start_epoch_ticker(engine: Weak<PluginEngine>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("kvplane-epoch".into())
        .spawn(move || loop {
            std::thread::sleep(EPOCH_TICK);
            match engine.upgrade() {
                Some(e) => e.engine.increment_epoch(),
                None => return,
            }
        })
        .map(drop)
}
