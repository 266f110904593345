//! TLS streams for the node's TCP port and its clients (issue 21), on
//! rustls's unbuffered API.
//!
//! **Why not tokio-rustls.** Its buffered session copies every received
//! byte three times around the decryption: from the socket's read buffer
//! into rustls's deframer, from the deframer (where the record is decrypted
//! in place) into a fresh allocation per record, and from there into the
//! reader's buffer; and it reads at most a record per system call. Here the
//! socket is read straight into the one buffer rustls decrypts in place, up
//! to 256 KiB (many records) per system call, and each record's plaintext is
//! copied once into the caller's buffer (rustls 0.23 still hands a
//! decrypted record over in a vector of its own: that copy is rustls's).
//! Sending encrypts into one reusable buffer written with one system call
//! per 1 MiB ([`WRITE_CHUNK_BYTES`]); rustls seals each record in a vector
//! of its own and copies it into that buffer (that copy is rustls's too).
//!
//! **One session, two halves.** The node and the client read and write a
//! connection from different tasks, and a TLS session is one state machine.
//! The halves share it behind a mutex held only while rustls runs (never
//! across an await or a system call of the writer): [`Core`] holds the
//! session, the received TLS bytes and plaintext decrypted but not yet read.
//! Whichever half calls rustls decrypts what has arrived: the reader
//! delivers it to its caller, the writer (which must go through the same
//! state machine to encrypt) sets it aside for the reader and wakes it. TLS
//! messages rustls produces while reading (an alert, a key update) are sent
//! by the writer ahead of its next data.
//!
//! **What a caller sees.** Errors are `io::Error`s whose inner error is the
//! `rustls::Error` (as tokio-rustls gives them), so the node and client name
//! a refused certificate or a received alert the same way. A corrupted or
//! forged record fails its AEAD tag: the read is an error and no byte of it
//! is delivered.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{AppDataRecord, ConnectionState, EncodeError, EncryptError, UnbufferedStatus};
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

pub use rustls;

/// TLS bytes read from the socket per system call, at most: many records
/// (a record carries at most 16 KiB).
pub const READ_BUFFER_BYTES: usize = 256 << 10;

/// Plaintext encrypted per write, at most: what one system call then sends.
///
/// New plaintext is taken only once the socket took the last chunk, so
/// this bounds a connection's send buffer. 1 MiB holds a whole answer of
/// 16 blocks of 64 KiB: against 256 KiB it gave TLS 64 KiB GET 1.60 GB/s
/// instead of 1.19 and 2 MiB GET 1.56 instead of 1.28 (two clients, four
/// interleaved rounds, release build); 2 MiB gained nothing more.
pub const WRITE_CHUNK_BYTES: usize = 1 << 20;

/// The largest TLS record on the wire (RFC 8446 5.2: a 5-byte header and
/// at most 2^14 + 256 bytes of protected payload). A read always has room
/// for one.
const MAX_RECORD_BYTES: usize = 5 + (1 << 14) + 256;

/// What a TLS 1.3 record adds to the plaintext it protects: its header,
/// the inner content type and the AEAD tag. Used to size the send buffer;
/// rustls says when it needs more.
const RECORD_OVERHEAD_BYTES: usize = 5 + 1 + 16;

/// Most bytes the peer sent during a handshake that are kept, to explain a
/// failed one (a plaintext kvplane error frame fits many times over).
pub const RECORDED_BYTES: usize = 16 << 10;

/// The crypto provider of both ends: aws-lc-rs, AES-128-GCM preferred.
/// Either AES suite is sound; the 128-bit one moves block bytes about a
/// third faster, and a KV cache moves gigabytes a second.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::aws_lc_rs::default_provider();
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => 0,
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => 1,
        _ => 2,
    });
    Arc::new(p)
}

/// One side of a TLS session (client or server): the one call of rustls's
/// unbuffered API that differs between them.
pub trait Session: Send + 'static {
    /// rustls's side data.
    type Data;

    /// rustls's `process_tls_records`.
    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data>;

    /// Whether the handshake is still under way.
    fn handshaking(&self) -> bool;
}

impl Session for UnbufferedClientConnection {
    type Data = ClientConnectionData;

    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, ClientConnectionData> {
        self.process_tls_records(incoming)
    }

    fn handshaking(&self) -> bool {
        self.is_handshaking()
    }
}

