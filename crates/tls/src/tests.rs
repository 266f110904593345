//! Real handshakes over loopback TCP with certificates made here.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// A CA and a server certificate for 127.0.0.1 signed by it.
struct Pki {
    ca: CertificateDer<'static>,
    server: ServerConfig,
}

fn pki() -> Pki {
    pki_named("test CA")
}

fn pki_named(ca_name: &str) -> Pki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, ca_name);
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    let mut server = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())))
        .unwrap();
    configure_server(&mut server);
    Pki { ca: ca.der().clone(), server }
}

fn client_config(ca: &CertificateDer<'static>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(PROTOCOL_VERSIONS)
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    configure_client(&mut config);
    Arc::new(config)
}

/// Every test ends within a minute: a session that stalls fails, it does
/// not hang the suite.
async fn within<F: std::future::Future<Output = ()>>(test: F) {
    tokio::time::timeout(Duration::from_secs(60), test).await.expect("the test made no progress in 60 s");
}

fn name() -> ServerName<'static> {
    ServerName::try_from("127.0.0.1").unwrap()
}

/// Byte `i` of a stream of `seed`: every position distinct enough that a
/// reordered, dropped or doubled piece shows.
fn byte(seed: u64, i: u64) -> u8 {
    let x = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

async fn send_pattern<W: AsyncWrite + Unpin>(w: &mut W, seed: u64, len: u64, rng: &mut fastrand::Rng) {
    let mut at = 0;
    while at < len {
        // Mixed shapes: tiny writes, record-sized ones, several slices at once.
        let n = match rng.u8(..4) {
            0 => rng.u64(1..64),
            1 => rng.u64(1..40_000),
            _ => rng.u64(1..600_000),
        }
        .min(len - at);
        let piece: Vec<u8> = (at..at + n).map(|i| byte(seed, i)).collect();
        if rng.bool() {
            w.write_all(&piece).await.unwrap();
        } else {
            let (a, b) = piece.split_at(piece.len() / 2);
            let mut done = 0;
            while done < piece.len() {
                let (a, b) = if done < a.len() { (&a[done..], b) } else { (&b[done - a.len()..], &b[..0]) };
                done += w.write_vectored(&[io::IoSlice::new(a), io::IoSlice::new(b)]).await.unwrap();
            }
        }
        at += n;
    }
    w.flush().await.unwrap();
}

async fn check_pattern<R: AsyncRead + Unpin>(r: &mut R, seed: u64, len: u64, rng: &mut fastrand::Rng) {
    let mut at = 0;
    let mut buf = vec![0u8; 700_000];
    while at < len {
        let want = match rng.u8(..3) {
            0 => rng.usize(1..8),
            1 => rng.usize(1..20_000),
            _ => rng.usize(1..700_000),
        };
        let n = r.read(&mut buf[..want]).await.unwrap();
        assert!(n > 0, "the stream ended at byte {at} of {len}");
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(*b, byte(seed, at + k as u64), "byte {} differs", at + k as u64);
        }
        at += n as u64;
    }
}

