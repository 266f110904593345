//! What one end's queue pair needs to connect to the other's, and its wire
//! form.
//!
//! Why here, in the protocol crate, and not beside kvplane-rdma's verbs: the
//! node and the client exchange endpoints over the ordinary kvplane
//! connection (`RDMA_CONNECT`), whose codec builds and is fuzzed without
//! libibverbs or kvplane-rdma; only creating and connecting the queue pairs
//! needs kvplane-rdma's `rdma` feature.

use std::io;

use super::descriptor::{Gid, MAX_QP_NUM};

/// The first four bytes of an encoded endpoint.
pub const ENDPOINT_MAGIC: [u8; 4] = *b"KVQP";
/// Length of an encoded endpoint: magic, gid, lid, qp_num, psn.
pub const ENDPOINT_LEN: usize = 4 + 16 + 2 + 4 + 4;
/// Packet sequence numbers are 24 bits wide.
pub const MAX_PSN: u32 = (1 << 24) - 1;

/// What the peer's queue pair needs to connect to this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuePairEndpoint {
    pub gid: Gid,
    pub lid: u16,
    /// Queue pair number (24 bits).
    pub qp_num: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
}

impl QueuePairEndpoint {
    /// The wire form: magic, gid (16), lid (2), qp_num (4), psn (4), all
    /// big-endian.
    pub fn encode(&self) -> [u8; ENDPOINT_LEN] {
        let mut b = [0u8; ENDPOINT_LEN];
        b[..4].copy_from_slice(&ENDPOINT_MAGIC);
        b[4..20].copy_from_slice(&self.gid.0);
        b[20..22].copy_from_slice(&self.lid.to_be_bytes());
        b[22..26].copy_from_slice(&self.qp_num.to_be_bytes());
        b[26..30].copy_from_slice(&self.psn.to_be_bytes());
        b
    }

    /// Parses [`QueuePairEndpoint::encode`]'s form; `InvalidData`, naming the field,
    /// for another magic or a queue pair number or PSN wider than 24 bits.
    pub fn decode(b: &[u8; ENDPOINT_LEN]) -> io::Result<QueuePairEndpoint> {
        let invalid = |msg: String| io::Error::new(io::ErrorKind::InvalidData, msg);
        if b[..4] != ENDPOINT_MAGIC {
            return Err(invalid(format!("field `magic`: {:02x?} is not a queue pair endpoint", &b[..4])));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[4..20]);
        let e = QueuePairEndpoint {
            gid: Gid(gid),
            lid: u16::from_be_bytes([b[20], b[21]]),
            qp_num: u32::from_be_bytes([b[22], b[23], b[24], b[25]]),
            psn: u32::from_be_bytes([b[26], b[27], b[28], b[29]]),
        };
        if e.qp_num > MAX_QP_NUM {
            return Err(invalid(format!("field `qp_num`: {:#x} is wider than 24 bits", e.qp_num)));
        }
        if e.psn > MAX_PSN {
            return Err(invalid(format!("field `psn`: {:#x} is wider than 24 bits", e.psn)));
        }
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals_name_the_field() {
        let e = QueuePairEndpoint { gid: Gid([9; 16]), lid: 3, qp_num: 0x12_3456, psn: 0xab_cdef };
        assert_eq!(QueuePairEndpoint::decode(&e.encode()).unwrap(), e);
        let mut b = e.encode();
        b[0] = 0;
        assert!(QueuePairEndpoint::decode(&b).unwrap_err().to_string().contains("`magic`"));
        let wide = QueuePairEndpoint { qp_num: 1 << 24, ..e }.encode();
        assert!(QueuePairEndpoint::decode(&wide).unwrap_err().to_string().contains("`qp_num`"));
        let wide = QueuePairEndpoint { psn: 1 << 24, ..e }.encode();
        assert!(QueuePairEndpoint::decode(&wide).unwrap_err().to_string().contains("`psn`"));
    }
}
