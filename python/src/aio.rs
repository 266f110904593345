//! `kvplane.aio.Client`: the client's calls as asyncio awaitables, on the
//! same native core as `kvplane.Client`.
//!
//! Each call returns a [`LoopCall`] (the coroutine protocol: `await` it, or
//! make it a task); the keys are checked and the buffers exported when the
//! method is called, and nothing is sent until the call is first awaited.
//! Its Rust future is polled on the event loop's thread (`loop_io.rs`).
//! Where the I/O happens depends on the client ([`Io`]):
//!
//! - **On the loop** (a node client over plain TCP; the default, or
//!   `KVPLANE_AIO_IO=loop`): the connections' sockets are watched by the
//!   loop's own selector, so the node's answer wakes the loop, whose
//!   callback reads it straight into the caller's buffers and completes the
//!   call. No other thread takes part (timers aside). The connections
//!   belong to the loop of the first call; a call from another loop while
//!   that one is running is refused, saying so, and once it is not (closed
//!   or stopped) the next call connects again on its own loop.
//! - **On an I/O thread** (a cluster client, TLS, a Unix socket, or
//!   `KVPLANE_AIO_IO=thread`): the call runs as one task on an I/O runtime
//!   and the loop waits for that task. A node client's runtime is a
//!   current-thread one that a thread of its own drives
//!   ([`crate::aio_node_runtime`], one per process), so the task, its
//!   connection's reader and the I/O driver share that thread as they share
//!   the calling thread of a sync node client; cluster clients keep the
//!   process's multi-thread runtime ([`crate::runtime`]: their slot-table
//!   follower runs between calls). The task's end wakes the loop through
//!   `loop.call_soon_threadsafe`: two thread hand-offs per call, about
//!   80-90 us on a 2-core machine, which at 16 x 64 KiB cost the asyncio
//!   client a fifth of the sync client's throughput.
//!
//! Connecting is lazy: `Client(...)` checks its options and does no I/O;
//! the first call (or `await connect()`, or `async with`) connects, once,
//! however many calls are waiting for it; a failed connection is tried
//! again by the next call.
//!
//! Cancellation (`task.cancel()`, `asyncio.timeout`, `wait_for`): on the
//! loop, the call's future is dropped on the loop's thread when the
//! cancellation is thrown in; on an I/O thread, the call's task is aborted
//! and the awaitable raises `CancelledError` only once the task's future is
//! dropped. Either way, once it raised, no buffer of a `get_into` is
//! written any more (the client guarantees no write after its future is
//! dropped); which of them were written before is not known (treat them as
//! unwritten). A cancelled `put_from` may have stored some keys, or all. A
//! call closed without being cancelled (garbage-collected while pending)
//! drops its future without waiting: the buffers stay exported (the memory
//! alive) until an I/O thread's task is gone.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use kvplane_client::{Client as NodeClient, ClientConfig, ClusterClient, ClusterClientConfig, Endpoint, KvError, Transport};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};
use pyo3::IntoPyObjectExt;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::loop_io::{panicked, running_executor, CancelSignal, Cancellation, LoopCall, LoopExecutor, LoopTransport};
use crate::{
    export, key_of, kv_error, lengths, put_failure, raise, runtime, same_length, show, Borrowed, Destinations, Exports, GetFailure,
    MemberRow, Target,
};

pub(crate) use crate::loop_io::register_exit_hook;

/// What a client connects with (the constructor's checked options).
struct Spec {
    endpoints: Vec<Endpoint>,
    cluster: bool,
    connections: Option<usize>,
    token: Option<String>,
    tls: Option<kvplane_client::ClientTls>,
    timeout: Duration,
    write_quorum: Option<usize>,
    shared_memory: bool,
}

impl Spec {
    async fn connect(&self, transport: Option<Arc<dyn Transport>>) -> Result<Target, KvError> {
        if self.cluster {
            let mut config = ClusterClientConfig::new(self.endpoints.clone());
            config.token = self.token.clone();
            config.tls = self.tls.clone();
            config.timeout = self.timeout;
            config.write_quorum = self.write_quorum;
            if let Some(n) = self.connections {
                config.connections = n;
            }
            return ClusterClient::connect(config).await.map(Target::Cluster);
        }
        let mut config = ClientConfig::new(self.endpoints[0].clone());
        config.token = self.token.clone();
        config.tls = self.tls.clone();
        config.timeout = self.timeout;
        config.shared_memory = self.shared_memory;
        config.transport = transport;
        if let Some(n) = self.connections {
            config.connections = n;
        }
        NodeClient::connect(config).await.map(|c| Target::Node(Box::new(c)))
    }
}

