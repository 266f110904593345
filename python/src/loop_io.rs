//! The asyncio client's calls, driven on the event loop's own thread.
//!
//! Every call of `kvplane.aio.Client` is a [`LoopCall`]: an object with the
//! coroutine protocol (`send`, `throw`, `close`, `__await__`), so that
//! `await`, `asyncio.create_task` and `asyncio.gather` take it as they take
//! a coroutine. Its first `send` (the first step of the task awaiting it)
//! starts the call's Rust future as a [`LoopTask`] of the loop's
//! [`LoopExecutor`] and polls it at once; the call's asyncio future then
//! completes from whichever poll finishes it.
//!
//! A loop task is polled only on the loop's thread: from that first step,
//! from the loop's readiness callbacks and from `call_soon` callbacks. A
//! waker woken on the loop's thread while tasks are being polled queues its
//! task on a thread-local list that the poll drains before it returns
//! (no trip through the loop); woken elsewhere (a tokio timer, an I/O
//! thread), it schedules the task with `loop.call_soon_threadsafe`.
//!
//! Where the call's I/O happens is the client's choice (`aio.rs`):
//! - on the loop itself ([`LoopTransport`]): the connection's socket is a
//!   non-blocking socket of this module's ([`LoopSocket`]), watched by the
//!   loop's selector (`add_reader` / `add_writer`), and its background
//!   reader is a loop task too. The node's answer wakes the loop's
//!   selector, whose callback reads the answer straight into the caller's
//!   buffers and completes the call's future: the same system calls as the
//!   sync client, no thread hand-off. What asyncio adds is its own work per
//!   readiness event.
//! - on the I/O runtime's thread (a cluster client, TLS, a Unix socket):
//!   the call's future spawns the call there and waits for it; the I/O
//!   thread's wake-up comes back through `call_soon_threadsafe`.
//!
//! Timeouts stay tokio's: every poll runs inside the I/O runtime's context,
//! whose thread fires the timers (and, for a timer, wakes the loop).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;
use futures::FutureExt;
use kvplane_client::{BoxedFuture, Halves, Transport};
use pyo3::exceptions::{PyBaseException, PyStopIteration};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyCFunction;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A call's Rust future: its outcome is the value its awaiter gets.
pub(crate) type CallFuture = Pin<Box<dyn Future<Output = PyResult<Py<PyAny>>> + Send + 'static>>;

/// One event loop, as its tasks and sockets reach it.
pub(crate) struct LoopExecutor {
    event_loop: Py<PyAny>,
    thread: ThreadId,
    call_soon: Py<PyAny>,
    call_soon_threadsafe: Py<PyAny>,
    add_reader: Py<PyAny>,
    remove_reader: Py<PyAny>,
    add_writer: Py<PyAny>,
    remove_writer: Py<PyAny>,
}

impl LoopExecutor {
    /// The running loop's executor (made once per loop and thread, kept
    /// until another loop runs there). Called on the loop's thread.
    fn of_running_loop(py: Python<'_>) -> PyResult<Arc<LoopExecutor>> {
        static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let running = GET_RUNNING_LOOP.import(py, "asyncio", "get_running_loop")?.call0()?;
        LAST.with(|last| {
            let mut last = last.borrow_mut();
            if let Some(exec) = last.as_ref().filter(|e| e.event_loop.is(&running)) {
                return Ok(Arc::clone(exec));
            }
            let method = |name: &str| running.getattr(name).map(Bound::unbind);
            let exec = Arc::new(LoopExecutor {
                thread: std::thread::current().id(),
                call_soon: method("call_soon")?,
                call_soon_threadsafe: method("call_soon_threadsafe")?,
                add_reader: method("add_reader")?,
                remove_reader: method("remove_reader")?,
                add_writer: method("add_writer")?,
                remove_writer: method("remove_writer")?,
                event_loop: running.unbind(),
            });
            *last = Some(Arc::clone(&exec));
            Ok(exec)
        })
    }

    fn on_loop_thread(&self) -> bool {
        std::thread::current().id() == self.thread
    }

    /// `loop.add_reader` or `loop.add_writer`.
    fn add_for(&self, side: Side) -> &Py<PyAny> {
        match side {
            Side::Read => &self.add_reader,
            Side::Write => &self.add_writer,
        }
    }

