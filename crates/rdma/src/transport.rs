//! Which path a GET takes, and the fallback to TCP.
//!
//! Why a choice at all: RDMA needs a device on both ends, and most
//! deployments (and every CI machine) have none; the ordinary TCP (or Unix
//! socket) path always works. So a client reads over RDMA only when it has a
//! device and the node offered a descriptor, and falls back to TCP whenever
//! that is not so, or the descriptor's lease has run out, or the READ fails
//! or brings back bytes that are not the block. A GET never fails because
//! RDMA could not be used.

use std::fmt;

use kvplane_protocol::rdma::{Descriptor, UseError};

/// How a block travels to the reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    /// One-sided RDMA READ from the node's registered pool.
    Rdma,
    /// The ordinary request/response connection.
    Tcp,
}

impl Path {
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Rdma => "rdma",
            Path::Tcp => "tcp",
        }
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// RDMA only when this end has a device and the other end offers to be
/// read (it registered its pool and sends descriptors); TCP otherwise.
pub fn choose(local_device: bool, remote_offers: bool) -> Path {
    if local_device && remote_offers {
        Path::Rdma
    } else {
        Path::Tcp
    }
}

/// Why a GET that could have gone over RDMA went over TCP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// This end has no RDMA device.
    NoLocalDevice,
    /// The node sent no descriptor (no device there, or it declined).
    NotOffered,
    /// The descriptor's lease had ended before the READ.
    Expired(UseError),
    /// The READ itself failed (the message of the error).
    ReadFailed(String),
    /// The READ brought back bytes that are not the block.
    Corrupt(UseError),
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fallback::NoLocalDevice => f.write_str("no local RDMA device"),
            Fallback::NotOffered => f.write_str("the node offered no descriptor"),
            Fallback::Expired(e) => write!(f, "descriptor unusable: {e}"),
            Fallback::ReadFailed(e) => write!(f, "RDMA READ failed: {e}"),
            Fallback::Corrupt(e) => write!(f, "RDMA READ brought back another block: {e}"),
        }
    }
}

/// What [`get`] fetched, over which path, and why not over RDMA when it
/// fell back.
#[derive(Debug, PartialEq, Eq)]
pub struct Fetched<T> {
    pub bytes: T,
    pub path: Path,
    pub fallback: Option<Fallback>,
}

