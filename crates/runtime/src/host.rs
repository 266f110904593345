//! The per-instance host state, what it counts against the declaration's
//! limits, and the small host interfaces (`buffers`, `log`, `clock`,
//! `metrics`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use wasmtime::component::{Resource, ResourceTable};
use wasmtime::ResourceLimiter;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::kvplane::plugin::{buffers, clock, log, metrics, types};
use super::buffer::{BlockBuffer, Region};
use super::decl::PluginDecl;

/// Bytes of stderr kept per instance: enough for a panic message and a few
/// lines of context, reported in the error when the instance traps.
const STDERR_CAPACITY: usize = 16 << 10;
/// The most bytes one `buffer.peek` may return (`buffers.max-peek`).
pub const MAX_PEEK: u32 = 4096;
/// Longest log record accepted from a plugin, in bytes; the rest is cut
/// (and counted as truncated), so one record cannot carry a flood.
pub const MAX_LOG_RECORD: usize = 4096;
/// How often, at most, the node log says that a plugin's records were
/// dropped: the report itself must not become the flood.
const LOG_DROP_REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Longest metric name accepted; longer names are dropped and counted.
const MAX_METRIC_NAME: usize = 128;

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
    /// Times a host limit refused the plugin, by limit name.
    pub limit_hits: Mutex<BTreeMap<&'static str, u64>>,
    /// Loaded driver libraries, by declared name (loaded on first open).
    pub(crate) drivers: Mutex<BTreeMap<String, Arc<kvplane_driver::Driver>>>,
    /// Metric updates dropped because the series limit was reached.
    pub dropped_metric_updates: AtomicU64,
    /// The plugin's log records: the rate limiter and what it let through.
    log: Mutex<LogLimiter>,
}

/// What became of a plugin's log records, for metrics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LogCounts {
    /// Records written to the node log.
    pub written: u64,
    /// Bytes of the messages written (after truncation).
    pub written_bytes: u64,
    /// Records dropped past `logRecordsPerSecond` / `logBurst`.
    pub dropped: u64,
    /// Records written cut to [`MAX_LOG_RECORD`] bytes.
    pub truncated: u64,
}

/// A token bucket over a plugin's log records: `rate` records a second,
/// `burst` at once. Shared by the plugin's instances, because the node log
/// is one disk whichever instance writes.
#[derive(Debug)]
struct LogLimiter {
    rate: f64,
    burst: f64,
    tokens: f64,
    refilled: std::time::Instant,
    counts: LogCounts,
    /// Drops not yet reported in the node log, and when it last said so.
    unreported: u64,
    reported: Option<std::time::Instant>,
}

impl LogLimiter {
    fn new(rate: u32, burst: u32) -> LogLimiter {
        let burst = f64::from(burst.max(1));
        LogLimiter {
            rate: f64::from(rate),
            burst,
            tokens: burst,
            refilled: std::time::Instant::now(),
            counts: LogCounts::default(),
            unreported: 0,
            reported: None,
        }
    }

    /// Whether one more record may be written now (counted either way).
    fn admit(&mut self, now: std::time::Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return true;
        }
        self.counts.dropped += 1;
        self.unreported += 1;
        false
    }

    /// Drops to report in the node log now, if any and if the last report
    /// is old enough.
    fn report_due(&mut self, now: std::time::Instant) -> Option<u64> {
        if self.unreported == 0 || self.reported.is_some_and(|t| now.saturating_duration_since(t) < LOG_DROP_REPORT_INTERVAL) {
            return None;
        }
        self.reported = Some(now);
        Some(std::mem::take(&mut self.unreported))
    }
}

impl PluginShared {
    pub fn new(decl: PluginDecl) -> Arc<PluginShared> {
        Arc::new(PluginShared {
            metrics: Mutex::new(BTreeMap::new()),
            limit_hits: Mutex::new(BTreeMap::new()),
            drivers: Mutex::new(BTreeMap::new()),
            dropped_metric_updates: AtomicU64::new(0),
            log: Mutex::new(LogLimiter::new(decl.limits.log_records_per_second, decl.limits.log_burst)),
            decl,
        })
    }

