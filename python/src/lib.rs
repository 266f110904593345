//! `kvplane._native`: the Python package's client, [`kvplane_client`] behind
//! PyO3.
//!
//! Engines (vLLM, LMCache) keep their KV cache in one large tensor and move
//! blocks of it by batch, so every data call takes a list of keys and a list
//! of buffers (memoryviews of slices of that tensor, numpy arrays, bytearrays:
//! anything with the buffer protocol) and the GIL is released for the whole
//! network round trip, so the engine's other Python threads keep running.
//!
//! Copies:
//! - `put_from` hands the client the caller's memory itself: each buffer is
//!   exported (the object cannot be resized or freed meanwhile) and wrapped
//!   in a [`Bytes`] that borrows it. Over TCP the client writes those slices
//!   to the socket with vectored writes (no copy in this process); over a
//!   Unix socket with shared memory it copies each block once into the
//!   region the node reads. The export is released when the last such
//!   `Bytes` is dropped, so no reference outlives the memory.
//! - `get_into` hands the client the caller's buffers as destinations
//!   ([`kvplane_client::Client::get_into`]): through shared memory each value
//!   is copied once, from the region the node wrote it to, straight into its
//!   buffer; over a socket, once from the received frame. (Across a cluster,
//!   once more: the owners are read in parallel first.)
//!
//! Buffers are checked before any I/O: a buffer that `get_into` would write
//! must be writable, C-contiguous and share no memory with another of the
//! call's buffers. A value longer than its buffer leaves that buffer
//! unwritten, and no buffer is written past its value's length.

mod aio;
mod device;
mod loop_io;
mod pages;

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use kvplane_client::{
    Client as NodeClient, ClientConfig, ClientTls, ClusterClient, ClusterClientConfig, Endpoint, ErrorKind, KvError, PrefixMatch,
};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use tokio::runtime::Runtime;

/// The module that defines the exception classes (they subclass both
/// `kvplane.Error` and the matching builtin, which is simpler in Python).
const ERRORS_MODULE: &str = "kvplane._errors";

/// Worker threads of the I/O runtime: enough to keep a few sockets busy
/// without competing with the engine for cores.
const IO_THREADS: usize = 2;

/// The process's I/O runtime, tagged with the process id that built it: a
/// runtime's threads do not survive `fork` (engines fork workers), so a
/// child builds its own and leaks the parent's copy instead of joining
/// threads that do not exist there.
static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// The runtime of asyncio node clients (`kvplane.aio`), tagged like
/// [`RUNTIME`].
static AIO_NODE_RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// This process's runtime of `slot`, built by `build` the first time (and
/// again in a forked child).
fn process_runtime(slot: &Mutex<Option<(u32, Arc<Runtime>)>>, build: impl FnOnce() -> PyResult<Arc<Runtime>>) -> PyResult<Arc<Runtime>> {
    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    match slot.take() {
        Some((p, rt)) if p == pid => {
            *slot = Some((p, Arc::clone(&rt)));
            return Ok(rt);
        }
        Some(inherited) => std::mem::forget(inherited),
        None => {}
    }
    let rt = build()?;
    *slot = Some((pid, Arc::clone(&rt)));
    Ok(rt)
}

fn runtime() -> PyResult<Arc<Runtime>> {
    process_runtime(&RUNTIME, || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(IO_THREADS)
            .thread_name("kvplane-io")
            .enable_all()
            .build()
            .map(Arc::new)
            .map_err(|e| raise("Internal", format!("starting the I/O runtime: {e}"), None, None))
    })
}

/// The runtime asyncio node clients run on: a current-thread runtime that
/// one thread of its own drives, so that a call's task, its connection's
/// reader and the I/O driver share that thread, as they share the calling
/// thread of a sync node client (see `aio.rs` for what the multi-thread
/// runtime cost). The thread attaches to the interpreter once and stays
/// detached: it keeps its Python thread state, so the wake-ups of event
/// loops it makes (attached) do not create and destroy one each.
pub(crate) fn aio_node_runtime() -> PyResult<Arc<Runtime>> {
    process_runtime(&AIO_NODE_RUNTIME, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(Arc::new)
            .map_err(|e| raise("Internal", format!("starting the asyncio I/O runtime: {e}"), None, None))?;
        let driven = Arc::clone(&rt);
        std::thread::Builder::new()
            .name("kvplane-aio".into())
            .spawn(move || Python::attach(|py| py.detach(|| driven.block_on(std::future::pending::<()>()))))
            .map_err(|e| raise("Internal", format!("starting the asyncio I/O thread: {e}"), None, None))?;
        Ok(rt)
    })
}

// --- errors ------------------------------------------------------------------------

/// What `put_from` (sync and async) and `put_pages` raise for a batch whose keys were not
/// all stored: the first failed key's error, with its key and index, and
/// how many others failed; `Ok` when every key was stored.
pub(crate) fn put_failure<T>(op: &str, keys: &[Bytes], results: &[Result<T, KvError>]) -> PyResult<()> {
    let mut failed = results.iter().enumerate().filter_map(|(i, r)| r.as_ref().err().map(|e| (i, e)));
    let Some((i, e)) = failed.next() else {
        return Ok(());
    };
    let others = match failed.count() {
        0 => String::new(),
        1 => ", and 1 other key failed".into(),
        m => format!(", and {m} other keys failed"),
    };
    Err(kv_error(e, format!("{op}: key '{}' (keys[{i}]) was not stored{others}", show(&keys[i])), Some(&keys[i]), Some(i)))
}

