//! `kvplane.aio.Client`: the client's calls as asyncio coroutines, on the
//! same native core as `kvplane.Client`.
//!
//! Each call is a pyo3 coroutine (`experimental-async`): awaiting it checks
//! the keys and exports the buffers (on the event loop's thread, attached
//! to the interpreter), spawns the call as one task on an I/O runtime and
//! awaits that task's `JoinHandle`. A node client's runtime is a
//! current-thread one that a thread of its own drives
//! ([`crate::aio_node_runtime`]), one per process: the call's task, its
//! connection's reader and the I/O driver all run there, as they all run
//! on the calling thread of a sync node client. On the process's
//! multi-thread runtime ([`crate::runtime`], which cluster clients keep:
//! their slot-table follower runs between calls) a node client's batched
//! GET cost 0.67-0.74 of the sync client's at 16 x 64 KiB: with one
//! connection, 2-3x the CPU time per call and 7 context switches against 2
//! (perf: the worker threads parked and woke in `epoll_wait` and on their
//! condition variable around every read, and each wake-up of the loop
//! created and destroyed a Python thread state). The price: the asyncio
//! node clients of a process share one I/O thread. The loop's thread never
//! waits for the network and no Python thread is used:
//! when the task finishes, its waker (pyo3's) hands the event loop the
//! result through `loop.call_soon_threadsafe`, one wake-up per call however
//! many frames the call exchanged. The task is spawned rather than polled
//! on the loop's thread because the client's futures belong to the I/O
//! runtime (its timers and sockets), and because a call polled there would
//! wake the loop once per answer.
//!
//! Connecting is lazy: `Client(...)` checks its options and does no I/O;
//! the first call (or `await connect()`, or `async with`) connects, once,
//! however many calls are waiting for it; a failed connection is tried
//! again by the next call.
//!
//! Cancellation (`task.cancel()`, `asyncio.timeout`, `wait_for`): the
//! coroutine is told through pyo3's `CancelHandle`, aborts its task and
//! waits until the task's future is dropped before it raises
//! `CancelledError`. A `get_into` writes its buffers only from that future
//! (the client guarantees no write after it is dropped), so once the
//! cancelled coroutine has raised, no buffer of its call is written any
//! more; which of them were written before is not known (treat them as
//! unwritten). A cancelled `put_from` may have stored some keys, or all.
//! A coroutine closed without being cancelled (garbage-collected while
//! pending) aborts its task too, without waiting: the buffers stay exported
//! (the memory alive) until the task is gone.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client as NodeClient, ClientConfig, ClusterClient, ClusterClientConfig, Endpoint, KvError};
use pyo3::coroutine::CancelHandle;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::{
    export, key_of, kv_error, lengths, put_failure, raise, runtime, same_length, show, Borrowed, Destinations, Exports, GetFailure,
    MemberRow, Target,
};

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
    async fn connect(&self) -> Result<Target, KvError> {
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
        if let Some(n) = self.connections {
            config.connections = n;
        }
        NodeClient::connect(config).await.map(Target::Node)
    }
}

/// One client's connections (once made) and the runtime they live on.
struct Shared {
    rt: std::mem::ManuallyDrop<Arc<Runtime>>,
    target: std::mem::ManuallyDrop<tokio::sync::OnceCell<Target>>,
    spec: Spec,
    /// The endpoints, for messages.
    what: String,
    pid: u32,
}

impl Shared {
    /// The connected target: connects first when no call has yet.
    async fn connected(&self) -> Result<&Target, KvError> {
        self.target.get_or_try_init(|| self.spec.connect()).await
    }

    /// The target of a task that [`run`] started (it connected first).
    fn target(&self) -> &Target {
        self.target.get().expect("run connects before it calls")
    }
}

impl Drop for Shared {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child: the connections' tasks live on the parent's
            // runtime, whose threads are not here. Leak both.
            return;
        }
        {
            let _context = self.rt.enter();
            // SAFETY: dropped once, here, and never used again.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.target) };
        }
        // SAFETY: as above; the target that used it is gone. The runtime
        // itself lives on (the process's static holds it).
        unsafe { std::mem::ManuallyDrop::drop(&mut self.rt) };
    }
}

