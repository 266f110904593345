//! The verbs side against whatever this machine has: without an RDMA
//! device, opening one must fail with the clear `NoDevice`; with Soft-RoCE
//! (`rdma link add ... type rxe netdev lo`), a real one-sided READ of a
//! registered pool over an RC queue pair connected through the TCP side
//! channel. Where Soft-RoCE cannot be set up, that test prints
//! `SKIPPED (no hardware): ...` on stderr and returns; scripts/test counts
//! such lines as skipped, not passed.
//!
//! Built only with the `rdma` feature (`cargo test -p kvplane-rdma --features
//! rdma --test verbs`).

#![allow(unsafe_code)] // Registers memory with the device, as the node does.

use std::net::TcpListener;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvplane_rdma::verbs::{self, Device, QueuePairEndpoint, RdmaError};
use kvplane_rdma::{choose, Descriptor, Gid, Leases, Path, UseError};

/// Whether the kernel lists any RDMA device (what libibverbs would open).
fn kernel_lists_devices() -> bool {
    std::fs::read_dir("/sys/class/infiniband").map(|mut d| d.next().is_some()).unwrap_or(false)
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[test]
fn open_without_a_device_is_no_device() {
    if kernel_lists_devices() {
        // A machine with a device: opening it must work, or fail for a
        // reason that names the port, not "no device".
        match Device::open_first() {
            Ok(dev) => assert!(!dev.name().is_empty()),
            Err(e) => assert!(!matches!(e, RdmaError::NoDevice(_)), "the kernel lists a device, libibverbs: {e}"),
        }
        return;
    }
    let err = match Device::open_first() {
        Ok(dev) => panic!("opened {} although the kernel lists no RDMA device", dev.name()),
        Err(e) => e,
    };
    assert!(matches!(err, RdmaError::NoDevice(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("no RDMA device: "), "{msg}");
    assert!(!verbs::device_present());
    // And a client here takes TCP.
    assert_eq!(choose(verbs::device_present(), true), Path::Tcp);
}

#[test]
fn endpoint_round_trip() {
    let e = QueuePairEndpoint { gid: Gid([9; 16]), lid: 3, qp_num: 0x12_3456, psn: 0xab_cdef };
    assert_eq!(QueuePairEndpoint::decode(&e.encode()).unwrap(), e);
    let mut b = e.encode();
    b[0] = 0;
    assert_eq!(QueuePairEndpoint::decode(&b).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
}

#[test]
fn descriptors_cross_the_side_channel() {
    let d = Descriptor { gid: Gid([1; 16]), lid: 0, qp_num: 5, addr: 0x2000, rkey: 6, len: 10, crc32c: 7, lease: 8, expires_at_ms: 9 };
    let mut wire = Vec::new();
    verbs::send_descriptor(&mut wire, &d).unwrap();
    assert_eq!(verbs::recv_descriptor(&mut wire.as_slice()).unwrap(), d);
    assert!(matches!(verbs::recv_descriptor(&mut &wire[..10]), Err(RdmaError::SideChannel(_))));
    // A corrupted descriptor is refused with the field at fault.
    wire[30] ^= 1;
    let e = verbs::recv_descriptor(&mut wire.as_slice()).unwrap_err();
    assert!(e.to_string().contains("`check`"), "{e}");
}

/// A Soft-RoCE link this test added, deleted on drop.
struct RxeLink(&'static str);

impl Drop for RxeLink {
    fn drop(&mut self) {
        let _ = Command::new("rdma").args(["link", "delete", self.0]).status();
    }
}

/// A device to test on: one already here, or a Soft-RoCE link over the
/// loopback interface; why not, when neither can be had.
fn soft_roce() -> Result<(Arc<Device>, Option<RxeLink>), String> {
    if let Ok(dev) = Device::open_first() {
        return Ok((dev, None));
    }
    let name = "kvplane_rxe0";
    let out = Command::new("rdma")
        .args(["link", "add", name, "type", "rxe", "netdev", "lo"])
        .output()
        .map_err(|e| format!("cannot run `rdma` (iproute2) to add a Soft-RoCE link: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`rdma link add {name} type rxe netdev lo` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let link = RxeLink(name);
    match Device::open_first() {
        Ok(dev) => Ok((dev, Some(link))),
        Err(e) => Err(format!("added Soft-RoCE link {name}, but: {e}")),
    }
}

#[test]
fn soft_roce_one_sided_read() {
    let (dev, _link) = match soft_roce() {
        Ok(d) => d,
        Err(why) => {
            eprintln!("SKIPPED (no hardware): Soft-RoCE RDMA READ test: {why}");
            return;
        }
    };

    // The node: a pool of 64 KiB, registered once; a lease table.
    let mut pool: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let expected = pool[4096..4096 + 8192].to_vec();
    let block = Arc::new(());
    // SAFETY: `pool` outlives `region` (dropped at the end of this scope,
    // before `pool`) and is not written while the region is registered.
    let region = unsafe { dev.register(pool.as_mut_ptr(), pool.len()) }.expect("register the pool");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();

    let reader_dev = Arc::clone(&dev);
    let reader = std::thread::spawn(move || {
        let (mut qp, mut stream) = verbs::connect(addr, &reader_dev).expect("connect the reader's queue pair");
        let d = verbs::recv_descriptor(&mut stream).expect("descriptor");
        let mut buf = vec![0u8; d.len as usize];
        // After its expiry the descriptor is refused before anything is posted.
        let late = qp.read(&d, d.expires_at_ms, &mut buf, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(late, RdmaError::Unusable(UseError::Expired { .. })), "{late:?}");
        qp.read(&d, now_ms(), &mut buf, Duration::from_secs(5)).expect("RDMA READ");
        buf
    });

    let (node_qp, mut stream) = verbs::accept(&listener, &dev).expect("accept the reader");
    let mut leases = Leases::new(8);
    let now = now_ms();
    let lease = leases.grant(&block, now, 30_000).unwrap();
    let d = region.describe(node_qp.qp_num(), 4096, 8192, crc32c::crc32c(&expected), lease).unwrap();
    verbs::send_descriptor(&mut stream, &d).unwrap();

    let got = reader.join().expect("reader thread");
    assert_eq!(got, expected);
    assert!(leases.check(lease.id, now).is_ok());
    assert_eq!(leases.release_expired(lease.expires_at_ms), 1);
    drop(node_qp);
    drop(region);
}
