//! The per-instance host state and the small host interfaces (`buffers`,
//! `log`, `clock`, `metrics`) that every plugin may import.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use wasmtime::component::{Resource, ResourceTable};
use wasmtime::ResourceLimiter;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::kvplane::plugin::{buffers, clock, log, metrics, types};
use super::decl::PluginDecl;

/// Bytes of stderr kept per instance: enough for a panic message and a few
/// lines of context, reported in the error when the instance traps.
const STDERR_CAPACITY: usize = 16 << 10;
/// The most bytes one `buffer.peek` may return (`buffers.max-peek`).
pub const MAX_PEEK: u32 = 4096;
/// Longest log line accepted from a plugin; the rest is cut.
const MAX_LOG_LINE: usize = 4096;
/// Distinct metric names one plugin may create: a guard against a plugin
/// exhausting host memory with generated names.
const MAX_METRIC_NAMES: usize = 256;

/// A block payload owned by the host and lent to a plugin by handle.
///
/// `Bytes` makes lending cheap: the table entry and the host's own copy share
/// one allocation.
#[derive(Debug, Clone)]
pub struct BlockBuffer {
    pub data: Bytes,
}

/// Metrics a plugin recorded through the `metrics` interface.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum MetricValue {
    Counter { value: u64 },
    Gauge { value: f64 },
    Histogram { count: u64, sum: f64 },
}

/// State shared by every instance of one loaded plugin.
#[derive(Debug)]
pub struct PluginShared {
    pub decl: PluginDecl,
    pub metrics: Mutex<BTreeMap<String, MetricValue>>,
}

impl PluginShared {
    pub fn new(decl: PluginDecl) -> Arc<PluginShared> {
        Arc::new(PluginShared { decl, metrics: Mutex::new(BTreeMap::new()) })
    }

    pub fn metrics_snapshot(&self) -> BTreeMap<String, MetricValue> {
        self.metrics.lock().map(|m| m.clone()).unwrap_or_default()
    }

    fn record(&self, name: String, update: impl FnOnce(Option<&mut MetricValue>) -> Option<MetricValue>) {
        let Ok(mut metrics) = self.metrics.lock() else {
            return;
        };
        let full = metrics.len() >= MAX_METRIC_NAMES;
        match metrics.get_mut(&name) {
            Some(existing) => {
                update(Some(existing));
            }
            None if !full => {
                if let Some(v) = update(None) {
                    metrics.insert(name, v);
                }
            }
            None => {}
        }
    }
}

/// Memory cap of one instance, remembering whether the cap was what stopped
/// the guest so that the resulting trap can be reported as such.
#[derive(Debug)]
pub struct MemoryCap {
    pub limit: u64,
    pub hit: bool,
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired as u64 > self.limit {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        // Tables hold function references; a million entries is far beyond
        // any honest plugin and bounds the host memory a table can take.
        if desired > 1_000_000 {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }
}

/// Everything one plugin instance's `Store` carries.
pub struct HostState {
    pub shared: Arc<PluginShared>,
    pub table: ResourceTable,
    pub wasi: WasiCtx,
    pub stderr: MemoryOutputPipe,
    pub memory: MemoryCap,
    /// When the current call must end; host I/O waits no longer than this.
    pub deadline: Option<tokio::time::Instant>,
}

impl HostState {
    /// A fresh state granting exactly what `shared.decl` declares: no
    /// environment, no arguments, no sockets through WASI, and a file system
    /// only if a directory was granted.
    pub fn new(shared: Arc<PluginShared>) -> anyhow::Result<HostState> {
        use anyhow::Context as _;
        let stderr = MemoryOutputPipe::new(STDERR_CAPACITY);
        let mut wasi = WasiCtx::builder();
        wasi.stderr(stderr.clone()).allow_tcp(false).allow_udp(false).allow_ip_name_lookup(false);
        if let Some(dir) = &shared.decl.granted_dir {
            wasi.preopened_dir(dir, "/data", wasmtime_wasi::FsPerms::ReadOnly)
                .map_err(anyhow::Error::from)
                .with_context(|| format!("plugin {}: granting directory {}", shared.decl.name, dir.display()))?;
        }
        let limit = shared.decl.limits.memory_bytes;
        Ok(HostState {
            shared,
            table: ResourceTable::new(),
            wasi: wasi.build(),
            stderr,
            memory: MemoryCap { limit, hit: false },
            deadline: None,
        })
    }

