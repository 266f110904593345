//! One client connection: handshake, then requests answered in order.
//!
//! Requests on a connection are served one after another (a client gets
//! parallelism from pipelining and from several connections), so a slow or
//! hostile client only ever stalls its own connection. Every way a peer can
//! misbehave ends in a typed `Error` frame and, where the byte stream can no
//! longer be trusted, a closed connection; nothing it sends can corrupt a
//! stored block, because a PUT block is checked before it is inserted.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_protocol::io::{read_block, read_bytes, read_header, skip, timeout_if_pending, write_frame};
use kvplane_protocol::{
    decode_body, encode, Block, ErrorCode, Features, Frame, FrameHeader, HelloAck, KvError, Message, Meta, Opcode, PayloadSlot,
    ProtocolError, Request, Response, ShmBlock, ShmGet, ShmPut, StatEntry, MAX_CLUSTER_WAIT_MS, MIN_VERSION, VERSION,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::admission::{FailureSeen, Peer};
use super::metrics::Op;
use super::receive::{within, PeerShare, Reserved, Stalled};
use super::NodeState;
use crate::cache::NewEntry;
use crate::memory::{with_streaming_stores, BlockMut};
use crate::rdma::ConnRdma;
use crate::shm::SharedRegion;
use crate::store::Staged;

/// Receive buffer per connection: many small frames per system call, while
/// block payloads larger than it are read straight into block memory.
const READ_BUFFER_BYTES: usize = 256 << 10;

type Shutdown = watch::Receiver<bool>;

pub(super) async fn accept_tcp(listener: TcpListener, state: Arc<NodeState>, slots: Arc<Semaphore>, mut shutdown: Shutdown) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(%peer, error = %e, "TCP_NODELAY refused");
                    }
                    admit(&mut conns, Incoming::Tcp(stream), &state, &slots, &shutdown, Peer::Ip(peer.ip()));
                }
                Err(e) => accept_failed(e).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = shutdown.changed() => break,
        }
    }
    while conns.join_next().await.is_some() {}
}

pub(super) async fn accept_unix(listener: UnixListener, state: Arc<NodeState>, slots: Arc<Semaphore>, mut shutdown: Shutdown) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let peer = match stream.peer_cred() {
                        Ok(cred) => Peer::Uid(cred.uid()),
                        Err(e) => {
                            tracing::debug!(error = %e, "no peer credentials on this connection");
                            Peer::Unknown
                        }
                    };
                    // A second handle on the same socket, for the one message
                    // that carries a descriptor (SHM_ATTACH_RESULT).
                    let local = match dup_unix(&stream) {
                        Ok(s) => Some(s),
                        Err(e) => {
                            tracing::debug!(error = %e, "no descriptor passing on this connection");
                            None
                        }
                    };
                    admit(&mut conns, Incoming::Unix { stream, local }, &state, &slots, &shutdown, peer);
                }
                Err(e) => accept_failed(e).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = shutdown.changed() => break,
        }
    }
    while conns.join_next().await.is_some() {}
}

/// Another handle on `stream`'s socket (a `dup`).
fn dup_unix(stream: &tokio::net::UnixStream) -> std::io::Result<tokio::net::UnixStream> {
    use std::os::fd::AsFd;
    let fd = stream.as_fd().try_clone_to_owned()?;
    let std = std::os::unix::net::UnixStream::from(fd);
    std.set_nonblocking(true)?;
    tokio::net::UnixStream::from_std(std)
}