    /// `loop.remove_reader` or `loop.remove_writer`.
    fn remove_for(&self, side: Side) -> &Py<PyAny> {
        match side {
            Side::Read => &self.remove_reader,
            Side::Write => &self.remove_writer,
        }
    }

    /// Whether `other` is this loop.
    pub(crate) fn is(&self, other: &LoopExecutor) -> bool {
        self.event_loop.is(&other.event_loop)
    }

    /// Whether the loop was closed (its sockets and tasks can never run).
    fn closed(&self, py: Python<'_>) -> bool {
        self.event_loop.bind(py).call_method0("is_closed").and_then(|c| c.is_truthy()).unwrap_or(true)
    }

    /// Whether the loop is running now (on whichever thread).
    pub(crate) fn running(&self, py: Python<'_>) -> bool {
        self.event_loop.bind(py).call_method0("is_running").and_then(|c| c.is_truthy()).unwrap_or(false)
    }

    /// `loop.call_soon(callback, *args)` on the loop's thread, else
    /// `loop.call_soon_threadsafe`. Off the loop's thread the call is
    /// counted in [`WAKING`] while it runs.
    fn soon<'py>(&self, py: Python<'py>, args: impl pyo3::call::PyCallArgs<'py>) -> PyResult<()> {
        if self.on_loop_thread() {
            self.call_soon.call1(py, args).map(drop)
        } else {
            self.call_soon_threadsafe.call1(py, args).map(drop)
        }
    }
}

thread_local! {
    /// The executor of the loop this thread ran last.
    static LAST: RefCell<Option<Arc<LoopExecutor>>> = const { RefCell::new(None) };
    /// Set while this thread polls loop tasks: a task woken meanwhile is
    /// queued on [`READY`] rather than scheduled through its loop.
    static DRAINING: Cell<bool> = const { Cell::new(false) };
    static READY: RefCell<VecDeque<Arc<LoopTask>>> = const { RefCell::new(VecDeque::new()) };
    /// Socket bytes this turn of the loop may still move (see
    /// [`TURN_BUDGET_BYTES`]).
    static BUDGET: Cell<usize> = const { Cell::new(TURN_BUDGET_BYTES) };
}

/// The most socket bytes one callback of the loop reads and writes before
/// it hands the loop back: a 24 MiB answer arriving as fast as it is read
/// would otherwise hold the loop for its whole transfer (about 10 ms), and
/// every other coroutine with it. 4 MiB is a millisecond or two of copying,
/// and costs a batch of 1 MiB or less nothing (an extra turn of the loop,
/// some microseconds, per 4 MiB beyond).
pub(crate) const TURN_BUDGET_BYTES: usize = 4 << 20;

/// Runs `first` (a poll or a wake-up) and then every task it woke, as one
/// turn of this module's work on the loop's thread. Nested calls (a poll
/// inside a poll) leave the draining to the outermost.
fn turn(first: impl FnOnce()) {
    let outer = DRAINING.replace(true);
    if outer {
        first();
        return;
    }
    BUDGET.set(TURN_BUDGET_BYTES);
    let _drained = Drained;
    first();
    while let Some(task) = READY.with(|ready| ready.borrow_mut().pop_front()) {
        task.poll_once();
    }
}

/// Ends the outermost [`turn`], also when it unwinds (a panic outside any
/// poll: polls catch their own): without it, `DRAINING` would stay set and
/// every later wake-up on this thread would be queued where no turn drains
/// it. Tasks still queued then are scheduled through their loops.
struct Drained;

impl Drop for Drained {
    fn drop(&mut self) {
        DRAINING.set(false);
        let left: Vec<Arc<LoopTask>> = READY.with(|ready| ready.borrow_mut().drain(..).collect());
        for task in left {
            task.scheduled.store(false, Ordering::Release);
            task.wake_by_ref();
        }
    }
}

/// Takes `n` bytes from this turn's budget.
fn spend(n: usize) {
    BUDGET.set(BUDGET.get().saturating_sub(n));
}

/// Wake-ups of event loops from other threads in progress (see
/// [`register_exit_hook`]).
static WAKING: AtomicUsize = AtomicUsize::new(0);
/// The longest the atexit hook waits for wake-ups in progress (each takes
/// microseconds once it has the GIL, which the hook releases to let it).
const EXIT_WAIT_LIMIT: Duration = Duration::from_secs(2);