    /// What the guest wrote to stderr, trimmed, for error messages.
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr.contents()).trim().to_owned()
    }

    pub fn plugin_name(&self) -> &str {
        &self.shared.decl.name
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl types::Host for HostState {}

impl buffers::Host for HostState {
    fn max_peek(&mut self) -> wasmtime::Result<u32> {
        Ok(MAX_PEEK)
    }
}

impl buffers::HostBuffer for HostState {
    fn len(&mut self, buffer: Resource<BlockBuffer>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&buffer)?.data.len() as u64)
    }

    fn peek(&mut self, buffer: Resource<BlockBuffer>, offset: u64, len: u32) -> wasmtime::Result<Result<Vec<u8>, types::Error>> {
        let data = &self.table.get(&buffer)?.data;
        if len > MAX_PEEK {
            return Ok(Err(types::Error::Invalid(format!("peek of {len} bytes exceeds max-peek {MAX_PEEK}"))));
        }
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        match start.checked_add(len as usize).filter(|&end| end <= data.len()) {
            Some(end) => Ok(Ok(data[start..end].to_vec())),
            None => Ok(Err(types::Error::Invalid(format!(
                "peek of {len} bytes at offset {offset} is outside a buffer of {} bytes",
                data.len()
            )))),
        }
    }

    fn drop(&mut self, buffer: Resource<BlockBuffer>) -> wasmtime::Result<()> {
        self.table.delete(buffer)?;
        Ok(())
    }
}

impl log::Host for HostState {
    fn log(&mut self, level: log::Level, message: String) -> wasmtime::Result<()> {
        let mut message = message;
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(" [truncated]");
        }
        let plugin = self.plugin_name();
        match level {
            log::Level::Trace => tracing::trace!(plugin, "{message}"),
            log::Level::Debug => tracing::debug!(plugin, "{message}"),
            log::Level::Info => tracing::info!(plugin, "{message}"),
            log::Level::Warn => tracing::warn!(plugin, "{message}"),
            log::Level::Error => tracing::error!(plugin, "{message}"),
        }
        Ok(())
    }
}

impl clock::Host for HostState {
    fn now_ms(&mut self) -> wasmtime::Result<u64> {
        Ok(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0))
    }

    fn monotonic_ns(&mut self) -> wasmtime::Result<u64> {
        Ok(super::engine::monotonic_origin().elapsed().as_nanos() as u64)
    }
}

impl metrics::Host for HostState {
    fn counter_add(&mut self, name: String, delta: u64) -> wasmtime::Result<()> {
        self.shared.record(name, |m| match m {
            Some(MetricValue::Counter { value }) => {
                *value = value.saturating_add(delta);
                None
            }
            Some(_) => None,
            None => Some(MetricValue::Counter { value: delta }),
        });
        Ok(())
    }

    fn gauge_set(&mut self, name: String, value: f64) -> wasmtime::Result<()> {
        self.shared.record(name, |m| match m {
            Some(MetricValue::Gauge { value: v }) => {
                *v = value;
                None
            }
            Some(_) => None,
            None => Some(MetricValue::Gauge { value }),
        });
        Ok(())
    }

    fn histogram_observe(&mut self, name: String, value: f64) -> wasmtime::Result<()> {
        self.shared.record(name, |m| match m {
            Some(MetricValue::Histogram { count, sum }) => {
                *count += 1;
                *sum += value;
                None
            }
            Some(_) => None,
            None => Some(MetricValue::Histogram { count: 1, sum: value }),
        });
        Ok(())
    }
}