async fn pair(pki: &Pki) -> (TlsStream<UnbufferedClientConnection>, TlsStream<UnbufferedServerConnection>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Arc::new(pki.server.clone());
    let accepted = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        TlsStream::accept(server, tcp).await.unwrap()
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let client = TlsStream::connect(client_config(&pki.ca), name(), tcp).await.unwrap();
    (client, accepted.await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_cross_both_ways_at_once_intact_whatever_the_read_and_write_sizes() {
    within(async {
        let pki = pki();
        let (client, server) = pair(&pki).await;
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        const LEN: u64 = 24 << 20;
        let tasks = [
            tokio::spawn(async move { send_pattern(&mut cw, 1, LEN, &mut fastrand::Rng::with_seed(11)).await }),
            tokio::spawn(async move { check_pattern(&mut sr, 1, LEN, &mut fastrand::Rng::with_seed(12)).await }),
            tokio::spawn(async move { send_pattern(&mut sw, 2, LEN, &mut fastrand::Rng::with_seed(13)).await }),
            tokio::spawn(async move { check_pattern(&mut cr, 2, LEN, &mut fastrand::Rng::with_seed(14)).await }),
        ];
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meter_counts_each_connections_buffers_within_their_bound_and_nothing_once_they_are_dropped() {
    within(async {
        let pki = pki();
        let meter = BufferMeter::default();
        let mut connections = Vec::new();
        for _ in 0..3 {
            let (client, server) = pair(&pki).await;
            connections.push((client.into_split(), server.metered(meter.clone()).into_split()));
        }
        assert_eq!(meter.bytes(), 3 * READ_BUFFER_BYTES, "a receive buffer each, counted at once");
        // Each server sends 4 MiB in writes of up to 600 KB: its send
        // buffer grows past half a chunk.
        const LEN: u64 = 4 << 20;
        for (seed, ((cr, _), (_, sw))) in connections.iter_mut().enumerate() {
            let seed = seed as u64;
            let (mut send_rng, mut read_rng) = (fastrand::Rng::with_seed(seed), fastrand::Rng::with_seed(seed + 100));
            tokio::join!(send_pattern(sw, seed, LEN, &mut send_rng), check_pattern(cr, seed, LEN, &mut read_rng));
        }
        let bound = READ_BUFFER_BYTES + WRITE_CHUNK_BYTES + WRITE_CHUNK_BYTES.div_ceil(1 << 14) * RECORD_OVERHEAD_BYTES;
        let held = meter.bytes();
        assert!(held > 3 * (READ_BUFFER_BYTES + WRITE_CHUNK_BYTES / 2), "the send buffers were counted as they grew: {held}");
        assert!(held <= 3 * bound, "{held} bytes held, over 3 x {bound}");
        // The client halves are not metered; dropping a server's halves
        // takes its buffers off, the receive buffer with the last half.
        let ((_, _), (sr, sw)) = connections.pop().unwrap();
        drop(sw);
        assert!(meter.bytes() < held, "a dropped send buffer is taken off");
        drop(sr);
        drop(connections);
        assert_eq!(meter.bytes(), 0, "nothing is counted once every buffer is dropped");
    })
    .await;
}

#[tokio::test]
async fn a_shutdown_sends_close_notify_and_the_peer_reads_the_end_after_every_byte() {
    within(async {
        let pki = pki();
        let (client, server) = pair(&pki).await;
        let (_cr, mut cw) = client.into_split();
        let (mut sr, _sw) = server.into_split();
        cw.write_all(&[7u8; 100_000]).await.unwrap();
        cw.shutdown().await.unwrap();
        let mut got = Vec::new();
        sr.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), 100_000);
        assert!(got.iter().all(|b| *b == 7));
        assert!(sr.peer_closed, "the end came from close_notify");
    })
    .await;
}

/// Relays both ways between a client and `server`, flipping one bit of the
/// client's byte number `at`.
async fn corrupting_relay(server: std::net::SocketAddr, at: usize) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let upstream = TcpStream::connect(server).await.unwrap();
        let (mut cr, mut cw) = client.into_split();
        let (mut ur, mut uw) = upstream.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut ur, &mut cw).await;
        });
        let mut seen = 0;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if (seen..seen + n).contains(&at) {
                buf[at - seen] ^= 0x10;
            }
            seen += n;
            if uw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    addr
}

