//! The local shared-memory path end to end: a real node on a Unix socket,
//! the real client (which picks the path by itself), and hand-made hostile
//! clients that test the trust boundary docs/protocol.md draws: a client's
//! memory is its own, a stored block cannot be changed through it, resizing
//! it is refused and abandoning it mid-transfer changes nothing for the node,
//! and a block being read is never reused under the reader.

#![allow(unsafe_code)] // The hostile client: recvmsg and ftruncate on the node's memfd, by hand.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvplane_client::{Client, ClientConfig, Connection, Endpoint, KvError};
use kvplane_node::memory::PoolConfig;
use kvplane_node::server::{Node, NodeConfig};
use kvplane_protocol::{encode, Features, Frame, Hello, Request, HEADER_LEN};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PATIENCE: Duration = Duration::from_secs(30);

async fn node(dir: &tempfile::TempDir, memory: usize, shm: usize) -> Node {
    let config = NodeConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        admin: None,
        unix: Some(dir.path().join("node.sock")),
        pool: PoolConfig::new(memory),
        shm_region_bytes: shm,
        ..NodeConfig::default()
    };
    Node::start(config).await.expect("node starts")
}

fn unix(node: &Node) -> Endpoint {
    Endpoint::Unix(node.unix_path().unwrap().to_path_buf())
}

fn stat(node: &Node, name: &str) -> u64 {
    node.stats().into_iter().find(|(n, _)| n == name).map(|(_, v)| v).unwrap()
}

fn block(seed: u8, len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect::<Vec<u8>>())
}

#[tokio::test]
async fn the_client_moves_blocks_through_shared_memory_on_a_unix_socket_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir, 256 * MIB, 64 * MIB).await;
    let c = Client::connect(ClientConfig::new(unix(&n))).await.unwrap();
    assert!(c.connection().await.unwrap().shared_memory().is_some(), "a Unix-socket connection got shared memory");
    let entries: Vec<(Bytes, Bytes)> = (0..8).map(|i| (Bytes::from(format!("k{i}")), block(i, 2 * MIB))).collect();
    let received = stat(&n, "bytes_received");
    assert!(c.put(entries.clone()).await.unwrap().iter().all(Result::is_ok));
    let got = c.get(entries.iter().map(|(k, _)| k.clone()).collect()).await.unwrap();
    for ((k, v), r) in entries.iter().zip(got) {
        assert_eq!(&r.unwrap(), v, "{k:?}");
    }
    // 16 MiB went in and came out; only keys, offsets and statuses crossed the socket.
    assert!(stat(&n, "bytes_received") - received < 64 * KIB as u64, "block bytes crossed the socket");
    assert!(stat(&n, "bytes_sent") < 64 * KIB as u64);

    // Over TCP, or from a node that shares no memory, the same calls use the socket.
    let tcp = Client::connect(ClientConfig::new(Endpoint::Tcp(n.tcp_addr().unwrap().to_string()))).await.unwrap();
    assert!(tcp.connection().await.unwrap().shared_memory().is_none());
    assert_eq!(tcp.get(vec![Bytes::from_static(b"k3")]).await.unwrap()[0].as_ref().unwrap(), &entries[3].1);
    let dir2 = tempfile::tempdir().unwrap();
    let plain = node(&dir2, 64 * MIB, 0).await;
    let c2 = Client::connect(ClientConfig::new(unix(&plain))).await.unwrap();
    assert!(c2.connection().await.unwrap().shared_memory().is_none(), "--shm-region 0 offers none");
    assert!(c2.put(vec![(Bytes::from_static(b"a"), block(1, 4 * KIB))]).await.unwrap()[0].is_ok());
    assert_eq!(c2.get(vec![Bytes::from_static(b"a")]).await.unwrap()[0].as_ref().unwrap(), &block(1, 4 * KIB));
}

/// A node holding `a` (64 KiB), `b` (100 bytes) and `c` (64 KiB), a client
/// of it through shared memory and one over TCP, and the keys `a`, `b`,
/// `c` and `absent` with the three values.
async fn three_stored(dir: &tempfile::TempDir) -> (Node, Client, Client, Vec<Bytes>, [Bytes; 3]) {
    let n = node(dir, 64 * MIB, 16 * MIB).await;
    let local = Client::connect(ClientConfig::new(unix(&n))).await.unwrap();
    assert!(local.connection().await.unwrap().shared_memory().is_some());
    let tcp = Client::connect(ClientConfig::new(Endpoint::Tcp(n.tcp_addr().unwrap().to_string()))).await.unwrap();
    let values = [block(1, 64 * KIB), block(2, 100), block(3, 64 * KIB)];
    let keys: Vec<Bytes> = [&b"a"[..], b"b", b"c", b"absent"].into_iter().map(Bytes::from_static).collect();
    let entries = keys.iter().zip(&values).map(|(k, v)| (k.clone(), v.clone())).collect();
    assert!(local.put(entries).await.unwrap().iter().all(Result::is_ok));
    (n, local, tcp, keys, values)
}