/// Registers, with `atexit` (once, at the module's import), a hook that
/// waits until no other thread is in the middle of waking an event loop.
///
/// `loop.call_soon_threadsafe` releases the GIL while it writes to the
/// loop's self-pipe. The loop's thread can take the GIL then, finish the
/// call (its result is already there), return from `asyncio.run` and start
/// finalizing the interpreter; the waking thread, taking the GIL back, is
/// then ended by Python (`PyThread_exit_thread`) in the middle of Rust
/// frames, and the process aborts ("Fatal Python error: Aborted" at the exit
/// of a benchmark's asyncio client, 3 runs in 10). So each such wake-up is
/// counted while it runs, and the hook, which Python runs before it
/// finalizes, waits (GIL released) until none is running. Later wake-ups
/// are not refused: an atexit handler that runs after this one may still
/// await kvplane.aio calls, and must not hang. It is a closure, not a
/// function of the module, so the module's names (and its stubs) stay as
/// they are.
pub(crate) fn register_exit_hook(py: Python<'_>) -> PyResult<()> {
    let hook = PyCFunction::new_closure(py, Some(c"_kvplane_aio_exit"), None, |args, _kwargs| {
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

/// A future that its loop polls (see the module documentation).
pub(crate) struct LoopTask {
    future: Mutex<Option<BoxedFuture<()>>>,
    /// Set from a wake-up until the poll it asked for starts.
    scheduled: AtomicBool,
    /// Set by [`LoopTask::cancel`]: the future is dropped at the next
    /// chance, never polled again.
    cancelled: AtomicBool,
    exec: Arc<LoopExecutor>,
    /// Whose context every poll runs in (the timers of the client's
    /// timeouts): the client's own, so a loop first used by another client
    /// (or inherited by a forked child) never lends its runtime.
    runtime: tokio::runtime::Handle,
}

impl LoopTask {
    fn new(exec: Arc<LoopExecutor>, runtime: tokio::runtime::Handle, future: BoxedFuture<()>) -> Arc<LoopTask> {
        Arc::new(LoopTask {
            future: Mutex::new(Some(future)),
            scheduled: AtomicBool::new(false),
            cancelled: AtomicBool::new(false),
            exec,
            runtime,
        })
    }

    /// Polls the task now (on its loop's thread, attached), then every task
    /// woken meanwhile.
    fn run(self: &Arc<Self>) {
        turn(|| self.poll_once());
    }

    fn poll_once(self: &Arc<Self>) {
        self.scheduled.store(false, Ordering::Release);
        let Ok(mut slot) = self.future.try_lock() else {
            // Polled from inside its own poll (a finalizer run by the
            // garbage collector starting a nested turn): polled again once
            // the poll in progress returned, by the outermost turn.
            self.scheduled.store(true, Ordering::Release);
            READY.with(|ready| ready.borrow_mut().push_back(Arc::clone(self)));
            return;
        };
        if self.cancelled.load(Ordering::Acquire) {
            slot.take();
            return;
        }
        let Some(future) = slot.as_mut() else { return };
        let _context = self.runtime.enter();
        let waker = Waker::from(Arc::clone(self));
        // A panic stays inside the poll (a call's future turns its own into
        // the call's error, see `LoopCall::step`): unwinding into the loop
        // would end the loop, and the future's lock would stay poisoned.
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(&mut Context::from_waker(&waker))));
        match polled {
            Ok(Poll::Ready(())) => {
                slot.take();
            }
            Ok(Poll::Pending) if self.cancelled.load(Ordering::Acquire) => {
                slot.take();
            }
            Ok(Poll::Pending) => {}
            Err(panic) => {
                eprintln!("kvplane.aio: a background task panicked ({}); it is dropped", panic_message(&*panic));
                slot.take();
            }
        }
    }

    /// Drops the future (now, unless it is being polled: then as soon as
    /// that poll returns). No poll of it starts afterwards.
    fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        if let Ok(mut slot) = self.future.try_lock() {
            slot.take();
        }
    }

    /// Whether the future has finished (or was dropped).
    fn finished(&self) -> bool {
        self.future.try_lock().map(|slot| slot.is_none()).unwrap_or(false)
    }
}