/// Where a client's I/O happens (see the module documentation).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Io {
    Loop,
    Thread,
}

/// The environment variable that chooses [`Io`] (`loop` or `thread`), for
/// A/B runs; unset, a client whose I/O can be the loop's uses the loop.
const IO_VARIABLE: &str = "KVPLANE_AIO_IO";

impl Io {
    /// The I/O of a client of `spec`: the loop's where it can carry it (a
    /// node client over plain TCP), unless the environment says otherwise.
    fn of(spec: &Spec) -> PyResult<Io> {
        let why_not = if spec.cluster {
            Some("a cluster client")
        } else if spec.tls.is_some() {
            Some("TLS")
        } else if matches!(spec.endpoints[0], Endpoint::Unix(_)) {
            Some("a Unix socket")
        } else {
            None
        };
        match std::env::var(IO_VARIABLE).ok().as_deref() {
            None | Some("") => Ok(if why_not.is_some() { Io::Thread } else { Io::Loop }),
            Some("thread") => Ok(Io::Thread),
            Some("loop") => match why_not {
                None => Ok(Io::Loop),
                Some(what) => Err(raise(
                    "Invalid",
                    format!("aio.Client: {IO_VARIABLE}=loop carries plain TCP to one node only, not {what}; unset it or set it to thread"),
                    None,
                    None,
                )),
            },
            Some(other) => Err(raise("Invalid", format!("aio.Client: {IO_VARIABLE} must be loop or thread, not {other:?}"), None, None)),
        }
    }
}

/// A loop-I/O client's connections and the loop they belong to.
struct Binding {
    exec: Arc<LoopExecutor>,
    target: tokio::sync::OnceCell<Target>,
}

/// One client's connections (once made) and the runtime they live on.
struct Shared {
    rt: std::mem::ManuallyDrop<Arc<Runtime>>,
    io: Io,
    /// Thread I/O: the connected target.
    target: std::mem::ManuallyDrop<tokio::sync::OnceCell<Target>>,
    /// Loop I/O: the connections, bound to the loop of the first call.
    binding: std::mem::ManuallyDrop<Mutex<Option<Arc<Binding>>>>,
    spec: Spec,
    /// The endpoints, for messages.
    what: String,
    pid: u32,
}

impl Shared {
    /// Thread I/O: the connected target, connecting first when no call has
    /// yet.
    async fn connected(&self) -> Result<&Target, KvError> {
        self.target.get_or_try_init(|| self.spec.connect(None)).await
    }

    /// Loop I/O: the connections of the running loop (the caller is a
    /// poll on its thread), bound to it by the first call.
    fn bind_here(&self, py: Python<'_>) -> PyResult<Arc<Binding>> {
        let exec = running_executor(py)?;
        let mut binding = self.binding.lock().unwrap_or_else(|e| e.into_inner());
        match binding.as_ref() {
            Some(b) if b.exec.is(&exec) => return Ok(Arc::clone(b)),
            Some(b) if b.exec.running(py) => {
                return Err(raise(
                    "Error",
                    format!(
                        "the client of {} made its connections on another event loop, which is running; \
                         make one client per event loop (or set {IO_VARIABLE}=thread)",
                        self.what
                    ),
                    None,
                    None,
                ))
            }
            // Unbound, or bound to a loop that is not running (closed, or
            // stopped: calls it still holds keep their connections until
            // they end): this loop's connections from here on.
            _ => {}
        }
        let fresh = Arc::new(Binding { exec, target: tokio::sync::OnceCell::new() });
        if let Some(old) = binding.replace(Arc::clone(&fresh)) {
            let _context = self.rt.enter();
            drop(old);
        }
        Ok(fresh)
    }

    /// The target, once connected (no I/O).
    fn target_now(&self) -> Option<TargetRef> {
        match self.io {
            Io::Thread => self.target.get().map(|_| TargetRef::Shared),
            Io::Loop => {
                let binding = self.binding.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
                binding.target.get().is_some().then_some(TargetRef::Bound(binding))
            }
        }
    }

