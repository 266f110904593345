//! The build without the `cuda` feature: the same functions as `cuda.rs`,
//! none of which can run. Only [`probe`] and [`Context::primary`] are ever
//! reached (they answer [`GpuError::NotBuilt`]); every other function takes
//! a `Context`, which cannot exist in this build.

use std::convert::Infallible;

use crate::GpuError;

pub(crate) fn probe() -> Result<(), GpuError> {
    Err(GpuError::NotBuilt)
}

pub(crate) struct Context(Infallible);

#[allow(clippy::missing_safety_doc)]
impl Context {
    pub(crate) fn primary(_ordinal: usize) -> Result<Context, GpuError> {
        Err(GpuError::NotBuilt)
    }

    pub(crate) fn name(&self) -> String {
        match self.0 {}
    }

    pub(crate) fn stream_create(&self) -> Result<usize, GpuError> {
        match self.0 {}
    }

    pub(crate) fn stream_destroy(&self, _stream: usize) {
        match self.0 {}
    }

    pub(crate) fn stream_done(&self, _stream: usize) -> Result<bool, GpuError> {
        match self.0 {}
    }

    pub(crate) fn event_create(&self) -> Result<usize, GpuError> {
        match self.0 {}
    }

    pub(crate) fn event_record(&self, _event: usize, _stream: usize) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub(crate) fn event_done(&self, _event: usize) -> Result<bool, GpuError> {
        match self.0 {}
    }

    pub(crate) fn event_destroy(&self, _event: usize) {
        match self.0 {}
    }

    pub(crate) fn host_register(&self, _ptr: *mut u8, _len: usize) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub(crate) fn host_unregister(&self, _ptr: *mut u8) {
        match self.0 {}
    }

    pub(crate) unsafe fn copy_to_host(&self, _dst: *mut u8, _src: u64, _len: usize, _stream: usize) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub(crate) unsafe fn copy_to_device(&self, _dst: u64, _src: *const u8, _len: usize, _stream: usize) -> Result<(), GpuError> {
        match self.0 {}
    }

    pub(crate) fn alloc(&self, _len: usize) -> Result<u64, GpuError> {
        match self.0 {}
    }

    pub(crate) fn free(&self, _ptr: u64) {
        match self.0 {}
    }

    pub(crate) fn alloc_host(&self, _len: usize) -> Result<*mut u8, GpuError> {
        match self.0 {}
    }

    pub(crate) fn free_host(&self, _ptr: *mut u8) {
        match self.0 {}
    }

    pub(crate) fn address_range(&self, _ptr: u64) -> Result<(u64, usize), GpuError> {
        match self.0 {}
    }

    pub(crate) fn ipc_export(&self, _ptr: u64) -> Result<[u8; 64], GpuError> {
        match self.0 {}
    }

    pub(crate) fn ipc_open(&self, _bytes: [u8; 64]) -> Result<u64, GpuError> {
        match self.0 {}
    }

    pub(crate) fn ipc_close(&self, _ptr: u64) {
        match self.0 {}
    }
}
