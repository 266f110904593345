//! One connection to a node: handshake, then pipelined requests.
//!
//! Writers take a short lock to put a whole frame on the socket; one read
//! loop reads every answer and hands it to the caller waiting on its request
//! id. Many callers can therefore have requests in flight on one connection,
//! which is what keeps a small pool busy.
//!
//! Who runs the read loop (see [`ReadSide`]): while a call's request is the
//! only one in flight, that call polls the loop from its own task and so
//! reads its own answer, as a bare socket client would; otherwise a
//! background task does and wakes each caller with its answer. The hand-off
//! from a reader task to the caller is a second task wake-up per request, on
//! the round trip's critical path (after the answer arrived), which a single
//! GET at a time pays in full. The loop is one future whoever polls it, so a
//! call cancelled half-way through reading its answer leaves the loop where
//! it was, and the next poller reads on from there: no half-read answer is
//! ever taken for the next one.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::AbortHandle;
use futures::task::AtomicWaker;
use kvplane_protocol::{
    decode_body, encode, ErrorCode, Features, Frame, FrameHeader, Hello, HelloAck, KvError, Limits, Message, Meta, Request, Response,
    ShmGet, ShmPut, HEADER_LEN, VERSION,
};
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::sync::oneshot;

use crate::answer_buffers::{AnswerBuffers, PooledBuffers};
use crate::endpoint::Endpoint;
use crate::into::{read_get_into, Destinations, Lease, NotRead};
use crate::key_error::KeyContext;
use crate::rdma;
use crate::shm::SharedMemory;
use crate::tls::ClientTls;
use crate::transport::Transport;
use bytes::Bytes;
use kvplane_protocol::io::{read_frame, read_meta, read_payloads, timeout_if_pending, write_frame, ReadError};

type Writer = Box<dyn AsyncWrite + Send + Unpin>;
/// The read half, buffered: many small answers per system call, while a GET
/// read into caller memory takes block bytes past the buffer, straight from
/// the stream ([`read_get_into`]).
type Reader = BufReader<Box<dyn AsyncRead + Send + Unpin>>;
/// By request id. The ids are this connection's own counter, never the
/// node's choice, so nobody can pick colliding keys: a fast hash does.
type Waiters = HashMap<u64, Waiter, foldhash::fast::RandomState>;

/// A caller waiting for the answer to its request.
struct Waiter {
    tx: oneshot::Sender<Result<Answer, KvError>>,
    /// For a GET: where the caller wants each block read to.
    into: Option<Arc<Destinations>>,
}

enum Answer {
    Response(Response),
    /// A GET answer read into the caller's destinations: per key, the bytes
    /// written or the key's error.
    Into(Vec<Result<usize, NotRead>>),
}

/// Answers from a node are read with generous limits: the node enforces its
/// own, and refusing its answer would only lose data already sent.
fn answer_limits() -> Limits {
    Limits { max_frame_bytes: u32::MAX, max_key_bytes: u16::MAX as u32, max_batch_keys: u32::MAX, max_lease_ms: u32::MAX }
}

/// Receive buffer of the reader half: large enough to gather many small
/// answers per system call; block payloads larger than it bypass it.
const READ_BUFFER_BYTES: usize = 256 << 10;

struct Shared {
    waiters: Mutex<Waiters>,
    /// Set once the reader has stopped; later calls fail at once.
    closed: AtomicBool,
    /// Set when the node said it closes this connection for idleness: the
    /// pool opens another for new calls, while answers to requests already
    /// sent are still read (the node serves them within its grace).
    closing: AtomicBool,
    close_reason: Mutex<Option<KvError>>,
    /// Set when a request frame was left half-written (its write timed out,
    /// or its caller dropped the call mid-write): the node would read the
    /// next frame as the rest of that one, so nothing more is written here.
    /// The pool opens another; answers to requests sent before are still
    /// read.
    broken: AtomicBool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail_all(&self, error: KvError) {
        self.closed.store(true, Ordering::Release);
        *self.close_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.clone());
        for (_, waiter) in self.lock().drain() {
            let _ = waiter.tx.send(Err(error.clone()));
        }
    }
}

/// The read loop ([`read_loop`]): one future, polled by whichever party
/// drives it now.
type ReadLoop = Pin<Box<dyn Future<Output = ()> + Send>>;

/// No call drives the read loop: the background task does.
const BACKGROUND: u64 = 0;