/// Why a task of [`run`] did not produce its value.
enum Failed {
    Connect(KvError),
    Call(KvError),
}

/// Wake-ups of event loops running on I/O threads now (see [`LoopWaker`]).
static WAKING: AtomicUsize = AtomicUsize::new(0);
/// The longest the atexit hook waits for wake-ups in progress (each takes
/// microseconds once it has the GIL, which the hook releases to let it).
const EXIT_WAIT_LIMIT: Duration = Duration::from_secs(2);

/// pyo3's waker of a call's coroutine, as the call's task sees it.
///
/// Waking pyo3's waker calls `loop.call_soon_threadsafe` from the I/O
/// thread the task finished on, and that call releases the GIL while it
/// writes to the loop's self-pipe. The loop's thread can take the GIL
/// then, finish the call (its result is already there), return from
/// `asyncio.run` and start finalizing the interpreter; the I/O thread,
/// taking the GIL back, is then ended by Python (`PyThread_exit_thread`)
/// in the middle of Rust frames, and the process aborts ("Fatal Python
/// error: Aborted" at the exit of scripts/bench-python's asyncio client,
/// 3 runs in 10). So each wake-up is counted while it runs, and an atexit
/// hook, which Python runs before it finalizes, waits (GIL released) until
/// none is running. The wake-up that resumed a program's last call is
/// counted before that call could return, so the hook waits for it. Later
/// wake-ups are not refused: an atexit handler that runs after this one
/// may still await kvplane.aio calls, and must not hang.
struct LoopWaker(Waker);