/// GET into the caller's memory, through shared memory and over TCP alike:
/// each value lands at the start of its destination and nothing past it; a
/// destination too small for its value is left untouched with a typed error
/// for that key alone; an absent key is not-found.
#[tokio::test]
async fn get_into_writes_each_value_into_its_destination_and_nothing_past_it() {
    let dir = tempfile::tempdir().unwrap();
    let (_node, local, tcp, keys, values) = three_stored(&dir).await;
    for (path, client) in [("shared memory", &local), ("tcp", &tcp)] {
        // a: room to spare; b: exactly its length; c: one byte short; absent.
        let mut bufs = [vec![0xEEu8; 64 * KIB + 10], vec![0xEEu8; 100], vec![0xEEu8; 64 * KIB - 1], vec![0xEEu8; 8]];
        let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let got = client.get_into(keys.clone(), &mut dests).await.unwrap();
        assert_eq!(got[0].as_ref().ok(), Some(&(64 * KIB)), "{path}");
        assert_eq!(got[1].as_ref().ok(), Some(&100), "{path}");
        assert!(matches!(got[2], Err(KvError::Capacity(_))), "{path}: {:?}", got[2]);
        assert!(matches!(got[3], Err(KvError::NotFound)), "{path}: {:?}", got[3]);
        assert_eq!(&bufs[0][..64 * KIB], &values[0][..], "{path}");
        assert!(bufs[0][64 * KIB..].iter().all(|&b| b == 0xEE), "{path}: written past the value");
        assert_eq!(&bufs[1][..], &values[1][..], "{path}");
        assert!(bufs[2].iter().chain(&bufs[3]).all(|&b| b == 0xEE), "{path}: a refused destination was written");
    }
    let mut one = [0u8; 4];
    let mismatched = local.get_into(keys.clone(), &mut [&mut one[..]]).await;
    assert!(matches!(mismatched, Err(KvError::Invalid(_))), "{mismatched:?}");
}

/// GET into a destination made of parts (a KV block whose layers lie in
/// separate tensors), through shared memory and over TCP alike: the value
/// fills the parts in order, nothing past its length is written, the bytes
/// pass the block's checksum however they are cut (over TCP it is computed
/// as each piece lands), and a value longer than all the parts together
/// leaves every part untouched.
#[tokio::test]
async fn get_into_parts_fills_the_parts_in_order_and_nothing_past_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let (_node, local, tcp, keys, values) = three_stored(&dir).await;
    for (path, client) in [("shared memory", &local), ("tcp", &tcp)] {
        // a: 65536 bytes over parts of 1000, 0, 40000 and 30000 (the last
        // one filled to 24536); b: exactly 60 + 40; c: one byte short of
        // 32 KiB + 32 KiB; absent.
        let sizes: [&[usize]; 4] = [&[1000, 0, 40_000, 30_000], &[60, 40], &[32 * KIB, 32 * KIB - 1], &[8]];
        let mut bufs: Vec<Vec<Vec<u8>>> = sizes.iter().map(|s| s.iter().map(|&len| vec![0xEEu8; len]).collect()).collect();
        let mut parts: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| b.iter_mut().map(Vec::as_mut_slice).collect()).collect();
        let mut dests: Vec<&mut [&mut [u8]]> = parts.iter_mut().map(Vec::as_mut_slice).collect();
        let got = client.get_into_parts(keys.clone(), &mut dests).await.unwrap();
        assert_eq!(got[0].as_ref().ok(), Some(&(64 * KIB)), "{path}: {:?}", got[0]);
        assert_eq!(got[1].as_ref().ok(), Some(&100), "{path}: {:?}", got[1]);
        assert!(matches!(got[2], Err(KvError::Capacity(_))), "{path}: {:?}", got[2]);
        assert!(matches!(got[3], Err(KvError::NotFound)), "{path}: {:?}", got[3]);
        let a: Vec<u8> = bufs[0].concat();
        assert_eq!(&a[..64 * KIB], &values[0][..], "{path}: the parts hold the value in order");
        assert!(a[64 * KIB..].iter().all(|&b| b == 0xEE), "{path}: written past the value");
        assert_eq!(bufs[1].concat(), values[1].to_vec(), "{path}");
        assert!(bufs[2].iter().chain(&bufs[3]).flatten().all(|&b| b == 0xEE), "{path}: a refused destination was written");
    }
}