/// Builds an instance of `kvplane._errors.CLASS(message, key=..., index=...)`.
fn raise(class: &str, message: String, key: Option<&[u8]>, index: Option<usize>) -> PyErr {
    Python::attach(|py| {
        let build = || -> PyResult<PyErr> {
            let cls = py.import(ERRORS_MODULE)?.getattr(class)?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("key", key.map(|k| PyBytes::new(py, k)))?;
            kwargs.set_item("index", index)?;
            Ok(PyErr::from_value(cls.call((message,), Some(&kwargs))?))
        };
        build().unwrap_or_else(|e| e)
    })
}

/// The exception class for a client error.
fn class_of(e: &KvError) -> &'static str {
    match e.kind() {
        ErrorKind::NotFound => "NotFound",
        ErrorKind::Timeout => "Timeout",
        ErrorKind::Unavailable => "Unavailable",
        ErrorKind::Invalid => "Invalid",
        ErrorKind::Capacity => "Capacity",
        ErrorKind::Internal => "Internal",
        ErrorKind::Unsupported => "Unsupported",
        ErrorKind::Busy => "Busy",
        ErrorKind::Denied => "Denied",
        ErrorKind::Corrupt => "Corrupt",
    }
}

/// A client error as its typed exception; `Busy` also carries
/// `retry_after_ms` so that a caller can back off as the node asked.
fn kv_error(e: &KvError, context: String, key: Option<&[u8]>, index: Option<usize>) -> PyErr {
    let err = raise(class_of(e), format!("{context}: {e}"), key, index);
    if let KvError::Busy { retry_after_ms, .. } = e {
        Python::attach(|py| {
            let _ = err.value(py).setattr("retry_after_ms", *retry_after_ms);
        });
    }
    err
}

/// A key for messages: printable ASCII as is, other bytes escaped.
fn show(key: &[u8]) -> String {
    key.escape_ascii().to_string()
}

// --- keys and buffers -------------------------------------------------------------

/// A key: `str` (its UTF-8 bytes) or `bytes`.
fn key_of(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<Bytes> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Bytes::copy_from_slice(b.as_bytes()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Bytes::copy_from_slice(s.to_str()?.as_bytes()));
    }
    Err(PyTypeError::new_err(format!("keys[{index}]: a key is str or bytes, not {}", obj.get_type().name()?)))
}

fn keys_of(keys: &[Bound<'_, PyAny>]) -> PyResult<Vec<Bytes>> {
    keys.iter().enumerate().map(|(i, k)| key_of(k, i)).collect()
}

fn same_length(op: &str, keys: usize, buffers: usize) -> PyResult<()> {
    if keys == buffers {
        return Ok(());
    }
    Err(raise("Invalid", format!("{op}: {keys} keys but {buffers} buffers; they pair up one to one"), None, None))
}

/// Exports one buffer, checking what the call needs of it: C-contiguous
/// always (the bytes are moved as one run), writable when `write`.
fn export(obj: &Bound<'_, PyAny>, index: usize, key: &[u8], write: bool) -> PyResult<PyUntypedBuffer> {
    export_at(obj, &format!("buffers[{index}]"), index, key, write)
}

/// [`export`] of a buffer named `label` in errors (`buffers[3][1]`).
fn export_at(obj: &Bound<'_, PyAny>, label: &str, index: usize, key: &[u8], write: bool) -> PyResult<PyUntypedBuffer> {
    let at = || format!("{label} (for key '{}')", show(key));
    let buffer = PyUntypedBuffer::get(obj)
        .map_err(|e| raise("BadBuffer", format!("{}: a {} does not export a buffer: {e}", at(), type_name(obj)), Some(key), Some(index)))?;
    if write && buffer.readonly() {
        return Err(raise("ReadOnlyBuffer", format!("{}: the {} is read-only", at(), type_name(obj)), Some(key), Some(index)));
    }
    if !buffer.is_c_contiguous() {
        return Err(raise(
            "NonContiguousBuffer",
            format!("{}: the {} is not C-contiguous (shape {:?}, strides {:?})", at(), type_name(obj), buffer.shape(), buffer.strides()),
            Some(key),
            Some(index),
        ));
    }
    Ok(buffer)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into())
}

/// The exported buffers of one `put_from`, shared by the [`Bytes`] that
/// borrow them: the exports are released (with the GIL, by pyo3) when the
/// last of those is dropped, wherever that happens.
struct Exports(Vec<PyUntypedBuffer>);

/// One exported buffer as the bytes of a PUT.
struct Borrowed {
    exports: Arc<Exports>,
    index: usize,
}

impl AsRef<[u8]> for Borrowed {
    #[allow(unsafe_code)]
    fn as_ref(&self) -> &[u8] {
        let b = &self.exports.0[self.index];
        let len = b.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the buffer is exported for as long as `self.exports` lives
        // (the exporter may neither free nor move it meanwhile), it is
        // C-contiguous (checked by `export`), so `len_bytes` bytes from
        // `buf_ptr` are its memory, and it is non-empty, so the pointer is
        // not null. The caller is told not to modify it during the call.
        unsafe { std::slice::from_raw_parts(b.buf_ptr().cast::<u8>(), len) }
    }
}

