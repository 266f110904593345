//! The CUDA driver calls this crate makes, through cudarc's raw bindings
//! with the driver library loaded at run time.
//!
//! Why a module of its own: it is the only place that touches the driver,
//! so the build without the `cuda` feature swaps in `absent.rs` (same
//! functions, each answering [`GpuError::NotBuilt`]) and everything above
//! stays the same code in both builds.
//!
//! Why a probe before the first call: cudarc panics when it cannot load
//! libcuda (and when a symbol is missing). [`probe`] looks for the library
//! with cudarc's own search list first and answers
//! [`GpuError::NoDevice`]; every call also runs under `catch_unwind`, so a
//! driver too old for a symbol is an error, not a crash.
//!
//! Handles cross this module as plain integers (a `CUstream` or device
//! pointer as its address), which keeps `absent.rs` free of CUDA types.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::GpuError;

/// Runs one driver call, turning a panic inside cudarc (library or symbol
/// missing) and a failed `CUresult` into errors that name the call.
fn call(name: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<(), GpuError> {
    let result = catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "cudarc panicked".into());
        GpuError::Driver { call: name, message: why }
    })?;
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_STUB_LIBRARY => {
            Err(GpuError::NoDevice(format!("{name}: {}", describe(result))))
        }
        _ => Err(GpuError::Driver { call: name, message: describe(result) }),
    }
}

/// The driver's name and text for an error code.
fn describe(code: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string (or leave
    // ours null); the driver library is loaded (a call just answered `code`).
    let ok = catch_unwind(AssertUnwindSafe(|| unsafe {
        sys::cuGetErrorName(code, &mut name);
        sys::cuGetErrorString(code, &mut text);
    }))
    .is_ok();
    let read = |p: *const std::ffi::c_char| {
        // SAFETY: a non-null pointer the driver gave us to a NUL-terminated
        // static string.
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (ok, read(name), read(text)) {
        (true, Some(n), Some(t)) => format!("{n}: {t}"),
        _ => format!("{code:?}"),
    }
}

/// Loads the driver library (once) and initialises the driver.
pub(crate) fn probe() -> Result<(), GpuError> {
    static PROBE: OnceLock<Result<(), GpuError>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the driver library by name.
            if !unsafe { sys::is_culib_present() } {
                return Err(GpuError::NoDevice(
                    "the CUDA driver library (libcuda.so) could not be loaded: no NVIDIA driver on this machine, \
                     or not on the loader's path (LD_LIBRARY_PATH)"
                        .into(),
                ));
            }
            // SAFETY: cuInit with flags 0 is the documented first call. Any
            // failure here (no device, a driver older than the kernel
            // module, a stub library) means no usable GPU.
            call("cuInit", || unsafe { sys::cuInit(0) }).map_err(|e| match e {
                GpuError::Driver { message, .. } => GpuError::NoDevice(format!("cuInit: {message}")),
                other => other,
            })
        })
        .clone()
}

/// A device's primary context, the one every runtime-API user (PyTorch
/// among them) shares, retained for as long as this value lives.
pub(crate) struct Context {
    ctx: sys::CUcontext,
    device: sys::CUdevice,
}