    /// How a cancellation is handled for a call of this client.
    fn cancellation(&self) -> (Cancellation, Option<Arc<CancelSignal>>) {
        match self.io {
            Io::Loop => (Cancellation::Drop, None),
            Io::Thread => {
                let signal = Arc::new(CancelSignal::default());
                (Cancellation::Wait(Arc::clone(&signal)), Some(signal))
            }
        }
    }
}

/// Where a connected target is.
enum TargetRef {
    Shared,
    Bound(Arc<Binding>),
}

impl Drop for Shared {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child: the connections' tasks live on the parent's
            // runtime (or loop), whose threads are not here. Leak them.
            return;
        }
        {
            let _context = self.rt.enter();
            // SAFETY: dropped once, here, and never used again.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.target) };
            // SAFETY: as above.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.binding) };
        }
        // SAFETY: as above; the targets that used it are gone. The runtime
        // itself lives on (the process's static holds it).
        unsafe { std::mem::ManuallyDrop::drop(&mut self.rt) };
    }
}

/// A call's connected target, as the call's closure gets it.
struct Connected {
    shared: Arc<Shared>,
    binding: Option<Arc<Binding>>,
}

impl Connected {
    fn target(&self) -> &Target {
        let cell = match &self.binding {
            Some(b) => &b.target,
            None => &*self.shared.target,
        };
        cell.get().expect("a call connects before it runs")
    }
}

/// Why a task of [`run`] did not produce its value.
enum Failed {
    Connect(KvError),
    Call(KvError),
}

/// Aborts the task when the call's future is dropped without having
/// waited for it (a call closed while pending).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a call's body runs its I/O through (see [`Shared::start`]).
struct CallIo {
    shared: Arc<Shared>,
    signal: Option<Arc<CancelSignal>>,
}