impl Wake for LoopWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        WAKING.fetch_add(1, Ordering::SeqCst);
        self.0.wake_by_ref();
        WAKING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Registers the hook that [`LoopWaker`] needs with `atexit` (once, at the
/// module's import). It is a closure, not a function of the module, so the
/// module's names (and its stubs) stay as they are.
pub(crate) fn register_exit_hook(py: Python<'_>) -> PyResult<()> {
    let hook = pyo3::types::PyCFunction::new_closure(py, Some(c"_kvplane_aio_exit"), None, |args, _kwargs| {
        args.py().detach(|| {
            let start = Instant::now();
            while WAKING.load(Ordering::SeqCst) > 0 && start.elapsed() < EXIT_WAIT_LIMIT {
                std::thread::sleep(Duration::from_micros(100));
            }
        });
        let left = WAKING.load(Ordering::SeqCst);
        if left > 0 {
            eprintln!("kvplane.aio: {left} event-loop wake-up(s) still running at exit after {EXIT_WAIT_LIMIT:?}");
        }
    })?;
    py.import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

/// Aborts the task when the coroutine's future is dropped without having
/// waited for it (a coroutine closed while pending).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs `call` as a task on the I/O runtime, connecting first, and awaits
/// it; a cancellation of the coroutine aborts the task and returns (the
/// `CancelledError` it was thrown) only once the task's future is dropped.
/// Connection failures are raised here; the call's own error is the
/// caller's to put in context.
async fn run<T, F>(
    shared: Arc<Shared>,
    mut cancel: CancelHandle,
    call: impl FnOnce(Arc<Shared>) -> F + Send + 'static,
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
        call(shared).await.map_err(Failed::Call)
    }));
    // The task wakes the loop through a LoopWaker (made once per waker
    // pyo3 hands this future); a cancellation comes on the loop's thread.
    let mut guarded: Option<(Waker, Waker)> = None;
    let outcome = poll_fn(|cx| {
        let waker = match &guarded {
            Some((inner, outer)) if inner.will_wake(cx.waker()) => outer.clone(),
            _ => {
                let outer = Waker::from(Arc::new(LoopWaker(cx.waker().clone())));
                guarded = Some((cx.waker().clone(), outer.clone()));
                outer
            }
        };
        if let Poll::Ready(joined) = Pin::new(&mut task.0).poll(&mut Context::from_waker(&waker)) {
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
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(raise("Internal", format!("the I/O runtime dropped a call: {e}"), None, None)),
    }
}

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
        match shared.target.get() {
            Some(target) => f(target),
            None => Err(raise(
                "Error",
                format!("{what}: the client of {} is not connected yet; await connect() first", self.endpoints.join(", ")),
                None,
                None,
            )),
        }
    }

    async fn get_many(&self, keys: Vec<Bytes>, cancel: CancelHandle) -> PyResult<Vec<Option<Py<PyBytes>>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let request = keys.clone();
        let values = run(self.shared()?, cancel, move |s| async move { s.target().get(request).await })
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
        let shared = Shared {
            rt: std::mem::ManuallyDrop::new(if cluster { runtime()? } else { crate::aio_node_runtime()? }),
            target: std::mem::ManuallyDrop::new(tokio::sync::OnceCell::new()),
            spec,
            what: if cluster { format!("the cluster of {}", endpoints.join(", ")) } else { endpoints.join(", ") },
            pid: std::process::id(),
        };
        Ok(AsyncClient { shared: RwLock::new(Some(Arc::new(shared))), endpoints, cluster })
    }

    /// Connects now (once; later calls return at once), so that a wrong
    /// address or token fails here rather than at the first call.
    async fn connect(&self, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<()> {
        run(self.shared()?, cancel, |_| async { Ok(()) }).await?.map_err(|e| kv_error(&e, "connect".into(), None, None))
    }

    /// `put_from` of the sync client: `buffers[i]` stored under `keys[i]`,
    /// sent from the buffers' own memory, which stays exported until the
    /// call is done. Do not modify the buffers until the coroutine returns.
    async fn put_from(&self, keys: Vec<Py<PyAny>>, buffers: Vec<Py<PyAny>>, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<()> {
        let shared = self.shared()?;
        let (keys, exports) = Python::attach(|py| -> PyResult<_> {
            same_length("put_from", keys.len(), buffers.len())?;
            let keys = keys_of(&keys)?;
            let exports =
                keys.iter().zip(&buffers).enumerate().map(|(i, (k, b))| export(b.bind(py), i, k, false)).collect::<PyResult<Vec<_>>>()?;
            Ok((keys, Arc::new(Exports(exports))))
        })?;
        if keys.is_empty() {
            return Ok(());
        }
        let entries: Vec<(Bytes, Bytes)> = keys
            .iter()
            .enumerate()
            .map(|(index, k)| (k.clone(), Bytes::from_owner(Borrowed { exports: Arc::clone(&exports), index })))
            .collect();
        let n = entries.len();
        let results = run(shared, cancel, move |s| async move { s.target().put(entries).await }).await;
        // Released here, attached, unless a task still holds a slice.
        drop(exports);
        let results = results?.map_err(|e| kv_error(&e, format!("put_from of {n} keys"), None, None))?;
        put_failure("put_from", &keys, &results)
    }

    /// `get_into` of the sync client: the value of `keys[i]` read into
    /// `buffers[i]` (a buffer, or a list of buffers filled in order); per
    /// key the bytes written, or None when absent. The buffers stay
    /// exported until the call's task is gone; after a cancelled call
    /// raised, none is written any more.
    #[allow(unsafe_code)]
    async fn get_into(
        &self,
        keys: Vec<Py<PyAny>>,
        buffers: Vec<Py<PyAny>>,
        #[pyo3(cancel_handle)] cancel: CancelHandle,
    ) -> PyResult<Vec<Option<usize>>> {
        let shared = self.shared()?;
        let (keys, exports, dests) = Python::attach(|py| -> PyResult<_> {
            same_length("get_into", keys.len(), buffers.len())?;
            let keys = keys_of(&keys)?;
            let buffers: Vec<Bound<'_, PyAny>> = buffers.iter().map(|b| b.bind(py).clone()).collect();
            let (exports, dests) = Destinations::export(&keys, &buffers)?;
            Ok((keys, exports, dests))
        })?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let request = keys.clone();
        let (exports, values) = run(shared, cancel, move |s| async move {
            // SAFETY: this task's future owns the exports and drops them
            // only after the read is done (or dropped with it).
            let values = unsafe { dests.read(s.target(), request).await };
            Ok((exports, values))
        })
        .await?
        .expect("the task answers its outcome as its value");
        // Released here, attached, rather than on an I/O thread.
        drop(exports);
        values.map_err(GetFailure::Call).and_then(lengths).map_err(|f| f.raise(&keys))
    }

    /// The value of `key` as new `bytes` (None when absent), or of a list
    /// of keys, in order: a copying convenience; engines use `get_into`.
    async fn get(&self, key: Py<PyAny>, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<Py<PyAny>> {
        let one = Python::attach(|py| {
            let k = key.bind(py);
            k.is_instance_of::<PyString>() || k.is_instance_of::<PyBytes>()
        });
        if one {
            let keys = keys_of(std::slice::from_ref(&key))?;
            let value = self.get_many(keys, cancel).await?.pop().flatten();
            return Ok(Python::attach(|py| value.map_or_else(|| py.None(), Py::into_any)));
        }
        let keys: Vec<Py<PyAny>> = Python::attach(|py| {
            let k = key.bind(py);
            k.extract().map_err(|_| {
                raise("Invalid", format!("get: expected a key (str or bytes) or a list of keys, not {}", k.get_type()), None, None)
            })
        })?;
        let values = self.get_many(keys_of(&keys)?, cancel).await?;
        Python::attach(|py| Ok(PyList::new(py, values)?.into_any().unbind()))
    }

    /// Stores `value` under `key`: `put_from` of one key.
    async fn put(&self, key: Py<PyAny>, value: Py<PyAny>, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<()> {
        self.put_from(vec![key], vec![value], cancel).await
    }

    /// Which of `keys` are stored, in order.
    async fn exists(&self, keys: Vec<Py<PyAny>>, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<Vec<bool>> {
        let shared = self.shared()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let n = keys.len();
        run(shared, cancel, move |s| async move { s.target().exists(keys).await })
            .await?
            .map_err(|e| kv_error(&e, format!("exists of {n} keys"), None, None))
    }

    /// Removes `keys`; per key, whether it was stored.
    async fn delete(&self, keys: Vec<Py<PyAny>>, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<Vec<bool>> {
        let shared = self.shared()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let n = keys.len();
        run(shared, cancel, move |s| async move { s.target().delete(keys).await })
            .await?
            .map_err(|e| kv_error(&e, format!("delete of {n} keys"), None, None))
    }

    /// How many leading keys of a chain are stored, and the pin lease
    /// granted on them (`lease_ms > 0`, capped by the node): `(matched,
    /// granted_lease_ms)`.
    #[pyo3(signature = (keys, lease_ms = 0))]
    async fn match_prefix(
        &self,
        keys: Vec<Py<PyAny>>,
        lease_ms: u64,
        #[pyo3(cancel_handle)] cancel: CancelHandle,
    ) -> PyResult<(usize, u64)> {
        let shared = self.shared()?;
        let keys = keys_of(&keys)?;
        if keys.is_empty() {
            return Ok((0, 0));
        }
        let n = keys.len();
        let m = run(shared, cancel, move |s| async move { s.target().match_prefix(keys, Duration::from_millis(lease_ms)).await })
            .await?
            .map_err(|e| kv_error(&e, format!("match_prefix of {n} keys"), None, None))?;
        Ok((m.matched, u64::try_from(m.lease.as_millis()).unwrap_or(u64::MAX)))
    }

    /// The node's counters, by name. `Unsupported` on a cluster client.
    async fn stats(&self, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<std::collections::HashMap<String, u64>> {
        run(self.shared()?, cancel, |s| async move { s.target().stats().await })
            .await?
            .map(|entries| entries.into_iter().collect())
            .map_err(|e| kv_error(&e, "stats".into(), None, None))
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
    /// flight finish first.
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
        self.shared.read().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|s| s.target.initialized())
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

    async fn __aenter__(slf: Py<Self>, #[pyo3(cancel_handle)] cancel: CancelHandle) -> PyResult<Py<Self>> {
        slf.get().connect(cancel).await?;
        Ok(slf)
    }

    #[pyo3(signature = (*_args))]
    async fn __aexit__(&self, _args: Py<pyo3::types::PyTuple>) -> bool {
        Python::attach(|py| self.close(py));
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { ", closed" } else { "" };
        format!("kvplane.aio.Client({:?}, cluster={}{state})", self.endpoints, if self.cluster { "True" } else { "False" })
    }
}
