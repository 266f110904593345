//! `kvplane._native.HostPages` and the page calls of `kvplane.Client`
//! (`get_pages`, `put_pages`): an engine's host memory pool seen as pages
//! of node blocks, for SGLang's HiCache page interface
//! (`kvplane.sglang_backend`).
//!
//! Why natively: SGLang hands its backend a batch of page hashes and a
//! tensor of host indices. Turning those into keys and buffers in Python (a
//! key string per block, a torch call to read the pages' first indices, a
//! dictionary of cached memoryviews, a memoryview exported per block, the
//! lengths compared in a list) cost 25-45 µs a batch, cold between two
//! transfers, against ~280 µs for the transfer itself of 32 pages of 64 KiB
//! over shared memory: the page interface ran at 0.79-0.87 of a bare
//! `get_into` of the same bytes. Here a batch is one call: the keys are
//! built in one allocation, the indices read from the tensor's memory (a
//! numpy view of it, no torch call) and checked, each page slot's block
//! addresses looked up in a table made once per slot from the engine's own
//! description of its pages (`describe`, SGLang's `get_page_buffer_meta`),
//! and each page checked whole.
//!
//! The pool's buffers are exported when the `HostPages` is made and stay
//! exported while it (or a PUT's block borrowed from them) lives, so every
//! address in its table, checked to lie inside one of them, is memory the
//! exporter can neither free nor move meanwhile.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use bytes::{BufMut, Bytes, BytesMut};
use kvplane_client::KvError;
use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyString;

use crate::{first_overlap, raise};

/// The pool's buffers, exported (see the module documentation).
struct Regions {
    exports: Vec<PyUntypedBuffer>,
}

impl Regions {
    /// Whether `len` bytes from `addr` lie inside one buffer.
    fn contain(&self, addr: usize, len: usize) -> bool {
        self.exports.iter().any(|b| {
            let base = b.buf_ptr() as usize;
            addr >= base && addr.checked_add(len).is_some_and(|end| end <= base + b.len_bytes())
        })
    }
}

/// One block of a page, borrowed from the pool as the bytes of a PUT.
struct PoolBlock {
    /// Held, not read: keeps the pool's buffers exported.
    _exported: Arc<Regions>,
    addr: usize,
    len: usize,
}

impl AsRef<[u8]> for PoolBlock {
    #[allow(unsafe_code)]
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `addr..addr + len` was checked to lie inside one of the
        // pool's buffers when its slot was learnt (`HostPages::learn`), those
        // buffers stay exported while `self._exported` lives, and `len` is a
        // block size, never 0 (checked by `HostPages::new`), so the pointer
        // is not null. The engine does not write a page while it stores it.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

/// A batch of pages as the client moves them: per block, its key and its
/// memory in the pool (address, length), in page order.
pub(crate) struct Batch {
    pub(crate) keys: Vec<Bytes>,
    pub(crate) blocks: Vec<(usize, usize)>,
}

/// A host memory pool of pages, each stored as `len(block_sizes)` node
/// blocks under `{prefix}{page hash}{suffix}`, one suffix per block:
///
/// `HostPages([memoryview(buffer), ...], prefix=..., suffixes=[...],
/// block_sizes=[...], page_tokens=64, tokens=pool_size)`
///
/// A page is `page_tokens` consecutive host indices (token slots) from its
/// first, all below `tokens`. Where a page slot's blocks lie is learnt the
/// first time the slot is used, from the `describe(starts)` callable given
/// to `Client.get_pages` / `put_pages`, which answers `(addresses, sizes)`:
/// `len(block_sizes)` blocks per page start, in order, each inside one of
/// the buffers; the pool's memory never moves, so that is kept (one entry
/// per page slot).
#[pyclass(name = "HostPages", module = "kvplane._native", frozen)]
pub(crate) struct HostPages {
    regions: Arc<Regions>,
    prefix: String,
    suffixes: Vec<String>,
    block_sizes: Vec<usize>,
    page_tokens: usize,
    tokens: usize,
    /// First host index of a page slot -> its blocks' addresses.
    slots: RwLock<HashMap<i64, Box<[usize]>>>,
    /// Pages moved through it (see `counts`), counted here rather than by
    /// the caller: a Python counter update right after a transfer cost the
    /// SGLang backend 14-19 µs a batch.
    counts: [AtomicU64; COUNTS.len()],
}

/// The names of `HostPages.counts()`, in the order of its counters.
const COUNTS: [&str; 4] = ["get_pages", "get_pages_read", "set_pages", "set_pages_present"];

/// A counter of `HostPages.counts()`.
#[derive(Clone, Copy)]
pub(crate) enum Count {
    /// Pages asked of `get_pages` (whose indices were pages of the pool).
    GetPages = 0,
    /// Of those, pages read whole.
    GetPagesRead = 1,
    /// Pages stored by `put_pages` or found there.
    SetPages = 2,
    /// Of those, pages already stored (not sent).
    SetPagesPresent = 3,
}

#[pymethods]
impl HostPages {
    #[new]
    #[pyo3(signature = (regions, *, prefix, suffixes, block_sizes, page_tokens, tokens))]
    fn new(
        regions: Vec<Bound<'_, PyAny>>,
        prefix: String,
        suffixes: Vec<String>,
        block_sizes: Vec<usize>,
        page_tokens: usize,
        tokens: usize,
    ) -> PyResult<Self> {
        if suffixes.is_empty() || suffixes.len() != block_sizes.len() {
            return Err(raise(
                "Invalid",
                format!("HostPages: {} suffixes and {} block sizes; a page has one of each per block", suffixes.len(), block_sizes.len()),
                None,
                None,
            ));
        }
        if let Some(j) = block_sizes.iter().position(|&n| n == 0) {
            return Err(raise("Invalid", format!("HostPages: block_sizes[{j}] is 0"), None, None));
        }
        if page_tokens == 0 {
            return Err(raise("Invalid", "HostPages: page_tokens is 0".into(), None, None));
        }
        let exports = regions
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let what = || format!("HostPages: regions[{i}] (a {})", crate::type_name(r));
                let b =
                    PyUntypedBuffer::get(r).map_err(|e| raise("BadBuffer", format!("{}: exports no buffer: {e}", what()), None, None))?;
                if b.readonly() {
                    return Err(raise("ReadOnlyBuffer", format!("{} is read-only; pages are read into it", what()), None, None));
                }
                if !b.is_c_contiguous() {
                    return Err(raise("NonContiguousBuffer", format!("{} is not C-contiguous", what()), None, None));
                }
                Ok(b)
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(HostPages {
            regions: Arc::new(Regions { exports }),
            prefix,
            suffixes,
            block_sizes,
            page_tokens,
            tokens,
            slots: RwLock::new(HashMap::new()),
            counts: Default::default(),
        })
    }