/// The read loop and who drives it: the one call in flight, from its own
/// task, or else the background task ([`drive_in_background`]).
///
/// A poll of the loop registers the poller's waker with the socket, and
/// only the last poller's: so exactly one party polls it at a time, the one
/// `driver` names, and every party checks that it is named while holding
/// the loop's lock. A party named afterwards is woken once the name changed
/// and so polls after any poll still in progress: it is the one the socket
/// wakes next.
struct ReadSide {
    /// `None` once the loop has ended (the connection failed and every
    /// waiter was answered with why, [`Shared::fail_all`]).
    read_loop: Mutex<Option<ReadLoop>>,
    /// [`BACKGROUND`], or the request id of the call that drives the loop.
    /// A call is named when it registers its request as the only one in
    /// flight; a second request in flight names the background task again
    /// (pipelined answers are handed over as before), so that a caller
    /// whose future is neither polled nor dropped holds up no one else.
    driver: AtomicU64,
    /// The driving call's waker: woken when the loop is taken from it.
    driver_waker: AtomicWaker,
    /// The background task's waker: woken when it is named again.
    background: AtomicWaker,
}

/// What polling the read loop as one party found.
enum Polled {
    /// Another party drives the loop; it was not polled.
    NotDriver,
    /// The loop waits for bytes (the poller's waker is registered).
    Pending,
    /// The loop has ended.
    Ended,
}

impl ReadSide {
    fn new(read_loop: ReadLoop) -> ReadSide {
        ReadSide {
            read_loop: Mutex::new(Some(read_loop)),
            driver: AtomicU64::new(BACKGROUND),
            driver_waker: AtomicWaker::new(),
            background: AtomicWaker::new(),
        }
    }

    /// Polls the loop if `me` drives it (checked under the lock: see the
    /// type's comment).
    fn poll_as(&self, me: u64, cx: &mut Context<'_>) -> Polled {
        let mut slot = self.read_loop.lock().unwrap_or_else(|e| e.into_inner());
        if self.driver.load(Ordering::Acquire) != me {
            return Polled::NotDriver;
        }
        let Some(read_loop) = slot.as_mut() else { return Polled::Ended };
        match read_loop.as_mut().poll(cx) {
            Poll::Ready(()) => {
                *slot = None;
                Polled::Ended
            }
            Poll::Pending => Polled::Pending,
        }
    }

    /// Names the background task the driver again and wakes the call that
    /// drove until now, which then waits for its answer to be handed over.
    /// Called with the waiters' lock held, by a second request in flight.
    fn take_from_caller(&self) -> bool {
        self.driver.swap(BACKGROUND, Ordering::AcqRel) != BACKGROUND
    }

    /// After [`ReadSide::take_from_caller`] returned true, with no lock
    /// held.
    fn wake_after_taking(&self) {
        self.driver_waker.wake();
        self.background.wake();
    }

    /// `me` stops driving (its answer came, it timed out, or it was
    /// cancelled): the background task drives from here, picking up the
    /// loop where it is, half-way through a frame or not.
    fn release(&self, me: u64) {
        if self.driver.compare_exchange(me, BACKGROUND, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.background.wake();
        }
    }
}

/// Drives the read loop whenever no call does, until it ends: it reads the
/// answers of pipelined requests, and between calls notices what the node
/// sends unasked (the idle notice, the connection's end) at once, so that
/// the pool opens a new connection before the next call needs one.
async fn drive_in_background(side: Arc<ReadSide>) {
    std::future::poll_fn(|cx| {
        side.background.register(cx.waker());
        match side.poll_as(BACKGROUND, cx) {
            Polled::Ended => Poll::Ready(()),
            Polled::NotDriver | Polled::Pending => Poll::Pending,
        }
    })
    .await;
}

/// A call named the driver of the read loop; dropped (the call answered,
/// failed or cancelled), the background task drives again.
struct Driving<'a> {
    side: &'a ReadSide,
    id: u64,
}

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.side.release(self.id);
    }
}