/// Running out of file descriptors must not turn the accept loop into a
/// busy loop; back off and let connections close.
async fn accept_failed(e: std::io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// A connection just accepted.
enum Incoming {
    Tcp(tokio::net::TcpStream),
    /// With a second handle on the socket, to pass a descriptor.
    Unix {
        stream: tokio::net::UnixStream,
        local: Option<tokio::net::UnixStream>,
    },
}

/// Starts serving a new connection, or tells it briefly why not: its peer
/// failed too many handshakes lately, holds its share of the connection
/// slots, or every slot is taken. A refusal is written before any TLS
/// handshake, in plaintext: a TLS client reads the node's reason from it
/// (a refused flood then costs the node no handshakes).
fn admit(conns: &mut JoinSet<()>, incoming: Incoming, state: &Arc<NodeState>, slots: &Arc<Semaphore>, shutdown: &Shutdown, peer: Peer) {
    let metrics = &state.metrics;
    if let Some(wait) = state.throttle.refuses(peer, std::time::Instant::now()) {
        metrics.connections_refused.inc_by(1);
        metrics.handshakes_throttled.inc_by(1);
        let limit = state.throttle.limit();
        let message =
            format!("{peer} failed {limit} handshakes within a minute (--max-handshake-failures); retry in {} s", wait.as_secs().max(1));
        return refuse(conns, incoming, message);
    }
    let Some(peer_slot) = state.peer_slots.acquire(peer) else {
        metrics.connections_refused.inc_by(1);
        metrics.peer_share_refused.inc_by(1);
        let limit = state.peer_slots.limit();
        tracing::warn!(%peer, limit, "connection refused: the peer holds its share of the connections");
        let message = format!("{peer} already holds {limit} connections, one peer's share (--max-connections-per-peer); retry later");
        return refuse(conns, incoming, message);
    };
    let Ok(permit) = Arc::clone(slots).try_acquire_owned() else {
        metrics.connections_refused.inc_by(1);
        let limit = state.config.max_connections;
        tracing::warn!(%peer, limit, "connection refused: too many connections");
        return refuse(conns, incoming, format!("too many connections (limit {limit}); retry later"));
    };
    let state = Arc::clone(state);
    let shutdown = shutdown.clone();
    conns.spawn(async move {
        state.metrics.connections_total.inc_by(1);
        state.metrics.connections_open.inc();
        // The TLS handshake and the HELLO share one deadline.
        let deadline = tokio::time::Instant::now() + state.config.handshake_timeout;
        let result = match incoming {
            Incoming::Tcp(stream) => match &state.tls {
                Some(tls) => match tls.accept(stream, deadline, state.config.handshake_timeout).await {
                    Ok(stream) => {
                        let (r, w) = stream.into_split();
                        serve(r, w, None, &state, shutdown, peer, deadline).await
                    }
                    Err(refused) => {
                        // A port probe is no failure (as without TLS).
                        if refused.failure != super::tls::Failure::Closed {
                            handshake_failed(&state, peer, &refused.message);
                        }
                        Err(ConnectionEnd::HandshakeFailed(refused.message))
                    }
                },
                None => {
                    let (r, w) = stream.into_split();
                    serve(r, w, None, &state, shutdown, peer, deadline).await
                }
            },
            Incoming::Unix { stream, local } => {
                let (r, w) = stream.into_split();
                serve(r, w, local, &state, shutdown, peer, deadline).await
            }
        };
        state.metrics.connections_open.dec();
        if let Err(e) = result {
            tracing::debug!(%peer, error = %e, "connection closed");
        }
        drop::<OwnedSemaphorePermit>(permit);
        drop(peer_slot);
    });
}

/// Answers `unavailable` with `message` (request id 0) and closes. A flood
/// of these must not pile up tasks that wait on clients who never read:
/// the write gets a second.
fn refuse(conns: &mut JoinSet<()>, incoming: Incoming, message: String) {
    conns.spawn(async move {
        let frame = Frame::response(0, Response::Error { code: ErrorCode::Unavailable, message });
        let Ok(encoded) = encode(&frame) else { return };
        let second = Duration::from_secs(1);
        let _ = match incoming {
            Incoming::Tcp(mut stream) => tokio::time::timeout(second, write_frame(&mut stream, &encoded)).await,
            Incoming::Unix { mut stream, .. } => tokio::time::timeout(second, write_frame(&mut stream, &encoded)).await,
        };
    });
}

/// Why a connection ended early (for the debug log).
#[derive(Debug, thiserror::Error)]
enum ConnectionEnd {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Refused(String),
    /// The peer did not complete a valid handshake (counted per peer).
    #[error("handshake failed: {0}")]
    HandshakeFailed(String),
    /// Refused at HELLO although its credentials were good (a tenant at
    /// its maxConnections): not counted against the peer.
    #[error("refused: {0}")]
    Busy(String),
    /// A frame did not arrive within its frame clock.
    #[error("a frame stalled")]
    Stalled,
}

impl From<Stalled> for ConnectionEnd {
    fn from(_: Stalled) -> Self {
        ConnectionEnd::Stalled
    }
}

/// How long an idle connection that was told it will be closed still
/// answers what arrives: a request the client sent before it read the
/// notice is served, not lost (see docs/protocol.md, "Idle connections").
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(5);

struct Conn<'a, R, W> {
    reader: BufReader<R>,
    writer: W,
    state: &'a NodeState,
    features: Features,
    /// Ends a CLUSTER_TABLE wait when the node shuts down.
    shutdown: Shutdown,
    /// A Unix-socket connection's second handle, to pass a descriptor.
    local: Option<tokio::net::UnixStream>,
    /// The memory shared with this client, once it asked (SHM_ATTACH).
    shm: Option<SharedRegion>,
    /// This connection's queue pair, once it asked (RDMA_CONNECT).
    rdma: ConnRdma,
    /// The peer's share of the receive budget (see `receive.rs`).
    receive_share: PeerShare,
    /// Who the HELLO authenticated as: with a tenants file, the tenant
    /// (resolved once, here) whose namespace and quotas every request of
    /// the connection has (see `crate::tenants`).
    scope: crate::tenants::Scope,
}

async fn serve<R, W>(
    reader: R,
    writer: W,
    local: Option<tokio::net::UnixStream>,
    state: &NodeState,
    mut shutdown: Shutdown,
    peer: Peer,
    handshake_deadline: tokio::time::Instant,
) -> Result<(), ConnectionEnd>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut conn = Conn {
        reader: BufReader::with_capacity(READ_BUFFER_BYTES, reader),
        writer,
        state,
        features: Features::default(),
        shutdown: shutdown.clone(),
        local,
        shm: None,
        rdma: ConnRdma::default(),
        receive_share: state.receive_budget.share(peer),
        scope: crate::tenants::Scope::Open,
    };
    let timeout = state.config.handshake_timeout;
    let shaken = match tokio::time::timeout_at(handshake_deadline, conn.handshake()).await {
        Ok(result) => result,
        Err(_) => Err(ConnectionEnd::HandshakeFailed(format!("no HELLO within {timeout:?}"))),
    };
    if let Err(ConnectionEnd::HandshakeFailed(reason)) = &shaken {
        handshake_failed(state, peer, reason);
    }
    shaken?;
    let idle_timeout = state.config.idle_timeout;
    // Once told it is idle, the connection answers what still arrives within
    // the grace, then closes.
    let mut told_idle = false;
    // One idle timer and one shutdown wait for the connection's life, not
    // one of each per request: a timer armed and cancelled per request takes
    // the timer wheel's lock twice, and a fresh `changed()` the shutdown
    // channel's (shared by every connection) twice. The timer fires at most
    // once per idle period and is pushed on to `last_frame + wait` when a
    // frame came in meanwhile.
    let mut last_frame = tokio::time::Instant::now();
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    let stop = shutdown.changed();
    tokio::pin!(stop);
    loop {
        let wait = if told_idle { IDLE_CLOSE_GRACE.min(idle_timeout) } else { idle_timeout };
        // Waits for the first byte of the next frame without consuming it,
        // so an idle timeout never cuts a header in half.
        let next = tokio::select! {
            biased;
            r = conn.reader.fill_buf() => Some(r.map(|b| b.is_empty())),
            () = &mut idle => None,
            _ = &mut stop => return Ok(()),
        };
        match next {
            None if last_frame + wait > tokio::time::Instant::now() => {
                idle.as_mut().reset(last_frame + wait);
                continue;
            }
            None if told_idle => return Ok(()),
            None => {
                state.metrics.idle_closed.inc_by(1);
                conn.tell_idle(idle_timeout).await?;
                told_idle = true;
                last_frame = tokio::time::Instant::now();
                idle.as_mut().reset(last_frame + IDLE_CLOSE_GRACE.min(idle_timeout));
                continue;
            }
            Some(Ok(true)) => return Ok(()),
            Some(Ok(false)) => {}
            Some(Err(e)) => return Err(e.into()),
        }
        // A header in the buffer already (most: a read takes many frames at
        // once) reads no clock.
        let header = match timeout_if_pending(|| tokio::time::Instant::now() + state.frame_clock.grace, read_header(&mut conn.reader)).await
        {
            Some(h) => h?,
            None => return conn.stalled(0, "a frame header").await,
        };
        let header = match header {
            None => return Ok(()),
            Some(Ok(h)) => h,
            Some(Err(e)) => return conn.fatal(0, e).await,
        };
        match conn.serve_frame(header).await {
            Ok(true) => last_frame = tokio::time::Instant::now(),
            Ok(false) => return Ok(()),
            Err(ConnectionEnd::Stalled) => {
                return conn.stalled(header.request_id, &format!("a frame of {} bytes", header.frame_len())).await
            }
            Err(e) => return Err(e),
        }
    }
}