impl Session for UnbufferedServerConnection {
    type Data = ServerConnectionData;

    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, ServerConnectionData> {
        self.process_tls_records(incoming)
    }

    fn handshaking(&self) -> bool {
        self.is_handshaking()
    }
}

/// A handshake that did not complete: the error (its inner error the
/// `rustls::Error` where rustls refused), and the first bytes the peer sent
/// (at most [`RECORDED_BYTES`]), so that a caller can tell a peer that
/// answered in plaintext.
#[derive(Debug)]
pub struct HandshakeError {
    pub error: io::Error,
    pub seen: Vec<u8>,
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// A running total of the bytes that connections' TLS buffers hold (the
/// receive buffer and the send buffer of each), for a metric: a buffer adds
/// its size when it is metered and whenever it grows, and takes it off when
/// it is dropped. Clones share the total.
#[derive(Clone, Debug, Default)]
pub struct BufferMeter(Arc<AtomicUsize>);

impl BufferMeter {
    /// Bytes held now by the buffers of every connection metered here.
    pub fn bytes(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    fn add(meter: &Option<BufferMeter>, n: usize) {
        if let Some(m) = meter {
            m.0.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn sub(meter: &Option<BufferMeter>, n: usize) {
        if let Some(m) = meter {
            m.0.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

/// Received TLS bytes: `buf[start..end]` not yet processed by rustls.
struct Incoming {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    meter: Option<BufferMeter>,
}

impl Drop for Incoming {
    fn drop(&mut self) {
        BufferMeter::sub(&self.meter, self.buf.len());
    }
}

impl Incoming {
    fn new() -> Incoming {
        Incoming { buf: vec![0; READ_BUFFER_BYTES], start: 0, end: 0, meter: None }
    }

    fn metered(&mut self, meter: BufferMeter) {
        BufferMeter::sub(&self.meter, self.buf.len());
        self.meter = Some(meter);
        BufferMeter::add(&self.meter, self.buf.len());
    }

    /// Room at the end for at least one whole record, the unprocessed bytes
    /// moved to the front when there is not (they are at most a part of one
    /// record whenever the socket is read, so the move is short).
    fn room(&mut self) -> &mut [u8] {
        if self.buf.len() - self.end < MAX_RECORD_BYTES {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.buf.len() - self.end < MAX_RECORD_BYTES {
                // A handshake message larger than the buffer (rustls caps
                // those at 64 KiB): grow.
                let grown = self.end + MAX_RECORD_BYTES;
                BufferMeter::add(&self.meter, grown - self.buf.len());
                self.buf.resize(grown, 0);
            }
        }
        &mut self.buf[self.end..]
    }
}

/// Bytes to send: `buf[sent..filled]`, `buf` kept initialized and reused.
struct Outgoing {
    buf: Vec<u8>,
    filled: usize,
    sent: usize,
    meter: Option<BufferMeter>,
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        BufferMeter::sub(&self.meter, self.buf.len());
    }
}

impl Outgoing {
    fn new() -> Outgoing {
        Outgoing::metered(None)
    }

    fn metered(meter: Option<BufferMeter>) -> Outgoing {
        Outgoing { buf: Vec::new(), filled: 0, sent: 0, meter }
    }

    fn unsent(&self) -> &[u8] {
        &self.buf[self.sent..self.filled]
    }

    fn is_empty(&self) -> bool {
        self.sent == self.filled
    }

    fn clear(&mut self) {
        self.filled = 0;
        self.sent = 0;
    }

    /// The free part, at least `need` bytes long.
    fn spare(&mut self, need: usize) -> &mut [u8] {
        if self.buf.len() - self.filled < need {
            let grown = self.filled + need;
            BufferMeter::add(&self.meter, grown - self.buf.len());
            self.buf.resize(grown, 0);
        }
        &mut self.buf[self.filled..]
    }

    fn extend(&mut self, bytes: &[u8]) {
        self.spare(bytes.len())[..bytes.len()].copy_from_slice(bytes);
        self.filled += bytes.len();
    }
}

/// Where decrypted application data goes: into the reader's buffer while
/// it has room (`to`), the rest (and everything, when the writer decrypts)
/// set aside in `rest` for the next read.
struct Delivery<'a, 'b> {
    to: Option<&'a mut ReadBuf<'b>>,
    rest: &'a mut Plaintext,
}

impl Delivery<'_, '_> {
    fn deliver(&mut self, payload: &[u8]) {
        let mut payload = payload;
        if let Some(to) = self.to.as_deref_mut() {
            if self.rest.is_empty() {
                let n = to.remaining().min(payload.len());
                to.put_slice(&payload[..n]);
                payload = &payload[n..];
            }
        }
        self.rest.bytes.extend_from_slice(payload);
    }
}

/// Plaintext decrypted but not yet read: `bytes[taken..]`.
#[derive(Default)]
struct Plaintext {
    bytes: Vec<u8>,
    taken: usize,
}

impl Plaintext {
    fn is_empty(&self) -> bool {
        self.taken == self.bytes.len()
    }

    fn take_into(&mut self, to: &mut ReadBuf<'_>) {
        let n = to.remaining().min(self.bytes.len() - self.taken);
        to.put_slice(&self.bytes[self.taken..self.taken + n]);
        self.taken += n;
        if self.taken == self.bytes.len() {
            self.bytes.clear();
            self.taken = 0;
        }
    }
}

/// What a writer asks rustls to encrypt.
#[derive(Clone, Copy)]
enum Outbound<'a> {
    Data(&'a [u8]),
    /// The alert that ends the session cleanly.
    CloseNotify,
}

/// What one call into rustls came to.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Application data was delivered.
    Data,
    /// A TLS message (handshake, alert, key update) was encoded for sending.
    Encoded,
    /// What was encoded must now be sent (the caller sends it).
    Transmit,
    /// Ready for application data, and no whole record left to decrypt.
    Writable,
    /// What was asked was encrypted.
    Wrote,
    /// The handshake needs more bytes from the peer.
    NeedBytes,
    /// The peer sent close_notify: no more data will come.
    PeerClosed,
    /// Both sides sent close_notify.
    Closed,
}

/// One call of `process_tls_records` over the unprocessed bytes, its state
/// handled: data delivered, messages encoded into `out`, `outbound` (if
/// any) encrypted into `out` once the session allows it. The processed bytes
/// are dropped from `incoming` whatever happened.
fn step<S: Session>(
    session: &mut S,
    incoming: &mut Incoming,
    out: &mut Outgoing,
    delivery: &mut Delivery<'_, '_>,
    outbound: Option<Outbound<'_>>,
) -> Result<Step, rustls::Error> {
    let UnbufferedStatus { mut discard, state } = session.process(&mut incoming.buf[incoming.start..incoming.end]);
    let result = match state {
        Err(e) => Err(e),
        Ok(ConnectionState::ReadTraffic(mut traffic)) => {
            let mut result = Ok(Step::Data);
            while let Some(record) = traffic.next_record() {
                match record {
                    Ok(AppDataRecord { discard: more, payload }) => {
                        discard += more;
                        delivery.deliver(payload);
                    }
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
            result
        }
        Ok(ConnectionState::EncodeTlsData(mut encode)) => loop {
            match encode.encode(out.spare(MAX_RECORD_BYTES)) {
                Ok(n) => {
                    out.filled += n;
                    break Ok(Step::Encoded);
                }
                Err(EncodeError::InsufficientSize(s)) => {
                    out.spare(s.required_size);
                }
                Err(EncodeError::AlreadyEncoded) => break Ok(Step::Encoded),
            }
        },
        Ok(ConnectionState::TransmitTlsData(transmit)) => {
            // The caller sends `out` before it reads or encrypts anything
            // else: to rustls that is as good as sent.
            transmit.done();
            Ok(Step::Transmit)
        }
        Ok(ConnectionState::WriteTraffic(mut traffic)) => match outbound {
            None => Ok(Step::Writable),
            Some(Outbound::CloseNotify) => loop {
                match traffic.queue_close_notify(out.spare(MAX_RECORD_BYTES)) {
                    Ok(n) => {
                        out.filled += n;
                        break Ok(Step::Wrote);
                    }
                    Err(EncryptError::InsufficientSize(s)) => {
                        out.spare(s.required_size);
                    }
                    Err(EncryptError::EncryptExhausted) => break Err(rustls::Error::EncryptError),
                }
            },
            Some(Outbound::Data(plain)) => {
                let records = plain.len().div_ceil(1 << 14).max(1);
                let mut need = plain.len() + records * RECORD_OVERHEAD_BYTES;
                loop {
                    match traffic.encrypt(plain, out.spare(need)) {
                        Ok(n) => {
                            out.filled += n;
                            break Ok(Step::Wrote);
                        }
                        Err(EncryptError::InsufficientSize(s)) => need = s.required_size,
                        Err(EncryptError::EncryptExhausted) => break Err(rustls::Error::EncryptError),
                    }
                }
            }
        },
        Ok(ConnectionState::BlockedHandshake) => Ok(Step::NeedBytes),
        Ok(ConnectionState::PeerClosed) => Ok(Step::PeerClosed),
        Ok(ConnectionState::Closed) => Ok(Step::Closed),
        // Early data is never enabled; later states are not known here.
        Ok(_) => Err(rustls::Error::General("unexpected TLS session state".into())),
    };
    incoming.start += discard;
    if incoming.start == incoming.end {
        incoming.start = 0;
        incoming.end = 0;
    }
    result
}

/// What both halves share.
struct Core<S> {
    session: S,
    incoming: Incoming,
    plaintext: Plaintext,
    /// TLS messages rustls produced while the reader ran, for the writer.
    control: Outgoing,
    peer_closed: bool,
    /// The first error rustls reported: the session is unusable after it.
    failed: Option<rustls::Error>,
    /// The reader, when it waits for the socket: the writer wakes it when
    /// it decrypted data for it or saw the peer close.
    reader: Option<Waker>,
}

impl<S: Session> Core<S> {
    fn new(session: S) -> Core<S> {
        Core {
            session,
            incoming: Incoming::new(),
            plaintext: Plaintext::default(),
            control: Outgoing::new(),
            peer_closed: false,
            failed: None,
            reader: None,
        }
    }
}

fn lock<S>(core: &Mutex<Core<S>>) -> MutexGuard<'_, Core<S>> {
    // A panic while rustls ran leaves nothing half-changed that matters
    // more than the session error it would be.
    core.lock().unwrap_or_else(|e| e.into_inner())
}

/// A TLS connection over TCP, its handshake done. [`TlsStream::into_split`]
/// gives its two halves.
pub struct TlsStream<S> {
    io: TcpStream,
    core: Core<S>,
    meter: Option<BufferMeter>,
}

impl TlsStream<UnbufferedClientConnection> {
    /// The client's handshake with the server at the other end of `io`,
    /// checking its certificate for `name`.
    pub async fn connect(
        config: Arc<ClientConfig>,
        name: rustls::pki_types::ServerName<'static>,
        io: TcpStream,
    ) -> Result<TlsStream<UnbufferedClientConnection>, HandshakeError> {
        let session =
            UnbufferedClientConnection::new(config, name).map_err(|e| HandshakeError { error: tls_error(e), seen: Vec::new() })?;
        TlsStream::handshake(io, session).await
    }
}

impl TlsStream<UnbufferedServerConnection> {
    /// The server's handshake with the client at the other end of `io`.
    pub async fn accept(config: Arc<ServerConfig>, io: TcpStream) -> Result<TlsStream<UnbufferedServerConnection>, HandshakeError> {
        let session = UnbufferedServerConnection::new(config).map_err(|e| HandshakeError { error: tls_error(e), seen: Vec::new() })?;
        TlsStream::handshake(io, session).await
    }
}

impl<S: Session> TlsStream<S> {
    /// Drives the handshake to its end. No time limit of its own: callers
    /// bound it (the node by its handshake deadline, the client by its
    /// connect timeout).
    async fn handshake(mut io: TcpStream, session: S) -> Result<TlsStream<S>, HandshakeError> {
        let mut core = Core::new(session);
        let mut out = Outgoing::new();
        let mut seen = Vec::new();
        loop {
            let mut delivery = Delivery { to: None, rest: &mut core.plaintext };
            let stepped = step(&mut core.session, &mut core.incoming, &mut out, &mut delivery, None);
            match stepped {
                Err(e) => {
                    // Where rustls refused, it queued an alert that tells
                    // the peer why: the next call hands it over before it
                    // looks at any received byte. One call only: a second
                    // would parse the bytes that failed again, and rustls
                    // sends one fatal alert per session. Sent best effort;
                    // the caller's deadline bounds it.
                    let mut delivery = Delivery { to: None, rest: &mut core.plaintext };
                    if let Ok(Step::Encoded) = step(&mut core.session, &mut core.incoming, &mut out, &mut delivery, None) {
                        let _ = io.write_all(out.unsent()).await;
                    }
                    return Err(HandshakeError { error: tls_error(e), seen });
                }
                Ok(Step::Encoded) => {}
                Ok(Step::Transmit) => {
                    if let Err(error) = io.write_all(out.unsent()).await {
                        return Err(HandshakeError { error, seen });
                    }
                    out.clear();
                }
                Ok(Step::Writable | Step::Data) if !core.session.handshaking() => {
                    if let Err(error) = io.write_all(out.unsent()).await {
                        return Err(HandshakeError { error, seen });
                    }
                    return Ok(TlsStream { io, core, meter: None });
                }
                // A server may send data before the client's last flight
                // arrived (and is verified): wait for it.
                Ok(Step::Writable | Step::Data | Step::NeedBytes) => {
                    let room = core.incoming.room();
                    let n = match io.read(room).await {
                        Ok(0) => {
                            let error =
                                io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection during the TLS handshake");
                            return Err(HandshakeError { error, seen });
                        }
                        Ok(n) => n,
                        Err(error) => return Err(HandshakeError { error, seen }),
                    };
                    let keep = n.min(RECORDED_BYTES.saturating_sub(seen.len()));
                    seen.extend_from_slice(&room[..keep]);
                    core.incoming.end += n;
                }
                Ok(Step::PeerClosed | Step::Closed | Step::Wrote) => {
                    let error = io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the TLS session during its handshake");
                    return Err(HandshakeError { error, seen });
                }
            }
        }
    }

    /// The reading and the writing half, usable from different tasks.
    pub fn into_split(self) -> (TlsReadHalf<S>, TlsWriteHalf<S>) {
        let (r, w) = self.io.into_split();
        let core = Arc::new(Mutex::new(self.core));
        let out = Outgoing::metered(self.meter);
        (TlsReadHalf { io: r, core: Arc::clone(&core) }, TlsWriteHalf { io: w, core, out, shut: false })
    }

    /// Counts this connection's receive and send buffers into `meter` from
    /// now until they are dropped (the receive buffer of [`READ_BUFFER_BYTES`]
    /// at once, the send buffer as it grows, up to a chunk of
    /// [`WRITE_CHUNK_BYTES`] and its records' overhead).
    pub fn metered(mut self, meter: BufferMeter) -> TlsStream<S> {
        self.core.incoming.metered(meter.clone());
        self.meter = Some(meter);
        self
    }

    /// The session, to ask what the handshake settled (the protocol
    /// version, the suite, the peer's certificates).
    pub fn session(&self) -> &S {
        &self.core.session
    }
}

/// The reading half of a [`TlsStream`].
pub struct TlsReadHalf<S> {
    io: OwnedReadHalf,
    core: Arc<Mutex<Core<S>>>,
}

impl<S: Session> AsyncRead for TlsReadHalf<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut guard = lock(&this.core);
        let core = &mut *guard;
        loop {
            if let Some(e) = &core.failed {
                return Poll::Ready(Err(tls_error(e.clone())));
            }
            if !core.plaintext.is_empty() {
                core.plaintext.take_into(buf);
                return Poll::Ready(Ok(()));
            }
            if core.peer_closed || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            // Decrypt every whole record that has arrived, while the
            // caller's buffer has room.
            let before = buf.filled().len();
            loop {
                let mut delivery = Delivery { to: Some(&mut *buf), rest: &mut core.plaintext };
                match step(&mut core.session, &mut core.incoming, &mut core.control, &mut delivery, None) {
                    Err(e) => {
                        core.failed = Some(e.clone());
                        return Poll::Ready(Err(tls_error(e)));
                    }
                    Ok(Step::Data) if buf.remaining() == 0 || !core.plaintext.is_empty() => break,
                    Ok(Step::Data | Step::Encoded | Step::Transmit) => {}
                    Ok(Step::PeerClosed | Step::Closed) => {
                        core.peer_closed = true;
                        break;
                    }
                    Ok(Step::Writable | Step::NeedBytes | Step::Wrote) => break,
                }
            }
            if buf.filled().len() > before || core.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if !core.plaintext.is_empty() {
                continue;
            }
            // Nothing whole left: read from the socket.
            let room = core.incoming.room();
            let mut read = ReadBuf::new(room);
            match Pin::new(&mut this.io).poll_read(cx, &mut read) {
                Poll::Pending => {
                    core.reader = Some(cx.waker().clone());
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let n = read.filled().len();
                    if n == 0 {
                        if core.incoming.start == core.incoming.end {
                            // The peer closed between records without a
                            // close_notify. The frames above carry their
                            // lengths, so a cut inside one is still caught.
                            core.peer_closed = true;
                            return Poll::Ready(Ok(()));
                        }
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the peer closed the connection inside a TLS record",
                        )));
                    }
                    core.incoming.end += n;
                }
            }
        }
    }
}

/// The writing half of a [`TlsStream`].
pub struct TlsWriteHalf<S> {
    io: OwnedWriteHalf,
    core: Arc<Mutex<Core<S>>>,
    /// Encrypted bytes not yet sent.
    out: Outgoing,
    shut: bool,
}

impl<S: Session> TlsWriteHalf<S> {
    /// Sends what is encrypted, until all of it is or the socket is full.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.out.is_empty() {
            let n = std::task::ready!(Pin::new(&mut self.io).poll_write(cx, self.out.unsent()))?;
            if n == 0 {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::WriteZero, "the peer stopped accepting bytes")));
            }
            self.out.sent += n;
        }
        self.out.clear();
        Poll::Ready(Ok(()))
    }

    /// Encrypts up to [`WRITE_CHUNK_BYTES`] of `bufs` into `out` (after any
    /// TLS message the reader left for sending), then a close_notify if
    /// `close`; returns how much plaintext it took.
    fn encrypt(&mut self, bufs: &[io::IoSlice<'_>], close: bool) -> io::Result<usize> {
        let mut guard = lock(&self.core);
        let core = &mut *guard;
        if let Some(e) = &core.failed {
            return Err(tls_error(e.clone()));
        }
        if !core.control.is_empty() {
            self.out.extend(core.control.unsent());
            core.control.clear();
        }
        let mut taken = 0;
        for slice in bufs.iter().filter(|s| !s.is_empty()) {
            let room = WRITE_CHUNK_BYTES - taken;
            if room == 0 {
                break;
            }
            let plain = &slice[..slice.len().min(room)];
            seal(core, &mut self.out, Outbound::Data(plain))?;
            taken += plain.len();
        }
        if close {
            seal(core, &mut self.out, Outbound::CloseNotify)?;
        }
        Ok(taken)
    }
}

