//! GPU copies for kvplane clients: an inference engine's KV blocks go from
//! device memory into a node and back without the engine staging them in
//! memory of its own.
//!
//! Why through the node's shared memory: a client on the node's host already
//! moves block bytes through memory the node shares with its connection
//! (see the client's `SharedMemory`). Registering that memory as pinned
//! (page-locked, not write-combined) lets the GPU's copy engines write and
//! read it directly, so a put-from-device is one device-to-host copy plus
//! the node's own copy out of shared memory, and a get-into-device the
//! node's copy in plus one host-to-device copy: no bounce buffer.
//!
//! - [`GpuContext`]: a device's primary context (the one PyTorch uses too).
//! - [`PinnedRegion`]: a connection's shared memory, registered as pinned;
//!   [`PinnedRegion::put_from_device`] and [`PinnedRegion::get_into_device`]
//!   take batches of (key, device pointer, length) as an engine holds them
//!   (a tensor's data pointer), with copies on a caller-given [`Stream`] or
//!   one of its own.
//! - [`GpuContext::import_ipc_handle`]: device memory another process
//!   exported (an engine's KV cache tensor), for a node-side process to
//!   copy from.
//!
//! Everything that touches CUDA is behind the `cuda` cargo feature, and the
//! driver library is loaded at run time: the default build needs no CUDA
//! toolkit and answers [`GpuError::NotBuilt`]; a build with the feature on a
//! machine without a GPU or driver answers [`GpuError::NoDevice`] with the
//! reason, and nothing else in the process is affected.

// Device pointers and pinned host memory throughout: unsafe code is allowed
// in the whole crate, and each use says why it is sound (clippy's
// `undocumented_unsafe_blocks` is denied for the workspace).
#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Connection, KvError, SharedMemory};

#[cfg(all(not(feature = "cuda"), not(test)))]
#[path = "absent.rs"]
mod driver;
// The unit tests without the feature run the batching logic against a
// stand-in driver (host memory, deferred copies); see fake.rs.
#[cfg(all(not(feature = "cuda"), test))]
#[path = "fake.rs"]
mod driver;
#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod driver;
mod plan;

