//! TLS streams for the node's TCP port and its clients (issue 21): rustls
//! for the handshake, a record layer of our own after it ([`records`]).
//!
//! **Why not tokio-rustls.** Its buffered session copies every received
//! byte three times around the decryption: from the socket's read buffer
//! into rustls's deframer, from the deframer (where the record is decrypted
//! in place) into a fresh allocation per record, and from there into the
//! reader's buffer; and it reads at most a record per system call. rustls's
//! unbuffered API, which this crate used for every record before, still
//! seals each record into a vector of its own and hands each opened one
//! over in one. So the handshake runs on the unbuffered API, and then
//! rustls hands over the traffic keys (its `KernelConnection`, the
//! interface kernel-TLS integrations use): records are sealed straight from
//! the caller's plaintext into the send buffer and opened straight from the
//! receive buffer into the caller's buffer: one pass over each byte per
//! end, the AEAD's. The socket is read into one buffer, up to 256 KiB (many
//! records) per system call; sending seals up to 1 MiB
//! ([`WRITE_CHUNK_BYTES`]) into one reusable buffer written with one system
//! call.
//!
//! **Two halves.** The node and the client read and write a connection from
//! different tasks. After the handshake each direction has its own key and
//! sequence number, so each half owns its own and they share only rustls's
//! key schedule (behind a mutex taken for a key update or a session
//! ticket, never per record), the first error either half met, and the
//! peer's request that our key change too, which the writer honours ahead
//! of its next data (RFC 8446 4.6.3).
//!
//! **What a caller sees.** Errors are `io::Error`s whose inner error is a
//! `rustls::Error` (as tokio-rustls gives them), so the node and client name
//! a refused certificate or a received alert the same way. A corrupted or
//! forged record fails its AEAD tag: the read is an error, no byte of it is
//! delivered (counted in the caller's `ReadBuf`), and both halves refuse
//! from then on. Only TLS 1.3 is spoken (both ends' configs must allow only
//! it, and set `enable_secret_extraction`: [`configure_server`], [`configure_client`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll};