#[tokio::test]
async fn a_bit_flipped_on_the_wire_fails_the_read_and_no_byte_of_its_record_is_delivered() {
    within(async {
        let pki = pki();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server_addr = listener.local_addr().unwrap();
        // Well past the handshake (a few KiB), inside the data.
        let relay = corrupting_relay(server_addr, 300_000).await;
        let server = Arc::new(pki.server.clone());
        let accepted = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            TlsStream::accept(server, tcp).await.unwrap()
        });
        let client = TlsStream::connect(client_config(&pki.ca), name(), TcpStream::connect(relay).await.unwrap()).await.unwrap();
        let (_cr, mut cw) = client.into_split();
        let (mut sr, _sw) = accepted.await.unwrap().into_split();
        let sent: Vec<u8> = (0..1_000_000u64).map(|i| byte(3, i)).collect();
        let writer = tokio::spawn(async move {
            let _ = cw.write_all(&sent).await;
            let _ = cw.flush().await;
            cw
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 50_000];
        let error = loop {
            match sr.read(&mut buf).await {
                Ok(0) => panic!("the stream ended after {} bytes without an error", got.len()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
        };
        let inner = error.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>());
        assert_eq!(inner, Some(&rustls::Error::DecryptError), "{error}");
        assert!(got.len() < 300_000, "{} bytes delivered, past the altered one", got.len());
        assert!(got.iter().enumerate().all(|(i, b)| *b == byte(3, i as u64)), "a delivered byte differs from what was sent");
        // The error sticks: the session is not used again.
        assert!(sr.read(&mut buf).await.is_err());
        drop(writer);
    })
    .await;
}

#[tokio::test]
async fn a_certificate_from_another_ca_fails_both_handshakes_and_each_side_says_why() {
    within(async {
        let pki = pki();
        let other = pki_with_other_ca();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Arc::new(pki.server.clone());
        let accepted = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            TlsStream::accept(server, tcp).await.map(|_| ())
        });
        let client = TlsStream::connect(client_config(&other), name(), TcpStream::connect(addr).await.unwrap()).await;
        let client = client.err().expect("the client trusted a certificate of another CA");
        let inner = client.error.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>());
        assert!(
            matches!(inner, Some(rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer))),
            "client: {}",
            client.error
        );
        let server = accepted.await.unwrap().expect_err("the server completed a refused handshake");
        let inner = server.error.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>());
        assert!(matches!(inner, Some(rustls::Error::AlertReceived(_))), "server: {} (the client's alert never arrived)", server.error);
    })
    .await;
}

fn pki_with_other_ca() -> CertificateDer<'static> {
    pki_named("another CA").ca
}

#[tokio::test]
async fn a_peer_that_answers_in_plaintext_fails_the_handshake_with_its_bytes_recorded() {
    within(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut hello = [0u8; 1];
            let _ = tcp.read(&mut hello).await;
            let _ = tcp.write_all(b"KVPL plaintext answer").await;
        });
        let pki = pki();
        let failed = TlsStream::connect(client_config(&pki.ca), name(), TcpStream::connect(addr).await.unwrap()).await;
        let failed = failed.err().expect("a plaintext peer completed a TLS handshake");
        assert!(failed.seen.starts_with(b"KVPL"), "seen: {:?}", failed.seen);
    })
    .await;
}

// rustls's own record layer as the peer: its buffered connection over a
// blocking socket on a thread of its own. What our record layer seals, the
// reference opens, and the other way round, through key updates of both
// ends (ours at a low key limit, rustls's on request) and the session
// tickets a server sends after its handshake.

fn reference_read(stream: &mut impl std::io::Read, seed: u64, len: u64) {
    let mut buf = vec![0u8; 100_000];
    let mut at = 0;
    while at < len {
        let want = buf.len().min((len - at) as usize);
        let n = stream.read(&mut buf[..want]).unwrap();
        assert!(n > 0, "the reference peer's stream ended at byte {at} of {len}");
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(*b, byte(seed, at + k as u64), "the reference peer read byte {} wrong", at + k as u64);
        }
        at += n as u64;
    }
}

fn reference_write(stream: &mut impl std::io::Write, seed: u64, len: u64) {
    let bytes: Vec<u8> = (0..len).map(|i| byte(seed, i)).collect();
    stream.write_all(&bytes).unwrap();
    stream.flush().unwrap();
}

/// A client session store that counts the TLS 1.3 tickets put in it.
#[derive(Debug)]
struct CountingTickets {
    inner: rustls::client::ClientSessionMemoryCache,
    tickets: std::sync::atomic::AtomicUsize,
}