// SAFETY: a CUcontext is a handle the driver lets any thread make current;
// every use goes through `bind`, which does that on the calling thread.
unsafe impl Send for Context {}
// SAFETY: see `Send`; the handle itself is never mutated.
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn primary(ordinal: usize) -> Result<Context, GpuError> {
        probe()?;
        let mut count = 0;
        // SAFETY: writes one int.
        call("cuDeviceGetCount", || unsafe { sys::cuDeviceGetCount(&mut count) })?;
        if count <= 0 {
            return Err(GpuError::NoDevice("the CUDA driver is loaded but reports no device".into()));
        }
        if ordinal >= count as usize {
            return Err(GpuError::Invalid(format!("device {ordinal}: this machine has {count} CUDA device(s)")));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: writes one device handle, for an ordinal checked above.
        call("cuDeviceGet", || unsafe { sys::cuDeviceGet(&mut device, ordinal as i32) })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; released in `Drop`.
        call("cuDevicePrimaryCtxRetain", || unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) })?;
        let context = Context { ctx, device };
        context.bind()?;
        Ok(context)
    }

    /// Makes the context current on the calling thread (a thread-local
    /// write in the driver): async tasks move between threads, so every
    /// entry point calls this first.
    pub(crate) fn bind(&self) -> Result<(), GpuError> {
        // SAFETY: a context retained by this value.
        call("cuCtxSetCurrent", || unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    pub(crate) fn name(&self) -> String {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the driver writes at most `buf.len()` bytes, NUL-terminated.
        match call("cuDeviceGetName", || unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.device) }) {
            // SAFETY: NUL-terminated by the driver within the buffer.
            Ok(()) => unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned(),
            Err(e) => format!("(unnamed device: {e})"),
        }
    }

    pub(crate) fn stream_create(&self) -> Result<usize, GpuError> {
        self.bind()?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed by `stream_destroy`.
        call("cuStreamCreate", || unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) })?;
        Ok(stream as usize)
    }

    pub(crate) fn stream_destroy(&self, stream: usize) {
        if self.bind().is_ok() {
            // SAFETY: a stream this crate created, destroyed once.
            let _ = call("cuStreamDestroy", || unsafe { sys::cuStreamDestroy_v2(stream as sys::CUstream) });
        }
    }

    /// True once every copy enqueued on `stream` has finished.
    pub(crate) fn stream_done(&self, stream: usize) -> Result<bool, GpuError> {
        // SAFETY: a query on a stream handle of this context.
        self.query("cuStreamQuery", || unsafe { sys::cuStreamQuery(stream as sys::CUstream) })
    }

    /// Runs a stream or event query: true when done, false for
    /// `CUDA_ERROR_NOT_READY`, an error for anything else.
    fn query(&self, name: &'static str, f: impl FnOnce() -> sys::CUresult) -> Result<bool, GpuError> {
        self.bind()?;
        let mut ready = true;
        call(name, || match f() {
            sys::CUresult::CUDA_ERROR_NOT_READY => {
                ready = false;
                sys::CUresult::CUDA_SUCCESS
            }
            code => code,
        })?;
        Ok(ready)
    }

    /// An event (no timing) marking a point in a stream, for waiting on
    /// part of what was enqueued.
    pub(crate) fn event_create(&self) -> Result<usize, GpuError> {
        self.bind()?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; destroyed by `event_destroy`.
        call("cuEventCreate", || unsafe { sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) })?;
        Ok(event as usize)
    }

    pub(crate) fn event_record(&self, event: usize, stream: usize) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: an event of this crate and a stream of this context.
        call("cuEventRecord", || unsafe { sys::cuEventRecord(event as sys::CUevent, stream as sys::CUstream) })
    }

    /// True once the stream has passed the point `event` recorded.
    pub(crate) fn event_done(&self, event: usize) -> Result<bool, GpuError> {
        // SAFETY: a query on an event of this crate.
        self.query("cuEventQuery", || unsafe { sys::cuEventQuery(event as sys::CUevent) })
    }

    pub(crate) fn event_destroy(&self, event: usize) {
        if self.bind().is_ok() {
            // SAFETY: an event from `event_create`, destroyed once.
            let _ = call("cuEventDestroy", || unsafe { sys::cuEventDestroy_v2(event as sys::CUevent) });
        }
    }

    /// Page-locks `len` bytes at `ptr` for the device's copy engines
    /// (portable: for every context; never write-combined).
    pub(crate) fn host_register(&self, ptr: *mut u8, len: usize) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the caller's mapping of at least `len` bytes, unregistered
        // before it is unmapped (see `PinnedRegion`).
        call("cuMemHostRegister", || unsafe { sys::cuMemHostRegister_v2(ptr.cast::<c_void>(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) })
    }

    pub(crate) fn host_unregister(&self, ptr: *mut u8) {
        if self.bind().is_ok() {
            // SAFETY: memory registered by `host_register`, unregistered once.
            let _ = call("cuMemHostUnregister", || unsafe { sys::cuMemHostUnregister(ptr.cast::<c_void>()) });
        }
    }

    /// Enqueues a copy of `len` bytes from device address `src` to `dst`.
    ///
    /// # Safety
    /// `dst` must stay valid for `len` bytes, and unused by anything else,
    /// until the stream has passed the copy; `src` must be device memory of
    /// this context (or imported into it) of at least `len` bytes.
    pub(crate) unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize, stream: usize) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the caller's promises above.
        call("cuMemcpyDtoHAsync", || unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, stream as sys::CUstream) })
    }

    /// Enqueues a copy of `len` bytes from `src` to device address `dst`.
    ///
    /// # Safety
    /// As [`Context::copy_to_host`], the other way round: `src` must stay
    /// valid and unchanged until the stream has passed the copy.
    pub(crate) unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize, stream: usize) -> Result<(), GpuError> {
        self.bind()?;
        // SAFETY: the caller's promises above.
        call("cuMemcpyHtoDAsync", || unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), len, stream as sys::CUstream) })
    }

    pub(crate) fn alloc(&self, len: usize) -> Result<u64, GpuError> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; freed by `free`.
        call("cuMemAlloc", || unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) })?;
        Ok(ptr)
    }

    pub(crate) fn free(&self, ptr: u64) {
        if self.bind().is_ok() {
            // SAFETY: memory from `alloc`, freed once.
            let _ = call("cuMemFree", || unsafe { sys::cuMemFree_v2(ptr) });
        }
    }

    pub(crate) fn alloc_host(&self, len: usize) -> Result<*mut u8, GpuError> {
        self.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one host pointer; freed by `free_host`.
        call("cuMemAllocHost", || unsafe { sys::cuMemAllocHost_v2(&mut ptr, len.max(1)) })?;
        Ok(ptr.cast::<u8>())
    }

    pub(crate) fn free_host(&self, ptr: *mut u8) {
        if self.bind().is_ok() {
            // SAFETY: memory from `alloc_host`, freed once.
            let _ = call("cuMemFreeHost", || unsafe { sys::cuMemFreeHost(ptr.cast::<c_void>()) });
        }
    }

    /// The base and size of the allocation that holds device address `ptr`.
    pub(crate) fn address_range(&self, ptr: u64) -> Result<(u64, usize), GpuError> {
        self.bind()?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: writes one pointer and one size.
        call("cuMemGetAddressRange", || unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
        Ok((base, size))
    }

    pub(crate) fn ipc_export(&self, ptr: u64) -> Result<[u8; 64], GpuError> {
        self.bind()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: writes one 64-byte handle for an allocation of this context.
        call("cuIpcGetMemHandle", || unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) })?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    pub(crate) fn ipc_open(&self, bytes: [u8; 64]) -> Result<u64, GpuError> {
        self.bind()?;
        let handle = sys::CUipcMemHandle { reserved: bytes.map(|b| b as std::ffi::c_char) };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the driver validates the handle; the mapping is closed by
        // `ipc_close`.
        call("cuIpcOpenMemHandle", || unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
        })?;
        Ok(ptr)
    }

    pub(crate) fn ipc_close(&self, ptr: u64) {
        if self.bind().is_ok() {
            // SAFETY: a mapping from `ipc_open`, closed once.
            let _ = call("cuIpcCloseMemHandle", || unsafe { sys::cuIpcCloseMemHandle(ptr) });
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the retain made in `primary`, released once.
        let _ = call("cuDevicePrimaryCtxRelease", || unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) });
    }
}