use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::kernel::KernelConnection;
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{AppDataRecord, ConnectionState, EncodeError, UnbufferedStatus};
use rustls::{ClientConfig, ExtractedSecrets, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

mod records;

use records::{PostHandshake, RecordKey};

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

/// KeyUpdates a peer may send in a row with no application data between
/// them (rustls itself allows a handful too).
const MAX_KEY_UPDATES_IN_A_ROW: u32 = 32;

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

/// One side of a TLS session (client or server): the calls of rustls's
/// API that differ between them.
pub trait Session: Send + 'static {
    /// rustls's side data.
    type Data: Send + 'static;

    /// rustls's `process_tls_records`.
    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data>;

    /// Whether the handshake is still under way.
    fn handshaking(&self) -> bool;

    /// rustls's `dangerous_into_kernel_connection`: the traffic keys and
    /// the key schedule, once the handshake is done.
    fn into_kernel(self) -> Result<(ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error>;

    /// A NewSessionTicket the peer sent after the handshake (its body).
    fn ticket(kernel: &mut KernelConnection<Self::Data>, body: &[u8]) -> Result<(), rustls::Error>;
}

impl Session for UnbufferedClientConnection {
    type Data = ClientConnectionData;

    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, ClientConnectionData> {
        self.process_tls_records(incoming)
    }

    fn handshaking(&self) -> bool {
        self.is_handshaking()
    }

    fn into_kernel(self) -> Result<(ExtractedSecrets, KernelConnection<ClientConnectionData>), rustls::Error> {
        self.dangerous_into_kernel_connection()
    }

    fn ticket(kernel: &mut KernelConnection<ClientConnectionData>, body: &[u8]) -> Result<(), rustls::Error> {
        kernel.handle_new_session_ticket(body)
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

    fn into_kernel(self) -> Result<(ExtractedSecrets, KernelConnection<ServerConnectionData>), rustls::Error> {
        self.dangerous_into_kernel_connection()
    }

    fn ticket(_: &mut KernelConnection<ServerConnectionData>, _: &[u8]) -> Result<(), rustls::Error> {
        Err(rustls::Error::General("a client sent a NewSessionTicket".into()))
    }
}

/// What a server config needs besides being built with
/// [`PROTOCOL_VERSIONS`] (TLS 1.3 only): rustls must hand the traffic keys
/// over after the handshake. A config without either fails every
/// handshake, saying so.
pub fn configure_server(config: &mut ServerConfig) {
    config.enable_secret_extraction = true;
}

/// The client's side of [`configure_server`].
pub fn configure_client(config: &mut ClientConfig) {
    config.enable_secret_extraction = true;
}

/// The protocol versions both ends' configs are built with.
pub const PROTOCOL_VERSIONS: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];

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

impl Plaintext {
    /// Puts `payload` into `to` as far as it has room (when nothing set
    /// aside comes first), the rest set aside for the next read.
    fn deliver(&mut self, to: Option<&mut ReadBuf<'_>>, payload: &[u8]) {
        let mut payload = payload;
        if let Some(to) = to {
            if self.is_empty() {
                let n = to.remaining().min(payload.len());
                to.put_slice(&payload[..n]);
                payload = &payload[n..];
            }
        }
        self.bytes.extend_from_slice(payload);
    }
}

/// What one call into rustls came to during the handshake.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Application data was delivered (a client may send its first data
    /// right behind its last handshake flight).
    Data,
    /// A TLS message (handshake, alert) was encoded for sending.
    Encoded,
    /// What was encoded must now be sent (the caller sends it).
    Transmit,
    /// Ready for application data, and no whole record left to decrypt.
    Writable,
    /// The handshake needs more bytes from the peer.
    NeedBytes,
    /// The peer closed the session.
    Closed,
}