/// Over TCP a large batch is split over several connections of the pool and
/// sent at once; each key's answer still lands in its own slot, in order,
/// for PUT, GET and GET into caller memory alike.
#[tokio::test]
async fn a_large_batch_is_striped_over_the_pool_and_answers_stay_in_key_order() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir, 256 * MIB, 0).await;
    let config = ClientConfig { connections: 4, ..ClientConfig::new(Endpoint::Tcp(n.tcp_addr().unwrap().to_string())) };
    let c = Client::connect(config).await.unwrap();
    // 32 x 64 KiB = 2 MiB: four stripes of 512 KiB. Distinct contents, and
    // one key in the middle deleted before the reads.
    let entries: Vec<(Bytes, Bytes)> = (0..32u8).map(|i| (Bytes::from(format!("s{i}")), block(i, 64 * KIB))).collect();
    assert!(c.put(entries.clone()).await.unwrap().iter().all(Result::is_ok));
    assert_eq!(stat(&n, "connections_total"), 4, "the PUT went out over every connection of the pool");
    assert_eq!(c.delete(vec![Bytes::from_static(b"s17")]).await.unwrap(), [true]);
    let keys: Vec<Bytes> = entries.iter().map(|(k, _)| k.clone()).collect();
    let got = c.get(keys.clone()).await.unwrap();
    let mut bufs: Vec<Vec<u8>> = (0..32).map(|_| vec![0u8; 64 * KIB]).collect();
    let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let into = c.get_into(keys, &mut dests).await.unwrap();
    for (i, (k, v)) in entries.iter().enumerate() {
        if k == "s17" {
            assert!(matches!(got[i], Err(KvError::NotFound)) && matches!(into[i], Err(KvError::NotFound)), "{k:?}");
            continue;
        }
        assert_eq!(got[i].as_ref().unwrap(), v, "{k:?}");
        assert_eq!(into[i].as_ref().ok(), Some(&(64 * KIB)), "{k:?}");
        assert_eq!(&bufs[i][..], &v[..], "{k:?}");
    }
}

/// A GET into caller memory over the socket whose call is dropped before
/// the answer arrives: the reader task, which reads answers from the socket
/// straight into the destinations, must not write a byte into them after the
/// call is gone, and the connection goes on serving.
#[tokio::test]
async fn a_dropped_get_into_never_writes_into_its_destinations_afterwards() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir, 256 * MIB, 0).await;
    let tcp = Client::connect(ClientConfig::new(Endpoint::Tcp(n.tcp_addr().unwrap().to_string()))).await.unwrap();
    let conn = tcp.connection().await.unwrap();
    let keys: Vec<Bytes> = (0..32).map(|i| Bytes::from(format!("big{i}"))).collect();
    assert!(tcp.put(keys.iter().map(|k| (k.clone(), block(9, 2 * MIB))).collect()).await.unwrap().iter().all(Result::is_ok));
    let mut bufs: Vec<Vec<u8>> = (0..32).map(|_| vec![0xEE; 2 * MIB]).collect();
    {
        let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        // Polled exactly once (the request goes out; on this test's one
        // thread nothing else runs meanwhile, so no answer byte can have
        // been read), then dropped. (A zero timeout would not do: its timer
        // need not fire at the first poll, and then the reader fills the
        // destinations while the call is still alive, as it should.)
        let mut call = std::pin::pin!(conn.get_into(keys.clone(), &mut dests));
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(std::future::Future::poll(call.as_mut(), cx))).await;
        assert!(first.is_pending(), "64 MiB came back within one poll");
    }
    // Answers come in order: once a later call on the same connection is
    // answered, the dropped call's answer has been read (and discarded).
    let mut one = vec![0u8; 2 * MIB];
    let got = conn.get_into(vec![keys[0].clone()], &mut [&mut one[..]]).await.unwrap();
    assert_eq!(got[0].as_ref().ok(), Some(&(2 * MIB)));
    assert_eq!(one, block(9, 2 * MIB));
    assert_eq!(stat(&n, "requests_get"), 2, "the dropped call's request went out and was answered");
    assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 0xEE)), "a destination was written after its call was dropped");
}