// --- the client ---------------------------------------------------------------------

enum Target {
    // Boxed: a node client is several times a cluster client's size.
    Node(Box<NodeClient>),
    Cluster(ClusterClient),
}

impl Target {
    async fn put(&self, entries: Vec<(Bytes, Bytes)>) -> Result<Vec<Result<(), KvError>>, KvError> {
        match self {
            Target::Node(c) => c.put(entries).await,
            Target::Cluster(c) => c.put(entries).await,
        }
    }

    async fn get(&self, keys: Vec<Bytes>) -> Result<Vec<Result<Bytes, KvError>>, KvError> {
        match self {
            Target::Node(c) => c.get(keys).await,
            Target::Cluster(c) => c.get(keys).await,
        }
    }

    async fn get_into(&self, keys: Vec<Bytes>, dests: &mut [&mut [u8]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        match self {
            Target::Node(c) => c.get_into(keys, dests).await,
            Target::Cluster(c) => c.get_into(keys, dests).await,
        }
    }

    async fn get_into_parts(&self, keys: Vec<Bytes>, dests: &mut [&mut [&mut [u8]]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        match self {
            Target::Node(c) => c.get_into_parts(keys, dests).await,
            Target::Cluster(c) => c.get_into_parts(keys, dests).await,
        }
    }

    async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, KvError> {
        match self {
            Target::Node(c) => c.exists(keys).await,
            Target::Cluster(c) => c.exists(keys).await,
        }
    }

    async fn delete(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, KvError> {
        match self {
            Target::Node(c) => c.delete(keys).await,
            Target::Cluster(c) => c.delete(keys).await,
        }
    }

    async fn match_prefix(&self, keys: Vec<Bytes>, lease: Duration) -> Result<PrefixMatch, KvError> {
        match self {
            Target::Node(c) => c.match_prefix(keys, lease).await,
            Target::Cluster(c) => c.match_prefix(keys, lease).await,
        }
    }

    async fn stats(&self) -> Result<Vec<(String, u64)>, KvError> {
        match self {
            Target::Node(c) => c.stats().await,
            Target::Cluster(_) => Err(KvError::Unsupported("stats() of a cluster client: ask each node's own client".into())),
        }
    }

    fn max_block_bytes(&self) -> Option<usize> {
        match self {
            Target::Node(c) => c.max_block_bytes(),
            Target::Cluster(c) => c.max_block_bytes(),
        }
    }

    fn max_lease_ms(&self) -> u32 {
        match self {
            Target::Node(c) => c.limits().max_lease_ms,
            Target::Cluster(c) => c.max_lease_ms(),
        }
    }
}

/// A connected client and the runtime its connections live on.
struct Inner {
    rt: std::mem::ManuallyDrop<Arc<Runtime>>,
    target: std::mem::ManuallyDrop<Target>,
    pid: u32,
    /// The runtime is a current-thread one that the calling threads drive
    /// (a node client); else the shared multi-thread one (a cluster client,
    /// whose slot-table follower must run between calls).
    driven_here: bool,
}

impl Inner {
    /// Runs a call and waits for it. A node client's runtime is driven by
    /// the calling thread itself: it waits in the I/O driver for the node's
    /// answer, so the kernel wakes it directly when the answer arrives (one
    /// wake-up, as a Rust caller on a runtime thread gets). A cluster
    /// client's call runs as a task on the shared runtime's workers, woken
    /// there at each answer, and this thread once, when it is done (a call
    /// polled on this thread would be woken across threads at each answer).
    fn run<T, F>(self: &Arc<Self>, call: impl FnOnce(Arc<Inner>) -> F) -> T
    where
        F: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        if self.driven_here {
            let inner = Arc::clone(self);
            return self.rt.block_on(async move {
                // Nothing runs on this runtime between calls: first let the
                // I/O driver report what happened meanwhile (a node that
                // closed a connection: the first yield polls the driver) and
                // the reader tasks it woke run (the second), so the pool
                // replaces a closed connection before the call picks it.
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
                call(inner).await
            });
        }
        let task = self.rt.spawn(call(Arc::clone(self)));
        match self.rt.block_on(task) {
            Ok(value) => value,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Tasks are cancelled only when the runtime shuts down, and this
            // process's runtime lives as long as the process.
            Err(e) => panic!("the I/O runtime dropped a call: {e}"),
        }
    }
}

impl Drop for Inner {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child: the connections' tasks live on the parent's
            // runtime, whose threads are not here. Leak both rather than
            // touch them.
            return;
        }
        {
            let _context = self.rt.enter();
            // SAFETY: dropped once, here, and never used again.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.target) };
        }
        // SAFETY: as above; the target that used it is gone.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.rt) };
    }
}

/// A member of a slot table as Python sees it: `(id, endpoint, state)`.
type MemberRow = (String, String, String);