impl Wake for LoopTask {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        if DRAINING.get() && self.exec.on_loop_thread() {
            READY.with(|ready| ready.borrow_mut().push_back(Arc::clone(self)));
            return;
        }
        let off_thread = !self.exec.on_loop_thread();
        if off_thread {
            WAKING.fetch_add(1, Ordering::SeqCst);
        }
        let scheduled = Python::try_attach(|py| {
            let schedule = || -> PyResult<()> {
                let runner = Py::new(py, TaskRunner { task: Arc::clone(self), ran: AtomicBool::new(false) })?;
                self.exec.soon(py, (runner.clone_ref(py),)).inspect_err(|_| {
                    // Not queued (or queued by a call that raised after):
                    // its drop must not cancel the task; what happens to
                    // the task is decided below.
                    runner.get().ran.store(true, Ordering::Release);
                })
            };
            // `call_soon` is Python: a signal's exception (a second Ctrl-C)
            // can be raised inside it. The interrupt is raised again at the
            // interpreter's next check, and the task scheduled once more.
            schedule().or_else(|e| {
                if self.exec.closed(py) {
                    return Err(e);
                }
                let again = schedule();
                rearm_interrupt(py, &e);
                again
            })
        });
        if off_thread {
            WAKING.fetch_sub(1, Ordering::SeqCst);
        }
        if !matches!(scheduled, Some(Ok(()))) {
            // The loop is closed (or the interpreter is ending): nothing
            // will ever poll this task. Its future is dropped, and with it
            // whatever it held (buffers, connections).
            self.cancel();
        }
    }
}

/// The callable a loop runs to poll a task (`call_soon`).
#[pyclass(module = "kvplane.aio", frozen)]
struct TaskRunner {
    task: Arc<LoopTask>,
    ran: AtomicBool,
}

#[pymethods]
impl TaskRunner {
    fn __call__(&self) {
        self.ran.store(true, Ordering::Release);
        self.task.run();
    }
}

impl Drop for TaskRunner {
    /// Dropped without having run: the loop let go of its queue (it was
    /// closed with the runner still queued), so nothing will poll the task
    /// again, and its wake-ups would be ignored (`scheduled` stays set).
    /// The future is dropped here, and the sockets it held are closed.
    fn drop(&mut self) {
        if !self.ran.load(Ordering::Acquire) {
            self.task.cancel();
        }
    }
}

/// When `e` is a `KeyboardInterrupt` that met a loop method this module
/// called (where it would be lost), the interpreter is told of the
/// interrupt again, so that it is raised at its next check.
fn rearm_interrupt(py: Python<'_>, e: &PyErr) {
    if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
        // As if SIGINT came again: its handler runs on the main thread.
        if let Err(lost) = py.import("_thread").and_then(|t| t.call_method0("interrupt_main")) {
            lost.write_unraisable(py, None);
        }
    }
}

/// A call's panic, as the `kvplane.Internal` its awaiter gets.
pub(crate) fn panicked(panic: Box<dyn std::any::Any + Send>) -> PyErr {
    crate::raise("Internal", format!("the call panicked: {}", panic_message(&*panic)), None, None)
}

/// The text of a panic's payload (a `&str` or `String` message).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_owned(),
        (_, Some(s)) => s.clone(),
        _ => "no message".to_owned(),
    }
}

/// Starts a connection's background reader on the loop. Called from a loop
/// task's poll ([`Transport::spawn`] runs inside `Connection::open_via`).
fn spawn_on(exec: &Arc<LoopExecutor>, runtime: tokio::runtime::Handle, future: BoxedFuture<()>) {
    let task = LoopTask::new(Arc::clone(exec), runtime, future);
    Waker::from(task).wake();
}

/// Asks for the thrown exception in thread mode (see [`LoopCall::throw`]):
/// the call's future aborts its task on the I/O thread and waits until it
/// is gone before it fails with the exception.
#[derive(Default)]
pub(crate) struct CancelSignal {
    thrown: Mutex<Option<Py<PyAny>>>,
    waker: AtomicWaker,
}

impl CancelSignal {
    /// Ready with the thrown exception once a cancellation was asked for.
    pub(crate) fn poll_cancelled(&self, cx: &mut Context<'_>) -> Poll<Py<PyAny>> {
        self.waker.register(cx.waker());
        match self.thrown.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(exception) => Poll::Ready(exception),
            None => Poll::Pending,
        }
    }

    fn ask(&self, exception: Py<PyAny>) {
        *self.thrown.lock().unwrap_or_else(|e| e.into_inner()) = Some(exception);
        self.waker.wake();
    }
}