#[tokio::test]
async fn writing_shared_memory_after_a_put_does_not_change_the_stored_block() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir, 64 * MIB, 4 * MIB).await;
    let conn = Connection::open(&unix(&n), None, PATIENCE).await.unwrap();
    let memory = Arc::clone(conn.shared_memory().unwrap());
    memory.write_at(0, &block(7, 64 * KIB)).unwrap();
    let r = conn.put_from_shared_checked(&[(Bytes::from_static(b"kept"), 0, 64 * KIB)]).await.unwrap();
    assert!(r[0].is_ok(), "{r:?}");
    memory.write_at(0, &[0xAA; 64 * KIB]).unwrap();
    let lens = conn.get_into_shared(&[(Bytes::from_static(b"kept"), MIB, 64 * KIB)]).await.unwrap();
    assert_eq!(lens[0].as_ref().unwrap(), &(64 * KIB));
    let mut back = vec![0u8; 64 * KIB];
    memory.read_at(MIB, &mut back).unwrap();
    assert_eq!(Bytes::from(back), block(7, 64 * KIB), "the node stored a copy, not the client's memory");

    // Ranges outside the memory, and a destination too small, are answered
    // per key and write nothing; the connection keeps serving.
    let r = conn.put_from_shared(&[(Bytes::from_static(b"x"), 4 * MIB - 10, 100)]).await;
    assert!(matches!(r, Err(KvError::Invalid(_))), "the client refuses a range past the end: {r:?}");
    // A checksum that does not match the bytes: refused, nothing stored.
    memory.write_at(0, &block(8, 4 * KIB)).unwrap();
    let bad = [kvplane_protocol::ShmPut { key: Bytes::from_static(b"bad"), offset: 0, len: 4096, crc: 12345 }];
    let answer = conn.call(Request::PutShm { entries: bad.to_vec() }).await.unwrap();
    assert_eq!(answer, kvplane_protocol::Response::PutShm { results: vec![Err(kvplane_protocol::ErrorCode::BadChecksum)] });
    let lens = conn.get_into_shared(&[(Bytes::from_static(b"bad"), MIB, 4 * KIB)]).await.unwrap();
    assert!(matches!(lens[0], Err(KvError::NotFound)), "{lens:?}");
    // Without a checksum the node stores what it copied, checksummed by itself.
    let r = conn.put_from_shared(&[(Bytes::from_static(b"plain"), 0, 4 * KIB)]).await.unwrap();
    assert!(r[0].is_ok());
    let got = Client::connect(ClientConfig { shared_memory: false, ..ClientConfig::new(unix(&n)) }).await.unwrap();
    assert_eq!(
        got.get(vec![Bytes::from_static(b"plain")]).await.unwrap()[0].as_ref().unwrap(),
        &block(8, 4 * KIB),
        "the node's copy is served over the socket as well"
    );
    let r = conn.put_from_shared(&[(Bytes::from_static(b"x"), 4 * MIB - 10, 100)]).await;
    assert!(matches!(r, Err(KvError::Invalid(_))), "the client refuses a range past the end: {r:?}");
    memory.write_at(2 * MIB, &[0x55; 64]).unwrap();
    let lens = conn.get_into_shared(&[(Bytes::from_static(b"kept"), 2 * MIB, 100)]).await.unwrap();
    assert!(matches!(lens[0], Err(KvError::Capacity(_))), "{lens:?}");
    let mut guard = [0u8; 64];
    memory.read_at(2 * MIB, &mut guard).unwrap();
    assert_eq!(guard, [0x55; 64], "nothing written for a block that does not fit");
    assert!(conn.get_into_shared(&[(Bytes::from_static(b"kept"), 4 * MIB - 100, 64 * KIB)]).await.unwrap()[0].is_err());
}