/// The first two of `spans` (address, length) that share memory, in order
/// of their indices; empty spans share none.
pub(crate) fn first_overlap(spans: &[(usize, usize)]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
    order.sort_unstable_by_key(|&i| spans[i].0);
    order
        .windows(2)
        .find(|pair| spans[pair[0]].0 + spans[pair[0]].1 > spans[pair[1]].0)
        .map(|pair| (pair[0].min(pair[1]), pair[0].max(pair[1])))
}

/// Where one `get_into` writes: `buffers[i]` is one buffer, or a list (or
/// tuple) of buffers that key `i`'s value fills in order (a KV block whose
/// layers lie in separate tensors, read straight into them: no staging
/// copy). As (address, length) parts, key `i` owning
/// `parts[first[i]..first[i + 1]]`: integers, because the call runs without
/// the GIL or on an I/O thread and raw pointers are not Send.
pub(crate) struct Destinations {
    parts: Vec<(usize, usize)>,
    first: Vec<usize>,
}

impl Destinations {
    /// Exports every buffer (writable, C-contiguous) and refuses parts that
    /// share memory, all before any I/O. The exports must be kept until the
    /// client is done with the memory: while they live, the exporters may
    /// neither free nor move it.
    /// The caller has checked that `keys` and `buffers` pair up.
    pub(crate) fn export(keys: &[Bytes], buffers: &[Bound<'_, PyAny>]) -> PyResult<(Exports, Destinations)> {
        let (mut exports, mut first) = (Vec::with_capacity(buffers.len()), Vec::with_capacity(buffers.len() + 1));
        let mut owner = Vec::with_capacity(buffers.len());
        for (i, (k, b)) in keys.iter().zip(buffers).enumerate() {
            first.push(exports.len());
            if b.is_instance_of::<PyList>() || b.is_instance_of::<PyTuple>() {
                for (j, part) in b.try_iter()?.enumerate() {
                    exports.push(export_at(&part?, &format!("buffers[{i}][{j}]"), i, k, true)?);
                    owner.push(i);
                }
            } else {
                exports.push(export(b, i, k, true)?);
                owner.push(i);
            }
        }
        first.push(exports.len());
        let parts: Vec<(usize, usize)> = exports.iter().map(|b| (b.buf_ptr() as usize, b.len_bytes())).collect();
        if let Some((a, b)) = first_overlap(&parts) {
            let (first, second) = (owner[a], owner[b]);
            let message = match first == second {
                true => format!("get_into: two parts of buffers[{first}] share memory; each part needs memory of its own"),
                false => format!("get_into: buffers[{first}] and buffers[{second}] share memory; each key needs a buffer of its own"),
            };
            return Err(raise("OverlappingBuffers", message, Some(&keys[second]), Some(second)));
        }
        Ok((Exports(exports), Destinations { parts, first }))
    }

    /// Reads `keys` into the destinations through `target`.
    ///
    /// # Safety
    ///
    /// The exports made with `self` must live, and their memory be written
    /// by nothing else, until the returned future is done or dropped.
    #[allow(unsafe_code)]
    pub(crate) async unsafe fn read(&self, target: &Target, keys: Vec<Bytes>) -> Result<Vec<Result<usize, KvError>>, KvError> {
        let mut flat: Vec<&mut [u8]> = self
            .parts
            .iter()
            // SAFETY: each (addr, len) is a writable, C-contiguous exported
            // buffer, exported for as long as the future lives (the caller's
            // promise), and no two overlap (checked by `export`), so these
            // are disjoint exclusive slices for the call.
            .map(|&(addr, len)| unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) })
            .collect();
        let mut per_key: Vec<&mut [&mut [u8]]> = Vec::with_capacity(self.first.len().saturating_sub(1));
        let mut rest = &mut flat[..];
        for pair in self.first.windows(2) {
            let (mine, later) = std::mem::take(&mut rest).split_at_mut(pair[1] - pair[0]);
            per_key.push(mine);
            rest = later;
        }
        target.get_into_parts(keys, &mut per_key).await
    }
}

/// A `get_into`'s answers as Python sees them: per key the bytes written,
/// or None when absent; a value longer than its buffer, or any other
/// key's error, fails the call.
fn lengths(values: Vec<Result<usize, KvError>>) -> Result<Vec<Option<usize>>, GetFailure> {
    values
        .into_iter()
        .enumerate()
        .map(|(index, v)| match v {
            Ok(n) => Ok(Some(n)),
            Err(KvError::NotFound) => Ok(None),
            Err(KvError::Capacity(detail)) => Err(GetFailure::TooSmall { index, detail }),
            Err(e) => Err(GetFailure::Key(index, e)),
        })
        .collect()
}

/// Why a `get_into` failed.
enum GetFailure {
    Call(KvError),
    Key(usize, KvError),
    TooSmall { index: usize, detail: String },
}

impl GetFailure {
    /// The typed exception, naming the key at fault among `keys`.
    fn raise(self, keys: &[Bytes]) -> PyErr {
        match self {
            GetFailure::Call(e) => kv_error(&e, format!("get_into of {} keys", keys.len()), None, None),
            GetFailure::Key(i, e) => kv_error(&e, format!("get_into: key '{}' (keys[{i}])", show(&keys[i])), Some(&keys[i]), Some(i)),
            GetFailure::TooSmall { index, detail } => raise(
                "BufferTooSmall",
                format!(
                    "get_into: buffers[{index}] is too small for the value of key '{}' ({detail}); it was not written",
                    show(&keys[index])
                ),
                Some(&keys[index]),
                Some(index),
            ),
        }
    }
}