impl rustls::client::ClientSessionStore for CountingTickets {
    fn set_kx_hint(&self, name: ServerName<'static>, group: rustls::NamedGroup) {
        self.inner.set_kx_hint(name, group)
    }
    fn kx_hint(&self, name: &ServerName<'_>) -> Option<rustls::NamedGroup> {
        self.inner.kx_hint(name)
    }
    fn set_tls12_session(&self, name: ServerName<'static>, value: rustls::client::Tls12ClientSessionValue) {
        self.inner.set_tls12_session(name, value)
    }
    fn tls12_session(&self, name: &ServerName<'_>) -> Option<rustls::client::Tls12ClientSessionValue> {
        self.inner.tls12_session(name)
    }
    fn remove_tls12_session(&self, name: &ServerName<'static>) {
        self.inner.remove_tls12_session(name)
    }
    fn insert_tls13_ticket(&self, name: ServerName<'static>, value: rustls::client::Tls13ClientSessionValue) {
        self.tickets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.insert_tls13_ticket(name, value)
    }
    fn take_tls13_ticket(&self, name: &ServerName<'static>) -> Option<rustls::client::Tls13ClientSessionValue> {
        self.inner.take_tls13_ticket(name)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_and_rustls_own_server_exchange_bytes_through_key_updates_of_both_and_its_tickets() {
    within(async {
        let pki = pki();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server_config = Arc::new(pki.server.clone());
        assert!(server_config.send_tls13_tickets > 0, "the reference server sends tickets after its handshake");
        const LEN: u64 = 3 << 20;
        let reference = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            let mut tls = rustls::StreamOwned::new(rustls::ServerConnection::new(server_config).unwrap(), tcp);
            reference_read(&mut tls, 1, LEN);
            // A KeyUpdate asking for ours: its next records use its next
            // key, and ours must change before our next data.
            tls.conn.refresh_traffic_keys().unwrap();
            reference_write(&mut tls, 2, LEN);
            reference_read(&mut tls, 3, LEN);
            tls.conn.send_close_notify();
            std::io::Write::flush(&mut tls).unwrap();
        });
        let store = Arc::new(CountingTickets { inner: rustls::client::ClientSessionMemoryCache::new(8), tickets: 0.into() });
        let mut config = Arc::unwrap_or_clone(client_config(&pki.ca));
        config.resumption = rustls::client::Resumption::store(store.clone());
        let tcp = TcpStream::connect(addr).await.unwrap();
        // Our key changes every 7 records: about 27 times in 3 MiB.
        let client = TlsStream::connect(Arc::new(config), name(), tcp).await.unwrap().with_key_limit(7);
        let (mut cr, mut cw) = client.into_split();
        let mut rng = fastrand::Rng::with_seed(21);
        send_pattern(&mut cw, 1, LEN, &mut rng).await;
        check_pattern(&mut cr, 2, LEN, &mut rng).await;
        assert!(cw.shared.update_requested.load(Ordering::Acquire), "the reference's KeyUpdate asked for ours");
        send_pattern(&mut cw, 3, LEN, &mut rng).await;
        assert!(!cw.shared.update_requested.load(Ordering::Acquire), "our KeyUpdate went ahead of our data");
        let mut rest = Vec::new();
        cr.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty() && cr.peer_closed, "the reference's close_notify ends the stream");
        reference.join().expect("the reference peer read every byte we sealed");
        assert!(store.tickets.load(std::sync::atomic::Ordering::Relaxed) > 0, "the server's tickets reached rustls's store");
    })
    .await;
}