/// An open, authenticated connection.
pub struct Connection {
    endpoint: Endpoint,
    /// `None` once a frame was left half-written (see [`Shared::broken`]):
    /// the write half is taken out while a frame is written and put back
    /// only once the whole frame is on the socket.
    writer: tokio::sync::Mutex<Option<Writer>>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    ack: HelloAck,
    timeout: Duration,
    read: Arc<ReadSide>,
    /// Stops [`drive_in_background`], wherever it runs.
    reader: AbortHandle,
    shm: Option<Arc<SharedMemory>>,
    /// A queue pair connected to the node's, when both ends offered RDMA.
    rdma: Option<rdma::Reader>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Connection {
    /// Connects, sends `Hello` and waits for `HelloAck`. A node that refuses
    /// the token answers `unauthorized`, reported as [`KvError::Invalid`].
    /// Over a Unix socket it also asks for the node's shared memory (see
    /// [`Connection::shared_memory`]); a node that offers none is used
    /// through the socket alone.
    pub async fn open(endpoint: &Endpoint, token: Option<&str>, timeout: Duration) -> Result<Connection, KvError> {
        Connection::open_with(endpoint, token, timeout, true, None).await
    }

    /// As [`Connection::open`]; `shared_memory: false` never asks for the
    /// node's shared memory; `tls`: speak TLS to a TCP endpoint (a Unix
    /// endpoint ignores it: it reaches this host only). Over TLS the client
    /// never asks for RDMA, whose one-sided reads would bypass the
    /// encryption.
    pub async fn open_with(
        endpoint: &Endpoint,
        token: Option<&str>,
        timeout: Duration,
        shared_memory: bool,
        tls: Option<&ClientTls>,
    ) -> Result<Connection, KvError> {
        Connection::open_via(endpoint, token, timeout, shared_memory, tls, None).await
    }

    /// As [`Connection::open_with`], with a TCP socket and a background
    /// reader from `transport` rather than tokio's (see [`Transport`]). A
    /// transport carries plain TCP only: with `tls` too it is refused.
    pub async fn open_via(
        endpoint: &Endpoint,
        token: Option<&str>,
        timeout: Duration,
        shared_memory: bool,
        tls: Option<&ClientTls>,
        transport: Option<&dyn Transport>,
    ) -> Result<Connection, KvError> {
        let buffers = AnswerBuffers::new(crate::answer_buffers::DEFAULT_POOL_BYTES);
        Connection::open_pooled(endpoint, token, timeout, shared_memory, tls, transport, buffers).await
    }

    /// As [`Connection::open_via`], reading owned GET answers into buffers
    /// of `buffers` (a [`Client`](crate::Client)'s, shared by its
    /// connections).
    pub(crate) async fn open_pooled(
        endpoint: &Endpoint,
        token: Option<&str>,
        timeout: Duration,
        shared_memory: bool,
        tls: Option<&ClientTls>,
        transport: Option<&dyn Transport>,
        buffers: Arc<AnswerBuffers>,
    ) -> Result<Connection, KvError> {
        let unavailable = |e: std::io::Error| KvError::Unavailable(format!("connect to {endpoint}: {e}"));
        let too_slow = || KvError::Timeout(format!("connect to {endpoint}: no answer in {timeout:?}"));
        let (reader, writer, ack, shm): (Reader, Writer, HelloAck, Option<Arc<SharedMemory>>) = match endpoint {
            Endpoint::Tcp(addr) if transport.is_some() => {
                let transport = transport.expect("matched on is_some");
                if tls.is_some() {
                    return Err(KvError::Invalid(format!(
                        "connect to {endpoint}: TLS is not carried by a custom transport ({transport:?})"
                    )));
                }
                let (r, mut w) =
                    tokio::time::timeout(timeout, transport.connect_tcp(addr)).await.map_err(|_| too_slow())?.map_err(unavailable)?;
                let mut r: Reader = BufReader::with_capacity(READ_BUFFER_BYTES, r);
                let ack = with_timeout(timeout, endpoint, handshake(&mut r, &mut w, endpoint, token, Features::ALL, None)).await?;
                (r, w, ack, None)
            }
            Endpoint::Tcp(addr) => {
                let stream = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr))
                    .await
                    .map_err(|_| too_slow())?
                    .map_err(unavailable)?;
                stream.set_nodelay(true).map_err(unavailable)?;
                if let Some(tls) = tls {
                    let stream = with_timeout(timeout, endpoint, tls.connect(endpoint, addr, stream)).await?;
                    let (r, mut w) = stream.into_split();
                    let mut r: Reader = BufReader::with_capacity(READ_BUFFER_BYTES, Box::new(r));
                    let ack = with_timeout(timeout, endpoint, handshake(&mut r, &mut w, endpoint, token, Features::ALL, Some(tls))).await?;
                    (r, Box::new(w) as Writer, ack, None)
                } else {
                    let (r, mut w) = stream.into_split();
                    let mut r: Reader = BufReader::with_capacity(READ_BUFFER_BYTES, Box::new(r));
                    // RDMA only when this host has a device (and the feature).
                    let wanted = if rdma::offered() { Features::ALL | Features::RDMA } else { Features::ALL };
                    let ack = with_timeout(timeout, endpoint, handshake(&mut r, &mut w, endpoint, token, wanted, None)).await?;
                    (r, Box::new(w) as Writer, ack, None)
                }
            }
            Endpoint::Unix(path) => {
                let mut stream = tokio::time::timeout(timeout, tokio::net::UnixStream::connect(path))
                    .await
                    .map_err(|_| too_slow())?
                    .map_err(unavailable)?;
                let wanted = if shared_memory { Features(Features::ALL.0 | Features::SHARED_MEMORY.0) } else { Features::ALL };
                let ack = {
                    let (r, mut w) = stream.split();
                    let mut r = BufReader::new(r);
                    let ack = with_timeout(timeout, endpoint, handshake(&mut r, &mut w, endpoint, token, wanted, None)).await?;
                    // The node sends nothing more until asked, so nothing
                    // past the HELLO_ACK can have been read ahead.
                    if !r.buffer().is_empty() {
                        return Err(KvError::Internal(format!("{endpoint} sent bytes after HELLO_ACK unasked")));
                    }
                    ack
                };
                let shm = if ack.features.contains(Features::SHARED_MEMORY) {
                    with_timeout(timeout, endpoint, attach_shared_memory(&mut stream, endpoint)).await?
                } else {
                    None
                };
                let (r, w) = stream.into_split();
                (BufReader::with_capacity(READ_BUFFER_BYTES, Box::new(r)), Box::new(w), ack, shm)
            }
        };
        let shared = Arc::new(Shared {
            waiters: Mutex::new(HashMap::default()),
            closed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            close_reason: Mutex::new(None),
            broken: AtomicBool::new(false),
        });
        let read = Arc::new(ReadSide::new(Box::pin(read_loop(reader, Arc::clone(&shared), endpoint.clone(), PooledBuffers(buffers)))));
        let (background, reader) = futures::future::abortable(drive_in_background(Arc::clone(&read)));
        let background = Box::pin(async move {
            let _ = background.await;
        });
        match transport.filter(|_| matches!(endpoint, Endpoint::Tcp(_))) {
            Some(transport) => transport.spawn(background),
            None => drop(tokio::spawn(background)),
        }
        let mut conn = Connection {
            endpoint: endpoint.clone(),
            writer: tokio::sync::Mutex::new(Some(writer)),
            shared,
            next_id: AtomicU64::new(1),
            ack,
            timeout,
            read,
            reader,
            shm,
            rdma: None,
        };
        if conn.ack.features.contains(Features::RDMA) {
            // Any failure leaves the connection on the socket path.
            match rdma::Reader::connect(&conn).await {
                Ok(r) => conn.rdma = Some(r),
                Err(e) => tracing::debug!(%endpoint, error = %e, "no RDMA on this connection; using the socket"),
            }
        }
        Ok(conn)
    }

    /// The queue pair GETs read through, when both ends offered RDMA.
    pub(crate) fn rdma(&self) -> Option<&rdma::Reader> {
        self.rdma.as_ref()
    }

    /// Stores blocks the caller wrote into this connection's shared memory:
    /// each entry is (key, offset, length). The node copies each block out
    /// and checksums its copy when a reader first needs the checksum; no
    /// checksum is computed here (it would cost
    /// a pass over every block), so a block the caller changes while the PUT
    /// is served is stored as the node read it. [`Connection::put_from_shared_checked`]
    /// sends checksums the node verifies.
    pub async fn put_from_shared(&self, entries: &[(Bytes, usize, usize)]) -> Result<Vec<Result<(), KvError>>, KvError> {
        self.put_shared(entries, false).await
    }

    /// As [`Connection::put_from_shared`], with each block's CRC-32C computed
    /// here and verified by the node on its copy (`bad-checksum` when the
    /// memory changed in between).
    pub async fn put_from_shared_checked(&self, entries: &[(Bytes, usize, usize)]) -> Result<Vec<Result<(), KvError>>, KvError> {
        self.put_shared(entries, true).await
    }

    async fn put_shared(&self, entries: &[(Bytes, usize, usize)], checked: bool) -> Result<Vec<Result<(), KvError>>, KvError> {
        let memory =
            self.shared_memory().ok_or_else(|| KvError::Unsupported(format!("{} shares no memory with this connection", self.endpoint)))?;
        let mut puts = Vec::with_capacity(entries.len());
        for (key, offset, len) in entries {
            // A range outside the memory is refused here, before any I/O.
            memory.check(*offset, *len)?;
            let crc = if checked { memory.checksum(*offset, *len)? } else { 0 };
            let len = u32::try_from(*len).map_err(|_| KvError::Invalid(format!("a block of {len} bytes")))?;
            puts.push(ShmPut { key: key.clone(), offset: *offset as u64, len, crc });
        }
        let n = puts.len();
        match self.call(Request::PutShm { entries: puts }).await? {
            Response::PutShm { results } if results.len() == n => Ok(results
                .into_iter()
                .zip(entries)
                .map(|(r, (key, _, len))| r.map_err(|c| KeyContext::put(key, *len, None).error(c)))
                .collect()),
            other => Err(KvError::Internal(format!("{} answered PUT_SHM with {:?}", self.endpoint, other))),
        }
    }

    /// Fetches blocks into this connection's shared memory: each entry is
    /// (key, offset, capacity); answers each block's length (its bytes are
    /// at the offset) or the key's error.
    pub async fn get_into_shared(&self, entries: &[(Bytes, usize, usize)]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        self.shared_memory().ok_or_else(|| KvError::Unsupported(format!("{} shares no memory with this connection", self.endpoint)))?;
        let gets: Vec<ShmGet> = entries
            .iter()
            .map(|(key, offset, capacity)| ShmGet {
                key: key.clone(),
                offset: *offset as u64,
                capacity: (*capacity).min(u32::MAX as usize) as u32,
            })
            .collect();
        let n = gets.len();
        match self.call(Request::GetShm { entries: gets }).await? {
            Response::GetShm { results } if results.len() == n => Ok(results
                .into_iter()
                .zip(entries)
                .map(|(r, (key, ..))| r.map(|b| b.len as usize).map_err(|c| KeyContext::new("GET", key).error(c)))
                .collect()),
            other => Err(KvError::Internal(format!("{} answered GET_SHM with {:?}", self.endpoint, other))),
        }
    }

    /// The memory the node shares with this connection (a Unix-socket
    /// connection to a node that offers it): PUT_SHM and GET_SHM move block
    /// bytes through it instead of through the socket.
    pub fn shared_memory(&self) -> Option<&Arc<SharedMemory>> {
        self.shm.as_ref()
    }

    /// What the node announced in the handshake.
    pub fn hello_ack(&self) -> &HelloAck {
        &self.ack
    }

    /// Whether new calls may use this connection: false once it has failed,
    /// a request frame was left half-written on it, or the node announced
    /// it closes it as idle (the pool then opens a new one).
    pub fn is_open(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire)
            && !self.shared.closing.load(Ordering::Acquire)
            && !self.shared.broken.load(Ordering::Acquire)
    }

    /// Sends one request and waits for its answer. An `Error` answer becomes
    /// the matching [`KvError`].
    pub async fn call(&self, request: Request) -> Result<Response, KvError> {
        match self.exchange(request, None).await? {
            Answer::Response(r) => Ok(r),
            Answer::Into(_) => Err(KvError::Internal(format!("{} answered a plain request as a GET into memory", self.endpoint))),
        }
    }

    /// GET with each value read from the socket straight into `dests[i]`
    /// (see the `into` module): per key, the bytes written, not-found, or
    /// `Capacity` when the value is longer than its destination (left
    /// untouched). No byte is written into `dests` after this returns, even
    /// when its future is dropped before.
    pub async fn get_into(&self, keys: Vec<Bytes>, dests: &mut [&mut [u8]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        let mut parts: Vec<&mut [&mut [u8]]> = dests.iter_mut().map(std::slice::from_mut).collect();
        self.get_into_parts(keys, &mut parts).await
    }

    /// [`Connection::get_into`] with each destination made of parts: the
    /// value of `keys[i]` fills `dests[i][0]`, then `dests[i][1]`, and so
    /// on, read from the socket straight into each part; `Capacity` (every
    /// part untouched) when it is longer than the parts together.
    pub async fn get_into_parts(&self, keys: Vec<Bytes>, dests: &mut [&mut [&mut [u8]]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        let n = keys.len();
        if n != dests.len() {
            return Err(KvError::Invalid(format!("get_into: {n} keys but {} destinations", dests.len())));
        }
        let lease = Lease::new(dests);
        let answer = self.exchange(Request::Get { keys: keys.clone() }, Some(Arc::clone(&lease.destinations))).await;
        drop(lease);
        match answer? {
            Answer::Into(results) if results.len() == n => Ok(results
                .into_iter()
                .zip(&keys)
                .map(|(r, key)| {
                    r.map_err(|why| match why {
                        NotRead::TooLong { len, room } => KvError::Capacity(format!(
                            "GET of key {}: the value of {len} bytes is longer than its destination of {room} bytes",
                            crate::key_error::shown(key)
                        )),
                        NotRead::Code(code) => KeyContext::new("GET", key).error(code),
                    })
                })
                .collect()),
            Answer::Into(results) => {
                Err(KvError::Internal(format!("{} answered a GET of {n} keys with {} results", self.endpoint, results.len())))
            }
            Answer::Response(other) => {
                Err(KvError::Internal(format!("{} answered a GET with {:?}", self.endpoint, Message::Response(other).opcode())))
            }
        }
    }

    /// Why new calls fail: the reason the read loop ended, if it has.
    fn closed_error(&self) -> KvError {
        let reason = self.shared.close_reason.lock().unwrap_or_else(|e| e.into_inner()).clone();
        reason.unwrap_or_else(|| KvError::Unavailable(format!("connection to {} is closed", self.endpoint)))
    }

    async fn exchange(&self, request: Request, into: Option<Arc<Destinations>>) -> Result<Answer, KvError> {
        if self.shared.broken.load(Ordering::Acquire) {
            return Err(KvError::Unavailable(format!(
                "connection to {} is no longer used: a request frame was left half-written on it",
                self.endpoint
            )));
        }
        if !self.is_open() {
            return Err(self.closed_error());
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let encoded = encode(&Frame::request(id, request)).map_err(|e| KvError::Invalid(e.to_string()))?;
        let (tx, mut rx) = oneshot::channel();
        // Registered before the write, so the reader always finds the waiter;
        // and who drives the read loop is settled with it (see `ReadSide`).
        let (alone, taken) = {
            let mut waiters = self.shared.lock();
            let alone = waiters.is_empty();
            waiters.insert(id, Waiter { tx, into });
            if alone {
                self.read.driver.store(id, Ordering::Release);
                (true, false)
            } else {
                (false, self.read.take_from_caller())
            }
        };
        if taken {
            self.read.wake_after_taking();
        }
        // On every way out of this call, the background task drives again.
        let driving = alone.then(|| Driving { side: &self.read, id });
        if self.shared.closed.load(Ordering::Acquire) {
            // The loop ended before this waiter was in: nothing answers it.
            self.shared.lock().remove(&id);
            return Err(self.closed_error());
        }
        // Writing has the same limit as waiting for the answer (the client's
        // timeout), counted from here and including the wait for the write
        // half: a node that stops reading (frozen, or its receive buffer
        // full) would otherwise hold this call, and the bytes it carries,
        // forever.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let too_slow =
            |what: &str| KvError::Timeout(format!("{}: writing the request {id} {what} within {:?}", self.endpoint, self.timeout));
        let Some(mut slot) = timeout_if_pending(|| deadline, self.writer.lock()).await else {
            // Nothing of this frame was written: the connection stays usable.
            self.shared.lock().remove(&id);
            return Err(too_slow("did not start (another request's write held the connection)"));
        };
        let Some(mut writer) = slot.take() else {
            // A frame before this one was left half-written.
            self.shared.lock().remove(&id);
            return Err(KvError::Unavailable(format!(
                "connection to {} is no longer used: a request frame was left half-written on it",
                self.endpoint
            )));
        };
        // Marks the connection broken unless the whole frame is written,
        // including when this call is dropped mid-write; the write half,
        // out of its slot meanwhile, is then dropped, never put back.
        let cut = Cut { shared: &self.shared, armed: true };
        match timeout_if_pending(|| deadline, write_frame(&mut *writer, &encoded)).await {
            Some(Ok(())) => {
                *slot = Some(writer);
                cut.disarm();
                // The write half is free for the next request at once, not
                // when this one is answered: that is what lets requests
                // pipeline (held to the end of the call, it let one request
                // at a time be in flight per connection).
                drop(slot);
            }
            Some(Err(e)) => {
                drop(slot);
                self.shared.lock().remove(&id);
                let error = KvError::Unavailable(format!("send to {}: {e}", self.endpoint));
                self.shared.fail_all(error.clone());
                return Err(error);
            }
            None => {
                drop(slot);
                self.shared.lock().remove(&id);
                tracing::warn!(endpoint = %self.endpoint, request_id = id, timeout = ?self.timeout,
                    "writing a request timed out; the connection is no longer used");
                return Err(too_slow("did not finish (the node is not reading; this connection is no longer used)"));
            }
        }
        let lost = || KvError::Unavailable(format!("connection to {} closed before the answer", self.endpoint));
        let wait = std::future::poll_fn(|cx| {
            if alone {
                // Only the driver's waker may sit in `driver_waker`: a call
                // that drove once and was taken from keeps being polled
                // (until its answer comes through the channel), and its
                // registration would replace the new driver's, whose wake-up
                // from the next take would then go to it instead. That new
                // driver, waiting on the socket and not the channel, slept
                // through its own answer until its timeout's timer polled
                // it (tokio's `Timeout` polls the future before it fails
                // it): 30 s, then success. The name is checked again under
                // the loop's lock just below, so a take between this check
                // and that one sends this call to the channel.
                if self.read.driver.load(Ordering::Acquire) == id {
                    self.read.driver_waker.register(cx.waker());
                }
                match self.read.poll_as(id, cx) {
                    Polled::NotDriver => {}
                    // Read here: no waker is registered with the channel, so
                    // this task's own answer wakes no one.
                    polled => match rx.try_recv() {
                        Ok(answer) => return Poll::Ready(answer),
                        Err(oneshot::error::TryRecvError::Closed) => return Poll::Ready(Err(lost())),
                        Err(oneshot::error::TryRecvError::Empty) if matches!(polled, Polled::Ended) => {
                            return Poll::Ready(Err(self.closed_error()))
                        }
                        // Still the driver: the socket wakes this task. If
                        // the loop was taken meanwhile, its new driver hands
                        // the answer over through the channel.
                        Err(oneshot::error::TryRecvError::Empty) if self.read.driver.load(Ordering::Acquire) == id => return Poll::Pending,
                        Err(oneshot::error::TryRecvError::Empty) => {}
                    },
                }
            }
            Pin::new(&mut rx).poll(cx).map(|r| r.unwrap_or_else(|_| Err(lost())))
        });
        let answer = match tokio::time::timeout(self.timeout, wait).await {
            Ok(answer) => answer,
            Err(_) => {
                self.shared.lock().remove(&id);
                Err(KvError::Timeout(format!("{} did not answer request {id} within {:?}", self.endpoint, self.timeout)))
            }
        };
        drop(driving);
        match answer? {
            Answer::Response(Response::Error { code, message }) => Err(code.into_kv_error(message)),
            other => Ok(other),
        }
    }
}

/// Marks its connection broken when dropped armed: a request frame was
/// started and not finished.
struct Cut<'a> {
    shared: &'a Shared,
    armed: bool,
}

impl Cut<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Cut<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.broken.store(true, Ordering::Release);
        }
    }
}