impl CallIo {
    /// Runs `call` on the client's target, connecting first, where the
    /// client's I/O happens. Connection failures are raised here; the
    /// call's own error is the caller's to put in context.
    async fn run<T, F>(self, call: impl FnOnce(Connected) -> F + Send + 'static) -> PyResult<Result<T, KvError>>
    where
        F: Future<Output = Result<T, KvError>> + Send + 'static,
        T: Send + 'static,
    {
        match self.shared.io {
            Io::Thread => run(self.shared, self.signal.expect("thread I/O has a cancel signal"), call).await,
            Io::Loop => {
                let binding = Python::attach(|py| self.shared.bind_here(py))?;
                // The transport is made only when this call connects.
                let connect = || {
                    let transport: Arc<dyn Transport> =
                        Arc::new(LoopTransport { exec: Arc::clone(&binding.exec), runtime: self.shared.rt.handle().clone() });
                    self.shared.spec.connect(Some(transport))
                };
                if let Err(e) = binding.target.get_or_try_init(connect).await {
                    return Err(kv_error(&e, format!("connect to {}", self.shared.what), None, None));
                }
                Ok(call(Connected { shared: self.shared, binding: Some(binding) }).await)
            }
        }
    }
}

impl Shared {
    /// The awaitable of one call: `body` runs when it is first awaited,
    /// its value is what the awaiter gets.
    fn start<T, F>(self: Arc<Self>, body: impl FnOnce(CallIo) -> F + Send + 'static) -> LoopCall
    where
        F: Future<Output = PyResult<T>> + Send + 'static,
        T: for<'py> IntoPyObject<'py> + Send + 'static,
    {
        let (cancellation, signal) = self.cancellation();
        let handle = self.rt.handle().clone();
        let io = CallIo { shared: self, signal };
        let future = async move {
            let value = body(io).await?;
            Python::attach(|py| value.into_py_any(py))
        };
        LoopCall::new(Box::pin(future), cancellation, handle)
    }
}

/// Runs `call` as a task on the I/O runtime, connecting first, and awaits
/// it; a cancellation thrown into the call aborts the task and fails (with
/// the thrown exception) only once the task's future is dropped.
async fn run<T, F>(
    shared: Arc<Shared>,
    cancel: Arc<CancelSignal>,
    call: impl FnOnce(Connected) -> F + Send + 'static,
) -> PyResult<Result<T, KvError>>
where
    F: Future<Output = Result<T, KvError>> + Send + 'static,
    T: Send + 'static,
{
    let what = shared.what.clone();
    let rt = Arc::clone(&shared.rt);
    let mut task = AbortOnDrop(rt.spawn(async move {
        if let Err(e) = shared.connected().await {
            return Err(Failed::Connect(e));
        }
        call(Connected { shared, binding: None }).await.map_err(Failed::Call)
    }));
    let outcome = poll_fn(|cx| {
        if let Poll::Ready(joined) = Pin::new(&mut task.0).poll(cx) {
            return Poll::Ready(Ok(joined));
        }
        cancel.poll_cancelled(cx).map(Err)
    })
    .await;
    let joined = match outcome {
        Ok(joined) => joined,
        Err(cancelled) => {
            task.0.abort();
            // A JoinHandle completes only after the task's future (and with
            // it every slice of the caller's buffers) has been dropped.
            let _ = (&mut task.0).await;
            return Err(Python::attach(|py| PyErr::from_value(cancelled.into_bound(py))));
        }
    };
    match joined {
        Ok(Ok(value)) => Ok(Ok(value)),
        Ok(Err(Failed::Call(e))) => Ok(Err(e)),
        Ok(Err(Failed::Connect(e))) => Err(kv_error(&e, format!("connect to {what}"), None, None)),
        Err(e) if e.is_panic() => Err(panicked(e.into_panic())),
        Err(e) => Err(raise("Internal", format!("the I/O runtime dropped a call: {e}"), None, None)),
    }
}

/// What a call with nothing to answer returns to Python: `None` (a `()`
/// would be an empty tuple).
const NONE: Option<()> = None;

/// Keys given to a coroutine, as bytes (checked as the sync client does).
fn keys_of(keys: &[Py<PyAny>]) -> PyResult<Vec<Bytes>> {
    Python::attach(|py| keys.iter().enumerate().map(|(i, k)| key_of(k.bind(py), i)).collect())
}

/// An asyncio client of one kvplane node, or of a whole cluster: the
/// operations of `kvplane.Client` as coroutines (see the module
/// documentation for connecting and cancellation).
#[pyclass(name = "Client", module = "kvplane.aio", frozen)]
pub(crate) struct AsyncClient {
    shared: RwLock<Option<Arc<Shared>>>,
    endpoints: Vec<String>,
    cluster: bool,
}

impl AsyncClient {
    fn shared(&self) -> PyResult<Arc<Shared>> {
        let shared = self.shared.read().unwrap_or_else(|p| p.into_inner()).clone();
        let shared = shared.ok_or_else(|| raise("Error", format!("the client of {} is closed", self.endpoints.join(", ")), None, None))?;
        if shared.pid != std::process::id() {
            return Err(raise(
                "Error",
                format!("this client was made in process {}, before a fork; make a new one in process {}", shared.pid, std::process::id()),
                None,
                None,
            ));
        }
        Ok(shared)
    }