/// Counts a failed handshake against its peer, and logs it: the first of
/// the peer's window and the one that throttles it at warn, the rest at
/// debug, so a token-guessing flood cannot flood the log as well.
fn handshake_failed(state: &NodeState, peer: Peer, reason: &str) {
    state.metrics.connections_refused.inc_by(1);
    state.metrics.handshake_failures.inc_by(1);
    match state.throttle.failed(peer, std::time::Instant::now()) {
        FailureSeen::First => {
            tracing::warn!(%peer, reason, "handshake failed (this peer's further failures this minute are counted, not logged)")
        }
        FailureSeen::Throttled { failures } => tracing::warn!(
            %peer,
            failures,
            reason,
            "handshake failed; the peer is refused for the rest of the minute (--max-handshake-failures)"
        ),
        FailureSeen::Again => tracing::debug!(%peer, reason, "handshake failed"),
    }
}

impl<R, W> Drop for Conn<'_, R, W> {
    fn drop(&mut self) {
        if self.shm.take().is_some() {
            self.state.shm_regions.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
}

impl<R, W> Conn<'_, R, W>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    /// Reads and checks the HELLO and answers it. Every refusal is a
    /// [`ConnectionEnd::HandshakeFailed`], counted against the peer; a
    /// client that connects and closes (a port probe) is not a failure.
    async fn handshake(&mut self) -> Result<(), ConnectionEnd> {
        match self.hello().await {
            Err(ConnectionEnd::Refused(reason)) => Err(ConnectionEnd::HandshakeFailed(reason)),
            other => other,
        }
    }

    async fn hello(&mut self) -> Result<(), ConnectionEnd> {
        let header = match read_header(&mut self.reader).await? {
            None => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed before the handshake").into()),
            Some(Ok(h)) => h,
            Some(Err(ProtocolError::BadMagic { found: [0x16, 0x03, ..] })) => return self.tls_on_plaintext_port().await,
            Some(Err(e)) => {
                self.fatal(0, e).await?;
                return Err(ConnectionEnd::Refused("bad first frame".into()));
            }
        };
        if header.opcode != Opcode::Hello as u8 {
            self.send_error(header.request_id, ErrorCode::HandshakeRequired, "the first frame must be HELLO".into()).await?;
            return Err(ConnectionEnd::Refused("first frame was not HELLO".into()));
        }
        if header.frame_len() > 64 << 10 {
            let e = ProtocolError::FrameTooLarge { declared: header.frame_len(), limit: 64 << 10 };
            self.fatal(header.request_id, e).await?;
            return Err(ConnectionEnd::Refused("oversized HELLO".into()));
        }
        let meta = read_bytes(&mut self.reader, header.meta_len as usize).await?;
        let hello = match decode_body(&header, meta, &self.state.config.limits) {
            Ok(Meta::Complete(Message::Request(Request::Hello(h)))) => h,
            Ok(_) => return Err(ConnectionEnd::Refused("HELLO decoded as another message".into())),
            Err(e) => {
                self.fatal(header.request_id, e).await?;
                return Err(ConnectionEnd::Refused("malformed HELLO".into()));
            }
        };
        if hello.version < MIN_VERSION {
            let msg = format!("client speaks up to version {}, this node speaks {MIN_VERSION}..={VERSION}", hello.version);
            self.send_error(header.request_id, ErrorCode::BadVersion, msg.clone()).await?;
            return Err(ConnectionEnd::Refused(msg));
        }
        if let Some(tenants) = &self.state.tenants {
            // A tenants file: the token names the tenant (or the cluster).
            match tenants.authenticate(hello.token.as_deref()) {
                Ok(scope) => self.scope = scope,
                Err(refused) => {
                    self.send_error(header.request_id, refused.code, refused.message.clone()).await?;
                    // A good token over its tenant's maxConnections is no
                    // failed handshake: counted against the peer, a tenant
                    // retrying at its cap would lock out every tenant that
                    // connects from the same address (or Unix uid).
                    if !refused.counts_against_peer() {
                        self.state.metrics.connections_refused.inc_by(1);
                        return Err(ConnectionEnd::Busy(refused.message));
                    }
                    return Err(ConnectionEnd::Refused(refused.message));
                }
            }
        } else if let Some(expected) = &self.state.config.token {
            let presented = hello.token.as_deref().unwrap_or("");
            if !constant_time_eq(presented.as_bytes(), expected.as_bytes()) {
                let msg = if hello.token.is_none() { "this node requires a bearer token" } else { "wrong bearer token" };
                self.send_error(header.request_id, ErrorCode::Unauthorized, msg.into()).await?;
                return Err(ConnectionEnd::Refused(msg.into()));
            }
        }
        let mut offered = Features::ALL;
        if self.local.is_some() && self.state.config.shm_region_bytes > 0 {
            offered = Features(offered.0 | Features::SHARED_MEMORY.0);
        }
        // A tenant gets no RDMA: a one-sided read reaches the registered
        // pool, every tenant's blocks, not only the ones it was described.
        if self.state.rdma.offered() && !matches!(self.scope, crate::tenants::Scope::Tenant(_)) {
            offered = offered | Features::RDMA;
        }
        self.features = hello.features.intersect(offered);
        let mut limits = self.state.config.limits;
        limits.max_key_bytes = self.scope.max_key_bytes(limits.max_key_bytes);
        let ack = HelloAck { version: hello.version.min(VERSION), features: self.features, limits };
        self.send(header.request_id, Response::HelloAck(ack)).await?;
        Ok(())
    }

    /// A TLS ClientHello on a port without TLS: answered, in plaintext, that
    /// this port speaks none (a TLS client shows that answer; see the
    /// client's `tls` module). The rest of the ClientHello is read first, so
    /// that the close is not a reset that could lose the answer.
    async fn tls_on_plaintext_port(&mut self) -> Result<(), ConnectionEnd> {
        self.state.metrics.protocol_errors.inc_by(1);
        let mut sink = [0u8; 4096];
        for _ in 0..16 {
            match tokio::time::timeout(Duration::from_millis(100), self.reader.read(&mut sink)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => break,
            }
        }
        let message = "this port speaks kvplane without TLS (the node runs without --tls-cert): connect without TLS, \
                       or start the node with --tls-cert and --tls-key";
        self.send_error(0, ErrorCode::HandshakeRequired, message.into()).await?;
        let _ = self.writer.shutdown().await;
        Err(ConnectionEnd::Refused("a TLS ClientHello on a port without TLS".into()))
    }

    /// Serves one frame whose header has been read. `Ok(false)` closes the
    /// connection (after a fatal protocol error has been answered);
    /// [`ConnectionEnd::Stalled`]: the frame did not arrive within its
    /// frame clock (the caller answers and closes).
    async fn serve_frame(&mut self, header: FrameHeader) -> Result<bool, ConnectionEnd> {
        let limits = self.state.config.limits;
        if let Err(e) = limits.check_request_header(&header) {
            self.fatal(header.request_id, e).await?;
            return Ok(false);
        }
        let started = Instant::now();
        let deadline = self.state.frame_clock.deadline(started, header.frame_len());
        // The meta is buffered whole: reserved first, so stalled frames
        // hold at most the receive budget between them. The wait counts
        // against the frame's clock (see `receive.rs`). A frame that is all
        // meta and all in the receive buffer already (a GET, EXISTS, ... of
        // a few keys: most requests) has arrived: nothing of it can stall,
        // and it is answered without waiting for the peer, so it reserves
        // nothing (the budget's two semaphores are shared by every
        // connection: two contended atomics and two locks a request).
        let arrived = header.payload_len() == 0 && self.reader.buffer().len() >= header.meta_len as usize;
        let meta_reserved = if arrived {
            Reserved::default()
        } else {
            within(deadline, self.state.receive_budget.reserve(&self.receive_share, header.meta_len as usize)).await?
        };
        let meta = within(deadline, read_bytes(&mut self.reader, header.meta_len as usize)).await??;
        self.state.metrics.bytes_received.inc_by(header.frame_len());
        let meta = match decode_body(&header, meta, &limits) {
            Ok(m) => m,
            Err(e) => {
                // The body length is known and within limits: skip the rest
                // of the frame and keep the connection.
                within(deadline, skip(&mut self.reader, header.payload_len() as u64)).await??;
                self.state.metrics.protocol_errors.inc_by(1);
                self.send_error(header.request_id, e.code(), e.to_string()).await?;
                return Ok(true);
            }
        };
        // With a tenants file: the keys into the tenant's namespace, and
        // its quotas (see `crate::tenants`); otherwise as it came.
        let meta = match self.scope.admit(meta, self.state.store.cache(), self.state.tenants.as_deref(), limits.max_key_bytes) {
            Ok(m) => m,
            Err(refused) => return self.refuse_request(header, deadline, refused).await,
        };
        let response = match meta {
            Meta::Put(slots) => {
                let n = slots.len();
                let results = self.put(slots, deadline).await?;
                drop(meta_reserved);
                self.state.metrics.record(Op::Put, n, started.elapsed());
                Response::Put { results }
            }
            Meta::Complete(Message::Request(Request::ShmAttach)) => match self.attach_shm(header.request_id).await? {
                // Sent, with the descriptor.
                None => return Ok(true),
                Some(refusal) => refusal,
            },
            Meta::Complete(Message::Request(request)) => {
                // Received whole: what it holds now is the request's keys.
                drop(meta_reserved);
                self.answer(request, started).await
            }
            Meta::Complete(Message::Response(_)) | Meta::Get(_) => {
                // Skip whatever payload the answer frame carries, so the
                // next frame is read from where the client put it.
                within(deadline, skip(&mut self.reader, header.payload_len() as u64)).await??;
                self.state.metrics.protocol_errors.inc_by(1);
                Response::Error { code: ErrorCode::Invalid, message: format!("opcode {:#04x} is an answer, not a request", header.opcode) }
            }
        };
        self.scope.count_answer(&response);
        self.send(header.request_id, response).await?;
        Ok(true)
    }

    /// Answers a request its tenant may not make (see
    /// `crate::tenants::Scope::admit`), after skipping its payload so the
    /// connection stays in step; `Ok(false)` closes it (a revoked tenant).
    async fn refuse_request(
        &mut self,
        header: FrameHeader,
        deadline: tokio::time::Instant,
        refused: crate::tenants::Refusal,
    ) -> Result<bool, ConnectionEnd> {
        within(deadline, skip(&mut self.reader, header.payload_len() as u64)).await??;
        self.send_error(header.request_id, refused.code, refused.message).await?;
        Ok(!refused.close)
    }

    /// Reads each PUT payload straight into a pool block, checks it against
    /// its checksum and only then makes it visible. A failed block is reported
    /// in its slot; the rest of the batch is still stored.
    ///
    /// Blocks whose bytes are all in the receive buffer already (a frame of
    /// small blocks, mostly) go as a run: their pool blocks are taken under
    /// one pool lock and stored as one batch, one lock per shard
    /// ([`Conn::put_buffered`]); one at a time, 32 blocks of 4 KiB took 96
    /// locks. Any other block goes alone ([`Conn::put_one`]). Once the pool
    /// had no room for a whole run, the rest of the frame goes one block at
    /// a time: then each allocation may evict, and a block that replaces a
    /// key frees the old one only when it is stored, so evicting for a
    /// whole run up front would evict more than one block after another.
    async fn put(&mut self, slots: Vec<PayloadSlot>, deadline: tokio::time::Instant) -> Result<Vec<Result<(), ErrorCode>>, ConnectionEnd> {
        let mut results = Vec::with_capacity(slots.len());
        // Write-through: the frame's checked blocks go to the store together,
        // then into memory; answered once both hold them.
        let mut staged = Vec::new();
        let mut next = 0;
        let mut runs = true;
        while next < slots.len() {
            if runs {
                let run = self.buffered_run(&slots[next..]);
                if run >= 2 {
                    let stored = self.put_buffered(&slots[next..next + run], &mut results, &mut staged).await;
                    next += stored;
                    if stored == run {
                        continue;
                    }
                    runs = false;
                }
            }
            self.put_one(&slots[next], deadline, &mut results, &mut staged).await?;
            next += 1;
        }
        self.store_through(staged, &mut results).await;
        Ok(results)
    }

    /// How many of `slots`, from the first, have all their bytes in the
    /// receive buffer already (and fit the largest block class).
    fn buffered_run(&self, slots: &[PayloadSlot]) -> usize {
        let mut available = self.reader.buffer().len();
        let max_block = self.state.store.max_block_bytes();
        slots
            .iter()
            .take_while(|slot| {
                let len = slot.len as usize;
                let fits = len <= max_block && len <= available;
                available -= if fits { len } else { 0 };
                fits
            })
            .count()
    }

    /// A run of PUT blocks whose bytes are all buffered: as many as the pool
    /// has room for without evicting are allocated together, copied out of
    /// the receive buffer (nothing to wait for, so no receive budget and no
    /// clock), and stored as one batch. Returns how many of `slots` it
    /// took, each answered in `results`.
    async fn put_buffered(
        &mut self,
        slots: &[PayloadSlot],
        results: &mut Vec<Result<(), ErrorCode>>,
        staged: &mut Vec<(usize, Staged)>,
    ) -> usize {
        let lens: Vec<usize> = slots.iter().map(|slot| slot.len as usize).collect();
        let mut blocks = Vec::new();
        let taken = self.state.store.try_allocate_many(&lens, &mut blocks);
        for block in &blocks {
            block.prefetch_bytes();
        }
        // The checksum of the receive buffer's bytes, still in cache from
        // the kernel's copy; the block is written around the cache (see
        // `BlockMut::stream_from`) with the same bytes, and answered.
        let first = results.len();
        let reader = &mut self.reader;
        with_streaming_stores(|stores| {
            for (slot, block) in slots.iter().zip(&mut blocks) {
                let src = &reader.buffer()[..slot.len as usize];
                let matches = kvplane_protocol::checksum(src) == slot.crc;
                block.stream_from(src, stores);
                reader.consume(slot.len as usize);
                results.push(if matches { Ok(()) } else { Err(ErrorCode::BadChecksum) });
            }
        });
        // Only now, the stores fenced, are the blocks published (or, those
        // that did not match, given back).
        let through = self.state.store.writes_through();
        let mut entries = Vec::with_capacity(taken);
        for ((place, slot), block) in (first..).zip(slots).zip(blocks) {
            if results[place].is_err() {
                self.state.metrics.checksum_failures.inc_by(1);
                continue;
            }
            // Keys are copied out of the frame's meta buffer: a stored slice
            // would keep the whole buffer alive as long as any key lives.
            let (key, block, crc) = (Bytes::copy_from_slice(&slot.key), block.freeze(), Some(slot.crc));
            if through {
                staged.push((place, Staged { key, block, crc }));
            } else {
                entries.push(NewEntry { key, block, crc });
            }
        }
        self.state.store.put_many(entries).await;
        taken
    }

    /// One PUT block: reserved in the receive budget unless its bytes are
    /// buffered already (a block of bytes still to come holds pool memory
    /// while it arrives), allocated (which may evict), read under the
    /// frame's `deadline` straight into its pool block, checked, stored.
    async fn put_one(
        &mut self,
        slot: &PayloadSlot,
        deadline: tokio::time::Instant,
        results: &mut Vec<Result<(), ErrorCode>>,
        staged: &mut Vec<(usize, Staged)>,
    ) -> Result<(), ConnectionEnd> {
        let len = slot.len as usize;
        // A block whose bytes are all in the receive buffer already is
        // filled without waiting: it never holds pool memory for bytes still
        // to come, so it takes no share of the receive budget and needs no
        // clock. A block over the largest class is refused by the allocation
        // below without reserving anything.
        let buffered = self.reader.buffer().len() >= len;
        let reserved = if len <= self.state.store.max_block_bytes() && !buffered {
            within(deadline, self.state.receive_budget.reserve(&self.receive_share, len)).await?
        } else {
            Default::default()
        };
        let mut block = match self.allocate(len).await {
            Ok(b) => b,
            Err(e) => {
                within(deadline, skip(&mut self.reader, slot.len as u64)).await??;
                results.push(Err(ErrorCode::from(&e)));
                return Ok(());
            }
        };
        // Straight into the pool block, checksummed as it lands.
        let crc = within(deadline, read_block(&mut self.reader, block.as_mut_slice())).await??;
        if crc != slot.crc {
            self.state.metrics.checksum_failures.inc_by(1);
            results.push(Err(ErrorCode::BadChecksum));
            return Ok(());
        }
        // Keys are copied out of the frame's meta buffer (see `put_buffered`).
        let (key, block) = (Bytes::copy_from_slice(&slot.key), block.freeze());
        if self.state.store.writes_through() {
            staged.push((results.len(), Staged { key, block, crc: Some(slot.crc) }));
        } else {
            self.state.store.put(key, block, Some(slot.crc)).await;
        }
        drop(reserved);
        results.push(Ok(()));
        Ok(())
    }

    /// Write-through: the PUT's checked blocks (each with its place in the
    /// answer) to the store; a block it refused is answered its error.
    async fn store_through(&self, staged: Vec<(usize, Staged)>, results: &mut [Result<(), ErrorCode>]) {
        if staged.is_empty() {
            return;
        }
        let (places, staged): (Vec<usize>, Vec<Staged>) = staged.into_iter().unzip();
        for (i, written) in places.into_iter().zip(self.state.store.put_through(staged).await) {
            if let Err(e) = written {
                results[i] = Err(ErrorCode::from(&e));
            }
        }
    }

    /// Tells the client this connection has been idle for `idle` and will
    /// close: `ERROR timeout` with request id 0. Requests that arrive in
    /// the grace that follows are still answered.
    async fn tell_idle(&mut self, idle: Duration) -> Result<(), ConnectionEnd> {
        let message = format!(
            "idle for {} s (--idle-timeout); closing in {} s, answering what arrives until then",
            idle.as_secs(),
            IDLE_CLOSE_GRACE.min(idle).as_secs()
        );
        self.send(0, Response::Error { code: ErrorCode::Timeout, message }).await
    }

    /// Answers a frame that did not arrive in time (`what`) with `timeout`,
    /// briefly (the peer may not read either), and ends the connection.
    async fn stalled(&mut self, request_id: u64, what: &str) -> Result<(), ConnectionEnd> {
        self.state.metrics.frames_stalled.inc_by(1);
        let clock = self.state.frame_clock;
        let message = format!(
            "{what} did not arrive in time: a frame gets {:?} (--frame-grace) plus its length at {} bytes/s (--min-receive-rate); closing the connection",
            clock.grace, clock.min_rate
        );
        if let Ok(encoded) = encode(&Frame::response(request_id, Response::Error { code: ErrorCode::Timeout, message: message.clone() })) {
            let _ = tokio::time::timeout(Duration::from_secs(1), write_frame(&mut self.writer, &encoded)).await;
        }
        Err(ConnectionEnd::Refused(message))
    }

    /// A pool block for a PUT.
    async fn allocate(&self, len: usize) -> Result<BlockMut, KvError> {
        self.state.store.allocate(len).await
    }

    async fn answer(&self, request: Request, started: Instant) -> Response {
        let metrics = &self.state.metrics;
        match request {
            Request::Get { keys } => {
                let results = self.get(&keys).await;
                metrics.record(Op::Get, keys.len(), started.elapsed());
                Response::Get { results }
            }
            Request::Exists { keys } => {
                let results = self.state.store.exists(&keys).await.into_iter().map(present).collect();
                metrics.record(Op::Exists, keys.len(), started.elapsed());
                Response::Exists { results }
            }
            Request::Delete { keys } => {
                let results = self.state.store.delete(&keys).await.into_iter().map(present).collect();
                metrics.record(Op::Delete, keys.len(), started.elapsed());
                Response::Delete { results }
            }
            Request::MatchPrefix { keys, lease_ms } => {
                let granted =
                    if self.features.contains(Features::PIN_LEASE) { lease_ms.min(self.state.config.limits.max_lease_ms) } else { 0 };
                let lease = (granted > 0).then(|| Duration::from_millis(granted as u64));
                let matched = self.state.store.match_prefix(&keys, lease).await;
                metrics.record(Op::MatchPrefix, keys.len(), started.elapsed());
                Response::MatchPrefix { matched: matched as u32, lease_ms: if matched > 0 { granted } else { 0 } }
            }
            Request::Stats => {
                Response::Stats { entries: self.state.stats().into_iter().map(|(name, value)| StatEntry { name, value }).collect() }
            }
            Request::Ping => Response::Pong,
            Request::ShmAttach => Response::Error { code: ErrorCode::Internal, message: "SHM_ATTACH is answered apart".into() },
            Request::PutShm { entries } => {
                let n = entries.len();
                let results = self.put_shm(entries).await;
                metrics.record(Op::Put, n, started.elapsed());
                results
            }
            Request::GetShm { entries } => {
                let n = entries.len();
                let results = self.get_shm(entries).await;
                metrics.record(Op::Get, n, started.elapsed());
                results
            }
            Request::ClusterTable { after_version, wait_ms } => match &self.state.cluster {
                None => Response::Error { code: ErrorCode::Unsupported, message: "this node is not in a cluster".into() },
                Some(cluster) => {
                    let wait = Duration::from_millis(wait_ms.min(MAX_CLUSTER_WAIT_MS) as u64);
                    let mut stop = self.shutdown.clone();
                    match cluster.table_after(after_version, wait, &mut stop).await {
                        Ok(router) => Response::ClusterTable(Box::new(router.table().clone())),
                        Err(message) => Response::Error { code: ErrorCode::Unavailable, message },
                    }
                }
            },
            Request::RdmaConnect { endpoint } => self.rdma.connect(&self.state.rdma, self.features.contains(Features::RDMA), &endpoint),
            Request::RdmaDescribe { keys, lease_ms } => {
                let agreed = self.features.contains(Features::RDMA);
                let max = self.state.config.limits.max_lease_ms;
                let answer = self.rdma.describe(&self.state.rdma, agreed, self.state.store.cache(), &keys, lease_ms, max);
                metrics.record(Op::Get, keys.len(), started.elapsed());
                answer
            }
            Request::Hello(_) => Response::Error { code: ErrorCode::Invalid, message: "HELLO after the handshake".into() },
            Request::Put { .. } => Response::Error { code: ErrorCode::Internal, message: "PUT arrived without payload slots".into() },
        }
    }

    /// Creates this connection's shared memory (once) and sends its
    /// descriptor with the answer. `Ok(None)`: sent; `Ok(Some(error))`: the
    /// answer to send instead.
    async fn attach_shm(&mut self, request_id: u64) -> Result<Option<Response>, ConnectionEnd> {
        let size = self.state.config.shm_region_bytes;
        let Some(local) = self.local.as_ref().filter(|_| self.features.contains(Features::SHARED_MEMORY)) else {
            return Ok(Some(Response::Error {
                code: ErrorCode::Unsupported,
                message:
                    "shared memory needs a Unix-socket connection whose HELLO asked for SHARED_MEMORY, on a node with --shm-region above 0"
                        .into(),
            }));
        };
        if self.shm.is_none() {
            let limit = self.state.config.shm_max_regions;
            let taken = self.state.shm_regions.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            if taken >= limit {
                self.state.shm_regions.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                return Ok(Some(Response::Error {
                    code: ErrorCode::Capacity,
                    message: format!("{limit} connections already hold shared memory (--shm-max); use the socket"),
                }));
            }
            match SharedRegion::create(size) {
                Ok(r) => self.shm = Some(r),
                Err(e) => {
                    self.state.shm_regions.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                    return Ok(Some(Response::Error {
                        code: ErrorCode::Capacity,
                        message: format!("creating {size} bytes of shared memory: {e}"),
                    }));
                }
            }
        }
        let region = self.shm.as_ref().expect("created above");
        let frame = encode(&Frame::response(request_id, Response::ShmAttach { size: region.len() as u64 }))
            .map_err(|e| ConnectionEnd::Refused(e.to_string()))?
            .to_vec();
        let (sock, pass) = (local.as_raw_fd(), region.fd());
        let sent = local.async_io(tokio::io::Interest::WRITABLE, || crate::shm::send_with_fd(sock, &frame, pass)).await?;
        // The rest (if the socket took only part) follows on the same socket.
        self.writer.write_all(&frame[sent..]).await?;
        self.writer.flush().await?;
        self.state.metrics.bytes_sent.inc_by(frame.len() as u64);
        Ok(None)
    }

    /// PUT_SHM: each block copied out of the shared memory into a pool
    /// block, checked against the client's checksum on that copy when it
    /// gave one, then stored. Without one (crc 0) the copy is stored as
    /// read, and its checksum is computed from it when first needed (a GET
    /// answers it): the PUT pays for the copy alone.
    async fn put_shm(&self, entries: Vec<ShmPut>) -> Response {
        let Some(region) = &self.shm else {
            return Response::Error { code: ErrorCode::Invalid, message: "PUT_SHM before SHM_ATTACH".into() };
        };
        let mut results = Vec::with_capacity(entries.len());
        let mut staged = Vec::new();
        for e in entries {
            // A range outside the memory is refused before anything is
            // allocated (an allocation may evict).
            if region.check(e.offset, e.len as usize).is_err() {
                results.push(Err(ErrorCode::Invalid));
                continue;
            }
            let mut block = match self.allocate(e.len as usize).await {
                Ok(b) => b,
                Err(err) => {
                    results.push(Err(ErrorCode::from(&err)));
                    continue;
                }
            };
            // 0: the client gave no checksum (it would cost it a pass over
            // the block). Either way the checksum is of the node's own copy,
            // which the client can no longer change.
            let copied = if e.crc == 0 {
                region.copy_out(e.offset, block.as_mut_slice()).map(|()| None)
            } else {
                region.copy_out_checksummed(e.offset, block.as_mut_slice()).map(Some)
            };
            let Ok(crc) = copied else {
                results.push(Err(ErrorCode::Invalid));
                continue;
            };
            if crc.is_some_and(|crc| crc != e.crc) {
                self.state.metrics.checksum_failures.inc_by(1);
                results.push(Err(ErrorCode::BadChecksum));
                continue;
            }
            let (key, block) = (Bytes::copy_from_slice(&e.key), block.freeze());
            if self.state.store.writes_through() {
                staged.push((results.len(), Staged { key, block, crc }));
            } else {
                self.state.store.put(key, block, crc).await;
            }
            results.push(Ok(()));
        }
        self.store_through(staged, &mut results).await;
        Response::PutShm { results }
    }

    /// GET_SHM: each block (from either tier) copied into the shared memory.
    /// A block whose checksum was never computed (put through shared memory
    /// without one) is checksummed on this copy, a chunk at a time while the
    /// chunk is in cache, and the checksum kept: the first read across
    /// engines pays no pass over the block of its own for it.
    async fn get_shm(&self, entries: Vec<ShmGet>) -> Response {
        let Some(region) = &self.shm else {
            return Response::Error { code: ErrorCode::Invalid, message: "GET_SHM before SHM_ATTACH".into() };
        };
        let keys: Vec<Bytes> = entries.iter().map(|e| e.key.clone()).collect();
        let found = self.state.store.get(&keys).await;
        let results = entries
            .iter()
            .zip(found)
            .map(|(e, r)| {
                // The block is held by reference until this copy ends: its
                // memory cannot be reused under it.
                let found = match r {
                    Ok(Some(found)) => found,
                    Ok(None) => return Err(ErrorCode::NotFound),
                    Err(e) => return Err(ErrorCode::from(&e)),
                };
                let bytes = found.block.as_slice();
                if bytes.len() > e.capacity as usize {
                    return Err(ErrorCode::Capacity);
                }
                let crc = match found.block.known_crc() {
                    Some(crc) => region.copy_in(e.offset, bytes).map(|()| crc),
                    None => region.copy_in_checksummed(e.offset, bytes).inspect(|&crc| found.record_crc(crc)),
                };
                Ok(ShmBlock { len: bytes.len() as u32, crc: crc.map_err(|_| ErrorCode::Invalid)? })
            })
            .collect();
        Response::GetShm { results }
    }

    /// Each key from the store (see `Store::get`), as the protocol answers it.
    async fn get(&self, keys: &[Bytes]) -> Vec<Result<Block, ErrorCode>> {
        self.state
            .store
            .get(keys)
            .await
            .into_iter()
            .map(|r| match r {
                Ok(Some(found)) => {
                    let (bytes, crc) = found.checksummed();
                    Ok(Block::with_crc(bytes, crc))
                }
                Ok(None) => Err(ErrorCode::NotFound),
                Err(e) => Err(ErrorCode::from(&e)),
            })
            .collect()
    }

    async fn send(&mut self, request_id: u64, response: Response) -> Result<(), ConnectionEnd> {
        let encoded = match encode(&Frame::response(request_id, response)) {
            Ok(e) => e,
            Err(e) => {
                let fallback = Response::Error { code: ErrorCode::Internal, message: format!("answer not encodable: {e}") };
                encode(&Frame::response(request_id, fallback)).map_err(|e| ConnectionEnd::Refused(e.to_string()))?
            }
        };
        let timeout = self.state.config.write_timeout;
        match timeout_if_pending(|| tokio::time::Instant::now() + timeout, write_frame(&mut self.writer, &encoded)).await {
            Some(result) => result?,
            None => return Err(ConnectionEnd::Refused(format!("client did not read an answer within {timeout:?}"))),
        }
        self.state.metrics.bytes_sent.inc_by(encoded.len() as u64);
        Ok(())
    }

    async fn send_error(&mut self, request_id: u64, code: ErrorCode, message: String) -> Result<(), ConnectionEnd> {
        self.send(request_id, Response::Error { code, message }).await
    }

    /// Answers a protocol error after which the stream cannot be trusted and
    /// ends the connection.
    async fn fatal(&mut self, request_id: u64, e: ProtocolError) -> Result<(), ConnectionEnd> {
        self.state.metrics.protocol_errors.inc_by(1);
        self.send_error(request_id, e.code(), format!("{e}; closing the connection")).await?;
        Err(ConnectionEnd::Refused(e.to_string()))
    }
}