/// How a call reacts to a cancellation thrown into it.
pub(crate) enum Cancellation {
    /// Its future is dropped at once, on the loop's thread: nothing it
    /// borrowed is used afterwards (loop mode).
    Drop,
    /// Its future is told through the signal and finishes first (thread
    /// mode: its task runs on another thread, which must be done with the
    /// caller's buffers before the coroutine raises).
    Wait(Arc<CancelSignal>),
}

enum CallState {
    /// Not awaited yet: nothing was sent.
    NotStarted(CallFuture, Cancellation, tokio::runtime::Handle),
    /// Its task runs; `waiting` is the asyncio future its awaiter waits on
    /// now, completed with the call's outcome.
    Started {
        task: Arc<LoopTask>,
        waiting: Arc<Mutex<Py<PyAny>>>,
        cancellation: Cancellation,
    },
    Done,
}

/// One call of `kvplane.aio.Client`, with the coroutine protocol (see the
/// module documentation).
#[pyclass(name = "Call", module = "kvplane.aio", frozen)]
pub(crate) struct LoopCall {
    state: Mutex<CallState>,
}

impl LoopCall {
    pub(crate) fn new(future: CallFuture, cancellation: Cancellation, runtime: tokio::runtime::Handle) -> LoopCall {
        LoopCall { state: Mutex::new(CallState::NotStarted(future, cancellation, runtime)) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CallState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Completes `waiting` with the call's outcome (unless it was cancelled).
fn deliver(py: Python<'_>, waiting: &Mutex<Py<PyAny>>, outcome: PyResult<Py<PyAny>>) -> PyResult<()> {
    let waiting = waiting.lock().unwrap_or_else(|e| e.into_inner()).clone_ref(py);
    let waiting = waiting.bind(py);
    if waiting.call_method0(pyo3::intern!(py, "done"))?.is_truthy()? {
        return Ok(());
    }
    match outcome {
        Ok(value) => waiting.call_method1(pyo3::intern!(py, "set_result"), (value,))?,
        Err(e) => waiting.call_method1(pyo3::intern!(py, "set_exception"), (e.into_value(py),))?,
    };
    Ok(())
}

/// `waiting`, marked as a future a task should wait on (what `yield` of an
/// asyncio future does).
fn wait_on(py: Python<'_>, waiting: &Py<PyAny>) -> PyResult<Py<PyAny>> {
    waiting.bind(py).setattr(pyo3::intern!(py, "_asyncio_future_blocking"), true)?;
    Ok(waiting.clone_ref(py))
}

/// The finished call's value, as `StopIteration`, or its exception.
fn finish(py: Python<'_>, waiting: &Py<PyAny>) -> PyErr {
    match waiting.bind(py).call_method0(pyo3::intern!(py, "result")) {
        Ok(value) => PyStopIteration::new_err((value.unbind(),)),
        Err(e) => e,
    }
}

#[pymethods]
impl LoopCall {
    fn __await__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.step(py)
    }

    /// The coroutine's step: the first starts the call; each returns the
    /// future to wait on, or raises `StopIteration` with the call's value.
    fn send(&self, py: Python<'_>, _value: Py<PyAny>) -> PyResult<Py<PyAny>> {
        self.step(py)
    }

    /// A cancellation (or any exception) thrown in by the awaiting task.
    #[pyo3(signature = (exception, value = None, _traceback = None))]
    fn throw(
        &self,
        py: Python<'_>,
        exception: Bound<'_, PyAny>,
        value: Option<Bound<'_, PyAny>>,
        _traceback: Option<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let exception = if exception.is_instance_of::<PyBaseException>() {
            exception
        } else {
            match value {
                Some(v) if v.is_instance_of::<PyBaseException>() => v,
                Some(v) => exception.call1((v,))?,
                None => exception.call0()?,
            }
        };
        let mut state = self.lock();
        match &*state {
            CallState::Started { task, waiting, cancellation: Cancellation::Wait(signal) } if !task.finished() => {
                // Waits (on a new future: the task's own was cancelled)
                // until the call has let go of everything it borrowed.
                let event_loop = task.exec.event_loop.bind(py);
                let next = event_loop.call_method0("create_future")?.unbind();
                *waiting.lock().unwrap_or_else(|e| e.into_inner()) = next.clone_ref(py);
                signal.ask(exception.unbind());
                return wait_on(py, &next);
            }
            CallState::Started { task, waiting, .. } => {
                task.cancel();
                let waiting = waiting.lock().unwrap_or_else(|e| e.into_inner()).clone_ref(py);
                let _ = waiting.bind(py).call_method0("cancel");
            }
            CallState::NotStarted(..) | CallState::Done => {}
        }
        *state = CallState::Done;
        Err(PyErr::from_value(exception))
    }

    /// The coroutine closed (garbage-collected while pending, or closed
    /// by its owner): the call's future is dropped without waiting.
    fn close(&self, py: Python<'_>) {
        let state = std::mem::replace(&mut *self.lock(), CallState::Done);
        if let CallState::Started { task, waiting, .. } = state {
            task.cancel();
            let waiting = waiting.lock().unwrap_or_else(|e| e.into_inner()).clone_ref(py);
            let _ = waiting.bind(py).call_method0("cancel");
        }
    }
}

impl LoopCall {
    fn step(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, CallState::Done) {
            CallState::NotStarted(future, cancellation, runtime) => {
                let exec = LoopExecutor::of_running_loop(py)?;
                let waiting = Arc::new(Mutex::new(exec.event_loop.bind(py).call_method0(pyo3::intern!(py, "create_future"))?.unbind()));
                let delivered = Arc::clone(&waiting);
                let task = LoopTask::new(
                    exec,
                    runtime,
                    Box::pin(async move {
                        // A panic is the call's error, not the loop's.
                        let outcome =
                            std::panic::AssertUnwindSafe(future).catch_unwind().await.unwrap_or_else(|panic| Err(panicked(panic)));
                        Python::attach(|py| {
                            if let Err(e) = deliver(py, &delivered, outcome) {
                                e.write_unraisable(py, None);
                            }
                        });
                    }),
                );
                *state = CallState::Started { task: Arc::clone(&task), waiting: Arc::clone(&waiting), cancellation };
                drop(state);
                // The first poll sends the request, here and now.
                task.run();
                let waiting = waiting.lock().unwrap_or_else(|e| e.into_inner()).clone_ref(py);
                self.after_poll(py, waiting)
            }
            started @ CallState::Started { .. } => {
                let CallState::Started { waiting, .. } = &started else { unreachable!() };
                let waiting = waiting.lock().unwrap_or_else(|e| e.into_inner()).clone_ref(py);
                *state = started;
                drop(state);
                self.after_poll(py, waiting)
            }
            CallState::Done => Err(pyo3::exceptions::PyRuntimeError::new_err("cannot reuse already awaited kvplane.aio call")),
        }
    }

    fn after_poll(&self, py: Python<'_>, waiting: Py<PyAny>) -> PyResult<Py<PyAny>> {
        if waiting.bind(py).call_method0(pyo3::intern!(py, "done"))?.is_truthy()? {
            *self.lock() = CallState::Done;
            return Err(finish(py, &waiting));
        }
        wait_on(py, &waiting)
    }
}

impl Drop for LoopCall {
    fn drop(&mut self) {
        if let CallState::Started { task, .. } = &*self.lock() {
            task.cancel();
        }
    }
}

// --- sockets the loop watches ---------------------------------------------------------

#[derive(Clone, Copy)]
enum Side {
    Read,
    Write,
}

/// One direction's readiness: who waits for it, and whether the loop
/// watches the socket for it.
#[derive(Default)]
struct Interest {
    waker: AtomicWaker,
    /// The loop watches the socket for this side (`add_reader` /
    /// `add_writer` was called and not undone).
    watched: AtomicBool,
    /// The loop reported readiness since the last [`LoopSocket::poll_ready`].
    fired: AtomicBool,
}

/// A non-blocking TCP socket whose readiness comes from the loop's selector.
///
/// The loop watches a side from the first time a read (or write) would
/// block, and keeps watching while someone waits: the selector is
/// level-triggered, so readiness that came between a read and the watch is
/// reported at its next select. When the selector reports a side nobody
/// waits for, the watch is removed (so a connection with unread bytes
/// and no reader does not spin the loop).
pub(crate) struct LoopSocket {
    /// `None` only in `drop`, which hands it to the loop when the loop still
    /// watches it (the descriptor must stay open until the loop forgot it:
    /// a new socket could otherwise get its number while it is watched).
    stream: Option<TcpStream>,
    exec: Arc<LoopExecutor>,
    read: Interest,
    write: Interest,
    this: Weak<LoopSocket>,
}

impl LoopSocket {
    fn stream(&self) -> &TcpStream {
        self.stream.as_ref().expect("taken only by drop")
    }