    /// The target, for the attributes that need one (no I/O).
    fn target_now<T>(&self, what: &str, f: impl FnOnce(&Target) -> PyResult<T>) -> PyResult<T> {
        let shared = self.shared()?;
        match shared.target_now() {
            Some(TargetRef::Shared) => f(shared.target.get().expect("checked by target_now")),
            Some(TargetRef::Bound(binding)) => f(binding.target.get().expect("checked by target_now")),
            None => Err(raise(
                "Error",
                format!("{what}: the client of {} is not connected yet; await connect() first", self.endpoints.join(", ")),
                None,
                None,
            )),
        }
    }
}

/// `get` of several keys: their values as new `bytes`, None when absent.
async fn get_many(io: CallIo, keys: Vec<Bytes>) -> PyResult<Vec<Option<Py<PyBytes>>>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let request = keys.clone();
    let values = io
        .run(move |c| async move { c.target().get(request).await })
        .await?
        .map_err(|e| kv_error(&e, format!("get of {} keys", keys.len()), None, None))?;
    Python::attach(|py| {
        values
            .into_iter()
            .enumerate()
            .map(|(i, v)| match v {
                Ok(v) => Ok(Some(PyBytes::new(py, &v).unbind())),
                Err(KvError::NotFound) => Ok(None),
                Err(e) => Err(kv_error(&e, format!("get: key '{}' (keys[{i}])", show(&keys[i])), Some(&keys[i]), Some(i))),
            })
            .collect()
    })
}

#[pymethods]
impl AsyncClient {
    /// Checks the options and connects nothing yet (see `connect`).
    #[new]
    // One argument per keyword of the Python constructor.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (endpoints, *, cluster = false, connections = None, token = None, timeout = 30.0, write_quorum = None, shared_memory = true, tls_ca = None, tls_cert = None, tls_key = None, tls_server_name = None))]
    fn new(
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
    ) -> PyResult<AsyncClient> {
        let tls = crate::tls_of("aio.Client", tls_ca, tls_cert, tls_key, tls_server_name)?;
        let endpoints: Vec<String> =
            if let Ok(s) = endpoints.cast::<PyString>() { vec![s.to_str()?.to_owned()] } else { endpoints.extract()? };
        let parsed = endpoints
            .iter()
            .map(|e| e.parse::<Endpoint>().map_err(|err| kv_error(&err, "aio.Client".into(), None, None)))
            .collect::<PyResult<Vec<_>>>()?;
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(raise("Invalid", format!("aio.Client: timeout must be a positive number of seconds, not {timeout}"), None, None));
        }
        if connections == Some(0) {
            return Err(raise("Invalid", "aio.Client: connections must be at least 1".into(), None, None));
        }
        if parsed.is_empty() {
            return Err(raise("Invalid", "aio.Client: no endpoint given".into(), None, None));
        }
        if !cluster && parsed.len() != 1 {
            return Err(raise(
                "Invalid",
                format!("aio.Client: a node client takes one endpoint, not {}; pass cluster=True to route over several", parsed.len()),
                None,
                None,
            ));
        }
        if !cluster && write_quorum.is_some() {
            return Err(raise("Invalid", "aio.Client: write_quorum applies to a cluster client (cluster=True)".into(), None, None));
        }
        // 0 would acknowledge a PUT no owner stored; None is the cluster's own.
        if write_quorum == Some(0) {
            return Err(raise("Invalid", "aio.Client: write_quorum must be at least 1 (or None for the cluster's own)".into(), None, None));
        }
        let spec = Spec {
            endpoints: parsed,
            cluster,
            connections,
            token,
            tls,
            timeout: Duration::from_secs_f64(timeout),
            write_quorum,
            shared_memory,
        };
        let io = Io::of(&spec)?;
        let shared = Shared {
            rt: std::mem::ManuallyDrop::new(if cluster { runtime()? } else { crate::aio_node_runtime()? }),
            io,
            target: std::mem::ManuallyDrop::new(tokio::sync::OnceCell::new()),
            binding: std::mem::ManuallyDrop::new(Mutex::new(None)),
            spec,
            what: if cluster { format!("the cluster of {}", endpoints.join(", ")) } else { endpoints.join(", ") },
            pid: std::process::id(),
        };
        Ok(AsyncClient { shared: RwLock::new(Some(Arc::new(shared))), endpoints, cluster })
    }

    /// Connects now (once; later calls return at once), so that a wrong
    /// address or token fails here rather than at the first call.
    fn connect(&self) -> PyResult<LoopCall> {
        Ok(self.shared()?.start(|io| async move {
            io.run(|_| async { Ok(()) }).await?.map_err(|e| kv_error(&e, "connect".into(), None, None))?;
            Ok(NONE)
        }))
    }

    /// `put_from` of the sync client: `buffers[i]` stored under `keys[i]`,
    /// sent from the buffers' own memory, which stays exported until the
    /// call is done. Do not modify the buffers until the call returns.
    fn put_from(&self, py: Python<'_>, keys: Vec<Py<PyAny>>, buffers: Vec<Py<PyAny>>) -> PyResult<LoopCall> {
        let shared = self.shared()?;
        same_length("put_from", keys.len(), buffers.len())?;
        let keys = keys_of(&keys)?;
        let exports =
            keys.iter().zip(&buffers).enumerate().map(|(i, (k, b))| export(b.bind(py), i, k, false)).collect::<PyResult<Vec<_>>>()?;
        let exports = Arc::new(Exports(exports));
        Ok(shared.start(move |io| async move {
            if keys.is_empty() {
                return Ok(NONE);
            }
            let entries: Vec<(Bytes, Bytes)> = keys
                .iter()
                .enumerate()
                .map(|(index, k)| (k.clone(), Bytes::from_owner(Borrowed { exports: Arc::clone(&exports), index })))
                .collect();
            let n = entries.len();
            let results = io.run(move |c| async move { c.target().put(entries).await }).await;
            // Released here, attached, unless a task still holds a slice.
            Python::attach(|_| drop(exports));
            let results = results?.map_err(|e| kv_error(&e, format!("put_from of {n} keys"), None, None))?;
            put_failure("put_from", &keys, &results).map(|()| NONE)
        }))
    }

