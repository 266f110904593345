//! The process-wide wasmtime `Engine`, its epoch clock and the on-disk cache
//! of compiled components.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine};

use super::decl::World;
use super::host::HostState;

/// How often the epoch advances. Deadlines are rounded up to this; a
/// runaway guest is stopped at most one tick after its deadline, so a
/// half-millisecond tick gives the ≤ 1 ms deadline resolution the data path
/// needs at the cost of 2000 wake-ups a second on one thread.
pub(crate) const EPOCH_TICK: Duration = Duration::from_micros(500);
/// First bytes of a compiled-component cache file, before its sha256.
const CACHE_MAGIC: &[u8; 8] = b"KVPLCW02";

/// Wasm stack per call. Deep recursion past this traps as a stack overflow.
const MAX_WASM_STACK: usize = 1 << 20;

pub(crate) fn monotonic_origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// The engine every plugin of this process runs on, with one linker per
/// world: each holds an empty WASI and only the host interfaces that world
/// imports, so a key-placement plugin that imports `transport` fails to
/// link instead of getting sockets.
pub struct PluginEngine {
    pub engine: Engine,
    linkers: [Linker<HostState>; 4],
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

        let linkers = [World::Backend, World::KeyPlacement, World::RetryPolicy, World::PlacementRule]
            .map(|w| world_linker(&engine, w).with_context(|| format!("linking the host interfaces of world {w}")));
        let [a, b, c, d] = linkers;
        let linkers = [a?, b?, c?, d?];

        let plugin_engine = Arc::new(PluginEngine { engine, linkers, cache_dir, metrics: Default::default() });
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

    /// The linker of `world`'s imports.
    pub fn linker(&self, world: World) -> &Linker<HostState> {
        &self.linkers[world as usize]
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
    /// A cache entry carries the sha256 of its compiled bytes and is loaded
    /// only when they still hash to it: a flipped byte (a bad disk, a
    /// tampered file) means recompiling, never running altered native code.
    /// The cache is an accelerator, never a source of truth.
    #[allow(unsafe_code)] // Loading cached native code; see the SAFETY comment.
    pub fn compile(&self, bytes: &[u8], sha256: &str) -> anyhow::Result<(Component, bool)> {
        let path = self.cache_path(sha256);
        if let Some(path) = path.as_deref().filter(|p| p.exists()) {
            match read_cache_entry(path) {
                Ok(compiled) => {
                    // SAFETY: `compiled` hashes to the digest written next to
                    // it by `write_cache_entry`, which stored the output of
                    // `Component::serialize` of an engine with the same
                    // compatibility hash (it is in the file name), in a cache
                    // directory owned by this user.
                    match unsafe { Component::deserialize(&self.engine, &compiled) } {
                        Ok(component) => return Ok((component, true)),
                        Err(e) => tracing::warn!(path = %path.display(), "ignoring unusable compiled-component cache entry: {e}"),
                    }
                }
                Err(e) => tracing::warn!(path = %path.display(), "recompiling: {e:#}"),
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

/// The compiled bytes of a cache entry, if its recorded digest matches.
fn read_cache_entry(path: &Path) -> anyhow::Result<Vec<u8>> {
    use sha2::{Digest, Sha256};
    let mut data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let header = CACHE_MAGIC.len() + 32;
    if data.len() < header || &data[..CACHE_MAGIC.len()] != CACHE_MAGIC {
        anyhow::bail!("{} is not a kvplane compiled-component cache entry", path.display());
    }
    let recorded = data[CACHE_MAGIC.len()..header].to_vec();
    let body = data.split_off(header);
    if Sha256::digest(&body).as_slice() != recorded.as_slice() {
        anyhow::bail!("{} does not match its recorded sha256 (corrupted or altered)", path.display());
    }
    Ok(body)
}

fn write_cache_entry(path: &Path, component: &Component) -> anyhow::Result<()> {
    use sha2::{Digest, Sha256};
    let dir = path.parent().context("cache path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let body = component.serialize()?;
    let mut bytes = Vec::with_capacity(CACHE_MAGIC.len() + 32 + body.len());
    bytes.extend_from_slice(CACHE_MAGIC);
    bytes.extend_from_slice(&Sha256::digest(&body));
    bytes.extend_from_slice(&body);
    // Write then rename, so a concurrent reader never sees half a file.
    let tmp = dir.join(format!(".{}.{}.tmp", std::process::id(), fastrand::u64(..)));
    std::fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    Ok(())
}

/// A linker with WASI (granting nothing; toolchains import it whether or
/// not the plugin uses it) and exactly the host interfaces `world` imports.
fn world_linker(engine: &Engine, world: World) -> anyhow::Result<Linker<HostState>> {
    use super::bindings::kvplane::plugin as iface;
    use wasmtime::component::HasSelf;
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(anyhow::Error::from).context("linking WASI")?;
    let l = &mut linker;
    iface::types::add_to_linker::<HostState, HasSelf<HostState>>(l, |s| s).map_err(anyhow::Error::from)?;
    iface::log::add_to_linker::<HostState, HasSelf<HostState>>(l, |s| s).map_err(anyhow::Error::from)?;
    iface::metrics::add_to_linker::<HostState, HasSelf<HostState>>(l, |s| s).map_err(anyhow::Error::from)?;
    match world {
        World::Backend => {
            iface::clock::add_to_linker::<HostState, HasSelf<HostState>>(l, |s| s).map_err(anyhow::Error::from)?;
            iface::buffers::add_to_linker::<HostState, HasSelf<HostState>>(l, |s| s).map_err(anyhow::Error::from)?;
            iface::transport::add_to_linker::<HostState, HasSelf<HostState>>(l, |s| s).map_err(anyhow::Error::from)?;
            iface::driver::add_to_linker::<HostState, HasSelf<HostState>>(l, |s| s).map_err(anyhow::Error::from)?;
        }
        World::KeyPlacement | World::RetryPolicy => {}
        World::PlacementRule => super::compat::link_v0_1(l).context("linking kvplane:plugin@0.1.0 for placement-rule")?,
    }
    Ok(linker)
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