/// Why a GPU operation could not be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// This build has no GPU support.
    #[error("GPU copies are not available: kvplane-gpu was built without its `cuda` feature")]
    NotBuilt,
    /// No usable GPU or driver on this machine (the reason is in the text).
    #[error("no usable GPU: {0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("CUDA driver call {call} failed: {message}")]
    Driver { call: &'static str, message: String },
    /// The arguments do not make sense (null pointer, block too large...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The node or the connection failed the request as a whole.
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// Whether GPU copies can work here: `Ok` when built with the `cuda`
/// feature and the driver loads and initialises; otherwise why not.
pub fn available() -> Result<(), GpuError> {
    driver::probe()
}

/// A device's primary context, shared by everything this crate does on it.
pub struct GpuContext {
    raw: driver::Context,
    ordinal: usize,
}

impl GpuContext {
    /// Opens device `ordinal` (its primary context, as the CUDA runtime
    /// and PyTorch use it).
    pub fn new(ordinal: usize) -> Result<Arc<GpuContext>, GpuError> {
        Ok(Arc::new(GpuContext { raw: driver::Context::primary(ordinal)?, ordinal }))
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name, as the driver gives it.
    pub fn device_name(&self) -> String {
        self.raw.name()
    }

    /// Allocates `len` bytes of device memory (for checks and tests; an
    /// engine brings its own).
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer, GpuError> {
        let ptr = self.raw.alloc(len)?;
        Ok(DeviceBuffer { ctx: Arc::clone(self), ptr, len, imported: false })
    }

    /// Allocates `len` bytes of pinned host memory with the driver's own
    /// allocator: the plain pinned-copy ceiling the shared-memory path is
    /// measured against.
    pub fn alloc_pinned_host(self: &Arc<Self>, len: usize) -> Result<HostBuffer, GpuError> {
        let ptr = self.raw.alloc_host(len)?;
        Ok(HostBuffer { ctx: Arc::clone(self), ptr, len })
    }

    /// Maps device memory another process exported with
    /// `cuIpcGetMemHandle` (`cudaIpcGetMemHandle`, or PyTorch's storage
    /// `_share_cuda_()`): `handle` is its 64 bytes. The buffer covers the
    /// whole exported allocation and is unmapped when dropped.
    pub fn import_ipc_handle(self: &Arc<Self>, handle: &[u8]) -> Result<DeviceBuffer, GpuError> {
        let bytes: [u8; 64] =
            handle.try_into().map_err(|_| GpuError::Invalid(format!("a CUDA IPC memory handle is 64 bytes, not {}", handle.len())))?;
        let ptr = self.raw.ipc_open(bytes)?;
        let len = match self.raw.address_range(ptr) {
            Ok((_, len)) => len,
            Err(e) => {
                self.raw.ipc_close(ptr);
                return Err(e);
            }
        };
        Ok(DeviceBuffer { ctx: Arc::clone(self), ptr, len, imported: true })
    }
}

/// A CUDA stream: this crate's own, or one the caller owns (an engine's
/// current stream), on which copies are enqueued in order after the
/// caller's own work.
pub struct Stream {
    ctx: Arc<GpuContext>,
    raw: usize,
    owned: bool,
}

impl Stream {
    /// A new non-blocking stream, destroyed when dropped.
    pub fn new(ctx: &Arc<GpuContext>) -> Result<Stream, GpuError> {
        Ok(Stream { ctx: Arc::clone(ctx), raw: ctx.raw.stream_create()?, owned: true })
    }

    /// A stream the caller owns, as a `CUstream`'s address (for instance
    /// `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default
    /// stream). It is never destroyed here.
    ///
    /// # Safety
    /// `raw` must be a stream of `ctx`'s device and outlive this value.
    pub unsafe fn from_raw(ctx: &Arc<GpuContext>, raw: usize) -> Stream {
        Stream { ctx: Arc::clone(ctx), raw, owned: false }
    }

    pub fn raw(&self) -> usize {
        self.raw
    }

    /// Waits, without blocking the thread, until every copy enqueued so
    /// far has finished: polls the stream, yielding to other tasks between
    /// polls (and sleeping a little once the wait grows long), so a copy's
    /// end is noticed within microseconds.
    pub async fn synchronize(&self) -> Result<(), GpuError> {
        poll_until(|| self.ctx.raw.stream_done(self.raw)).await
    }

    /// Waits as [`Stream::synchronize`] does, blocking the thread.
    pub fn wait(&self) -> Result<(), GpuError> {
        while !self.ctx.raw.stream_done(self.raw)? {
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned {
            self.ctx.raw.stream_destroy(self.raw);
        }
    }
}

/// Polls `done` until it answers true: yielding to other tasks between
/// polls, sleeping a little once the wait grows long.
async fn poll_until(mut done: impl FnMut() -> Result<bool, GpuError>) -> Result<(), GpuError> {
    let start = Instant::now();
    while !done()? {
        if start.elapsed() < Duration::from_millis(2) {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
    }
    Ok(())
}

/// A point recorded in a stream (a CUDA event without timing): lets a batch
/// wait for one round's copies while the next round's are still running.
struct Marker {
    ctx: Arc<GpuContext>,
    raw: usize,
}

impl Marker {
    fn record(stream: &Stream) -> Result<Arc<Marker>, GpuError> {
        let marker = Marker { ctx: Arc::clone(&stream.ctx), raw: stream.ctx.raw.event_create()? };
        marker.ctx.raw.event_record(marker.raw, stream.raw)?;
        Ok(Arc::new(marker))
    }

    async fn wait(&self) -> Result<(), GpuError> {
        poll_until(|| self.ctx.raw.event_done(self.raw)).await
    }
}

impl Drop for Marker {
    fn drop(&mut self) {
        self.ctx.raw.event_destroy(self.raw);
    }
}

/// Device memory: allocated here, or imported from another process.
pub struct DeviceBuffer {
    ctx: Arc<GpuContext>,
    ptr: u64,
    len: usize,
    imported: bool,
}

impl DeviceBuffer {
    /// The device address, as the copy functions take it.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 64-byte CUDA IPC handle another process imports with
    /// [`GpuContext::import_ipc_handle`] (allocated buffers only).
    pub fn ipc_handle(&self) -> Result<[u8; 64], GpuError> {
        if self.imported {
            return Err(GpuError::Invalid("an imported buffer cannot be exported again".into()));
        }
        self.ctx.raw.ipc_export(self.ptr)
    }

    fn range(&self, offset: usize, len: usize) -> Result<u64, GpuError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr + offset as u64),
            _ => Err(GpuError::Invalid(format!("bytes {offset}..{offset}+{len} are outside the {}-byte device buffer", self.len))),
        }
    }

    /// Copies `src` to `offset`, blocking the thread until the copy is
    /// done (checks and tests; blocking, so that no cancelled future can
    /// leave a copy running into a borrow that has ended).
    pub fn write(&self, offset: usize, src: &[u8], stream: &Stream) -> Result<(), GpuError> {
        let dst = self.range(offset, src.len())?;
        // SAFETY: `dst` is inside this buffer (checked); `src` stays borrowed
        // until `wait` has seen the stream pass the copy. Should the wait
        // fail, the context is broken and the driver runs nothing more on it.
        unsafe { self.ctx.raw.copy_to_device(dst, src.as_ptr(), src.len(), stream.raw)? };
        stream.wait()
    }

    /// Copies `dst.len()` bytes at `offset` into `dst`, blocking as
    /// [`DeviceBuffer::write`] does.
    pub fn read(&self, offset: usize, dst: &mut [u8], stream: &Stream) -> Result<(), GpuError> {
        let src = self.range(offset, dst.len())?;
        // SAFETY: as in `write`, the other way round.
        unsafe { self.ctx.raw.copy_to_host(dst.as_mut_ptr(), src, dst.len(), stream.raw)? };
        stream.wait()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.imported {
            self.ctx.raw.ipc_close(self.ptr);
        } else {
            self.ctx.raw.free(self.ptr);
        }
    }
}

/// Pinned host memory from the driver's allocator (`cuMemAllocHost`).
pub struct HostBuffer {
    ctx: Arc<GpuContext>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: owned memory reached only through raw-pointer copies enqueued by
// methods taking `&mut self` or `&self` with the caller awaiting the copy.
unsafe impl Send for HostBuffer {}
// SAFETY: see `Send`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Enqueues one copy of `len` bytes from `src` to the buffer's start;
    /// the caller awaits [`Stream::synchronize`] before reading or reusing
    /// the buffer.
    pub fn copy_from_device(&mut self, src: &DeviceBuffer, len: usize, stream: &Stream) -> Result<(), GpuError> {
        let from = src.range(0, len)?;
        if len > self.len {
            return Err(GpuError::Invalid(format!("{len} bytes do not fit the {}-byte host buffer", self.len)));
        }
        // SAFETY: both ranges checked; the buffer lives as long as `self`,
        // which outlives the context's streams only if the caller awaits
        // the stream before dropping it, as documented.
        unsafe { self.ctx.raw.copy_to_host(self.ptr, from, len, stream.raw) }
    }

    /// Enqueues one copy of `len` bytes from the buffer's start to `dst`.
    pub fn copy_to_device(&self, dst: &DeviceBuffer, len: usize, stream: &Stream) -> Result<(), GpuError> {
        let to = dst.range(0, len)?;
        if len > self.len {
            return Err(GpuError::Invalid(format!("{len} bytes are more than the {}-byte host buffer", self.len)));
        }
        // SAFETY: as in `copy_from_device`.
        unsafe { self.ctx.raw.copy_to_device(to, self.ptr, len, stream.raw) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        self.ctx.raw.free_host(self.ptr);
    }
}

/// One connection's shared memory, registered as pinned for the device:
/// the staging memory of [`PinnedRegion::put_from_device`] and
/// [`PinnedRegion::get_into_device`].
///
/// The region uses the whole shared memory, so the connection should
/// serve device copies alone (a `Client` of its own): the client's other
/// calls carve ranges of the same memory. Calls on one region run one at a
/// time.
///
/// A batch larger than the region goes in rounds that alternate between
/// the region's halves, so one round's device copies overlap the node's
/// copies of the next (put) or the previous (get).
pub struct PinnedRegion {
    ctx: Arc<GpuContext>,
    memory: Arc<SharedMemory>,
    /// Held for the length of a call; the last copies a call enqueued,
    /// which the next call waits for before it touches the region (a call
    /// that failed or was cancelled may have left some running).
    busy: tokio::sync::Mutex<Option<Arc<Marker>>>,
}

impl PinnedRegion {
    /// Page-locks `memory` (`cuMemHostRegister`, portable, not
    /// write-combined) until the region is dropped.
    pub fn register(ctx: &Arc<GpuContext>, memory: &Arc<SharedMemory>) -> Result<PinnedRegion, GpuError> {
        ctx.raw.host_register(memory.as_ptr(), memory.len())?;
        Ok(PinnedRegion { ctx: Arc::clone(ctx), memory: Arc::clone(memory), busy: tokio::sync::Mutex::new(None) })
    }

    /// The region of `conn`'s shared memory (see [`PinnedRegion::register`]);
    /// `KvError::Unsupported` when the node shares none with it.
    pub fn for_connection(ctx: &Arc<GpuContext>, conn: &Connection) -> Result<PinnedRegion, GpuError> {
        let memory = conn.shared_memory().ok_or_else(|| {
            KvError::Unsupported("this connection has no shared memory (a Unix-socket connection to a node with --shm-region > 0)".into())
        })?;
        PinnedRegion::register(ctx, memory)
    }

    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.memory
    }

    fn check(&self, conn: &Connection) -> Result<(), GpuError> {
        match conn.shared_memory() {
            Some(m) if Arc::ptr_eq(m, &self.memory) => Ok(()),
            _ => Err(GpuError::Invalid("this connection's shared memory is not the registered region".into())),
        }
    }

    /// Enqueues copies of device blocks into the region: each entry is
    /// (device pointer, offset in the region, length). The caller awaits
    /// the stream before using those bytes. Also the copy whose bandwidth
    /// the device check measures.
    pub fn stage_from_device(&self, blocks: &[(u64, usize, usize)], stream: &Stream) -> Result<(), GpuError> {
        for &(src, offset, len) in blocks {
            let at = self.place(offset, len)?;
            // SAFETY: `at` is inside the registered mapping (checked), which
            // the region keeps alive; `src` is the caller's device memory.
            unsafe { self.ctx.raw.copy_to_host(at, src, len, stream.raw)? };
        }
        Ok(())
    }

    /// Enqueues copies of region bytes to the device: each entry is (device
    /// pointer, offset in the region, length).
    pub fn unstage_to_device(&self, blocks: &[(u64, usize, usize)], stream: &Stream) -> Result<(), GpuError> {
        for &(dst, offset, len) in blocks {
            let at = self.place(offset, len)?;
            // SAFETY: as in `stage_from_device`, the other way round.
            unsafe { self.ctx.raw.copy_to_device(dst, at, len, stream.raw)? };
        }
        Ok(())
    }

    fn place(&self, offset: usize, len: usize) -> Result<*mut u8, GpuError> {
        self.memory.check(offset, len).map_err(|e| GpuError::Invalid(e.to_string()))?;
        // SAFETY: `offset..offset + len` is within the mapping (checked above).
        Ok(unsafe { self.memory.as_ptr().add(offset) })
    }

    /// Stores device blocks: each entry is (key, device pointer, length).
    /// The blocks are copied into the region on `stream` (after whatever
    /// the caller enqueued there before), then the node copies them out;
    /// batches larger than the region go in several rounds, the next
    /// round's device copies running while the node copies the last one.
    /// Answers each key's result, as `Connection::put_from_shared` does.
    pub async fn put_from_device(
        &self,
        conn: &Connection,
        blocks: &[(Bytes, u64, usize)],
        stream: &Stream,
    ) -> Result<Vec<Result<(), KvError>>, GpuError> {
        self.check(conn)?;
        let pairs: Vec<(u64, usize)> = blocks.iter().map(|(_, p, l)| (*p, *l)).collect();
        let plan = plan::staging(&pairs, self.memory.len())?;
        let mut last = self.busy.lock().await;
        if let Some(previous) = last.take() {
            previous.wait().await?;
        }
        let rounds = &plan.rounds;
        let stage = |k: usize, last: &mut Option<Arc<Marker>>| -> Result<Arc<Marker>, GpuError> {
            let copies: Vec<(u64, usize, usize)> = rounds[k].iter().map(|s| (blocks[s.index].1, s.offset, s.len)).collect();
            self.stage_from_device(&copies, stream)?;
            let marker = Marker::record(stream)?;
            *last = Some(Arc::clone(&marker));
            Ok(marker)
        };
        let mut results: Vec<Result<(), KvError>> = Vec::with_capacity(blocks.len());
        let mut next = if rounds.is_empty() { None } else { Some(stage(0, &mut last)?) };
        for k in 0..rounds.len() {
            let staged = next.take().ok_or_else(|| GpuError::Invalid("a round was not staged".into()))?;
            // Round k + 1 goes into the other half, which the node finished
            // copying out of (round k - 1) before this iteration began.
            if plan.alternating && k + 1 < rounds.len() {
                next = Some(stage(k + 1, &mut last)?);
            }
            staged.wait().await?;
            let entries: Vec<(Bytes, usize, usize)> = rounds[k].iter().map(|s| (blocks[s.index].0.clone(), s.offset, s.len)).collect();
            results.extend(conn.put_from_shared(&entries).await?);
            if !plan.alternating && k + 1 < rounds.len() {
                next = Some(stage(k + 1, &mut last)?);
            }
        }
        Ok(results)
    }

    /// Fetches blocks into device memory: each entry is (key, device
    /// pointer, capacity). The node copies each block into the region, then
    /// it is copied to the device on `stream`; in a batch of several rounds
    /// the node fills one half of the region while the other half's copies
    /// to the device run. The call returns once every copy has finished.
    /// Answers each block's length or its key's error (a block longer than
    /// its capacity is the node's `Invalid`).
    pub async fn get_into_device(
        &self,
        conn: &Connection,
        blocks: &[(Bytes, u64, usize)],
        stream: &Stream,
    ) -> Result<Vec<Result<usize, KvError>>, GpuError> {
        self.check(conn)?;
        let pairs: Vec<(u64, usize)> = blocks.iter().map(|(_, p, c)| (*p, *c)).collect();
        let plan = plan::staging(&pairs, self.memory.len())?;
        let mut last = self.busy.lock().await;
        if let Some(previous) = last.take() {
            previous.wait().await?;
        }
        let mut results: Vec<Result<usize, KvError>> = Vec::with_capacity(blocks.len());
        let mut markers: Vec<Arc<Marker>> = Vec::with_capacity(plan.rounds.len());
        for (k, round) in plan.rounds.iter().enumerate() {
            // The memory this round fills was last read by the device
            // copies of round k - 2 (alternating halves) or k - 1.
            let reuse = if plan.alternating { k.checked_sub(2) } else { k.checked_sub(1) };
            if let Some(r) = reuse {
                markers[r].wait().await?;
            }
            let entries: Vec<(Bytes, usize, usize)> = round.iter().map(|s| (blocks[s.index].0.clone(), s.offset, s.len)).collect();
            let lens = conn.get_into_shared(&entries).await?;
            if lens.len() != round.len() {
                return Err(KvError::Internal(format!("{} answers for {} keys", lens.len(), round.len())).into());
            }
            let mut copies = Vec::with_capacity(round.len());
            for (slot, len) in round.iter().zip(&lens) {
                if let Ok(len) = len {
                    if *len > slot.len {
                        return Err(KvError::Internal(format!("the node answered {len} bytes for a {}-byte capacity", slot.len)).into());
                    }
                    copies.push((blocks[slot.index].1, slot.offset, *len));
                }
            }
            self.unstage_to_device(&copies, stream)?;
            let marker = Marker::record(stream)?;
            *last = Some(Arc::clone(&marker));
            markers.push(marker);
            results.extend(lens);
        }
        if let Some(marker) = markers.last() {
            marker.wait().await?;
        }
        Ok(results)
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        self.ctx.raw.host_unregister(self.memory.as_ptr());
    }
}

/// The batching logic against a real node, on the stand-in driver of
/// fake.rs (copies deferred until waited for): rounds, alternating halves,
/// per-key results and every byte.
#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;
    use kvplane_client::{Client, ClientConfig, Endpoint};
    use kvplane_node::memory::PoolConfig;
    use kvplane_node::server::{Node, NodeConfig};

    const KIB: usize = 1 << 10;

    async fn node(dir: &tempfile::TempDir, shm: usize) -> Node {
        let config = NodeConfig {
            listen: None,
            admin: None,
            unix: Some(dir.path().join("node.sock")),
            pool: PoolConfig::new(64 << 20),
            shm_region_bytes: shm,
            ..NodeConfig::default()
        };
        Node::start(config).await.expect("node starts")
    }

    fn pattern(seed: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (seed * 31 + i * 7 + i / 253) as u8).collect()
    }

    struct Setup {
        _dir: tempfile::TempDir,
        _node: Node,
        _client: Client,
        conn: Arc<Connection>,
        ctx: Arc<GpuContext>,
        region: PinnedRegion,
        stream: Stream,
    }

    async fn setup(shm: usize) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let node = node(&dir, shm).await;
        let mut config = ClientConfig::new(Endpoint::Unix(node.unix_path().unwrap().to_path_buf()));
        config.connections = 1;
        let client = Client::connect(config).await.unwrap();
        let conn = client.connection().await.unwrap();
        let ctx = GpuContext::new(0).unwrap();
        let region = PinnedRegion::for_connection(&ctx, &conn).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        Setup { _dir: dir, _node: node, _client: client, conn, ctx, region, stream }
    }

    /// Puts `lens.len()` blocks of the given lengths from one device
    /// buffer, gets them back into another, compares every byte.
    async fn round_trip(s: &Setup, lens: &[usize], expect_alternating: bool) {
        let pairs: Vec<(u64, usize)> = lens.iter().map(|l| (1, *l)).collect();
        let plan = plan::staging(&pairs, s.region.memory().len()).unwrap();
        assert!(plan.rounds.len() > 1, "the batch needs several rounds");
        assert_eq!(plan.alternating, expect_alternating);

        let total: usize = lens.iter().sum();
        let src = s.ctx.alloc(total).unwrap();
        let bytes = pattern(lens.len(), total);
        src.write(0, &bytes, &s.stream).unwrap();
        let mut at = 0;
        let mut puts = Vec::new();
        for (i, len) in lens.iter().enumerate() {
            puts.push((Bytes::from(format!("k{i}")), src.ptr() + at as u64, *len));
            at += len;
        }
        let results = s.region.put_from_device(&s.conn, &puts, &s.stream).await.unwrap();
        assert!(results.iter().all(Result::is_ok), "{results:?}");

        let dst = s.ctx.alloc(total).unwrap();
        let gets: Vec<(Bytes, u64, usize)> = puts.iter().map(|(k, p, l)| (k.clone(), dst.ptr() + (p - src.ptr()), *l)).collect();
        let lens_back = s.region.get_into_device(&s.conn, &gets, &s.stream).await.unwrap();
        assert_eq!(lens_back.into_iter().map(Result::unwrap).collect::<Vec<_>>(), lens);
        let mut back = vec![0u8; total];
        dst.read(0, &mut back, &s.stream).unwrap();
        assert!(back == bytes, "the bytes got back differ from those put");
    }

    #[tokio::test]
    async fn batches_larger_than_the_shared_memory_round_trip_in_alternating_halves() {
        let s = setup(256 * KIB).await;
        let lens: Vec<usize> = (0..23).map(|i| 20 * KIB + i * 517).collect();
        round_trip(&s, &lens, true).await;
    }

    #[tokio::test]
    async fn blocks_over_half_the_shared_memory_go_one_round_at_a_time() {
        let s = setup(256 * KIB).await;
        round_trip(&s, &[200 * KIB, 150 * KIB, 250 * KIB, 100], false).await;
    }

    #[tokio::test]
    async fn each_key_gets_its_own_answer() {
        let s = setup(256 * KIB).await;
        let src = s.ctx.alloc(8 * KIB).unwrap();
        src.write(0, &pattern(1, 8 * KIB), &s.stream).unwrap();
        let put = [(Bytes::from_static(b"present"), src.ptr(), 8 * KIB)];
        assert!(s.region.put_from_device(&s.conn, &put, &s.stream).await.unwrap()[0].is_ok());

        let dst = s.ctx.alloc(16 * KIB).unwrap();
        let gets =
            [(Bytes::from_static(b"missing"), dst.ptr(), 8 * KIB), (Bytes::from_static(b"present"), dst.ptr() + 8 * KIB as u64, 8 * KIB)];
        let got = s.region.get_into_device(&s.conn, &gets, &s.stream).await.unwrap();
        assert_eq!(got[0], Err(KvError::NotFound));
        assert_eq!(got[1], Ok(8 * KIB));
        let small = [(Bytes::from_static(b"present"), dst.ptr(), KIB)];
        let got = s.region.get_into_device(&s.conn, &small, &s.stream).await.unwrap();
        assert!(got[0].is_err(), "a block larger than its capacity is refused: {:?}", got[0]);
        let mut back = vec![0u8; 8 * KIB];
        dst.read(8 * KIB, &mut back, &s.stream).unwrap();
        assert!(back == pattern(1, 8 * KIB));
    }

    #[tokio::test]
    async fn bad_batches_are_refused_before_any_copy() {
        let s = setup(256 * KIB).await;
        let too_big = [(Bytes::from_static(b"k"), 0x1000, 300 * KIB)];
        assert!(
            matches!(s.region.put_from_device(&s.conn, &too_big, &s.stream).await, Err(GpuError::Invalid(m)) if m.contains("--shm-region"))
        );
        let null = [(Bytes::from_static(b"k"), 0, KIB)];
        assert!(matches!(s.region.get_into_device(&s.conn, &null, &s.stream).await, Err(GpuError::Invalid(_))));
        assert!(matches!(s.ctx.import_ipc_handle(&[0; 63]), Err(GpuError::Invalid(_))));

        // Another connection's memory is not this region.
        let other = setup(256 * KIB).await;
        let ok = [(Bytes::from_static(b"k"), 0x1000, KIB)];
        assert!(matches!(s.region.put_from_device(&other.conn, &ok, &s.stream).await, Err(GpuError::Invalid(_))));
    }

    #[tokio::test]
    async fn an_exported_handle_imports_the_same_memory() {
        let s = setup(256 * KIB).await;
        let buf = s.ctx.alloc(4 * KIB).unwrap();
        buf.write(0, &pattern(9, 4 * KIB), &s.stream).unwrap();
        let imported = s.ctx.import_ipc_handle(&buf.ipc_handle().unwrap()).unwrap();
        assert_eq!(imported.len(), 4 * KIB);
        assert!(imported.ipc_handle().is_err(), "an imported buffer is not exported again");
        let mut back = vec![0u8; 4 * KIB];
        imported.read(0, &mut back, &s.stream).unwrap();
        assert!(back == pattern(9, 4 * KIB));
    }
}