/// Our server's end of a connection from rustls's own client, which
/// `script` drives (from its TCP stream and a client config trusting the
/// server) on a thread of its own.
async fn our_server_and_a_reference_client(
    script: impl FnOnce(std::net::TcpStream, Arc<ClientConfig>) + Send + 'static,
) -> (TlsStream<UnbufferedServerConnection>, std::thread::JoinHandle<()>) {
    let pki = pki();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = client_config(&pki.ca);
    let reference = std::thread::spawn(move || script(std::net::TcpStream::connect(addr).unwrap(), config));
    let (tcp, _) = listener.accept().await.unwrap();
    (TlsStream::accept(Arc::new(pki.server.clone()), tcp).await.unwrap(), reference)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_server_and_rustls_own_client_exchange_bytes_through_key_updates_of_both() {
    within(async {
        const LEN: u64 = 3 << 20;
        let (server, reference) = our_server_and_a_reference_client(|tcp, config| {
            let mut tls = rustls::StreamOwned::new(rustls::ClientConnection::new(config, name()).unwrap(), tcp);
            reference_read(&mut tls, 1, LEN);
            tls.conn.refresh_traffic_keys().unwrap();
            reference_write(&mut tls, 2, LEN);
            reference_read(&mut tls, 3, LEN);
        })
        .await;
        let server = server.with_key_limit(5);
        let (mut sr, mut sw) = server.into_split();
        let mut rng = fastrand::Rng::with_seed(22);
        send_pattern(&mut sw, 1, LEN, &mut rng).await;
        check_pattern(&mut sr, 2, LEN, &mut rng).await;
        send_pattern(&mut sw, 3, LEN, &mut rng).await;
        reference.join().expect("the reference peer read every byte we sealed");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_update_right_behind_the_clients_finished_is_the_record_layers_and_is_answered() {
    within(async {
        const LEN: u64 = 1 << 20;
        let (server, reference) = our_server_and_a_reference_client(|mut tcp, config| {
            use std::io::Write;
            let mut conn = rustls::ClientConnection::new(config, name()).unwrap();
            // The handshake by hand, so that the client's Finished and a
            // KeyUpdate asking for ours leave in one flight.
            while conn.is_handshaking() {
                while conn.wants_write() {
                    conn.write_tls(&mut tcp).unwrap();
                }
                if !conn.is_handshaking() {
                    break;
                }
                conn.read_tls(&mut tcp).unwrap();
                conn.process_new_packets().unwrap();
            }
            conn.refresh_traffic_keys().unwrap();
            let mut flight = Vec::new();
            while conn.wants_write() {
                conn.write_tls(&mut flight).unwrap();
            }
            tcp.write_all(&flight).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            // Data under its next key, behind the KeyUpdate.
            tls.write_all(b"after the update").unwrap();
            tls.flush().unwrap();
            reference_read(&mut tls, 1, LEN);
        })
        .await;
        let (mut sr, mut sw) = server.into_split();
        // The data behind the KeyUpdate opens under the client's next key,
        // and our answer goes ahead of our data, which the reference opens.
        let mut after = [0u8; 16];
        sr.read_exact(&mut after).await.unwrap();
        assert_eq!(&after, b"after the update");
        assert!(sw.shared.update_requested.load(Ordering::Acquire), "the KeyUpdate reached the record layer");
        send_pattern(&mut sw, 1, LEN, &mut fastrand::Rng::with_seed(23)).await;
        reference.join().expect("the reference read what we sealed after its KeyUpdate");
    })
    .await;
}

#[tokio::test]
async fn a_peer_gets_32_key_updates_in_a_row_and_not_33() {
    within(async {
        let pki = pki();
        for (updates, refused) in [(MAX_KEY_UPDATES_IN_A_ROW, false), (MAX_KEY_UPDATES_IN_A_ROW + 1, true)] {
            let (client, server) = pair(&pki).await;
            let (_cr, mut cw) = client.into_split();
            let (mut sr, _sw) = server.into_split();
            for _ in 0..updates {
                cw.update_key().unwrap();
            }
            cw.write_all(b"data").await.unwrap();
            cw.flush().await.unwrap();
            let mut got = [0u8; 4];
            let read = sr.read_exact(&mut got).await;
            if refused {
                let error = read.expect_err("the 33rd KeyUpdate in a row was taken");
                assert!(error.to_string().contains("KeyUpdates with no data between them"), "{error}");
            } else {
                read.unwrap();
                assert_eq!(&got, b"data");
            }
        }
    })
    .await;
}