/// A presence answer as the protocol has it: present, `not-found`, or the
/// key's error.
fn present(r: Result<bool, KvError>) -> Result<(), ErrorCode> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err(ErrorCode::NotFound),
        Err(e) => Err(ErrorCode::from(&e)),
    }
}

/// Compares secrets without an early exit, so response timing does not
/// reveal how much of a guessed token was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    //! A PUT frame's blocks as the batched path stores them (a run of
    //! buffered blocks, then one at a time once the pool is full), against
    //! a real node on loopback and the real client: each block's status,
    //! which blocks stay and how many were evicted must be what storing
    //! the blocks one after another gives.

    use std::time::Duration;

    use bytes::Bytes;
    use kvplane_client::{Client, ClientConfig, Endpoint};
    use kvplane_protocol::{Block, ErrorCode, PutEntry, Request, Response};

    use crate::cache::CacheConfig;
    use crate::memory::PoolConfig;
    use crate::server::{Node, NodeConfig};

    const BLOCK: usize = 4 << 10;
    /// A pool of 64 slab pages of one 4 KiB block each (its largest block).
    const SLOTS: usize = 64;

    /// A node whose pool holds [`SLOTS`] blocks, with one cache shard so
    /// that eviction order is the policy's alone.
    async fn small_node() -> (Node, Client) {
        let config = NodeConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            admin: None,
            unix: None,
            pool: PoolConfig::new(SLOTS * BLOCK),
            cache: CacheConfig { shards: 1, ..CacheConfig::default() },
            ..NodeConfig::default()
        };
        let node = Node::start(config).await.expect("node starts");
        let endpoint = Endpoint::Tcp(node.tcp_addr().expect("tcp").to_string());
        let client = Client::connect(ClientConfig::new(endpoint)).await.expect("client connects");
        (node, client)
    }

    fn key(name: &str) -> Bytes {
        Bytes::copy_from_slice(name.as_bytes())
    }

    fn data(seed: u8, len: usize) -> Bytes {
        Bytes::from((0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
    }

    /// One PUT frame of `entries`, answered per block.
    async fn put_frame(client: &Client, entries: Vec<PutEntry>) -> Vec<Result<(), ErrorCode>> {
        let n = entries.len();
        match client.call(Request::Put { entries }).await.expect("answered") {
            Response::Put { results } if results.len() == n => results,
            other => panic!("PUT of {n} blocks answered {other:?}"),
        }
    }

    async fn store(client: &Client, names: &[String], seed: u8) {
        let entries = names.iter().map(|n| PutEntry { key: key(n), block: Block::new(data(seed, BLOCK)) }).collect();
        let results = put_frame(client, entries).await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }

    async fn stat(client: &Client, name: &str) -> u64 {
        let stats = client.stats().await.expect("stats");
        stats.iter().find(|(n, _)| n == name).map(|(_, v)| *v).unwrap_or_else(|| panic!("no stat {name}"))
    }

    async fn held(client: &Client, names: &[&str]) -> Vec<bool> {
        let got = client.get(names.iter().map(|n| key(n)).collect()).await.expect("get answered");
        got.iter().map(Result::is_ok).collect()
    }

    #[tokio::test]
    async fn a_put_frame_answers_each_block_in_place_through_a_bad_checksum_a_block_too_large_and_a_pool_that_fills_mid_way() {
        let (_node, client) = small_node().await;
        // 60 of the 64 slots pinned: 4 free, and only this frame's own
        // blocks can be evicted.
        let pinned: Vec<String> = (0..60).map(|i| format!("pinned-{i}")).collect();
        for part in pinned.chunks(20) {
            store(&client, part, 1).await;
        }
        let lease = client.match_prefix(pinned.iter().map(|n| key(n)).collect(), Duration::from_secs(600)).await.expect("match");
        assert_eq!(lease.matched, 60);
        let good = |name: &str, seed: u8| PutEntry { key: key(name), block: Block::new(data(seed, BLOCK)) };
        let entries = vec![
            good("a", 2),
            PutEntry { key: key("b"), block: Block::with_crc(data(3, BLOCK), 0xbad) },
            good("c", 4),
            // Over the largest block (4 KiB): refused, its bytes skipped.
            good("d", 5),
            good("e", 6),
            good("f", 7),
            good("g", 8),
            good("h", 9),
            good("i", 10),
        ];
        let mut entries = entries;
        entries[3].block = Block::new(data(5, 2 * BLOCK));
        let results = put_frame(&client, entries).await;
        // a and c take two free slots (b's is given back); e and f the last
        // two; g, h and i each evict the oldest unpinned block: a, c, e.
        use ErrorCode::{BadChecksum, Invalid};
        assert_eq!(results, [Ok(()), Err(BadChecksum), Ok(()), Err(Invalid), Ok(()), Ok(()), Ok(()), Ok(()), Ok(())]);
        assert_eq!(stat(&client, "evictions").await, 3);
        assert_eq!(
            held(&client, &["a", "b", "c", "d", "e", "f", "g", "h", "i"]).await,
            [false, false, false, false, false, true, true, true, true]
        );
        let got = client.get(vec![key("f"), key("i")]).await.expect("get");
        assert_eq!(got[0].as_ref().expect("f"), &data(7, BLOCK));
        assert_eq!(got[1].as_ref().expect("i"), &data(10, BLOCK));
        // Every slot pinned or this frame's: pin those too, and nothing is
        // left to evict; each block is refused by name.
        let rest: Vec<Bytes> = ["f", "g", "h", "i"].iter().map(|n| key(n)).collect();
        assert_eq!(client.match_prefix(rest, Duration::from_secs(600)).await.expect("match").matched, 4);
        let results = put_frame(&client, vec![good("j", 11), good("k", 12)]).await;
        assert_eq!(results, [Err(ErrorCode::Capacity), Err(ErrorCode::Capacity)]);
        assert_eq!(stat(&client, "entries").await, 64);
    }

    #[tokio::test]
    async fn a_put_frame_that_replaces_stored_keys_on_a_full_pool_evicts_as_one_put_after_another_does() {
        let (_node, client) = small_node().await;
        let names: Vec<String> = (0..SLOTS).map(|i| format!("k{i:02}")).collect();
        for part in names.chunks(16) {
            store(&client, part, 1).await;
        }
        assert_eq!(stat(&client, "evictions").await, 0);
        // The newest eight again, new bytes: the first allocation evicts the
        // oldest block (k00); each block stored frees the one it replaces,
        // which the next allocation takes. Allocating the whole frame before
        // storing any of it would evict eight.
        store(&client, &names[56..], 2).await;
        assert_eq!(stat(&client, "evictions").await, 1);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let held = held(&client, &refs).await;
        assert!(!held[0] && held[1..].iter().all(|&h| h), "{held:?}");
        let got = client.get(vec![key("k56"), key("k63"), key("k55")]).await.expect("get");
        assert_eq!(got.into_iter().map(|r| r.expect("held")).collect::<Vec<_>>(), [data(2, BLOCK), data(2, BLOCK), data(1, BLOCK)]);
    }
}
