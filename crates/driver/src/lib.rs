//! The host side of kvplane's *driver* seam.
//!
//! Some stores can only be reached through their vendor's native client
//! library (EIC's SDK, for example). Such a store gets a *driver*: a shared
//! library that wraps the vendor's client behind the small C interface of
//! `include/kvplane_driver.h` (ABI version 1). This crate loads a driver at
//! run time ([`Driver::load`]: `dlopen`, the entry symbol
//! `kvplane_driver_v1_entry`, the ABI version, every function pointer),
//! opens sessions on it ([`Driver::open`]) and makes its batch calls
//! ([`Session::put`], [`Session::get`], [`Session::exists`],
//! [`Session::delete`]), answering one [`Result`] per entry whose error is
//! the driver's [`Status`].
//!
//! # Unsafe code
//!
//! Calling into a C library cannot be done without `unsafe`, so it is denied
//! everywhere but in one private module, `ffi`, which holds the `#[repr(C)]`
//! mirror of the header, the loading of the library and every call into it.
//! Each unsafe block there says, in a `SAFETY:` comment, which rule of the
//! header or which invariant of this crate makes it sound. What the host can
//! check it does not trust: a status the driver left unset, a length it
//! reports past the end of the buffer it was given, a status code outside the
//! header, all come back as errors ([`Status::Internal`],
//! [`Status::Unknown`]) rather than as undefined behaviour or a panic. What it
//! cannot check (a driver that writes out of bounds, keeps a pointer, or
//! crashes) is the price of running a vendor's native code in process; a
//! driver is loaded only when an operator's plugin declaration names it.
//!
//! # Lifetimes and threads
//!
//! A [`Driver`] is shared behind an [`Arc`](std::sync::Arc) and keeps its
//! library loaded; every [`Session`] holds that `Arc`, so the library stays
//! loaded while any session lives. A session is `Send` but not `Sync`, and
//! its calls take `&mut self`: the header's "one thread per session at a
//! time", enforced by the compiler. Distinct sessions may be used from
//! distinct threads at once. The header promises nothing about concurrent
//! `open` calls, so the host makes them one at a time.
//!
//! With the `test-support` feature, `test_support` builds the C test
//! driver (`tests/fixtures/test-driver/test_driver.c`) for tests.

mod error;
#[allow(unsafe_code)] // The C interface itself; see the module docs above and in ffi.rs.
mod ffi;
mod status;
#[cfg(feature = "test-support")]
pub mod test_support;

pub use error::DriverError;
pub use ffi::{Driver, Session};
pub use status::{Options, Status};

/// The driver ABI version this host implements (`KVPLANE_DRIVER_ABI_VERSION`).
pub const ABI_VERSION: u32 = 1;

/// The symbol every driver exports (`kvplane_driver_v1_entry`).
pub const ENTRY_SYMBOL: &str = "kvplane_driver_v1_entry";
