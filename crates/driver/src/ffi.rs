//! The C interface of include/kvplane_driver.h: its types mirrored with
//! `#[repr(C)]`, the loading of a driver library, and every call into it.
//!
//! This is the crate's only module with unsafe code, because each of these
//! is a foreign function call or a read of memory the driver owns, which the
//! compiler cannot check. What keeps them sound:
//!
//! * The function pointers are copied out of the driver's table once, at
//!   load, after checking the ABI version (which fixes the table's layout)
//!   and that none is NULL. They point into the library, which [`Driver`]
//!   keeps loaded and every [`Session`] keeps alive through its `Arc`.
//! * Every pointer passed in points into a buffer this module owns for the
//!   length of the call (the header: pointers are valid for the call only),
//!   with the lengths passed beside it; the status and detail arrays have one
//!   element per entry, as the header requires.
//! * A session is used by one thread at a time: [`Session`] is `!Sync` and
//!   its calls take `&mut self`; it is closed exactly once, on drop.
//!
//! The answers are read in safe code (`crate::status`), which trusts nothing
//! the driver wrote.

use std::ffi::{c_char, CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use libloading::Library;

use crate::status::{Answers, Options, Status, DETAIL_UNSET, STATUS_UNSET};
use crate::{DriverError, ABI_VERSION, ENTRY_SYMBOL};

/// The size of the buffer `open` writes its error message into.
const OPEN_ERR_CAP: usize = 1024;

/// `kvplane_bytes`.
#[repr(C)]
struct RawBytes {
    ptr: *const u8,
    len: usize,
}

impl RawBytes {
    fn new(bytes: &[u8]) -> Self {
        RawBytes { ptr: bytes.as_ptr(), len: bytes.len() }
    }
}

/// `kvplane_mut_bytes`.
#[repr(C)]
struct RawMutBytes {
    ptr: *mut u8,
    len: usize,
}

/// `kvplane_config_entry`.
#[repr(C)]
struct RawConfigEntry {
    key: *const c_char,
    value: *const c_char,
}

/// `kvplane_options`.
#[repr(C)]
struct RawOptions {
    ttl_ms: u64,
    ns: *const c_char,
    timeout_ms: u64,
}

/// `kvplane_session`: opaque, only ever behind a pointer.
#[repr(C)]
struct RawSession {
    _opaque: [u8; 0],
}

type OpenFn = unsafe extern "C" fn(*const RawConfigEntry, usize, *mut c_char, usize) -> *mut RawSession;
type CloseFn = unsafe extern "C" fn(*mut RawSession);
type PutFn = unsafe extern "C" fn(*mut RawSession, *const RawBytes, *const RawBytes, usize, *const RawOptions, *mut i32, *mut u64);
type GetFn = unsafe extern "C" fn(*mut RawSession, *const RawBytes, *const RawMutBytes, usize, *const RawOptions, *mut i32, *mut u64);
type KeysFn = unsafe extern "C" fn(*mut RawSession, *const RawBytes, usize, *const RawOptions, *mut i32, *mut u64);
type EntryFn = unsafe extern "C" fn() -> *const RawDriverV1;

/// `kvplane_driver_v1`. A nullable C function pointer is an `Option` of a
/// Rust one (guaranteed to have the same layout, NULL being `None`).
#[repr(C)]
struct RawDriverV1 {
    abi_version: u32,
    name: *const c_char,
    open: Option<OpenFn>,
    close: Option<CloseFn>,
    put: Option<PutFn>,
    get: Option<GetFn>,
    exists: Option<KeysFn>,
    remove: Option<KeysFn>,
}

/// The driver's functions, checked non-NULL.
#[derive(Clone, Copy)]
struct Functions {
    open: OpenFn,
    close: CloseFn,
    put: PutFn,
    get: GetFn,
    exists: KeysFn,
    remove: KeysFn,
}

/// A loaded driver library. Shared behind an `Arc`; it stays loaded while
/// any [`Session`] opened on it lives.
pub struct Driver {
    path: PathBuf,
    name: String,
    functions: Functions,
    /// Makes `open` calls one at a time: the header does not say that a
    /// driver's `open` may run on two threads at once.
    open_lock: Mutex<()>,
    /// Declared last so that it is dropped last: `functions` point into it.
    _library: Library,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver").field("path", &self.path).field("name", &self.name).finish_non_exhaustive()
    }
}