async fn with_timeout<T>(
    timeout: Duration,
    endpoint: &Endpoint,
    f: impl std::future::Future<Output = Result<T, KvError>>,
) -> Result<T, KvError> {
    tokio::time::timeout(timeout, f).await.map_err(|_| KvError::Timeout(format!("handshake with {endpoint}: no answer in {timeout:?}")))?
}

/// HELLO → HELLO_ACK. Over TLS, an alert the node sends now is named
/// (TLS 1.3 refuses a client certificate after the client's side of the
/// handshake is done).
async fn handshake<R, W>(
    reader: &mut BufReader<R>,
    writer: &mut W,
    endpoint: &Endpoint,
    token: Option<&str>,
    features: Features,
    tls: Option<&ClientTls>,
) -> Result<HelloAck, KvError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let named = |e: &std::io::Error| tls.and_then(|t| t.explain_tls(endpoint, None, e));
    let hello = Frame::request(0, Request::Hello(Hello { version: VERSION, features, token: token.map(str::to_owned) }));
    let encoded = encode(&hello).map_err(|e| KvError::Invalid(format!("hello: {e}")))?;
    if let Err(e) = write_frame(writer, &encoded).await {
        // The write may fail on the close that followed an alert: the
        // alert, when it can still be read, says why.
        if tls.is_some() {
            if let Err(ReadError::Io(read)) = read_frame(reader, &answer_limits()).await {
                if let Some(known) = named(&read) {
                    return Err(known);
                }
            }
        }
        return Err(named(&e).unwrap_or_else(|| KvError::Unavailable(format!("connect to {endpoint}: {e}"))));
    }
    match read_frame(reader, &answer_limits()).await {
        Err(ReadError::Io(e)) if named(&e).is_some() => Err(named(&e).expect("checked")),
        Ok(Some(Frame { message: Message::Response(Response::HelloAck(ack)), .. })) => Ok(ack),
        Ok(Some(Frame { message: Message::Response(Response::Error { code, message }), .. })) => {
            Err(code.into_kv_error(format!("{endpoint} refused the handshake: {message}")))
        }
        Ok(Some(other)) => Err(KvError::Internal(format!("{endpoint} answered the handshake with {:?}", other.message.opcode()))),
        Ok(None) => Err(KvError::Unavailable(format!("{endpoint} closed the connection during the handshake"))),
        Err(e) => Err(read_error(endpoint, e)),
    }
}