/// A PUT_SHM without a checksum is not checksummed when it is served: the
/// checksum is computed later, when a GET needs it, and it is the checksum of
/// the node's copy: what the client wrote to its memory after the PUT was
/// answered reaches neither the bytes nor the checksum a reader gets.
#[tokio::test]
async fn an_unchecked_puts_checksum_is_of_the_nodes_copy_whenever_it_is_computed() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir, 64 * MIB, 4 * MIB).await;
    let conn = Connection::open(&unix(&n), None, PATIENCE).await.unwrap();
    let memory = Arc::clone(conn.shared_memory().unwrap());
    let want = block(9, 256 * KIB);
    memory.write_at(0, &want).unwrap();
    let r = conn.put_from_shared(&[(Bytes::from_static(b"lazy"), 0, 256 * KIB)]).await.unwrap();
    assert!(r[0].is_ok(), "{r:?}");
    // The client scribbles over the range once the PUT is answered.
    memory.write_at(0, &[0xEE; 256 * KIB]).unwrap();

    // GET_SHM answers the checksum of the stored bytes.
    let get = [kvplane_protocol::ShmGet { key: Bytes::from_static(b"lazy"), offset: MIB as u64, capacity: (256 * KIB) as u32 }];
    match conn.call(Request::GetShm { entries: get.to_vec() }).await.unwrap() {
        kvplane_protocol::Response::GetShm { results } => {
            let got = results[0].expect("stored");
            assert_eq!((got.len as usize, got.crc), (want.len(), crc32c::crc32c(&want)));
        }
        other => panic!("{other:?}"),
    }
    let mut back = vec![0u8; 256 * KIB];
    memory.read_at(MIB, &mut back).unwrap();
    assert_eq!(Bytes::from(back), want);

    // And over the socket, whose payloads the client checks against the
    // checksum that travels with them.
    let socket = Client::connect(ClientConfig { shared_memory: false, ..ClientConfig::new(unix(&n)) }).await.unwrap();
    assert_eq!(socket.get(vec![Bytes::from_static(b"lazy")]).await.unwrap()[0].as_ref().unwrap(), &want);
}

/// A hand-made client: handshake asking for shared memory, SHM_ATTACH, and
/// the raw memfd the node passes — what a hostile client holds.
struct RawLocal {
    sock: std::os::unix::net::UnixStream,
    memfd: OwnedFd,
}

fn recv_fd(sock: RawFd, buf: &mut [u8]) -> (usize, Option<OwnedFd>) {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = [0u8; 64];
    // SAFETY: a zeroed msghdr with pointers to live buffers of the stated
    // sizes; a passed descriptor is owned exactly once.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() as _;
        let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
        assert!(n >= 0, "recvmsg: {}", std::io::Error::last_os_error());
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        let fd =
            if cmsg.is_null() { None } else { Some(OwnedFd::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>()))) };
        (n as usize, fd)
    }
}

impl RawLocal {
    fn attach(path: &std::path::Path) -> RawLocal {
        use std::io::{Read, Write};
        let mut sock = std::os::unix::net::UnixStream::connect(path).unwrap();
        sock.set_read_timeout(Some(PATIENCE)).unwrap();
        let hello = Request::Hello(Hello { version: 1, features: Features(Features::ALL.0 | Features::SHARED_MEMORY.0), token: None });
        sock.write_all(&encode(&Frame::request(1, hello)).unwrap().to_vec()).unwrap();
        let mut ack = [0u8; HEADER_LEN + 26];
        sock.read_exact(&mut ack).unwrap();
        sock.write_all(&encode(&Frame::request(2, Request::ShmAttach)).unwrap().to_vec()).unwrap();
        let mut answer = [0u8; HEADER_LEN + 8];
        let (n, memfd) = recv_fd(sock.as_raw_fd(), &mut answer);
        sock.read_exact(&mut answer[n..]).unwrap();
        RawLocal { sock, memfd: memfd.expect("the node passed its memfd") }
    }
}