/// A client of one kvplane node, or of a whole cluster.
///
/// `Client("127.0.0.1:9600")` keeps a pool of `connections` connections to
/// one node (calls are spread over them and pipelined).
/// `Client(["10.0.0.1:9600", "10.0.0.2:9600"], cluster=True)` asks any of
/// those nodes for the cluster's slot table, follows its changes, and sends
/// each key to its owners itself.
///
/// Every call releases the GIL while it waits for the network. The client
/// may be shared by threads. It belongs to the process that made it: after
/// `fork`, make a new one in the child.
#[pyclass(name = "Client", module = "kvplane", frozen)]
struct Client {
    inner: RwLock<Option<Arc<Inner>>>,
    endpoints: Vec<String>,
    cluster: bool,
}

impl Client {
    fn inner(&self) -> PyResult<Arc<Inner>> {
        let inner = self.inner.read().unwrap_or_else(|p| p.into_inner()).clone();
        let inner = inner.ok_or_else(|| raise("Error", format!("the client of {} is closed", self.endpoints.join(", ")), None, None))?;
        if inner.pid != std::process::id() {
            return Err(raise(
                "Error",
                format!("this client was made in process {}, before a fork; make a new one in process {}", inner.pid, std::process::id()),
                None,
                None,
            ));
        }
        Ok(inner)
    }
}

/// TLS to TCP endpoints from the constructor's `tls_*` options: a CA file
/// (required for TLS), an optional client certificate and key (for nodes
/// started with --tls-client-ca), a server name to check instead of the
/// endpoint's host. Refusals name the option and the file.
pub(crate) fn tls_of(
    who: &str,
    ca: Option<std::path::PathBuf>,
    cert: Option<std::path::PathBuf>,
    key: Option<std::path::PathBuf>,
    server_name: Option<String>,
) -> PyResult<Option<ClientTls>> {
    let Some(ca) = ca else {
        if cert.is_some() || key.is_some() || server_name.is_some() {
            return Err(raise("Invalid", format!("{who}: tls_cert, tls_key and tls_server_name need tls_ca"), None, None));
        }
        return Ok(None);
    };
    let client = match (&cert, &key) {
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        (None, None) => None,
        _ => return Err(raise("Invalid", format!("{who}: tls_cert and tls_key go together"), None, None)),
    };
    ClientTls::new(&ca, client, server_name.as_deref()).map(Some).map_err(|e| kv_error(&e, format!("{who}: tls_ca"), None, None))
}

