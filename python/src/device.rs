//! `kvplane.DeviceClient`: KV blocks between GPU memory and a node on the
//! same host, through [`kvplane_gpu`].
//!
//! Why a class of its own rather than methods of `Client`: the GPU path
//! registers one connection's shared memory as pinned and uses the whole of
//! it as staging memory (see [`kvplane_gpu::PinnedRegion`]), so that
//! connection must serve device copies alone. A `DeviceClient` is one
//! Unix-socket connection, its pinned region and a CUDA stream.
//!
//! The same code serves both builds: without the package's `cuda` feature
//! `kvplane-gpu` answers `NotBuilt`, and constructing a `DeviceClient`
//! raises `GpuUnavailable` saying how to build the package with it; with
//! the feature on a machine without a GPU or driver it raises
//! `GpuUnavailable` with the driver's reason. `Client` is unaffected either
//! way.
//!
//! Device pointers cross as integers (`tensor.data_ptr()`), as every
//! engine-facing CUDA API in Python passes them: the copies go to and from
//! device memory only, which no check here can validate; a wrong pointer is
//! the driver's error (or another device allocation's bytes), never this
//! process's host memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvplane_client::{Client as NodeClient, ClientConfig, Connection, Endpoint, KvError};
use kvplane_gpu::{GpuContext, GpuError, PinnedRegion, Stream};
use pyo3::prelude::*;
use pyo3::types::PyString;
use tokio::runtime::Runtime;

use crate::{keys_of, kv_error, raise, same_length, show};

/// What a build without the `cuda` feature answers, and how to get one.
const NOT_BUILT: &str = "this kvplane package was built without GPU support: \
    build it with its `cuda` feature (`maturin build --release --features cuda`; no CUDA toolkit needed)";

/// The exception for a GPU error: `GpuUnavailable` when there is no GPU
/// path at all, the client error's class for a node or connection error,
/// `Invalid` for bad arguments, `GpuError` for a failed driver call.
fn gpu_error(e: &GpuError, context: String) -> PyErr {
    match e {
        GpuError::NotBuilt => raise("GpuUnavailable", format!("{context}: {NOT_BUILT}"), None, None),
        GpuError::NoDevice(why) => raise("GpuUnavailable", format!("{context}: no usable GPU: {why}"), None, None),
        GpuError::Invalid(why) => raise("Invalid", format!("{context}: {why}"), None, None),
        GpuError::Driver { .. } => raise("GpuError", format!("{context}: {e}"), None, None),
        GpuError::Kv(kv) => kv_error(kv, context, None, None),
    }
}

/// Why GPU copies cannot work here (`None` when they can): the package was
/// built without its `cuda` feature, or no driver or GPU answers.
#[pyfunction]
pub(crate) fn gpu_unavailable_reason() -> Option<String> {
    kvplane_gpu::available().err().map(|e| match e {
        GpuError::NotBuilt => NOT_BUILT.to_string(),
        other => other.to_string(),
    })
}

/// What a `DeviceClient` holds while open (closed by [`dispose`], which
/// unregisters the region before the connection's shared memory can go).
struct Open {
    region: PinnedRegion,
    stream: Stream,
    conn: Arc<Connection>,
    client: NodeClient,
    ctx: Arc<GpuContext>,
    /// A current-thread runtime the calling thread drives (as a node
    /// `Client`'s is): the connection's reader task runs only during calls.
    rt: Runtime,
    pid: u32,
}

impl Open {
    /// The connection, reopened (with a new region) when the node closed
    /// it since the last call, as a restarted node does.
    fn ready(&mut self) -> Result<(), GpuError> {
        // Let the driver report a closed socket before asking.
        self.rt.block_on(async {
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        });
        if self.conn.is_open() {
            return Ok(());
        }
        let conn = self.rt.block_on(self.client.connection())?;
        let region = PinnedRegion::for_connection(&self.ctx, &conn)?;
        self.region = region;
        self.conn = conn;
        Ok(())
    }
}

/// Closes an open client: the connection's tasks are dropped inside its
/// runtime's context, the runtime last. In a forked child nothing is
/// touched (the parent's CUDA context and runtime threads are not there):
/// it all leaks.
fn dispose(open: Open) {
    if open.pid != std::process::id() {
        std::mem::forget(open);
        return;
    }
    let Open { region, stream, conn, client, ctx, rt, .. } = open;
    {
        let _context = rt.enter();
        drop((region, stream, conn, client, ctx));
    }
    drop(rt);
}

