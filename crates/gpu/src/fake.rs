//! A stand-in for the driver in this crate's unit tests without the `cuda`
//! feature: "device memory" is host memory, and every copy is deferred
//! until a wait reaches it (an event query runs the stream's queue up to
//! that event, a stream query runs all of it). Deferring as long as the
//! driver may is what makes a missing wait in the batching logic show up
//! as wrong bytes, on machines without a GPU.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::GpuError;

enum Op {
    Copy { dst: usize, src: usize, len: usize },
    Mark(usize),
}

#[derive(Default)]
struct State {
    streams: HashMap<usize, VecDeque<Op>>,
    /// Event -> the stream it was recorded on.
    events: HashMap<usize, usize>,
    allocations: BTreeMap<u64, usize>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
static NEXT: AtomicUsize = AtomicUsize::new(1);

fn with<R>(f: impl FnOnce(&mut State) -> R) -> R {
    let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    f(state.get_or_insert_with(State::default))
}

/// Runs queued operations of `stream` until `until` (a mark) is passed, or
/// all of them.
fn run(stream: usize, until: Option<usize>) {
    with(|s| {
        let queue = s.streams.entry(stream).or_default();
        if let Some(mark) = until {
            if !queue.iter().any(|op| matches!(op, Op::Mark(m) if *m == mark)) {
                return;
            }
        }
        while let Some(op) = queue.pop_front() {
            match op {
                // SAFETY: test-only; the library keeps both ranges valid
                // until a wait has run the copy (the property under test).
                Op::Copy { dst, src, len } => unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) },
                Op::Mark(m) if Some(m) == until => return,
                Op::Mark(_) => {}
            }
        }
    })
}

pub(crate) fn probe() -> Result<(), GpuError> {
    Ok(())
}

pub(crate) struct Context;

impl Context {
    pub(crate) fn primary(_ordinal: usize) -> Result<Context, GpuError> {
        Ok(Context)
    }

    pub(crate) fn name(&self) -> String {
        "fake".into()
    }

    pub(crate) fn stream_create(&self) -> Result<usize, GpuError> {
        Ok(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn stream_destroy(&self, stream: usize) {
        run(stream, None);
        with(|s| s.streams.remove(&stream));
    }

    pub(crate) fn stream_done(&self, stream: usize) -> Result<bool, GpuError> {
        run(stream, None);
        Ok(true)
    }

    pub(crate) fn event_create(&self) -> Result<usize, GpuError> {
        Ok(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn event_record(&self, event: usize, stream: usize) -> Result<(), GpuError> {
        with(|s| {
            s.streams.entry(stream).or_default().push_back(Op::Mark(event));
            s.events.insert(event, stream);
        });
        Ok(())
    }

    pub(crate) fn event_done(&self, event: usize) -> Result<bool, GpuError> {
        let stream = with(|s| s.events.get(&event).copied());
        if let Some(stream) = stream {
            run(stream, Some(event));
        }
        Ok(true)
    }

    pub(crate) fn event_destroy(&self, event: usize) {
        with(|s| s.events.remove(&event));
    }

    pub(crate) fn host_register(&self, _ptr: *mut u8, _len: usize) -> Result<(), GpuError> {
        Ok(())
    }

    pub(crate) fn host_unregister(&self, _ptr: *mut u8) {}

    pub(crate) unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize, stream: usize) -> Result<(), GpuError> {
        with(|s| s.streams.entry(stream).or_default().push_back(Op::Copy { dst: dst as usize, src: src as usize, len }));
        Ok(())
    }

    pub(crate) unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize, stream: usize) -> Result<(), GpuError> {
        with(|s| s.streams.entry(stream).or_default().push_back(Op::Copy { dst: dst as usize, src: src as usize, len }));
        Ok(())
    }

    pub(crate) fn alloc(&self, len: usize) -> Result<u64, GpuError> {
        let ptr = Box::into_raw(vec![0u8; len.max(1)].into_boxed_slice()) as *mut u8 as u64;
        with(|s| s.allocations.insert(ptr, len.max(1)));
        Ok(ptr)
    }

    pub(crate) fn free(&self, ptr: u64) {
        if let Some(len) = with(|s| s.allocations.remove(&ptr)) {
            // SAFETY: the box `alloc` leaked, of that length, freed once.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr as *mut u8, len)) });
        }
    }

    pub(crate) fn alloc_host(&self, len: usize) -> Result<*mut u8, GpuError> {
        Ok(self.alloc(len)? as *mut u8)
    }

    pub(crate) fn free_host(&self, ptr: *mut u8) {
        self.free(ptr as u64)
    }

    pub(crate) fn address_range(&self, ptr: u64) -> Result<(u64, usize), GpuError> {
        with(|s| s.allocations.get(&ptr).map(|len| (ptr, *len)))
            .ok_or_else(|| GpuError::Driver { call: "cuMemGetAddressRange", message: "not an allocation".into() })
    }

    pub(crate) fn ipc_export(&self, ptr: u64) -> Result<[u8; 64], GpuError> {
        let mut handle = [0u8; 64];
        handle[..8].copy_from_slice(&ptr.to_le_bytes());
        Ok(handle)
    }

    pub(crate) fn ipc_open(&self, bytes: [u8; 64]) -> Result<u64, GpuError> {
        Ok(u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default()))
    }

    pub(crate) fn ipc_close(&self, _ptr: u64) {}
}
