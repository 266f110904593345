//! One connection to a node: handshake, then pipelined requests.
//!
//! Writers take a short lock to put a whole frame on the socket; a reader task
//! owns the read half and hands each answer to the caller waiting on its
//! request id. Many callers can therefore have requests in flight on one
//! connection, which is what keeps a small pool busy.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvplane_protocol::{encode, Features, Frame, Hello, HelloAck, KvError, Limits, Message, Request, Response, VERSION};
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::endpoint::Endpoint;
use kvplane_protocol::io::{read_frame, write_frame, ReadError};

type Writer = Box<dyn AsyncWrite + Send + Unpin>;
type Waiters = HashMap<u64, oneshot::Sender<Result<Response, KvError>>>;

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
    close_reason: Mutex<Option<KvError>>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail_all(&self, error: KvError) {
        self.closed.store(true, Ordering::Release);
        *self.close_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.clone());
        for (_, tx) in self.lock().drain() {
            let _ = tx.send(Err(error.clone()));
        }
    }
}

/// An open, authenticated connection.
pub struct Connection {
    endpoint: Endpoint,
    writer: tokio::sync::Mutex<Writer>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    ack: HelloAck,
    timeout: Duration,
    reader: JoinHandle<()>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Connection {
    /// Connects, sends `Hello` and waits for `HelloAck`. A node that refuses
    /// the token answers `unauthorized`, reported as [`KvError::Invalid`].
    pub async fn open(endpoint: &Endpoint, token: Option<&str>, timeout: Duration) -> Result<Connection, KvError> {
        let unavailable = |e: std::io::Error| KvError::Unavailable(format!("connect to {endpoint}: {e}"));
        let (reader, writer): (Box<dyn AsyncRead + Send + Unpin>, Writer) = match endpoint {
            Endpoint::Tcp(addr) => {
                let stream = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr))
                    .await
                    .map_err(|_| KvError::Timeout(format!("connect to {endpoint}: no answer in {timeout:?}")))?
                    .map_err(unavailable)?;
                stream.set_nodelay(true).map_err(unavailable)?;
                let (r, w) = stream.into_split();
                (Box::new(r), Box::new(w))
            }
            Endpoint::Unix(path) => {
                let stream = tokio::time::timeout(timeout, tokio::net::UnixStream::connect(path))
                    .await
                    .map_err(|_| KvError::Timeout(format!("connect to {endpoint}: no answer in {timeout:?}")))?
                    .map_err(unavailable)?;
                let (r, w) = stream.into_split();
                (Box::new(r), Box::new(w))
            }
        };
        let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, reader);
        let mut writer = writer;
        let hello = Frame::request(0, Request::Hello(Hello { version: VERSION, features: Features::ALL, token: token.map(str::to_owned) }));
        let encoded = encode(&hello).map_err(|e| KvError::Invalid(format!("hello: {e}")))?;
        let handshake = async {
            write_frame(&mut writer, &encoded).await.map_err(unavailable)?;
            match read_frame(&mut reader, &answer_limits()).await {
                Ok(Some(Frame { message: Message::Response(Response::HelloAck(ack)), .. })) => Ok(ack),
                Ok(Some(Frame { message: Message::Response(Response::Error { code, message }), .. })) => {
                    Err(code.into_kv_error(format!("{endpoint} refused the handshake: {message}")))
                }
                Ok(Some(other)) => Err(KvError::Internal(format!("{endpoint} answered the handshake with {:?}", other.message.opcode()))),
                Ok(None) => Err(KvError::Unavailable(format!("{endpoint} closed the connection during the handshake"))),
                Err(e) => Err(read_error(endpoint, e)),
            }
        };
        let ack = tokio::time::timeout(timeout, handshake)
            .await
            .map_err(|_| KvError::Timeout(format!("handshake with {endpoint}: no answer in {timeout:?}")))??;
        let shared =
            Arc::new(Shared { waiters: Mutex::new(HashMap::new()), closed: AtomicBool::new(false), close_reason: Mutex::new(None) });
        let reader = tokio::spawn(read_loop(reader, Arc::clone(&shared), endpoint.clone()));
        Ok(Connection {
            endpoint: endpoint.clone(),
            writer: tokio::sync::Mutex::new(writer),
            shared,
            next_id: AtomicU64::new(1),
            ack,
            timeout,
            reader,
        })
    }

    /// What the node announced in the handshake.
    pub fn hello_ack(&self) -> &HelloAck {
        &self.ack
    }

    /// False once the connection has failed; the pool then opens a new one.
    pub fn is_open(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire)
    }

    /// Sends one request and waits for its answer. An `Error` answer becomes
    /// the matching [`KvError`].
    pub async fn call(&self, request: Request) -> Result<Response, KvError> {
        if !self.is_open() {
            let reason = self.shared.close_reason.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Err(reason.unwrap_or_else(|| KvError::Unavailable(format!("connection to {} is closed", self.endpoint))));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let encoded = encode(&Frame::request(id, request)).map_err(|e| KvError::Invalid(e.to_string()))?;
        let (tx, rx) = oneshot::channel();
        // Registered before the write, so the reader always finds the waiter.
        self.shared.lock().insert(id, tx);
        let sent = {
            let mut w = self.writer.lock().await;
            write_frame(&mut *w, &encoded).await
        };
        if let Err(e) = sent {
            self.shared.lock().remove(&id);
            let error = KvError::Unavailable(format!("send to {}: {e}", self.endpoint));
            self.shared.fail_all(error.clone());
            return Err(error);
        }
        let answer = match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(KvError::Unavailable(format!("connection to {} closed before the answer", self.endpoint))),
            Err(_) => {
                self.shared.lock().remove(&id);
                Err(KvError::Timeout(format!("{} did not answer request {id} within {:?}", self.endpoint, self.timeout)))
            }
        }?;
        match answer {
            Response::Error { code, message } => Err(code.into_kv_error(message)),
            other => Ok(other),
        }
    }
}

fn read_error(endpoint: &Endpoint, e: ReadError) -> KvError {
    match e {
        ReadError::Io(e) => KvError::Unavailable(format!("read from {endpoint}: {e}")),
        ReadError::Decode(e) => KvError::Internal(format!("undecodable answer from {endpoint}: {e}")),
    }
}

async fn read_loop<R: AsyncRead + Unpin>(mut reader: R, shared: Arc<Shared>, endpoint: Endpoint) {
    let limits = answer_limits();
    let reason = loop {
        match read_frame(&mut reader, &limits).await {
            Ok(Some(Frame { request_id, message: Message::Response(resp) })) => {
                if request_id == 0 {
                    // Not tied to a request: the node is closing the connection.
                    if let Response::Error { code, message } = resp {
                        break code.into_kv_error(format!("{endpoint} closed the connection: {message}"));
                    }
                    continue;
                }
                let waiter = shared.lock().remove(&request_id);
                if let Some(tx) = waiter {
                    let _ = tx.send(Ok(resp));
                } else {
                    tracing::debug!(request_id, %endpoint, "answer for a request nobody waits for (timed out)");
                }
            }
            Ok(Some(other)) => {
                break KvError::Internal(format!("{endpoint} sent a request frame ({:?}) to a client", other.message.opcode()))
            }
            Ok(None) => break KvError::Unavailable(format!("{endpoint} closed the connection")),
            Err(e) => break read_error(&endpoint, e),
        }
    };
    shared.fail_all(reason);
}