    fn interest(&self, side: Side) -> &Interest {
        match side {
            Side::Read => &self.read,
            Side::Write => &self.write,
        }
    }

    /// Registers `cx`'s waker for `side` and makes sure the loop watches it.
    fn wait(&self, side: Side, cx: &mut Context<'_>) -> io::Result<()> {
        let interest = self.interest(side);
        interest.waker.register(cx.waker());
        if interest.watched.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let fd = self.stream().as_raw_fd();
        let watched = Python::attach(|py| -> PyResult<()> {
            let callback = Py::new(py, Readiness { socket: self.this.clone(), side })?;
            let add = self.exec.add_for(side);
            if self.exec.on_loop_thread() {
                add.call1(py, (fd, callback)).map(drop)
            } else {
                self.exec.soon(py, (add.clone_ref(py), fd, callback))
            }
        });
        watched.map_err(|e| {
            // The selector may hold the descriptor already (the exception
            // came after `add_reader` registered it): it is forgotten, or
            // the socket's drop would close a descriptor still watched.
            Python::attach(|py| {
                rearm_interrupt(py, &e);
                let _ = self.exec.remove_for(side).call1(py, (fd,));
            });
            interest.watched.store(false, Ordering::Release);
            io::Error::other(format!("the event loop cannot watch the socket: {e}"))
        })
    }