/// SHM_ATTACH → SHM_ATTACH_RESULT, whose first bytes carry the memfd. A
/// node that refuses leaves the connection on the socket path (`Ok(None)`).
async fn attach_shared_memory(stream: &mut tokio::net::UnixStream, endpoint: &Endpoint) -> Result<Option<Arc<SharedMemory>>, KvError> {
    use std::os::fd::AsRawFd;
    use tokio::io::AsyncReadExt;
    let io = |e: std::io::Error| KvError::Unavailable(format!("shared memory with {endpoint}: {e}"));
    let encoded = encode(&Frame::request(0, Request::ShmAttach)).map_err(|e| KvError::Invalid(e.to_string()))?;
    write_frame(stream, &encoded).await.map_err(io)?;
    // The header, with the descriptor on its first bytes.
    let mut header = [0u8; HEADER_LEN];
    let mut got = 0;
    let mut file = None;
    while got < HEADER_LEN {
        let fd = stream.as_raw_fd();
        let (n, passed) =
            stream.async_io(tokio::io::Interest::READABLE, || crate::shm::recv_with_fd(fd, &mut header[got..])).await.map_err(io)?;
        if n == 0 {
            return Err(KvError::Unavailable(format!("{endpoint} closed the connection during SHM_ATTACH")));
        }
        got += n;
        file = file.or(passed);
    }
    let parsed = FrameHeader::parse(&header).map_err(|e| KvError::Internal(format!("SHM_ATTACH answer from {endpoint}: {e}")))?;
    let mut body = vec![0u8; parsed.body_len as usize];
    if body.len() > 64 << 10 {
        return Err(KvError::Internal(format!("SHM_ATTACH answer from {endpoint} declares {} bytes", body.len())));
    }
    stream.read_exact(&mut body).await.map_err(io)?;
    let meta = bytes::Bytes::from(body).slice(..parsed.meta_len as usize);
    match decode_body(&parsed, meta, &answer_limits()) {
        Ok(Meta::Complete(Message::Response(Response::ShmAttach { size }))) => {
            let file = file.ok_or_else(|| KvError::Internal(format!("{endpoint} answered SHM_ATTACH without a descriptor")))?;
            let len = usize::try_from(size).map_err(|_| KvError::Internal(format!("{endpoint} offered {size} bytes")))?;
            let memory = SharedMemory::map(file, len).map_err(io)?;
            Ok(Some(Arc::new(memory)))
        }
        Ok(Meta::Complete(Message::Response(Response::Error { code, message }))) => {
            tracing::debug!(%endpoint, %code, message, "no shared memory; using the socket");
            Ok(None)
        }
        Ok(_) => Err(KvError::Internal(format!("{endpoint} answered SHM_ATTACH with another message"))),
        Err(e) => Err(KvError::Internal(format!("SHM_ATTACH answer from {endpoint}: {e}"))),
    }
}