/// Device memory blocks to and from one kvplane node on this host.
///
/// `DeviceClient("unix:///run/kvplane/node.sock", device=0)` opens one
/// connection over the node's Unix socket, registers the memory the node
/// shares with it as pinned (page-locked) for `device`, and moves blocks
/// between device memory and that memory with the GPU's copy engines; the
/// node copies them into and out of its pool. Block bytes never cross the
/// socket or this process's other memory.
///
/// Device memory is given as addresses and sizes, as an engine holds it:
/// `tensor.data_ptr()` and `tensor.nbytes` of a contiguous CUDA tensor on
/// `device`. Copies run on `stream` (a `CUstream` address such as
/// `torch.cuda.current_stream(device).cuda_stream`, after the work already
/// enqueued there) or on the client's own; every call returns once its
/// copies are done.
///
/// Raises `GpuUnavailable` when this build or this machine has no GPU path.
/// Calls on one client run one at a time; after `fork`, make a new one.
#[pyclass(name = "DeviceClient", module = "kvplane", frozen)]
pub(crate) struct DeviceClient {
    open: Mutex<Option<Open>>,
    /// Set by `close`; read without the lock, which a call holds throughout.
    closed: AtomicBool,
    endpoint: String,
    device: usize,
}

impl DeviceClient {
    /// Runs `f` on the open client (reconnected if needed), without the GIL.
    ///
    /// The lock is taken without the GIL too: a thread holding it gives the
    /// GIL back only when its call is done, so a thread waiting for the
    /// lock while holding the GIL would deadlock with it.
    fn with_open<T: Send>(&self, py: Python<'_>, what: &str, f: impl FnOnce(&mut Open) -> Result<T, GpuError> + Send) -> PyResult<T> {
        enum Failed {
            Closed,
            Forked(u32),
            Gpu(GpuError),
        }
        let outcome = py.detach(|| {
            let mut guard = self.open.lock().unwrap_or_else(|p| p.into_inner());
            let open = guard.as_mut().ok_or(Failed::Closed)?;
            if open.pid != std::process::id() {
                return Err(Failed::Forked(open.pid));
            }
            open.ready().and_then(|()| f(open)).map_err(Failed::Gpu)
        });
        outcome.map_err(|e| match e {
            Failed::Closed => raise("Error", format!("{what}: the device client of {} is closed", self.endpoint), None, None),
            Failed::Forked(pid) => {
                raise("Error", format!("{what}: this device client was made in process {pid}, before a fork; make a new one"), None, None)
            }
            Failed::Gpu(e) => gpu_error(&e, what.to_string()),
        })
    }
}

impl Drop for DeviceClient {
    fn drop(&mut self) {
        if let Some(open) = self.open.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            dispose(open);
        }
    }
}