    /// What became of the plugin's log records so far.
    pub fn log_counts(&self) -> LogCounts {
        self.log.lock().map(|l| l.counts).unwrap_or_default()
    }

    pub fn metrics_snapshot(&self) -> BTreeMap<String, MetricValue> {
        self.metrics.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Count one refusal by the limit named `limit`.
    pub fn hit_limit(&self, limit: &'static str) {
        if let Ok(mut hits) = self.limit_hits.lock() {
            *hits.entry(limit).or_default() += 1;
        }
    }

    pub fn limit_hits_snapshot(&self) -> BTreeMap<&'static str, u64> {
        self.limit_hits.lock().map(|h| h.clone()).unwrap_or_default()
    }

    fn record(&self, name: String, update: impl FnOnce(Option<&mut MetricValue>) -> Option<MetricValue>) {
        let Ok(mut metrics) = self.metrics.lock() else {
            return;
        };
        let full = metrics.len() >= self.decl.limits.metric_series as usize;
        match metrics.get_mut(&name) {
            Some(existing) => {
                update(Some(existing));
            }
            None if !full && name.len() <= MAX_METRIC_NAME => {
                if let Some(v) = update(None) {
                    metrics.insert(name, v);
                }
            }
            None => {
                drop(metrics);
                self.dropped_metric_updates.fetch_add(1, Ordering::Relaxed);
                self.hit_limit("metric-series");
            }
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

/// What one instance holds of the host, counted against its limits.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub connections: u32,
    pub buffers: u32,
    pub buffer_bytes: u64,
    pub queued_bytes: u64,
    /// Every entry of the resource table (connections, buffers, sessions).
    pub handles: u32,
}

/// Which kind of handle a table entry is, for the accounting.
#[derive(Debug, Clone, Copy)]
pub enum HandleKind {
    Connection,
    Buffer { charged: u64 },
    Session,
}

/// Everything one plugin instance's `Store` carries.
pub struct HostState {
    pub shared: Arc<PluginShared>,
    pub table: ResourceTable,
    pub wasi: WasiCtx,
    pub stderr: MemoryOutputPipe,
    pub memory: MemoryCap,
    pub usage: Usage,
    /// When the current call must end; host I/O waits no longer than this.
    pub deadline: Option<tokio::time::Instant>,
    /// Set when the `handles` limit refused this instance: handles it never
    /// gave back stay spent, so the pool retires it after the call instead
    /// of lending it the next one (which it could not even be lent).
    pub(crate) handles_exhausted: bool,
}

impl HostState {
    /// A fresh state granting exactly what `shared.decl` declares: no
    /// environment, no arguments, no sockets through WASI, and a file system
    /// only if a directory was granted. WASI's clocks read zero and its
    /// randomness is a fixed sequence: the contract's `clock` (for worlds
    /// that import it) and the host-drawn `jitter-seed` are the only sources
    /// of time and chance, so placement and retry plugins stay deterministic.
    pub fn new(shared: Arc<PluginShared>) -> anyhow::Result<HostState> {
        use anyhow::Context as _;
        let stderr = MemoryOutputPipe::new(STDERR_CAPACITY);
        let mut wasi = WasiCtx::builder();
        wasi.stderr(stderr.clone()).allow_tcp(false).allow_udp(false).allow_ip_name_lookup(false);
        wasi.secure_random(wasmtime_wasi::Deterministic::new(vec![0x6b, 0x76, 0x70, 0x6c]))
            .insecure_random(wasmtime_wasi::Deterministic::new(vec![0x6b, 0x76, 0x70, 0x6c]))
            .insecure_random_seed(0)
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock);
        if let Some(dir) = &shared.decl.granted_dir {
            wasi.preopened_dir(dir, "/data", wasmtime_wasi::FsPerms::ReadOnly)
                .map_err(anyhow::Error::from)
                .with_context(|| format!("plugin {}: granting directory {}", shared.decl.name, dir.display()))?;
        }
        let limit = shared.decl.limits.memory_bytes;
        // Every handle in the instance's table counts against the declared
        // `handles`, the WASI ones (streams, pollables) as much as the
        // host's: wasmtime's own cap is 100,000. The host's handles are
        // refused with `capacity` by `admit` before they reach the table; a
        // WASI call whose resource no longer fits traps (WASI functions have
        // no error to answer), and the trapped instance is discarded.
        let mut table = ResourceTable::new();
        table.set_max_capacity(shared.decl.limits.handles as usize);
        Ok(HostState {
            shared,
            table,
            wasi: wasi.build(),
            stderr,
            memory: MemoryCap { limit, hit: false },
            usage: Usage::default(),
            deadline: None,
            handles_exhausted: false,
        })
    }

    /// Refuse with `capacity` (and count it) when `used + more` would pass
    /// `limit`.
    pub(crate) fn check_limit(&self, name: &'static str, used: u64, more: u64, limit: u64) -> Result<(), types::Error> {
        if used.saturating_add(more) > limit {
            self.shared.hit_limit(name);
            return Err(types::Error::Capacity(format!(
                "plugin {}: {name} limit reached ({used} in use, {more} more asked, limit {limit})",
                self.shared.decl.name
            )));
        }
        Ok(())
    }

    /// Admit one more table entry of `kind`, or refuse with `capacity`.
    pub(crate) fn admit(&mut self, kind: HandleKind) -> Result<(), types::Error> {
        let limits = self.shared.decl.limits;
        if let Err(e) = self.check_limit("handles", u64::from(self.usage.handles), 1, u64::from(limits.handles)) {
            self.handles_exhausted = true;
            return Err(e);
        }
        match kind {
            HandleKind::Connection => {
                self.check_limit("connections", u64::from(self.usage.connections), 1, u64::from(limits.connections))?;
                self.usage.connections += 1;
            }
            HandleKind::Buffer { charged } => {
                self.check_limit("buffers", u64::from(self.usage.buffers), 1, u64::from(limits.buffers))?;
                self.check_limit("buffer-bytes", self.usage.buffer_bytes, charged, limits.buffer_bytes)?;
                self.usage.buffers += 1;
                self.usage.buffer_bytes += charged;
            }
            HandleKind::Session => {}
        }
        self.usage.handles += 1;
        Ok(())
    }

    /// Undo [`admit`](Self::admit) when an entry leaves the table.
    pub(crate) fn release(&mut self, kind: HandleKind) {
        self.usage.handles = self.usage.handles.saturating_sub(1);
        match kind {
            HandleKind::Connection => self.usage.connections = self.usage.connections.saturating_sub(1),
            HandleKind::Buffer { charged } => {
                self.usage.buffers = self.usage.buffers.saturating_sub(1);
                self.usage.buffer_bytes = self.usage.buffer_bytes.saturating_sub(charged);
            }
            HandleKind::Session => {}
        }
    }

    /// Put a buffer view in the table, counted against the limits.
    pub(crate) fn push_buffer(&mut self, buffer: BlockBuffer) -> wasmtime::Result<Result<Resource<BlockBuffer>, types::Error>> {
        let charged = Self::charge_of(&buffer);
        if let Err(e) = self.admit(HandleKind::Buffer { charged }) {
            return Ok(Err(e));
        }
        Ok(Ok(self.table.push(buffer)?))
    }

    /// Bytes a view's region counts against `buffer-bytes`: a region the host
    /// allocated for the plugin counts once, with its only view — the first
    /// when it is added, the last when it leaves.
    fn charge_of(buffer: &BlockBuffer) -> u64 {
        let region: &Arc<Region> = buffer.region();
        if region.charged > 0 && Arc::strong_count(region) == 1 {
            region.charged as u64
        } else {
            0
        }
    }

    /// Remove a buffer from the table and uncount it.
    pub(crate) fn delete_buffer(&mut self, buffer: Resource<BlockBuffer>) -> wasmtime::Result<BlockBuffer> {
        let b = self.table.delete(buffer)?;
        let charged = Self::charge_of(&b);
        self.release(HandleKind::Buffer { charged });
        Ok(b)
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
        Ok(self.table.get(&buffer)?.len() as u64)
    }

    fn writable(&mut self, buffer: Resource<BlockBuffer>) -> wasmtime::Result<bool> {
        Ok(self.table.get(&buffer)?.writable())
    }

    fn peek(&mut self, buffer: Resource<BlockBuffer>, offset: u64, len: u32) -> wasmtime::Result<Result<Vec<u8>, types::Error>> {
        if len > MAX_PEEK {
            return Ok(Err(types::Error::Invalid(format!("peek of {len} bytes exceeds max-peek {MAX_PEEK}"))));
        }
        Ok(self.table.get(&buffer)?.peek(offset, len as usize))
    }

    fn slice(
        &mut self,
        buffer: Resource<BlockBuffer>,
        offset: u64,
        len: u64,
    ) -> wasmtime::Result<Result<Resource<BlockBuffer>, types::Error>> {
        match self.table.get(&buffer)?.slice(offset, len) {
            Ok(view) => self.push_buffer(view),
            Err(e) => Ok(Err(e)),
        }
    }

    fn drop(&mut self, buffer: Resource<BlockBuffer>) -> wasmtime::Result<()> {
        self.delete_buffer(buffer)?;
        Ok(())
    }
}

impl log::Host for HostState {
    fn log(&mut self, level: log::Level, message: String) -> wasmtime::Result<()> {
        let limits = self.shared.decl.limits;
        let now = std::time::Instant::now();
        let (admitted, report) = match self.shared.log.lock() {
            Ok(mut limiter) => {
                let admitted = limiter.admit(now);
                (admitted, limiter.report_due(now))
            }
            Err(_) => (false, None),
        };
        let plugin = self.plugin_name();
        if let Some(dropped) = report {
            tracing::warn!(
                plugin,
                dropped,
                "plugin {plugin}: {dropped} log records dropped since the last report: past its log rate limit \
                 (limits.logRecordsPerSecond {}, limits.logBurst {})",
                limits.log_records_per_second,
                limits.log_burst
            );
        }
        if !admitted {
            self.shared.hit_limit("log-rate");
            return Ok(());
        }
        let mut message = message;
        let truncated = message.len() > MAX_LOG_RECORD;
        if truncated {
            let mut cut = MAX_LOG_RECORD;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(" [truncated]");
        }
        if let Ok(mut limiter) = self.shared.log.lock() {
            limiter.counts.written += 1;
            limiter.counts.written_bytes += message.len() as u64;
            limiter.counts.truncated += u64::from(truncated);
        }
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

/// WASI's clocks as plugins see them: always zero. Time comes only from the
/// contract's `clock` interface, for the worlds that import it.
struct FrozenClock;

impl wasmtime_wasi::HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::LogLimiter;
    use std::time::{Duration, Instant};

    #[test]
    fn the_log_limiter_lets_the_burst_then_the_rate_through_and_reports_drops_once_a_second() {
        let mut l = LogLimiter::new(10, 3);
        let t0 = Instant::now();
        let admitted: Vec<bool> = (0..5).map(|_| l.admit(t0)).collect();
        assert_eq!(admitted, [true, true, true, false, false]);
        assert_eq!(l.report_due(t0), Some(2), "the first drops are reported at once");
        assert!(!l.admit(t0));
        assert_eq!(l.report_due(t0 + Duration::from_millis(500)), None, "not twice within the interval");
        // 100 ms at 10/s is one record more.
        assert!(l.admit(t0 + Duration::from_millis(100)));
        assert!(!l.admit(t0 + Duration::from_millis(100)));
        assert_eq!(l.report_due(t0 + Duration::from_secs(1)), Some(2), "the drops since the last report");
        assert_eq!(l.counts.dropped, 4);
        // Quiet refills the burst and no more.
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..5).filter(|_| l.admit(later)).count(), 3);
    }
}