    /// The keys of pages `hashes`, block by block: what `get_pages` and
    /// `put_pages` move (for `match_prefix`, `exists`, tools and tests).
    fn keys<'py>(&self, py: Python<'py>, hashes: Vec<Bound<'py, PyAny>>) -> PyResult<Vec<Bound<'py, PyString>>> {
        let keys = self.keys_of(&hashes)?;
        // Each key is the UTF-8 of str parts, so valid UTF-8.
        Ok(keys.iter().map(|k| PyString::new(py, std::str::from_utf8(k).expect("keys are made of str"))).collect())
    }

    /// Blocks per page.
    #[getter]
    fn per_page(&self) -> usize {
        self.block_sizes.len()
    }

    /// Pages moved so far: asked of `get_pages` and read whole by it
    /// (`get_pages`, `get_pages_read`), given to `put_pages` and found
    /// already stored (`set_pages`, `set_pages_present`).
    fn counts(&self) -> HashMap<&'static str, u64> {
        COUNTS.iter().zip(&self.counts).map(|(&name, c)| (name, c.load(Ordering::Relaxed))).collect()
    }

    /// How many page slots were learnt (described) so far.
    fn __len__(&self) -> usize {
        self.slots.read().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl HostPages {
    /// Adds `n` to a counter of `counts()`.
    pub(crate) fn count(&self, counter: Count, n: usize) {
        self.counts[counter as usize].fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn per_page_blocks(&self) -> usize {
        self.block_sizes.len()
    }

    /// The block sizes of a page, in order.
    pub(crate) fn block_sizes(&self) -> &[usize] {
        &self.block_sizes
    }

    /// Keys `{prefix}{hash}{suffix}`, page by page, all in one allocation.
    fn keys_of(&self, hashes: &[Bound<'_, PyAny>]) -> PyResult<Vec<Bytes>> {
        let hashes = hashes
            .iter()
            .enumerate()
            .map(|(i, h)| {
                h.cast::<PyString>()
                    .map_err(|_| {
                        pyo3::exceptions::PyTypeError::new_err(format!("hashes[{i}]: a page hash is a str, not {}", crate::type_name(h)))
                    })?
                    .to_str()
            })
            .collect::<PyResult<Vec<&str>>>()?;
        let suffixes: usize = self.suffixes.iter().map(String::len).sum();
        let k = self.suffixes.len();
        let total = hashes.iter().map(|h| k * (self.prefix.len() + h.len()) + suffixes).sum();
        let mut all = BytesMut::with_capacity(total);
        let mut keys = Vec::with_capacity(hashes.len() * k);
        for h in hashes {
            for s in &self.suffixes {
                all.put_slice(self.prefix.as_bytes());
                all.put_slice(h.as_bytes());
                all.put_slice(s.as_bytes());
                keys.push(all.split().freeze());
            }
        }
        Ok(keys)
    }

    /// The first host index of each of `pages` pages in `host_indices` (a
    /// C-contiguous buffer of 8- or 4-byte signed integers, such as a
    /// numpy view of SGLang's int64 tensor), checking that each page is
    /// `page_tokens` consecutive slots of the pool.
    fn page_starts(&self, py: Python<'_>, host_indices: &Bound<'_, PyAny>, pages: usize) -> PyResult<Vec<i64>> {
        // A tensor first: it exports no buffer, and a refused export costs
        // an exception.
        let indices: Vec<i64> = if host_indices.hasattr(intern!(py, "data_ptr"))? {
            tensor_indices(py, host_indices)?
        } else if let Ok(b) = PyBuffer::<i64>::get(host_indices) {
            b.to_vec(py)?
        } else {
            match PyBuffer::<i32>::get(host_indices) {
                Ok(b) => b.to_vec(py)?.into_iter().map(i64::from).collect(),
                Err(e) => {
                    return Err(raise(
                        "Invalid",
                        format!("host_indices: a {} is not a buffer of 8- or 4-byte integers ({e})", crate::type_name(host_indices)),
                        None,
                        None,
                    ))
                }
            }
        };
        let pt = self.page_tokens;
        if indices.len() != pages * pt {
            return Err(raise("Invalid", format!("host_indices: {} indices for {pages} pages of {pt} tokens", indices.len()), None, None));
        }
        let tokens = i64::try_from(self.tokens).unwrap_or(i64::MAX);
        indices
            .chunks_exact(pt)
            .enumerate()
            .map(|(page, run)| {
                let start = run[0];
                if start < 0 || start.saturating_add(pt as i64) > tokens {
                    return Err(raise(
                        "Invalid",
                        format!(
                            "host_indices[{}] = {start}: page {page} of {pt} slots from there lies outside the host pool's {} slots",
                            page * pt,
                            self.tokens
                        ),
                        None,
                        None,
                    ));
                }
                if let Some(t) = (1..pt).find(|&t| run[t] != start + t as i64) {
                    return Err(raise(
                        "Invalid",
                        format!(
                            "host_indices[{}] = {}: page {page} is not {pt} consecutive slots from {start} (a page is one run of slots)",
                            page * pt + t,
                            run[t]
                        ),
                        None,
                        None,
                    ));
                }
                Ok(start)
            })
            .collect()
    }

    /// Learns the blocks of page slots `starts` from `describe(starts)`.
    fn learn(&self, describe: &Bound<'_, PyAny>, starts: Vec<i64>) -> PyResult<()> {
        let (addrs, sizes): (Vec<usize>, Vec<usize>) = describe.call1((starts.clone(),))?.extract()?;
        let k = self.block_sizes.len();
        if addrs.len() != starts.len() * k || sizes.len() != addrs.len() {
            return Err(raise(
                "Invalid",
                format!(
                    "describe({} page starts) answered {} addresses and {} sizes; {k} blocks per page expected",
                    starts.len(),
                    addrs.len(),
                    sizes.len()
                ),
                None,
                None,
            ));
        }
        let mut learnt = Vec::with_capacity(starts.len());
        for (p, &start) in starts.iter().enumerate() {
            let page = &addrs[p * k..(p + 1) * k];
            for (j, (&addr, &size)) in page.iter().zip(&sizes[p * k..(p + 1) * k]).enumerate() {
                if size != self.block_sizes[j] {
                    return Err(raise(
                        "Invalid",
                        format!("describe: block {j} of the page at slot {start} is {size} bytes, not {}", self.block_sizes[j]),
                        None,
                        None,
                    ));
                }
                if !self.regions.contain(addr, size) {
                    return Err(raise(
                        "Invalid",
                        format!(
                            "describe: block {j} of the page at slot {start} ({addr:#x}, {size} bytes) lies outside the pool's buffers"
                        ),
                        None,
                        None,
                    ));
                }
            }
            learnt.push((start, page.to_vec().into_boxed_slice()));
        }
        self.slots.write().unwrap_or_else(|p| p.into_inner()).extend(learnt);
        Ok(())
    }

    /// The keys and pool memory of a batch of pages (see the class): the
    /// pages' slots learnt first where new, and no two blocks sharing
    /// memory (two pages of one slot in a batch are refused).
    pub(crate) fn batch(
        &self,
        py: Python<'_>,
        hashes: &[Bound<'_, PyAny>],
        host_indices: &Bound<'_, PyAny>,
        describe: &Bound<'_, PyAny>,
    ) -> PyResult<Batch> {
        let starts = self.page_starts(py, host_indices, hashes.len())?;
        let keys = self.keys_of(hashes)?;
        let missing: Vec<i64> = {
            let slots = self.slots.read().unwrap_or_else(|p| p.into_inner());
            let mut missing: Vec<i64> = starts.iter().copied().filter(|s| !slots.contains_key(s)).collect();
            missing.sort_unstable();
            missing.dedup();
            missing
        };
        if !missing.is_empty() {
            self.learn(describe, missing)?;
        }
        let blocks: Vec<(usize, usize)> = {
            let slots = self.slots.read().unwrap_or_else(|p| p.into_inner());
            starts.iter().flat_map(|s| slots[s].iter().copied().zip(self.block_sizes.iter().copied())).collect()
        };
        if let Some((a, b)) = first_overlap(&blocks) {
            let k = self.block_sizes.len();
            return Err(raise(
                "Invalid",
                format!(
                    "pages {} and {} of the batch share memory (host indices from {} and {}); each page needs slots of its own",
                    a / k,
                    b / k,
                    starts[a / k],
                    starts[b / k]
                ),
                Some(&keys[b]),
                Some(b),
            ));
        }
        Ok(Batch { keys, blocks })
    }

    /// The bytes of the PUT of one block of a batch, borrowed from the pool.
    pub(crate) fn block_bytes(&self, (addr, len): (usize, usize)) -> Bytes {
        Bytes::from_owner(PoolBlock { _exported: Arc::clone(&self.regions), addr, len })
    }
}

/// Per page of a GET's answers (per block: bytes read, or the key's
/// error, absent or longer than its block): whether every block was read
/// at its full size, and the pages read only in part (some block there but
/// not all, or one of another length: evicted in part, or not this
/// layout's bytes).
pub(crate) fn whole_pages(answers: &[Result<usize, KvError>], sizes: &[usize]) -> (Vec<bool>, Vec<usize>) {
    let mut whole = Vec::with_capacity(answers.len() / sizes.len());
    let mut partial = Vec::new();
    for (page, got) in answers.chunks_exact(sizes.len()).enumerate() {
        let all = got.iter().zip(sizes).all(|(g, &n)| matches!(g, Ok(m) if *m == n));
        if !all && got.iter().any(|g| matches!(g, Ok(_) | Err(KvError::Capacity(_)))) {
            partial.push(page);
        }
        whole.push(all);
    }
    (whole, partial)
}

/// `torch.int64` and `torch.int32`, looked up once.
static TORCH_INDEX_DTYPES: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

/// The values of a torch tensor of host indices (SGLang's own, as it hands
/// them over), read from its memory: a contiguous CPU tensor of int64 or
/// int32. Five cheap attribute reads instead of `tensor.numpy()`, which
/// right after a transfer (its code out of the caches) cost 34-50 µs a
/// batch against 13 µs for `data_ptr`, `numel` and `dtype`.
#[allow(unsafe_code)]
fn tensor_indices(py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let refuse = |why: String| raise("Invalid", format!("host_indices: a {} {why}", crate::type_name(t)), None, None);
    let (int64, int32) = TORCH_INDEX_DTYPES.get_or_try_init(py, || -> PyResult<_> {
        let torch = py.import("torch")?;
        Ok((torch.getattr("int64")?.unbind(), torch.getattr("int32")?.unbind()))
    })?;
    if !t.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
        return Err(refuse("is not in host memory".into()));
    }
    let dtype = t.getattr(intern!(py, "dtype"))?;
    let wide = dtype.is(int64.bind(py));
    if !wide && !dtype.is(int32.bind(py)) {
        return Err(refuse(format!("of {dtype} is not of int64 or int32")));
    }
    if !t.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()? {
        return Err(refuse("is not contiguous".into()));
    }
    let n: usize = t.call_method0(intern!(py, "numel"))?.extract()?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let addr: usize = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let align = if wide { std::mem::align_of::<i64>() } else { std::mem::align_of::<i32>() };
    if addr == 0 || addr % align != 0 {
        return Err(refuse(format!("has its data at {addr:#x}, not aligned for its integers")));
    }
    // SAFETY: a contiguous CPU tensor of `n` elements of int64 (int32) has
    // them at `data_ptr`, aligned (checked) and non-null; the caller holds
    // the tensor for the call and the GIL is held while they are copied.
    Ok(unsafe {
        if wide {
            std::slice::from_raw_parts(addr as *const i64, n).to_vec()
        } else {
            std::slice::from_raw_parts(addr as *const i32, n).iter().map(|&v| i64::from(v)).collect()
        }
    })
}