    /// Ready once the loop reported `side` ready since the last call (for
    /// connecting: writable means the connection is made or failed).
    fn poll_ready(&self, side: Side, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.interest(side).fired.swap(false, Ordering::AcqRel) {
            return Poll::Ready(Ok(()));
        }
        self.wait(side, cx)?;
        Poll::Pending
    }

    /// The loop's readiness callback for `side`.
    fn ready(&self, py: Python<'_>, side: Side) {
        let interest = self.interest(side);
        interest.fired.store(true, Ordering::Release);
        match interest.waker.take() {
            Some(waker) => turn(|| waker.wake()),
            None => {
                interest.watched.store(false, Ordering::Release);
                let _ = self.exec.remove_for(side).call1(py, (self.stream().as_raw_fd(),));
            }
        }
    }

    /// When this turn's budget is spent: the task is polled again at the
    /// loop's next turn (`call_soon`), after what else is ready.
    fn out_of_budget(&self, cx: &mut Context<'_>) -> Result<bool, io::Error> {
        if BUDGET.get() > 0 || !DRAINING.get() {
            return Ok(false);
        }
        Python::attach(|py| -> PyResult<()> {
            let later = Py::new(py, WakeLater(cx.waker().clone()))?;
            self.exec.soon(py, (later,))
        })
        .map_err(|e| io::Error::other(format!("the event loop cannot schedule the socket's next turn: {e}")))?;
        Ok(true)
    }