/// One GET with fallback: over RDMA (`rdma` reads the block the descriptor
/// describes) when [`choose`] allows it, the descriptor is usable at
/// `now_ms` and the bytes it returns pass [`Descriptor::verify`]; otherwise
/// over TCP (`tcp`). Only `tcp`'s error is an error of the GET.
pub fn get<T, E, F>(
    local_device: bool,
    offer: Option<&Descriptor>,
    now_ms: u64,
    rdma: impl FnOnce(&Descriptor) -> Result<T, E>,
    tcp: impl FnOnce() -> Result<T, F>,
) -> Result<Fetched<T>, F>
where
    T: AsRef<[u8]>,
    E: fmt::Display,
{
    let fallback = match (choose(local_device, offer.is_some()), offer) {
        (Path::Rdma, Some(d)) => match d.check_usable(now_ms) {
            Err(e) => Fallback::Expired(e),
            Ok(()) => match rdma(d) {
                Err(e) => Fallback::ReadFailed(e.to_string()),
                Ok(bytes) => match d.verify(bytes.as_ref()) {
                    Ok(()) => return Ok(Fetched { bytes, path: Path::Rdma, fallback: None }),
                    Err(e) => Fallback::Corrupt(e),
                },
            },
        },
        _ if !local_device => Fallback::NoLocalDevice,
        _ => Fallback::NotOffered,
    };
    Ok(Fetched { bytes: tcp()?, path: Path::Tcp, fallback: Some(fallback) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvplane_protocol::rdma::Gid;
    use std::cell::Cell;

    const BLOCK: &[u8] = b"the block's bytes";

    fn offer() -> Descriptor {
        Descriptor {
            gid: Gid::default(),
            lid: 1,
            qp_num: 7,
            addr: 0x1000,
            rkey: 9,
            len: BLOCK.len() as u32,
            crc32c: crc32c::crc32c(BLOCK),
            lease: 3,
            expires_at_ms: 100,
        }
    }

    #[test]
    fn rdma_only_with_both_ends() {
        assert_eq!(choose(true, true), Path::Rdma);
        assert_eq!(choose(true, false), Path::Tcp);
        assert_eq!(choose(false, true), Path::Tcp);
        assert_eq!(choose(false, false), Path::Tcp);
        assert_eq!(Path::Rdma.to_string(), "rdma");
        assert_eq!(Path::Tcp.as_str(), "tcp");
    }

    /// Runs [`get`] with an RDMA reader that returns `read` and a TCP reader
    /// that returns the block; which of them ran.
    fn run(local: bool, d: Option<&Descriptor>, now: u64, read: Result<Vec<u8>, &str>) -> (Fetched<Vec<u8>>, bool, bool) {
        let rdma_ran = Cell::new(false);
        let tcp_ran = Cell::new(false);
        let got = get(
            local,
            d,
            now,
            |_| {
                rdma_ran.set(true);
                read
            },
            || -> Result<_, ()> {
                tcp_ran.set(true);
                Ok(BLOCK.to_vec())
            },
        )
        .unwrap();
        (got, rdma_ran.get(), tcp_ran.get())
    }

    #[test]
    fn both_ends_read_over_rdma() {
        let d = offer();
        let (got, rdma, tcp) = run(true, Some(&d), 99, Ok(BLOCK.to_vec()));
        assert_eq!(got, Fetched { bytes: BLOCK.to_vec(), path: Path::Rdma, fallback: None });
        assert!(rdma && !tcp);
    }

    #[test]
    fn no_device_or_no_offer_goes_tcp_without_trying() {
        let d = offer();
        let (got, rdma, tcp) = run(false, Some(&d), 0, Ok(BLOCK.to_vec()));
        assert_eq!((got.path, got.fallback), (Path::Tcp, Some(Fallback::NoLocalDevice)));
        assert!(!rdma && tcp);
        let (got, rdma, tcp) = run(true, None, 0, Ok(BLOCK.to_vec()));
        assert_eq!((got.path, got.fallback), (Path::Tcp, Some(Fallback::NotOffered)));
        assert!(!rdma && tcp);
        assert_eq!(got.bytes, BLOCK);
    }

    #[test]
    fn expired_descriptor_is_not_read() {
        let d = offer();
        let (got, rdma, tcp) = run(true, Some(&d), 100, Ok(BLOCK.to_vec()));
        assert_eq!(got.path, Path::Tcp);
        assert!(matches!(got.fallback, Some(Fallback::Expired(UseError::Expired { lease: 3, .. }))));
        assert!(!rdma && tcp, "an expired descriptor must not reach the wire");
    }

    #[test]
    fn failed_or_corrupt_reads_fall_back() {
        let d = offer();
        let (got, rdma, tcp) = run(true, Some(&d), 1, Err("remote access error"));
        assert_eq!(got.fallback, Some(Fallback::ReadFailed("remote access error".into())));
        assert!(rdma && tcp);
        assert_eq!(got.bytes, BLOCK);

        let mut stale = BLOCK.to_vec();
        stale[0] ^= 1;
        let (got, _, tcp) = run(true, Some(&d), 1, Ok(stale));
        assert!(matches!(got.fallback, Some(Fallback::Corrupt(UseError::Checksum { .. }))), "{:?}", got.fallback);
        assert!(tcp);
        assert_eq!(got.bytes, BLOCK);
        assert!(got.fallback.unwrap().to_string().contains("another block"));
    }

    #[test]
    fn tcp_errors_are_the_gets_errors() {
        let r: Result<Fetched<Vec<u8>>, &str> = get(false, None, 0, |_| Ok::<_, &str>(vec![]), || Err("connection refused"));
        assert_eq!(r, Err("connection refused"));
    }
}
