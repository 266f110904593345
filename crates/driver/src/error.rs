//! Why a driver could not be loaded or could not open a session.

use std::path::PathBuf;

/// A failure to load a driver or open a session on it; every message names
/// the driver's path. Failures of single entries of a batch call are
/// [`Status`](crate::Status)es instead.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// `dlopen` failed: no such file, not a shared library, an unresolved
    /// symbol, ...
    #[error("cannot load driver {}: {source}", path.display())]
    Load { path: PathBuf, source: libloading::Error },
    /// The library does not export the entry symbol.
    #[error("driver {} does not export `{}`: {source}", path.display(), crate::ENTRY_SYMBOL)]
    MissingEntry { path: PathBuf, source: libloading::Error },
    /// The entry function returned a pointer the host cannot read.
    #[error("driver {}: `{}` returned {what}", path.display(), crate::ENTRY_SYMBOL)]
    BadEntry { path: PathBuf, what: &'static str },
    /// The driver implements another version of the ABI.
    #[error("driver {} implements driver ABI version {found}; this host implements version {expected}", path.display())]
    AbiVersion { path: PathBuf, found: u32, expected: u32 },
    /// A function pointer of the driver's table is NULL.
    #[error("driver {}: function `{function}` of its table is NULL", path.display())]
    NullFunction { path: PathBuf, function: &'static str },
    /// A config key or value holds a NUL byte, which a C string cannot carry.
    #[error("driver {}: the {what} of config key {key:?} contains a NUL byte", path.display())]
    ConfigNul { path: PathBuf, key: String, what: &'static str },
    /// The driver's `open` refused; `message` is what it wrote.
    #[error("driver {} could not open a session: {message}", path.display())]
    Open { path: PathBuf, message: String },
}