/// `(key, device address, size)` triples from the three lists.
fn blocks_of(op: &str, keys: &[Bound<'_, PyAny>], ptrs: &[u64], sizes: &[usize]) -> PyResult<Vec<(Bytes, u64, usize)>> {
    same_length(op, keys.len(), ptrs.len())?;
    if sizes.len() != keys.len() {
        return Err(raise("Invalid", format!("{op}: {} keys but {} sizes; they pair up one to one", keys.len(), sizes.len()), None, None));
    }
    let keys = keys_of(keys)?;
    if let Some(i) = ptrs.iter().position(|&p| p == 0) {
        return Err(raise(
            "Invalid",
            format!("{op}: ptrs[{i}] (for key '{}') is a null device pointer", show(&keys[i])),
            Some(&keys[i]),
            Some(i),
        ));
    }
    Ok(keys.into_iter().zip(ptrs.iter().copied()).zip(sizes.iter().copied()).map(|((k, p), s)| (k, p, s)).collect())
}

/// The caller's stream, or the client's own.
///
/// # Safety
/// A given `raw` must be a stream of the client's device, alive for the call.
#[allow(unsafe_code)]
unsafe fn stream_for<'a>(open: &'a Open, raw: Option<usize>, borrowed: &'a mut Option<Stream>) -> &'a Stream {
    match raw {
        Some(raw) => {
            // SAFETY: the caller's promise, passed on (see the method docs).
            *borrowed = Some(unsafe { Stream::from_raw(&open.ctx, raw) });
            borrowed.as_ref().expect("just set")
        }
        None => &open.stream,
    }
}

#[pymethods]
impl DeviceClient {
    #[new]
    #[pyo3(signature = (endpoint, *, device = 0, token = None, timeout = 30.0))]
    fn new(py: Python<'_>, endpoint: &Bound<'_, PyString>, device: usize, token: Option<String>, timeout: f64) -> PyResult<DeviceClient> {
        let endpoint = endpoint.to_str()?.to_owned();
        let what = format!("DeviceClient({endpoint:?}, device={device})");
        let parsed: Endpoint = endpoint.parse().map_err(|e| kv_error(&e, what.clone(), None, None))?;
        if !matches!(parsed, Endpoint::Unix(_)) {
            return Err(raise(
                "Invalid",
                format!("{what}: GPU copies go through memory the node shares over its Unix socket; give unix:///path/to/node.sock"),
                None,
                None,
            ));
        }
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(raise("Invalid", format!("{what}: timeout must be a positive number of seconds, not {timeout}"), None, None));
        }
        // The GPU first: without one there is nothing to connect for.
        let ctx = GpuContext::new(device).map_err(|e| gpu_error(&e, what.clone()))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| raise("Internal", format!("{what}: starting the client's runtime: {e}"), None, None))?;
        let mut config = ClientConfig::new(parsed);
        config.connections = 1;
        config.token = token;
        config.timeout = Duration::from_secs_f64(timeout);
        let open = py.detach(|| -> Result<Open, GpuError> {
            let (client, conn) = rt.block_on(async {
                let client = NodeClient::connect(config).await?;
                let conn = client.connection().await?;
                Ok::<_, KvError>((client, conn))
            })?;
            let region = PinnedRegion::for_connection(&ctx, &conn)?;
            let stream = Stream::new(&ctx)?;
            Ok(Open { region, stream, conn, client, ctx, rt, pid: std::process::id() })
        });
        let open = open.map_err(|e| gpu_error(&e, what))?;
        Ok(DeviceClient { open: Mutex::new(Some(open)), closed: AtomicBool::new(false), endpoint, device })
    }

    /// Stores device memory: `sizes[i]` bytes at device address `ptrs[i]`
    /// under `keys[i]`. The copies start on `stream` after whatever was
    /// enqueued there before (the kernels that wrote those blocks); the call
    /// returns once the node holds them, and the device memory may then be
    /// reused. A batch larger than the shared memory goes in rounds.
    ///
    /// `stream`, when given, must be a live `CUstream` of this client's
    /// device (`torch.cuda.current_stream(device).cuda_stream`; 0 is the
    /// legacy default stream).
    ///
    /// Raises the typed exception of the first key not stored, with `key`
    /// and `index` set; the other keys of the batch may have been.
    #[pyo3(signature = (keys, ptrs, sizes, *, stream = None))]
    #[allow(unsafe_code)]
    fn put_from_device(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        stream: Option<usize>,
    ) -> PyResult<()> {
        let blocks = blocks_of("put_from_device", &keys, &ptrs, &sizes)?;
        if blocks.is_empty() {
            return Ok(());
        }
        let n = blocks.len();
        let results = self.with_open(py, &format!("put_from_device of {n} keys"), |open| {
            let mut borrowed = None;
            // SAFETY: the caller's promise on `stream` (method docs).
            let stream = unsafe { stream_for(open, stream, &mut borrowed) };
            open.rt.block_on(open.region.put_from_device(&open.conn, &blocks, stream))
        })?;
        if let Some((i, e)) = results.iter().enumerate().find_map(|(i, r)| r.as_ref().err().map(|e| (i, e))) {
            let key = &blocks[i].0;
            return Err(kv_error(e, format!("put_from_device: key '{}' (keys[{i}]) was not stored", show(key)), Some(key), Some(i)));
        }
        Ok(())
    }

    /// Reads the value of `keys[i]` into device memory at `ptrs[i]`, which
    /// holds `capacities[i]` bytes, and answers per key how many bytes were
    /// written, or `None` when the key is absent. The copies run on
    /// `stream` (see `put_from_device`) and are done when the call returns.
    /// A value larger than its capacity raises `BufferTooSmall` and is not
    /// written.
    #[pyo3(signature = (keys, ptrs, capacities, *, stream = None))]
    #[allow(unsafe_code)]
    fn get_into_device(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ptrs: Vec<u64>,
        capacities: Vec<usize>,
        stream: Option<usize>,
    ) -> PyResult<Vec<Option<usize>>> {
        let blocks = blocks_of("get_into_device", &keys, &ptrs, &capacities)?;
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        let n = blocks.len();
        let results = self.with_open(py, &format!("get_into_device of {n} keys"), |open| {
            let mut borrowed = None;
            // SAFETY: the caller's promise on `stream` (method docs).
            let stream = unsafe { stream_for(open, stream, &mut borrowed) };
            open.rt.block_on(open.region.get_into_device(&open.conn, &blocks, stream))
        })?;
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let key = &blocks[i].0;
                match r {
                    Ok(n) => Ok(Some(n)),
                    Err(KvError::NotFound) => Ok(None),
                    Err(KvError::Capacity(detail)) => Err(raise(
                        "BufferTooSmall",
                        format!(
                            "get_into_device: capacities[{i}] is too small for the value of key '{}' ({detail}); it was not written",
                            show(key)
                        ),
                        Some(key),
                        Some(i),
                    )),
                    Err(e) => Err(kv_error(&e, format!("get_into_device: key '{}' (keys[{i}])", show(key)), Some(key), Some(i))),
                }
            })
            .collect()
    }

    /// Unregisters the shared memory and closes the connection; later calls
    /// raise `kvplane.Error`.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Relaxed);
        // Waits for a call on another thread to finish (see `with_open`).
        py.detach(|| {
            let open = self.open.lock().unwrap_or_else(|p| p.into_inner()).take();
            open.map(dispose)
        });
    }

    /// True once `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// The node's endpoint, as given.
    #[getter]
    fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { ", closed" } else { "" };
        format!("kvplane.DeviceClient({:?}, device={}{state})", self.endpoint, self.device)
    }
}