#[tokio::test]
async fn a_client_cannot_resize_the_shared_memory_and_abandoning_it_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir, 64 * MIB, 4 * MIB).await;
    let path = n.unix_path().unwrap().to_path_buf();
    let raw = tokio::task::spawn_blocking(move || RawLocal::attach(&path)).await.unwrap();
    // SAFETY: ftruncate on a descriptor this test owns: the hostile move.
    let shrink = unsafe { libc::ftruncate(raw.memfd.as_raw_fd(), 0) };
    assert_eq!(shrink, -1, "the node's memory could be shrunk under it");
    // SAFETY: as above.
    let grow = unsafe { libc::ftruncate(raw.memfd.as_raw_fd(), 1 << 40) };
    assert_eq!(grow, -1);
    // Half a PUT_SHM, then the client vanishes with its memory.
    {
        use std::io::Write;
        let put =
            Request::PutShm { entries: vec![kvplane_protocol::ShmPut { key: Bytes::from_static(b"half"), offset: 0, len: 4096, crc: 0 }] };
        let bytes = encode(&Frame::request(3, put)).unwrap().to_vec();
        let mut sock = raw.sock.try_clone().unwrap();
        sock.write_all(&bytes[..bytes.len() / 2]).unwrap();
    }
    drop(raw);
    // The node closes that connection and drops its memory...
    let start = Instant::now();
    while stat(&n, "connections_open") > 0 {
        assert!(start.elapsed() < PATIENCE, "the abandoned connection was never closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and serves every other client as before; the half PUT stored nothing.
    let c = Client::connect(ClientConfig::new(unix(&n))).await.unwrap();
    assert!(c.put(vec![(Bytes::from_static(b"after"), block(3, 8 * KIB))]).await.unwrap()[0].is_ok());
    assert_eq!(c.get(vec![Bytes::from_static(b"after")]).await.unwrap()[0].as_ref().unwrap(), &block(3, 8 * KIB));
    assert_eq!(c.exists(vec![Bytes::from_static(b"half")]).await.unwrap(), vec![false]);
}

#[tokio::test]
async fn each_client_has_its_own_memory_and_sees_only_what_it_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(&dir, 64 * MIB, 2 * MIB).await;
    let a = Connection::open(&unix(&n), None, PATIENCE).await.unwrap();
    let b = Connection::open(&unix(&n), None, PATIENCE).await.unwrap();
    let (ma, mb) = (Arc::clone(a.shared_memory().unwrap()), Arc::clone(b.shared_memory().unwrap()));
    ma.write_at(0, &block(9, 64 * KIB)).unwrap();
    assert!(a.put_from_shared(&[(Bytes::from_static(b"secret"), 0, 64 * KIB)]).await.unwrap()[0].is_ok());
    assert!(a.get_into_shared(&[(Bytes::from_static(b"secret"), 512 * KIB, 64 * KIB)]).await.unwrap()[0].is_ok());
    // B's memory is untouched by everything A did.
    let mut all = vec![0u8; 2 * MIB];
    mb.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|&x| x == 0), "another client's bytes appeared in this client's memory");
    // Writing its own memory does not reach A's.
    mb.write_at(0, &[0xFF; 64 * KIB]).unwrap();
    let mut first = vec![0u8; 64 * KIB];
    ma.read_at(0, &mut first).unwrap();
    assert_eq!(Bytes::from(first), block(9, 64 * KIB));
}

#[tokio::test]
async fn a_block_read_under_eviction_pressure_is_never_torn() {
    let dir = tempfile::tempdir().unwrap();
    // 8 MiB of pool for 256 keys of 64 KiB: a writer evicts constantly.
    let n = node(&dir, 8 * MIB, 4 * MIB).await;
    let reader = Connection::open(&unix(&n), None, PATIENCE).await.unwrap();
    let writer = Client::connect(ClientConfig::new(unix(&n))).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                // Every key holds the block of its own seed: a torn or
                // reused block shows as bytes of another seed.
                let key = format!("k{}", i % 256);
                let _ = writer.put(vec![(Bytes::from(key), block((i % 256) as u8, 64 * KIB))]).await;
                i += 1;
            }
            i
        })
    };
    let memory = Arc::clone(reader.shared_memory().unwrap());
    let (mut found, mut reads) = (0, 0);
    let start = Instant::now();
    // Until 20 reads found their block and the pool (about 128 of these
    // blocks) has turned over twice under the reader: counts, not a time,
    // so a loaded machine runs longer instead of testing less.
    let deadline = 4 * PATIENCE;
    while found < 20 || stat(&n, "evictions") < 256 {
        assert!(
            start.elapsed() < deadline,
            "within {deadline:?}: {found} reads found their block, {} evictions (20 and 256 wanted)",
            stat(&n, "evictions")
        );
        let k = reads % 256;
        let lens = reader.get_into_shared(&[(Bytes::from(format!("k{k}")), 0, 64 * KIB)]).await.unwrap();
        reads += 1;
        if let Ok(len) = lens[0] {
            let mut back = vec![0u8; len];
            memory.read_at(0, &mut back).unwrap();
            assert_eq!(Bytes::from(back), block(k as u8, 64 * KIB), "block k{k} was torn or reused under the reader");
            found += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let written = flood.await.unwrap();
    assert!(stat(&n, "evictions") >= 256, "the pool was meant to be under pressure ({written} writes)");
}