impl Driver {
    /// Loads the driver library at `path`: resolves `kvplane_driver_v1_entry`,
    /// checks that the table it returns is of ABI version 1 and has no NULL
    /// function.
    pub fn load(path: &Path) -> Result<Arc<Driver>, DriverError> {
        let library = open_library(path).map_err(|source| DriverError::Load { path: path.to_owned(), source })?;
        // SAFETY: the header declares the entry symbol as
        // `const kvplane_driver_v1 *kvplane_driver_v1_entry(void)`, which is
        // `EntryFn`. The copied pointer is used only below, while `library`
        // is loaded.
        let entry: EntryFn = match unsafe { library.get::<EntryFn>(ENTRY_SYMBOL.as_bytes()) } {
            Ok(symbol) => *symbol,
            Err(source) => return Err(DriverError::MissingEntry { path: path.to_owned(), source }),
        };
        // SAFETY: a driver's entry function takes nothing and returns a
        // pointer to its static table (the header); the library is loaded.
        let table = unsafe { entry() };
        let bad_entry = |what| DriverError::BadEntry { path: path.to_owned(), what };
        if table.is_null() {
            return Err(bad_entry("NULL"));
        }
        // The ABI version is the table's first field in every version of
        // the ABI, so it is read alone before trusting the rest of the layout.
        let version = table.cast::<u32>();
        if !version.is_aligned() {
            return Err(bad_entry("a misaligned pointer"));
        }
        // SAFETY: `version` is non-NULL, aligned for a u32, and points to the
        // start of the loaded library's static table, whose first field is
        // the `uint32_t abi_version` (offset 0 in a C struct).
        let found = unsafe { version.read() };
        if found != ABI_VERSION {
            return Err(DriverError::AbiVersion { path: path.to_owned(), found, expected: ABI_VERSION });
        }
        if !table.is_aligned() {
            return Err(bad_entry("a misaligned pointer"));
        }
        // SAFETY: `table` is non-NULL, aligned, and points to the loaded
        // library's static table; its version is 1, so it is a
        // `kvplane_driver_v1`, which `RawDriverV1` mirrors. Every bit pattern
        // of its fields is valid (pointers, and `Option`s of function pointers).
        let table = unsafe { table.read() };
        let name = if table.name.is_null() {
            String::from("(unnamed)")
        } else {
            // SAFETY: `name` is a NUL-terminated string of the loaded library
            // (the header's rule for strings); it is copied at once.
            unsafe { CStr::from_ptr(table.name) }.to_string_lossy().into_owned()
        };
        let null = |function| DriverError::NullFunction { path: path.to_owned(), function };
        let functions = Functions {
            open: table.open.ok_or_else(|| null("open"))?,
            close: table.close.ok_or_else(|| null("close"))?,
            put: table.put.ok_or_else(|| null("put"))?,
            get: table.get.ok_or_else(|| null("get"))?,
            exists: table.exists.ok_or_else(|| null("exists"))?,
            remove: table.remove.ok_or_else(|| null("remove"))?,
        };
        tracing::debug!(driver = %path.display(), name, "loaded driver");
        Ok(Arc::new(Driver { path: path.to_owned(), name, functions, open_lock: Mutex::new(()), _library: library }))
    }

    /// The path the driver was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The driver's name for logs (its table's `name`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Opens a session with `config` (key, value pairs, passed in order).
    /// The error carries the message the driver wrote.
    pub fn open(self: &Arc<Self>, config: &[(String, String)]) -> Result<Session, DriverError> {
        let nul = |key: &str, what| DriverError::ConfigNul { path: self.path.clone(), key: key.to_owned(), what };
        let strings = config
            .iter()
            .map(|(key, value)| {
                let k = CString::new(key.as_str()).map_err(|_| nul(key, "key"))?;
                let v = CString::new(value.as_str()).map_err(|_| nul(key, "value"))?;
                Ok((k, v))
            })
            .collect::<Result<Vec<_>, DriverError>>()?;
        let entries: Vec<RawConfigEntry> =
            strings.iter().map(|(key, value)| RawConfigEntry { key: key.as_ptr(), value: value.as_ptr() }).collect();
        let mut err = vec![0u8; OPEN_ERR_CAP];
        let session = {
            let _one_at_a_time = self.open_lock.lock().unwrap_or_else(PoisonError::into_inner);
            // SAFETY: `open` was checked non-NULL at load and the library is
            // loaded (`self`). `entries` holds `entries.len()` entries whose
            // strings are NUL-terminated and live in `strings` until after
            // the call; `err` is writable for `OPEN_ERR_CAP` bytes.
            unsafe { (self.functions.open)(entries.as_ptr(), entries.len(), err.as_mut_ptr().cast(), OPEN_ERR_CAP) }
        };
        match NonNull::new(session) {
            Some(raw) => Ok(Session { driver: Arc::clone(self), raw, _not_sync: PhantomData }),
            None => {
                // Up to the NUL, or the whole buffer from a driver that wrote
                // no NUL: never past it.
                let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
                let message = String::from_utf8_lossy(&err[..end]).trim().to_owned();
                let message = if message.is_empty() { String::from("(the driver gave no message)") } else { message };
                Err(DriverError::Open { path: self.path.clone(), message })
            }
        }
    }
}

