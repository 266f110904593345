//! The RDMA block descriptor's decoder (kvplane-protocol's `rdma` module) on
//! arbitrary bytes: it must never panic, and whatever it accepts must encode
//! back to exactly those bytes (one wire form per descriptor).

#![no_main]

use kvplane_protocol::rdma::Descriptor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = Descriptor::decode(data) {
        let again = d.encode().expect("a decoded descriptor is valid");
        assert_eq!(again.as_slice(), data);
    }
});