/// One call of `process_tls_records` over the unprocessed bytes (none when
/// `read` is false), its state handled: data set aside in `plaintext`,
/// messages encoded into `out`. The processed bytes are dropped from
/// `incoming` whatever happened.
fn step<S: Session>(
    session: &mut S,
    incoming: &mut Incoming,
    out: &mut Outgoing,
    plaintext: &mut Plaintext,
    read: bool,
) -> Result<Step, rustls::Error> {
    let received = if read { &mut incoming.buf[incoming.start..incoming.end] } else { &mut [][..] };
    let UnbufferedStatus { mut discard, state } = session.process(received);
    let result = match state {
        Err(e) => Err(e),
        Ok(ConnectionState::ReadTraffic(mut traffic)) => {
            let mut result = Ok(Step::Data);
            while let Some(record) = traffic.next_record() {
                match record {
                    Ok(AppDataRecord { discard: more, payload }) => {
                        discard += more;
                        plaintext.deliver(None, payload);
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
            // The caller sends `out` before it reads anything else: to
            // rustls that is as good as sent.
            transmit.done();
            Ok(Step::Transmit)
        }
        Ok(ConnectionState::WriteTraffic(_)) => Ok(Step::Writable),
        Ok(ConnectionState::BlockedHandshake) => Ok(Step::NeedBytes),
        Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => Ok(Step::Closed),
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

/// What the two halves share after the handshake.
struct Shared<D> {
    /// rustls's key schedule: the next traffic secret at a key update, and
    /// the tickets a server sends.
    kernel: Mutex<KernelConnection<D>>,
    /// The peer asked (in its KeyUpdate) that our sending key change too.
    update_requested: AtomicBool,
    /// The first error either half met: the session is unusable after it.
    failed: OnceLock<rustls::Error>,
}

impl<D> Shared<D> {
    fn kernel(&self) -> MutexGuard<'_, KernelConnection<D>> {
        // A panic inside rustls's key schedule leaves nothing half-changed
        // that matters more than the session error it would be.
        self.kernel.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `e` as the session's end (the first one stays) and gives it
    /// back as the caller's error.
    fn fail(&self, e: rustls::Error) -> io::Error {
        let _ = self.failed.set(e);
        tls_error(self.failed.get().expect("set just now").clone())
    }

    fn check(&self) -> io::Result<()> {
        match self.failed.get() {
            Some(e) => Err(tls_error(e.clone())),
            None => Ok(()),
        }
    }
}

/// A TLS connection over TCP, its handshake done. [`TlsStream::into_split`]
/// gives its two halves.
pub struct TlsStream<S: Session> {
    io: TcpStream,
    incoming: Incoming,
    plaintext: Plaintext,
    rx: RecordKey,
    tx: RecordKey,
    kernel: KernelConnection<S::Data>,
    /// Records one sending key may seal before it is replaced (the suite's
    /// confidentiality limit).
    key_limit: u64,
    meter: Option<BufferMeter>,
}

impl TlsStream<UnbufferedClientConnection> {
    /// The client's handshake with the server at the other end of `io`,
    /// checking its certificate for `name`. `config` must be set up as
    /// [`configure_client`] says.
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
    /// `config` must be set up as [`configure_server`] says.
    pub async fn accept(config: Arc<ServerConfig>, io: TcpStream) -> Result<TlsStream<UnbufferedServerConnection>, HandshakeError> {
        let session = UnbufferedServerConnection::new(config).map_err(|e| HandshakeError { error: tls_error(e), seen: Vec::new() })?;
        TlsStream::handshake(io, session).await
    }
}

impl<S: Session> TlsStream<S> {
    /// Drives the handshake to its end, then takes the traffic keys over.
    /// No time limit of its own: callers bound it (the node by its
    /// handshake deadline, the client by its connect timeout).
    async fn handshake(mut io: TcpStream, mut session: S) -> Result<TlsStream<S>, HandshakeError> {
        let mut incoming = Incoming::new();
        let mut plaintext = Plaintext::default();
        let mut out = Outgoing::new();
        let mut seen = Vec::new();
        loop {
            // Once the handshake is done rustls is given no more received
            // bytes: what it still has to send (the client's Finished, the
            // server's tickets) it encodes from its own state, and every
            // record after the peer's Finished is the record layer's. Were
            // rustls to read on, it would act on records itself: a
            // KeyUpdate asking for ours would have its answer queued
            // inside rustls, where the hand-over drops it, and our next
            // records would use a key the peer was never told of.
            let read = session.handshaking();
            match step(&mut session, &mut incoming, &mut out, &mut plaintext, read) {
                Err(e) => {
                    // Where rustls refused, it queued an alert that tells
                    // the peer why: the next call hands it over before it
                    // looks at any received byte. One call only: a second
                    // would parse the bytes that failed again, and rustls
                    // sends one fatal alert per session. Sent best effort;
                    // the caller's deadline bounds it.
                    if let Ok(Step::Encoded) = step(&mut session, &mut incoming, &mut out, &mut plaintext, read) {
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
                Ok(Step::Writable | Step::Data) if !session.handshaking() => {
                    if let Err(error) = io.write_all(out.unsent()).await {
                        return Err(HandshakeError { error, seen });
                    }
                    return match TlsStream::take_over(io, session, incoming, plaintext) {
                        Ok(stream) => Ok(stream),
                        Err(error) => Err(HandshakeError { error, seen }),
                    };
                }
                Ok(Step::Writable | Step::Data | Step::NeedBytes) if !read => {
                    let error = io::Error::other("rustls asked for received bytes after its handshake was done");
                    return Err(HandshakeError { error, seen });
                }
                // A server may send data before the client's last flight
                // arrived (and is verified): wait for it.
                Ok(Step::Writable | Step::Data | Step::NeedBytes) => {
                    let room = incoming.room();
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
                    incoming.end += n;
                }
                Ok(Step::Closed) => {
                    let error = io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the TLS session during its handshake");
                    return Err(HandshakeError { error, seen });
                }
            }
        }
    }

    /// The traffic keys from rustls, for [`records`]; what rustls decrypted
    /// and what it left unread stay where they are.
    fn take_over(io: TcpStream, session: S, incoming: Incoming, plaintext: Plaintext) -> io::Result<TlsStream<S>> {
        let refused = |e: rustls::Error| {
            io::Error::other(format!(
                "the TLS session could not hand its traffic keys over ({e}): the config must allow TLS 1.3 only and set \
                 enable_secret_extraction (kvplane_tls::configure_server / configure_client)"
            ))
        };
        let (secrets, kernel) = session.into_kernel().map_err(refused)?;
        if kernel.protocol_version() != rustls::ProtocolVersion::TLSv1_3 {
            return Err(refused(rustls::Error::General(format!("{:?} was negotiated", kernel.protocol_version()))));
        }
        let key_limit = kernel.negotiated_cipher_suite().tls13().map_or(u64::MAX, |s| s.common.confidentiality_limit);
        let (tx_seq, tx) = secrets.tx;
        let (rx_seq, rx) = secrets.rx;
        let tx = RecordKey::new(tx, tx_seq).map_err(refused)?;
        let rx = RecordKey::new(rx, rx_seq).map_err(refused)?;
        Ok(TlsStream { io, incoming, plaintext, rx, tx, kernel, key_limit, meter: None })
    }

    /// The reading and the writing half, usable from different tasks.
    pub fn into_split(self) -> (TlsReadHalf<S>, TlsWriteHalf<S>) {
        let (r, w) = self.io.into_split();
        let shared =
            Arc::new(Shared { kernel: Mutex::new(self.kernel), update_requested: AtomicBool::new(false), failed: OnceLock::new() });
        let out = Outgoing::metered(self.meter);
        (
            TlsReadHalf {
                io: r,
                incoming: self.incoming,
                plaintext: self.plaintext,
                key: self.rx,
                peer_closed: false,
                updates_in_a_row: 0,
                shared: Arc::clone(&shared),
            },
            TlsWriteHalf { io: w, out, key: self.tx, key_limit: self.key_limit, shared, shut: false },
        )
    }

    /// Counts this connection's receive and send buffers into `meter` from
    /// now until they are dropped (the receive buffer of [`READ_BUFFER_BYTES`]
    /// at once, the send buffer as it grows, up to a chunk of
    /// [`WRITE_CHUNK_BYTES`] and its records' overhead).
    pub fn metered(mut self, meter: BufferMeter) -> TlsStream<S> {
        self.incoming.metered(meter.clone());
        self.meter = Some(meter);
        self
    }

    /// Makes the sending key change after `records` records instead of the
    /// suite's confidentiality limit (tests reach a key update this way).
    #[cfg(test)]
    fn with_key_limit(mut self, records: u64) -> TlsStream<S> {
        self.key_limit = records;
        self
    }
}

/// The reading half of a [`TlsStream`].
pub struct TlsReadHalf<S: Session> {
    io: OwnedReadHalf,
    /// Received TLS bytes not yet opened.
    incoming: Incoming,
    /// Opened application data the caller's buffer had no room for.
    plaintext: Plaintext,
    key: RecordKey,
    /// The peer sent close_notify (or closed between records).
    peer_closed: bool,
    /// KeyUpdates received since the last record of application data
    /// that carried any.
    updates_in_a_row: u32,
    shared: Arc<Shared<S::Data>>,
}

impl<S: Session> TlsReadHalf<S> {
    /// Opens every whole record received while the caller's buffer has
    /// room: application data into `buf` (straight into it when the whole
    /// record fits; the rest of a record that does not is set aside),
    /// alerts and post-handshake messages handled.
    fn open_records(&mut self, buf: &mut ReadBuf<'_>) -> Result<(), rustls::Error> {
        while buf.remaining() > 0 && self.plaintext.is_empty() && !self.peer_closed {
            let Some(len) = records::whole_record(&self.incoming.buf[self.incoming.start..self.incoming.end])? else {
                break;
            };
            let at = self.incoming.start..self.incoming.start + len;
            let room = records::opened_len(len);
            if buf.remaining() >= room {
                // Straight into the caller's buffer; only a record that
                // opened is counted in it.
                let out = &mut buf.initialize_unfilled_to(room)[..room];
                let opened = records::open_into(&mut self.key, &self.incoming.buf[at.clone()], out);
                if opened.is_err() {
                    // What a failed tag left there is no one's to see.
                    out.fill(0);
                }
                let (kind, n) = opened?;
                if kind == records::APPLICATION_DATA {
                    // Empty records of data do not reset it.
                    if n > 0 {
                        self.updates_in_a_row = 0;
                    }
                    buf.advance(n);
                } else {
                    let content = out[..n].to_vec();
                    self.control(kind, &content)?;
                }
            } else {
                let record = &mut self.incoming.buf[at.clone()];
                let (kind, content) = records::open_in_place(&mut self.key, record)?;
                if kind == records::APPLICATION_DATA {
                    if !content.is_empty() {
                        self.updates_in_a_row = 0;
                    }
                    self.plaintext.deliver(Some(&mut *buf), &record[content]);
                } else {
                    let content = record[content].to_vec();
                    self.control(kind, &content)?;
                }
            }
            self.incoming.start = at.end;
            if self.incoming.start == self.incoming.end {
                self.incoming.start = 0;
                self.incoming.end = 0;
            }
        }
        Ok(())
    }

    /// A record that is not application data: an alert, or a message of
    /// the key schedule.
    fn control(&mut self, kind: u8, content: &[u8]) -> Result<(), rustls::Error> {
        match kind {
            records::ALERT => {
                records::alert(content)?;
                self.peer_closed = true;
                Ok(())
            }
            records::HANDSHAKE => {
                for message in records::post_handshake(content)? {
                    match message {
                        PostHandshake::KeyUpdate { requested } => {
                            // Each costs a key derivation: a peer gets a few
                            // in a row, not a stream of them.
                            self.updates_in_a_row += 1;
                            if self.updates_in_a_row > MAX_KEY_UPDATES_IN_A_ROW {
                                return Err(rustls::Error::General(format!(
                                    "the peer sent more than {MAX_KEY_UPDATES_IN_A_ROW} TLS KeyUpdates with no data between them"
                                )));
                            }
                            let (seq, secrets) = self.shared.kernel().update_rx_secret()?;
                            self.key = RecordKey::new(secrets, seq)?;
                            if requested {
                                self.shared.update_requested.store(true, Ordering::Release);
                            }
                        }
                        PostHandshake::Ticket(body) => S::ticket(&mut self.shared.kernel(), body)?,
                    }
                }
                Ok(())
            }
            other => Err(rustls::Error::General(format!("a TLS record of content type {other} after the handshake"))),
        }
    }
}

impl<S: Session> AsyncRead for TlsReadHalf<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            this.shared.check()?;
            if !this.plaintext.is_empty() {
                this.plaintext.take_into(buf);
                return Poll::Ready(Ok(()));
            }
            if this.peer_closed || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let before = buf.filled().len();
            if let Err(e) = this.open_records(buf) {
                return Poll::Ready(Err(this.shared.fail(e)));
            }
            if buf.filled().len() > before || this.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if !this.plaintext.is_empty() {
                continue;
            }
            // Nothing whole left (or only tickets and key updates): read
            // from the socket.
            let room = this.incoming.room();
            let mut read = ReadBuf::new(room);
            std::task::ready!(Pin::new(&mut this.io).poll_read(cx, &mut read))?;
            let n = read.filled().len();
            if n == 0 {
                if this.incoming.start == this.incoming.end {
                    // The peer closed between records without a
                    // close_notify. The frames above carry their lengths,
                    // so a cut inside one is still caught.
                    this.peer_closed = true;
                    return Poll::Ready(Ok(()));
                }
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection inside a TLS record",
                )));
            }
            this.incoming.end += n;
        }
    }
}

/// The writing half of a [`TlsStream`].
pub struct TlsWriteHalf<S: Session> {
    io: OwnedWriteHalf,
    /// Sealed bytes not yet sent.
    out: Outgoing,
    key: RecordKey,
    key_limit: u64,
    shared: Arc<Shared<S::Data>>,
    shut: bool,
}

impl<S: Session> TlsWriteHalf<S> {
    /// Sends what is sealed, until all of it is or the socket is full.
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

    /// Seals one record into `out`, replacing the key first when it is at
    /// its limit.
    fn seal(&mut self, kind: u8, fragment: &[u8]) -> Result<(), rustls::Error> {
        if self.key.seq().saturating_add(1) >= self.key_limit {
            self.update_key()?;
        }
        let len = records::sealed_len(fragment.len());
        records::seal(&mut self.key, kind, fragment, &mut self.out.spare(len)[..len])?;
        self.out.filled += len;
        Ok(())
    }

    /// Tells the peer our next records use our next key (a KeyUpdate sealed
    /// with the current one), then takes it (RFC 8446 4.6.3).
    fn update_key(&mut self) -> Result<(), rustls::Error> {
        let len = records::sealed_len(records::KEY_UPDATE_NOT_REQUESTED.len());
        records::seal(&mut self.key, records::HANDSHAKE, &records::KEY_UPDATE_NOT_REQUESTED, &mut self.out.spare(len)[..len])?;
        self.out.filled += len;
        let (seq, secrets) = self.shared.kernel().update_tx_secret()?;
        self.key = RecordKey::new(secrets, seq)?;
        Ok(())
    }

    /// Seals up to [`WRITE_CHUNK_BYTES`] of `bufs` into `out` (after the
    /// KeyUpdate the peer asked for, if it did), then a close_notify if
    /// `close`; returns how much plaintext it took.
    fn encrypt(&mut self, bufs: &[io::IoSlice<'_>], close: bool) -> io::Result<usize> {
        self.shared.check()?;
        self.seal_chunk(bufs, close).map_err(|e| self.shared.fail(e))
    }

    /// [`TlsWriteHalf::encrypt`]'s work; an error ends the session.
    fn seal_chunk(&mut self, bufs: &[io::IoSlice<'_>], close: bool) -> Result<usize, rustls::Error> {
        if self.shared.update_requested.swap(false, Ordering::AcqRel) {
            self.update_key()?;
        }
        let mut taken = 0;
        for slice in bufs.iter().filter(|s| !s.is_empty()) {
            // A chunk of plaintext, or of sealed bytes where many small
            // slices (a record each) make those the more.
            let room = WRITE_CHUNK_BYTES.saturating_sub(taken.max(self.out.filled));
            if room == 0 {
                break;
            }
            let plain = &slice[..slice.len().min(room)];
            // Grown once for the slice, not record by record.
            self.out.spare(plain.len() + plain.len().div_ceil(records::MAX_FRAGMENT_BYTES) * RECORD_OVERHEAD_BYTES);
            for fragment in plain.chunks(records::MAX_FRAGMENT_BYTES) {
                self.seal(records::APPLICATION_DATA, fragment)?;
            }
            taken += plain.len();
        }
        if close {
            self.seal(records::ALERT, &records::CLOSE_NOTIFY)?;
        }
        Ok(taken)
    }
}

impl<S: Session> AsyncWrite for TlsWriteHalf<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.shut {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "written after the TLS session's close_notify")));
        }
        // What was sealed before goes first: new plaintext is taken only
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
        if this.shared.update_requested.load(Ordering::Acquire) {
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