/// Opens the library, resolving all its symbols now (a missing one fails the
/// load instead of a later call) and keeping them out of the global scope.
#[cfg(unix)]
fn open_library(path: &Path) -> Result<Library, libloading::Error> {
    use libloading::os::unix::{Library as UnixLibrary, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: loading a library runs its initialisers, which no check here
    // can vet: a driver is trusted code, loaded only because an operator's
    // plugin declaration names it (see the crate docs).
    unsafe { UnixLibrary::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map(Library::from)
}

#[cfg(not(unix))]
fn open_library(path: &Path) -> Result<Library, libloading::Error> {
    // SAFETY: as for unix above.
    unsafe { Library::new(path) }
}

/// A session with a driver's store (`kvplane_session`), closed on drop.
///
/// Calls take `&mut self`, and a session is `Send` but not `Sync`: one
/// thread at a time, as the header requires.
///
/// ```compile_fail,E0277
/// fn shared<T: Sync>() {}
/// shared::<kvplane_driver::Session>();
/// ```
///
/// Each batch call answers one result per key, in order. Slices that differ
/// in length, or [`Options`] the C interface cannot carry, are refused
/// without calling the driver: every entry answers [`Status::Invalid`].
pub struct Session {
    driver: Arc<Driver>,
    raw: NonNull<RawSession>,
    /// Explicitly `!Sync` (the pointer already makes it so).
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

// SAFETY: the header lets a session be used from any thread, one at a time;
// it is not tied to the thread that opened it. Moving a `Session` to another
// thread moves that use with it, and `!Sync` plus `&mut self` calls keep it
// to one thread at a time.
unsafe impl Send for Session {}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session").field("driver", &self.driver.path).finish_non_exhaustive()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: `raw` came from this driver's `open`, has not been closed
        // (this is the only close), and the library is loaded (`driver`).
        unsafe { (self.driver.functions.close)(self.raw.as_ptr()) }
    }
}

impl Session {
    /// Stores `values[i]` under `keys[i]`.
    pub fn put(&mut self, keys: &[&[u8]], values: &[&[u8]], opts: &Options) -> Vec<Result<(), Status>> {
        let keys_c: Vec<RawBytes> = keys.iter().map(|k| RawBytes::new(k)).collect();
        let values_c: Vec<RawBytes> = values.iter().map(|v| RawBytes::new(v)).collect();
        let put = self.driver.functions.put;
        let (answers, status, detail) = match self.batch("put", keys.len(), values.len(), opts, |session, options, status, detail| {
            // SAFETY: `put` is non-NULL and loaded; `session` is open and
            // ours alone for the call; `keys_c` and `values_c` describe live
            // slices and have `n` elements each (checked by `batch`), as do
            // `status` and `detail`; `options` lives for the call.
            unsafe { put(session, keys_c.as_ptr(), values_c.as_ptr(), keys_c.len(), options, status, detail) }
        }) {
            Ok(out) => out,
            Err(refused) => return refused,
        };
        status.iter().zip(&detail).enumerate().map(|(i, (&s, &d))| answers.unit(i, s, d)).collect()
    }

    /// Copies the value of `keys[i]` into `dest[i]`: the number of bytes
    /// written, or [`Status::Capacity`] with the value's length when it is
    /// longer than `dest[i]`, which may then hold garbage (bytes outside
    /// `dest[i]` are never written).
    pub fn get(&mut self, keys: &[&[u8]], dest: &mut [&mut [u8]], opts: &Options) -> Vec<Result<usize, Status>> {
        let keys_c: Vec<RawBytes> = keys.iter().map(|k| RawBytes::new(k)).collect();
        let dest_len: Vec<usize> = dest.iter().map(|d| d.len()).collect();
        let dest_c: Vec<RawMutBytes> = dest.iter_mut().map(|d| RawMutBytes { ptr: d.as_mut_ptr(), len: d.len() }).collect();
        let get = self.driver.functions.get;
        let (answers, status, detail) = match self.batch("get", keys.len(), dest_c.len(), opts, |session, options, status, detail| {
            // SAFETY: as in `put`; `dest_c` describes the caller's distinct
            // `&mut` slices, exclusively borrowed for the call, with their
            // lengths, and the driver writes only within them (the header).
            unsafe { get(session, keys_c.as_ptr(), dest_c.as_ptr(), keys_c.len(), options, status, detail) }
        }) {
            Ok(out) => out,
            Err(refused) => return refused,
        };
        status.iter().zip(&detail).zip(&dest_len).enumerate().map(|(i, ((&s, &d), &len))| answers.get(i, s, d, len)).collect()
    }

    /// Whether each key is present: `KVPLANE_OK` is `true`,
    /// `KVPLANE_NOT_FOUND` is `false`.
    pub fn exists(&mut self, keys: &[&[u8]], opts: &Options) -> Vec<Result<bool, Status>> {
        let exists = self.driver.functions.exists;
        self.keys_call("exists", exists, keys, opts, |answers, i, s, d| answers.exists(i, s, d))
    }

    /// Removes each key (the driver's `remove`); a missing key is `Ok`.
    pub fn delete(&mut self, keys: &[&[u8]], opts: &Options) -> Vec<Result<(), Status>> {
        let remove = self.driver.functions.remove;
        self.keys_call("remove", remove, keys, opts, |answers, i, s, d| answers.unit(i, s, d))
    }

    /// `exists` or `remove`: a call on keys alone.
    fn keys_call<T>(
        &mut self,
        call: &'static str,
        function: KeysFn,
        keys: &[&[u8]],
        opts: &Options,
        read: impl Fn(&Answers<'_>, usize, i32, u64) -> Result<T, Status>,
    ) -> Vec<Result<T, Status>> {
        let keys_c: Vec<RawBytes> = keys.iter().map(|k| RawBytes::new(k)).collect();
        let (answers, status, detail) = match self.batch(call, keys.len(), keys.len(), opts, |session, options, status, detail| {
            // SAFETY: as in `put`, for `exists` or `remove` (`function`,
            // copied from the checked table).
            unsafe { function(session, keys_c.as_ptr(), keys_c.len(), options, status, detail) }
        }) {
            Ok(out) => out,
            Err(refused) => return refused,
        };
        status.iter().zip(&detail).enumerate().map(|(i, (&s, &d))| read(&answers, i, s, d)).collect()
    }

    /// Runs one batch call of `n` entries (the key count; `other` is the
    /// length of the other slice, values or destinations, which must equal
    /// it): builds the options, the status and detail arrays filled with
    /// their sentinels, and calls `call` with pointers to them. Refuses, with
    /// one `Invalid` per key, what cannot be passed.
    #[allow(clippy::type_complexity)]
    fn batch<T>(
        &mut self,
        call: &'static str,
        n: usize,
        other: usize,
        opts: &Options,
        run: impl FnOnce(*mut RawSession, *const RawOptions, *mut i32, *mut u64),
    ) -> Result<(Answers<'_>, Vec<i32>, Vec<u64>), Vec<Result<T, Status>>> {
        let refuse = |why: &dyn fmt::Display| {
            tracing::debug!(driver = %self.driver.path.display(), call, "refused a batch call: {why}");
            (0..n).map(|_| Err(Status::Invalid)).collect()
        };
        if other != n {
            return Err(refuse(&format_args!("{n} keys but {other} values or destinations")));
        }
        let (ttl_ms, ns) = opts.to_c().map_err(|why| refuse(&why))?;
        let options = RawOptions { ttl_ms, ns: ns.as_ref().map_or(std::ptr::null(), |ns| ns.as_ptr()), timeout_ms: opts.timeout_ms };
        let mut status = vec![STATUS_UNSET; n];
        let mut detail = vec![DETAIL_UNSET; n];
        if n > 0 {
            run(self.raw.as_ptr(), &options, status.as_mut_ptr(), detail.as_mut_ptr());
        }
        // `ns`, which `options` points into, lives until here.
        drop(ns);
        Ok((Answers { driver: &self.driver.path, call }, status, detail))
    }
}