    /// `get_into` of the sync client: the value of `keys[i]` read into
    /// `buffers[i]` (a buffer, or a list of buffers filled in order); per
    /// key the bytes written, or None when absent. The buffers stay
    /// exported until the call is gone; after a cancelled call raised,
    /// none is written any more.
    #[allow(unsafe_code)]
    fn get_into(&self, py: Python<'_>, keys: Vec<Py<PyAny>>, buffers: Vec<Py<PyAny>>) -> PyResult<LoopCall> {
        let shared = self.shared()?;
        same_length("get_into", keys.len(), buffers.len())?;
        let keys = keys_of(&keys)?;
        let buffers: Vec<Bound<'_, PyAny>> = buffers.iter().map(|b| b.bind(py).clone()).collect();
        let (exports, dests) = Destinations::export(&keys, &buffers)?;
        Ok(shared.start(move |io| async move {
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            let request = keys.clone();
            let (exports, values) = io
                .run(move |c| async move {
                    // SAFETY: this future owns the exports and drops them
                    // only after the read is done (or dropped with it).
                    let values = unsafe { dests.read(c.target(), request).await };
                    Ok((exports, values))
                })
                .await?
                .expect("the call answers its outcome as its value");
            // Released here, attached, rather than on an I/O thread.
            Python::attach(|_| drop(exports));
            values.map_err(GetFailure::Call).and_then(lengths).map_err(|f| f.raise(&keys))
        }))
    }

    /// The value of `key` as new `bytes` (None when absent), or of a list
    /// of keys, in order: a copying convenience; engines use `get_into`.
    fn get(&self, key: &Bound<'_, PyAny>) -> PyResult<LoopCall> {
        let shared = self.shared()?;
        if key.is_instance_of::<PyString>() || key.is_instance_of::<PyBytes>() {
            let keys = keys_of(&[key.clone().unbind()])?;
            return Ok(shared.start(move |io| async move {
                let value = get_many(io, keys).await?.pop().flatten();
                Ok(Python::attach(|py| value.map_or_else(|| py.None(), Py::into_any)))
            }));
        }
        let keys: Vec<Py<PyAny>> = key.extract().map_err(|_| {
            raise("Invalid", format!("get: expected a key (str or bytes) or a list of keys, not {}", key.get_type()), None, None)
        })?;
        let keys = keys_of(&keys)?;
        Ok(shared.start(move |io| async move {
            let values = get_many(io, keys).await?;
            Python::attach(|py| Ok(PyList::new(py, values)?.into_any().unbind()))
        }))
    }

    /// Stores `value` under `key`: `put_from` of one key.
    fn put(&self, py: Python<'_>, key: Py<PyAny>, value: Py<PyAny>) -> PyResult<LoopCall> {
        self.put_from(py, vec![key], vec![value])
    }

    /// Which of `keys` are stored, in order.
    fn exists(&self, keys: Vec<Py<PyAny>>) -> PyResult<LoopCall> {
        let shared = self.shared()?;
        let keys = keys_of(&keys)?;
        Ok(shared.start(move |io| async move {
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            let n = keys.len();
            io.run(move |c| async move { c.target().exists(keys).await })
                .await?
                .map_err(|e| kv_error(&e, format!("exists of {n} keys"), None, None))
        }))
    }

    /// Removes `keys`; per key, whether it was stored.
    fn delete(&self, keys: Vec<Py<PyAny>>) -> PyResult<LoopCall> {
        let shared = self.shared()?;
        let keys = keys_of(&keys)?;
        Ok(shared.start(move |io| async move {
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            let n = keys.len();
            io.run(move |c| async move { c.target().delete(keys).await })
                .await?
                .map_err(|e| kv_error(&e, format!("delete of {n} keys"), None, None))
        }))
    }