#[pymethods]
impl Client {
    #[new]
    // One argument per keyword of the Python constructor.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (endpoints, *, cluster = false, connections = None, token = None, timeout = 30.0, write_quorum = None, shared_memory = true, tls_ca = None, tls_cert = None, tls_key = None, tls_server_name = None))]
    fn new(
        py: Python<'_>,
        endpoints: &Bound<'_, PyAny>,
        cluster: bool,
        connections: Option<usize>,
        token: Option<String>,
        timeout: f64,
        write_quorum: Option<usize>,
        shared_memory: bool,
        tls_ca: Option<std::path::PathBuf>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        tls_server_name: Option<String>,
    ) -> PyResult<Client> {
        let tls = tls_of("Client", tls_ca, tls_cert, tls_key, tls_server_name)?;
        let endpoints: Vec<String> =
            if let Ok(s) = endpoints.cast::<PyString>() { vec![s.to_str()?.to_owned()] } else { endpoints.extract()? };
        let parsed = endpoints
            .iter()
            .map(|e| e.parse::<Endpoint>().map_err(|err| kv_error(&err, "Client".into(), None, None)))
            .collect::<PyResult<Vec<_>>>()?;
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(raise("Invalid", format!("Client: timeout must be a positive number of seconds, not {timeout}"), None, None));
        }
        let timeout = Duration::from_secs_f64(timeout);
        if connections == Some(0) {
            return Err(raise("Invalid", "Client: connections must be at least 1".into(), None, None));
        }
        if !cluster && parsed.len() != 1 {
            return Err(raise(
                "Invalid",
                format!("Client: a node client takes one endpoint, not {}; pass cluster=True to route over several", parsed.len()),
                None,
                None,
            ));
        }
        if !cluster && write_quorum.is_some() {
            return Err(raise("Invalid", "Client: write_quorum applies to a cluster client (cluster=True)".into(), None, None));
        }
        // 0 would acknowledge a PUT no owner stored; None is the cluster's own.
        if write_quorum == Some(0) {
            return Err(raise("Invalid", "Client: write_quorum must be at least 1 (or None for the cluster's own)".into(), None, None));
        }
        let rt = runtime()?;
        let what = endpoints.join(", ");
        let target = if cluster {
            let mut config = ClusterClientConfig::new(parsed);
            config.token = token;
            config.tls = tls;
            config.timeout = timeout;
            config.write_quorum = write_quorum;
            if let Some(n) = connections {
                config.connections = n;
            }
            let client = py
                .detach(|| rt.block_on(ClusterClient::connect(config)))
                .map(Target::Cluster)
                .map_err(|e| kv_error(&e, format!("connect to the cluster of {what}"), None, None))?;
            (client, None)
        } else {
            let mut config = ClientConfig::new(parsed.into_iter().next().expect("one endpoint"));
            config.token = token;
            config.tls = tls;
            config.timeout = timeout;
            config.shared_memory = shared_memory;
            if let Some(n) = connections {
                config.connections = n;
            }
            // A node client's connections live on a runtime of its own that
            // only the calling threads drive (see `Inner::run`).
            let rt = Arc::new(
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| raise("Internal", format!("starting the client's runtime: {e}"), None, None))?,
            );
            let client = py
                .detach(|| rt.block_on(NodeClient::connect(config)))
                .map(|c| Target::Node(Box::new(c)))
                .map_err(|e| kv_error(&e, format!("connect to {what}"), None, None))?;
            (client, Some(rt))
        };
        let (target, rt, driven_here) = match target {
            (target, Some(own)) => (target, own, true),
            (target, None) => (target, rt, false),
        };
        let inner = Inner {
            rt: std::mem::ManuallyDrop::new(rt),
            target: std::mem::ManuallyDrop::new(target),
            pid: std::process::id(),
            driven_here,
        };
        Ok(Client { inner: RwLock::new(Some(Arc::new(inner))), endpoints, cluster })
    }

    /// Stores `buffers[i]` under `keys[i]`, sending straight from the
    /// buffers' memory. Keys are `str` or `bytes`; buffers are any
    /// C-contiguous object with the buffer protocol (read-only is fine).
    /// Do not modify the buffers until the call returns.
    ///
    /// Raises the typed exception of the first key that was not stored, with
    /// `key` and `index` set; the other keys of the batch may have been.
    fn put_from(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        same_length("put_from", keys.len(), buffers.len())?;
        let inner = self.inner()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok(());
        }
        let exports = keys.iter().zip(&buffers).enumerate().map(|(i, (k, b))| export(b, i, k, false)).collect::<PyResult<Vec<_>>>()?;
        let exports = Arc::new(Exports(exports));
        let entries: Vec<(Bytes, Bytes)> = keys
            .iter()
            .enumerate()
            .map(|(index, k)| (k.clone(), Bytes::from_owner(Borrowed { exports: Arc::clone(&exports), index })))
            .collect();
        let n = entries.len();
        let results = py.detach(|| inner.run(|inner| async move { inner.target.put(entries).await }));
        // Released here, with the GIL, unless a task still holds a slice.
        drop(exports);
        let results = results.map_err(|e| kv_error(&e, format!("put_from of {n} keys"), None, None))?;
        put_failure("put_from", &keys, &results)
    }

    /// Reads the value of `keys[i]` into `buffers[i]` and answers, per key,
    /// how many bytes were written (from the buffer's start), or `None` when
    /// the key is absent. `buffers[i]` may also be a list of buffers, which
    /// the value fills in order (a KV block whose layers lie in separate
    /// tensors, read straight into them). Buffers must be writable and
    /// C-contiguous (`ReadOnlyBuffer`, `NonContiguousBuffer` otherwise,
    /// before any I/O); buffers that share memory raise `OverlappingBuffers`
    /// (before any I/O); a value larger than its buffer (its list's buffers
    /// together) raises `BufferTooSmall` and that buffer is not written. No
    /// buffer is written past its value's length; when a call raises, the
    /// other buffers may already hold their values.
    #[allow(unsafe_code)]
    fn get_into(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<Option<usize>>> {
        same_length("get_into", keys.len(), buffers.len())?;
        let inner = self.inner()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (exports, dests) = Destinations::export(&keys, &buffers)?;
        let request = keys.clone();
        let outcome = py.detach(|| -> Result<Vec<Option<usize>>, GetFailure> {
            // SAFETY: `run` returns only once the task has finished with the
            // memory, and the exports are released after this closure.
            let values = inner.run(|inner| async move { unsafe { dests.read(&inner.target, request).await } }).map_err(GetFailure::Call)?;
            lengths(values)
        });
        drop(exports);
        outcome.map_err(|f| f.raise(&keys))
    }

    /// Reads pages of a host memory pool (`kvplane._native.HostPages`)
    /// straight into it: page `i` is `hashes[i]`, at the pool's slots
    /// `host_indices[i * page_tokens:(i + 1) * page_tokens]` (a buffer of
    /// int64 or int32, such as `tensor.numpy()`); `describe(starts)` is
    /// asked where the blocks of page slots not seen before lie (see
    /// `HostPages`). One call per batch: the keys, the indices and the
    /// blocks' memory are worked out here, not in Python.
    ///
    /// Answers `(whole, partial)`: per page, whether every block was read
    /// at its full size; and the pages read only in part (some block
    /// there and not all, or one of another length; a block longer than
    /// its place in the pool is not written). `Invalid` for indices that
    /// are not pages of the pool (naming the index) or two pages of one
    /// slot, before any I/O; a key's other error fails the call as in
    /// `get_into`.
    #[allow(unsafe_code)]
    fn get_pages(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, pages::HostPages>,
        hashes: Vec<Bound<'_, PyAny>>,
        host_indices: &Bound<'_, PyAny>,
        describe: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<bool>, Vec<usize>)> {
        let inner = self.inner()?;
        let table = pages.get();
        if hashes.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let batch = table.batch(py, &hashes, host_indices, describe)?;
        table.count(pages::Count::GetPages, hashes.len());
        let request = batch.keys.clone();
        let blocks = batch.blocks;
        // `pages` (a reference the caller holds for the call) keeps the
        // pool's buffers exported until this returns.
        let answers = py.detach(|| {
            inner.run(|inner| async move {
                let mut slices: Vec<&mut [u8]> = blocks
                    .iter()
                    // SAFETY: each (addr, len) lies inside one of the pool's
                    // exported, writable buffers (checked when its slot was
                    // learnt), which stay exported while `pages` lives, past
                    // this call; no two overlap (checked by `batch`), so
                    // these are disjoint exclusive slices for the call.
                    .map(|&(addr, len)| unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) })
                    .collect();
                inner.target.get_into(request, &mut slices).await
            })
        });
        let answers = answers.map_err(|e| GetFailure::Call(e).raise(&batch.keys))?;
        if let Some((i, Err(e))) =
            answers.iter().enumerate().find(|(_, a)| matches!(a, Err(e) if !matches!(e, KvError::NotFound | KvError::Capacity(_))))
        {
            return Err(GetFailure::Key(i, e.clone()).raise(&batch.keys));
        }
        let (whole, partial) = pages::whole_pages(&answers, table.block_sizes());
        table.count(pages::Count::GetPagesRead, whole.iter().filter(|&&w| w).count());
        Ok((whole, partial))
    }

    /// Stores pages of a host memory pool that the node lacks, sent from
    /// the pool's memory: the pages of `get_pages` (same arguments), one
    /// EXISTS of their blocks, then one PUT of the blocks of every page not
    /// wholly stored. Answers, per page, whether it was already stored
    /// (and so not sent). Raises as `put_from` when a block was not stored.
    fn put_pages(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, pages::HostPages>,
        hashes: Vec<Bound<'_, PyAny>>,
        host_indices: &Bound<'_, PyAny>,
        describe: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let inner = self.inner()?;
        let table = pages.get();
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let batch = table.batch(py, &hashes, host_indices, describe)?;
        let k = table.per_page_blocks();
        let values: Vec<Bytes> = batch.blocks.iter().map(|&b| table.block_bytes(b)).collect();
        let keys = batch.keys;
        let (present, sent, results) = py
            .detach(|| {
                inner.run(move |inner| async move {
                    let there = inner.target.exists(keys.clone()).await?;
                    let present: Vec<bool> = there.chunks_exact(k).map(|page| page.iter().all(|&b| b)).collect();
                    let entries: Vec<(Bytes, Bytes)> =
                        keys.into_iter().zip(values).enumerate().filter(|(i, _)| !present[i / k]).map(|(_, entry)| entry).collect();
                    let sent: Vec<Bytes> = entries.iter().map(|(key, _)| key.clone()).collect();
                    let results = if entries.is_empty() { Vec::new() } else { inner.target.put(entries).await? };
                    Ok::<_, KvError>((present, sent, results))
                })
            })
            .map_err(|e| kv_error(&e, format!("put_pages of {} pages", hashes.len()), None, None))?;
        put_failure("put_pages", &sent, &results)?;
        table.count(pages::Count::SetPages, present.len());
        table.count(pages::Count::SetPagesPresent, present.iter().filter(|&&p| p).count());
        Ok(present)
    }

    /// The value of `key` (a `str` or `bytes`) as a new `bytes` object, or
    /// `None` when absent; given a list of keys, the list of their values.
    /// A convenience that copies; engines use `get_into`.
    fn get<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        if key.is_instance_of::<PyString>() || key.is_instance_of::<PyBytes>() {
            let mut one = self.get_many(py, vec![key.clone()])?;
            return Ok(match one.pop().flatten() {
                Some(value) => value.into_any(),
                None => py.None().into_bound(py),
            });
        }
        let keys: Vec<Bound<'py, PyAny>> = key.extract().map_err(|_| {
            raise("Invalid", format!("get: expected a key (str or bytes) or a list of keys, not {}", key.get_type()), None, None)
        })?;
        Ok(pyo3::types::PyList::new(py, self.get_many(py, keys)?)?.into_any())
    }

    /// Stores `value` (`bytes` or any C-contiguous buffer) under `key`:
    /// `put_from` of one key.
    fn put(&self, py: Python<'_>, key: Bound<'_, PyAny>, value: Bound<'_, PyAny>) -> PyResult<()> {
        self.put_from(py, vec![key], vec![value])
    }

    /// Which of `keys` are stored, in order.
    fn exists(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let inner = self.inner()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let n = keys.len();
        py.detach(|| inner.run(|inner| async move { inner.target.exists(keys).await }))
            .map_err(|e| kv_error(&e, format!("exists of {n} keys"), None, None))
    }

    /// Removes `keys`; per key, whether it was stored.
    fn delete(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let inner = self.inner()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let n = keys.len();
        py.detach(|| inner.run(|inner| async move { inner.target.delete(keys).await }))
            .map_err(|e| kv_error(&e, format!("delete of {n} keys"), None, None))
    }

    /// How many leading keys of a chain (a prompt's blocks, in order) are
    /// stored, and for how long they are pinned: with `lease_ms > 0` the
    /// node keeps the matched blocks from eviction for the granted lease
    /// (capped by the node), so the `get_into` that follows finds them.
    /// Answers `(matched, granted_lease_ms)`; the lease is 0 when nothing
    /// matched or no pin was asked.
    #[pyo3(signature = (keys, lease_ms = 0))]
    fn match_prefix(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>, lease_ms: u64) -> PyResult<(usize, u64)> {
        let inner = self.inner()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok((0, 0));
        }
        let n = keys.len();
        let m = py
            .detach(|| inner.run(move |inner| async move { inner.target.match_prefix(keys, Duration::from_millis(lease_ms)).await }))
            .map_err(|e| kv_error(&e, format!("match_prefix of {n} keys"), None, None))?;
        Ok((m.matched, u64::try_from(m.lease.as_millis()).unwrap_or(u64::MAX)))
    }

    /// The node's counters, by name (what `kvplane stats` prints): hits,
    /// misses, evictions, bytes, connections, per-operation requests and
    /// keys, and the bounds in force. `Unsupported` on a cluster client.
    fn stats(&self, py: Python<'_>) -> PyResult<std::collections::HashMap<String, u64>> {
        let inner = self.inner()?;
        py.detach(|| inner.run(|inner| async move { inner.target.stats().await }))
            .map(|entries| entries.into_iter().collect())
            .map_err(|e| kv_error(&e, "stats".into(), None, None))
    }

    /// The slot table a cluster client routes by: `(version, members)`, each
    /// member `(id, endpoint, state)` with state `"up"`, `"joining"`,
    /// `"draining"` or `"down"`. The client follows the nodes' table by
    /// itself; this is for tools, tests and logs. `Invalid` on a node client.
    fn cluster_table(&self) -> PyResult<(u64, Vec<MemberRow>)> {
        let inner = self.inner()?;
        let Target::Cluster(c) = &*inner.target else {
            return Err(raise(
                "Invalid",
                format!("cluster_table: {} is a node client, not a cluster client", self.endpoints.join(", ")),
                None,
                None,
            ));
        };
        let table = c.table();
        let members = table.members().iter().map(|m| (m.id.clone(), m.endpoint.clone(), m.state.name().to_owned())).collect();
        Ok((table.version, members))
    }

    /// Closes the connections; later calls raise `kvplane.Error`. Calls in
    /// flight on other threads finish first.
    fn close(&self, py: Python<'_>) {
        let inner = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        // Dropping the last reference closes sockets: not worth the GIL.
        py.detach(move || drop(inner));
    }

    /// True once `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// The endpoints given (for a cluster: the seeds).
    #[getter]
    fn endpoints(&self) -> Vec<String> {
        self.endpoints.clone()
    }

    /// Whether this is a cluster client.
    #[getter]
    fn cluster(&self) -> bool {
        self.cluster
    }

    /// The largest value the node stores (`kvplane node --max-block`), or
    /// None from a node that does not say: a longer value is refused
    /// (`Invalid`, naming both sizes), so callers with larger values split
    /// them.
    #[getter]
    fn max_block_bytes(&self) -> PyResult<Option<usize>> {
        Ok(self.inner()?.target.max_block_bytes())
    }

    /// The longest pin lease the node grants (`kvplane node --max-lease`);
    /// `match_prefix` clamps a longer one to it.
    #[getter]
    fn max_lease_ms(&self) -> PyResult<u32> {
        Ok(self.inner()?.target.max_lease_ms())
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
        format!("kvplane.Client({:?}, cluster={}{state})", self.endpoints, if self.cluster { "True" } else { "False" })
    }
}

