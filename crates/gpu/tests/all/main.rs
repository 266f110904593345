//! The GPU crate's integration tests, as one test binary (each module links
//! a node for its end-to-end half).

#[cfg(feature = "cuda")]
mod device;
mod no_device;