/// Encrypts `next` into `out`, first handling whatever rustls has to say
/// (records the reader had not decrypted yet are set aside for it).
fn seal<S: Session>(core: &mut Core<S>, out: &mut Outgoing, next: Outbound<'_>) -> io::Result<()> {
    loop {
        let mut delivery = Delivery { to: None, rest: &mut core.plaintext };
        match step(&mut core.session, &mut core.incoming, out, &mut delivery, Some(next)) {
            Err(e) => {
                core.failed = Some(e.clone());
                return Err(tls_error(e));
            }
            Ok(Step::Wrote) => return Ok(()),
            Ok(Step::Data) => wake(&mut core.reader),
            Ok(Step::PeerClosed) => {
                core.peer_closed = true;
                wake(&mut core.reader);
            }
            Ok(Step::Encoded | Step::Transmit) => {}
            Ok(Step::Closed) if matches!(next, Outbound::CloseNotify) => return Ok(()),
            Ok(Step::Closed) => return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the TLS session is closed")),
            Ok(Step::Writable | Step::NeedBytes) => {
                return Err(io::Error::other("the TLS session cannot send (handshake not complete)"));
            }
        }
    }
}

fn wake(waker: &mut Option<Waker>) {
    if let Some(w) = waker.take() {
        w.wake();
    }
}

impl<S: Session> AsyncWrite for TlsWriteHalf<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // What was encrypted before goes first: new plaintext is taken only
        // once the socket took the last, so the send buffer never holds
        // more than one chunk.
        std::task::ready!(this.poll_send(cx))?;
        let n = this.encrypt(bufs, false)?;
        // Start sending now; what the socket does not take yet goes with
        // the next write or the flush.
        if let Poll::Ready(Err(e)) = this.poll_send(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_send(cx))?;
        if !lock(&this.core).control.is_empty() {
            this.encrypt(&[], false)?;
            std::task::ready!(this.poll_send(cx))?;
        }
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_send(cx))?;
        if !this.shut {
            this.shut = true;
            // close_notify is a courtesy: a failed session just closes.
            let _ = this.encrypt(&[], true);
        }
        std::task::ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