fn read_error(endpoint: &Endpoint, e: ReadError) -> KvError {
    match e {
        ReadError::Io(e) => KvError::Unavailable(format!("read from {endpoint}: {e}")),
        ReadError::Decode(e) => KvError::Internal(format!("undecodable answer from {endpoint}: {e}")),
    }
}

async fn read_loop(mut reader: Reader, shared: Arc<Shared>, endpoint: Endpoint, buffers: PooledBuffers) {
    let limits = answer_limits();
    let reason = loop {
        let (header, meta) = match read_meta(&mut reader, &limits).await {
            Ok(Some(m)) => m,
            Ok(None) => break KvError::Unavailable(format!("{endpoint} closed the connection")),
            Err(e) => break read_error(&endpoint, e),
        };
        let request_id = header.request_id;
        // A GET answer for a caller that lent its memory: read there.
        let into = match &meta {
            Meta::Get(_) => shared.lock().get(&request_id).and_then(|w| w.into.clone()),
            _ => None,
        };
        let answer = match (meta, into) {
            (Meta::Get(slots), Some(dests)) => match read_get_into(&mut reader, slots, &dests).await {
                Ok(results) => Answer::Into(results),
                Err(e) => break KvError::Unavailable(format!("read from {endpoint}: {e}")),
            },
            (meta, _) => match read_payloads(&mut reader, &header, meta, &buffers).await {
                Ok(Frame { message: Message::Response(resp), .. }) => Answer::Response(resp),
                Ok(other) => {
                    break KvError::Internal(format!("{endpoint} sent a request frame ({:?}) to a client", other.message.opcode()))
                }
                Err(e) => break read_error(&endpoint, e),
            },
        };
        if request_id == 0 {
            // `timeout` with id 0: the node closes this idle connection after
            // a grace in which it still answers (docs/protocol.md, "Idle
            // connections"); no new call goes here, answers keep coming.
            if let Answer::Response(Response::Error { code: ErrorCode::Timeout, message }) = &answer {
                tracing::debug!(%endpoint, message, "the node closes this idle connection");
                shared.closing.store(true, Ordering::Release);
                continue;
            }
            // Anything else not tied to a request: the node is closing the
            // connection now.
            if let Answer::Response(Response::Error { code, message }) = answer {
                break code.into_kv_error(format!("{endpoint} closed the connection: {message}"));
            }
            continue;
        }
        let waiter = shared.lock().remove(&request_id);
        if let Some(w) = waiter {
            let _ = w.tx.send(Ok(answer));
        } else {
            tracing::debug!(request_id, %endpoint, "answer for a request nobody waits for (timed out)");
        }
    };
    shared.fail_all(reason);
}