    fn poll_read(&self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.out_of_budget(cx)? {
            return Poll::Pending;
        }
        loop {
            match self.stream().read(buf.initialize_unfilled()) {
                Ok(n) => {
                    spend(n);
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait(Side::Read, cx)?;
                    return Poll::Pending;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_write_with(&self, cx: &mut Context<'_>, mut write: impl FnMut(&TcpStream) -> io::Result<usize>) -> Poll<io::Result<usize>> {
        if self.out_of_budget(cx)? {
            return Poll::Pending;
        }
        loop {
            match write(self.stream()) {
                Ok(n) => {
                    spend(n);
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait(Side::Write, cx)?;
                    return Poll::Pending;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl Drop for LoopSocket {
    fn drop(&mut self) {
        let Some(stream) = self.stream.take() else { return };
        if !self.read.watched.load(Ordering::Acquire) && !self.write.watched.load(Ordering::Acquire) {
            return;
        }
        let fd = stream.as_raw_fd();
        let forgotten = Python::try_attach(|py| -> PyResult<()> {
            if self.exec.on_loop_thread() {
                // Both, whatever the first answers; the descriptor closes
                // after them.
                let (read, write) = (self.exec.remove_reader.call1(py, (fd,)), self.exec.remove_writer.call1(py, (fd,)));
                drop(stream);
                return read.and(write).map(drop);
            }
            // Elsewhere: the loop forgets the descriptor, then closes it.
            let (remove_reader, remove_writer) = (self.exec.remove_reader.clone_ref(py), self.exec.remove_writer.clone_ref(py));
            let stream = Mutex::new(Some(stream));
            let forget = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<()> {
                let py = args.py();
                let (read, write) = (remove_reader.call1(py, (fd,)), remove_writer.call1(py, (fd,)));
                drop(stream.lock().unwrap_or_else(|e| e.into_inner()).take());
                read.and(write).map(drop)
            })?;
            self.exec.call_soon_threadsafe.call1(py, (forget,)).map(drop)
        });
        // A closed loop (or an ending interpreter) watches nothing more:
        // the descriptor closes here, with `stream` dropped by the closure
        // or above.
        let _ = forgotten;
    }
}

/// A wake-up at the loop's next turn (see [`LoopSocket::out_of_budget`]).
#[pyclass(module = "kvplane.aio", frozen)]
struct WakeLater(Waker);

#[pymethods]
impl WakeLater {
    fn __call__(&self) {
        turn(|| self.0.wake_by_ref());
    }
}

/// The loop's callback for one side of one socket.
#[pyclass(module = "kvplane.aio", frozen)]
struct Readiness {
    socket: Weak<LoopSocket>,
    side: Side,
}

#[pymethods]
impl Readiness {
    fn __call__(&self, py: Python<'_>) {
        if let Some(socket) = self.socket.upgrade() {
            socket.ready(py, self.side);
        }
    }
}

struct LoopRead(Arc<LoopSocket>);
struct LoopWrite(Arc<LoopSocket>);

impl AsyncRead for LoopRead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.0.poll_read(cx, buf)
    }
}

impl AsyncWrite for LoopWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.0.poll_write_with(cx, |mut s| s.write(buf))
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        self.0.poll_write_with(cx, |mut s| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.0.stream().shutdown(std::net::Shutdown::Write))
    }
}

/// Connections whose sockets the loop watches and whose background readers
/// are loop tasks (see the module documentation).
pub(crate) struct LoopTransport {
    pub(crate) exec: Arc<LoopExecutor>,
    /// The client's runtime, whose context the background readers are
    /// polled in.
    pub(crate) runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for LoopTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the asyncio event loop's sockets")
    }
}

impl Transport for LoopTransport {
    fn connect_tcp(&self, addr: &str) -> BoxedFuture<io::Result<Halves>> {
        let exec = Arc::clone(&self.exec);
        let addr = addr.to_owned();
        Box::pin(async move {
            // An address is used as it is; a name is resolved on the I/O
            // runtime's blocking pool (never on the loop's thread).
            let candidates: Vec<SocketAddr> = match addr.parse::<SocketAddr>() {
                Ok(one) => vec![one],
                Err(_) => tokio::net::lookup_host(&addr).await?.collect(),
            };
            let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
            for candidate in candidates {
                match connect_one(&exec, candidate).await {
                    Ok(halves) => return Ok(halves),
                    Err(e) => last = e,
                }
            }
            Err(last)
        })
    }

    fn spawn(&self, task: BoxedFuture<()>) {
        spawn_on(&self.exec, self.runtime.clone(), task);
    }
}

/// A non-blocking connect to `addr`, its completion reported by the loop.
async fn connect_one(exec: &Arc<LoopExecutor>, addr: SocketAddr) -> io::Result<Halves> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    let in_progress = match socket.connect(&addr.into()) {
        Ok(()) => false,
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) || e.kind() == io::ErrorKind::WouldBlock => true,
        Err(e) => return Err(e),
    };
    let socket = Arc::new_cyclic(|this| LoopSocket {
        stream: Some(socket.into()),
        exec: Arc::clone(exec),
        read: Interest::default(),
        write: Interest::default(),
        this: this.clone(),
    });
    if in_progress {
        std::future::poll_fn(|cx| socket.poll_ready(Side::Write, cx)).await?;
        if let Some(e) = socket.stream().take_error()? {
            return Err(e);
        }
        // Writable without an error, yet not connected: refused.
        socket.stream().peer_addr()?;
    }
    let read: Box<dyn AsyncRead + Send + Unpin> = Box::new(LoopRead(Arc::clone(&socket)));
    let write: Box<dyn AsyncWrite + Send + Unpin> = Box::new(LoopWrite(socket));
    Ok((read, write))
}

/// The running loop's executor, for a client that binds its connections to
/// it (see `aio.rs`).
pub(crate) fn running_executor(py: Python<'_>) -> PyResult<Arc<LoopExecutor>> {
    LoopExecutor::of_running_loop(py)
}