    /// How many leading keys of a chain are stored, and the pin lease
    /// granted on them (`lease_ms > 0`, capped by the node): `(matched,
    /// granted_lease_ms)`.
    #[pyo3(signature = (keys, lease_ms = 0))]
    fn match_prefix(&self, keys: Vec<Py<PyAny>>, lease_ms: u64) -> PyResult<LoopCall> {
        let shared = self.shared()?;
        let keys = keys_of(&keys)?;
        Ok(shared.start(move |io| async move {
            if keys.is_empty() {
                return Ok((0, 0));
            }
            let n = keys.len();
            let m = io
                .run(move |c| async move { c.target().match_prefix(keys, Duration::from_millis(lease_ms)).await })
                .await?
                .map_err(|e| kv_error(&e, format!("match_prefix of {n} keys"), None, None))?;
            Ok((m.matched, u64::try_from(m.lease.as_millis()).unwrap_or(u64::MAX)))
        }))
    }

    /// The node's counters, by name. `Unsupported` on a cluster client.
    fn stats(&self) -> PyResult<LoopCall> {
        Ok(self.shared()?.start(|io| async move {
            io.run(|c| async move { c.target().stats().await })
                .await?
                .map(|entries| entries.into_iter().collect::<std::collections::HashMap<String, u64>>())
                .map_err(|e| kv_error(&e, "stats".into(), None, None))
        }))
    }

    /// The slot table of a connected cluster client: `(version, members)`.
    /// `Invalid` on a node client.
    fn cluster_table(&self) -> PyResult<(u64, Vec<MemberRow>)> {
        if !self.cluster {
            return Err(raise(
                "Invalid",
                format!("cluster_table: {} is a node client, not a cluster client", self.endpoints.join(", ")),
                None,
                None,
            ));
        }
        self.target_now("cluster_table", |target| {
            let Target::Cluster(c) = target else { unreachable!("a cluster client connects to a cluster") };
            let table = c.table();
            let members = table.members().iter().map(|m| (m.id.clone(), m.endpoint.clone(), m.state.name().to_owned())).collect();
            Ok((table.version, members))
        })
    }

    /// Closes the connections; later calls raise `kvplane.Error`. Calls in
    /// flight finish first. Loop I/O: the connections' readers end at the
    /// loop's next turn, so a loop that is not running closes their sockets
    /// when it next runs, or when it is closed (`TaskRunner`'s drop).
    fn close(&self, py: Python<'_>) {
        let shared = self.shared.write().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(move || drop(shared));
    }

    /// True once `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.shared.read().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// Whether a connection was made (by `connect` or a call).
    #[getter]
    fn connected(&self) -> bool {
        self.shared.read().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|s| s.target_now().is_some())
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

    /// The largest value the node stores, or None from a node that does not
    /// say. Needs a connection (`Error` before one is made).
    #[getter]
    fn max_block_bytes(&self) -> PyResult<Option<usize>> {
        self.target_now("max_block_bytes", |t| Ok(t.max_block_bytes()))
    }

    /// The longest pin lease the node grants. Needs a connection.
    #[getter]
    fn max_lease_ms(&self) -> PyResult<u32> {
        self.target_now("max_lease_ms", |t| Ok(t.max_lease_ms()))
    }

    fn __aenter__(slf: Py<Self>) -> PyResult<LoopCall> {
        let shared = slf.get().shared()?;
        Ok(shared.start(move |io| async move {
            io.run(|_| async { Ok(()) }).await?.map_err(|e| kv_error(&e, "connect".into(), None, None))?;
            Ok(slf)
        }))
    }

    /// Closes the client (at once: nothing is left to wait for).
    #[pyo3(signature = (*_args))]
    fn __aexit__(&self, py: Python<'_>, _args: Py<pyo3::types::PyTuple>) -> PyResult<LoopCall> {
        self.close(py);
        Ok(LoopCall::new(
            Box::pin(async { Python::attach(|py| false.into_py_any(py)) }),
            Cancellation::Drop,
            crate::aio_node_runtime()?.handle().clone(),
        ))
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { ", closed" } else { "" };
        format!("kvplane.aio.Client({:?}, cluster={}{state})", self.endpoints, if self.cluster { "True" } else { "False" })
    }
}