impl Client {
    /// `get` of a list of keys.
    fn get_many<'py>(&self, py: Python<'py>, keys: Vec<Bound<'py, PyAny>>) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let inner = self.inner()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let request = keys.clone();
        let values = py
            .detach(|| inner.run(|inner| async move { inner.target.get(request).await }))
            .map_err(|e| kv_error(&e, format!("get of {} keys", keys.len()), None, None))?;
        values
            .into_iter()
            .enumerate()
            .map(|(i, v)| match v {
                Ok(v) => Ok(Some(PyBytes::new(py, &v))),
                Err(KvError::NotFound) => Ok(None),
                Err(e) => Err(kv_error(&e, format!("get: key '{}' (keys[{i}])", show(&keys[i])), Some(&keys[i]), Some(i))),
            })
            .collect()
    }
}

/// The native half of the `kvplane` package; import `kvplane` instead.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    // Both classes are named Client (kvplane.Client, kvplane.aio.Client):
    // added under a name of its own, which kvplane/aio.py imports.
    m.add("AsyncClient", m.py().get_type::<aio::AsyncClient>())?;
    m.add_class::<device::DeviceClient>()?;
    m.add_class::<pages::HostPages>()?;
    m.add_function(wrap_pyfunction!(device::gpu_unavailable_reason, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    aio::register_exit_hook(m.py())?;
    Ok(())
}
