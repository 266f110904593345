//! The ibverbs side (feature `rdma`): a device, the node's pool registered
//! as a memory region, RC queue pairs connected over a TCP side channel,
//! and the reader's one-sided RDMA READ.
//!
//! Why raw verbs (`ibverbs-sys`, the bindings the `ibverbs` crate is built
//! on) rather than the `ibverbs` crate's safe API: that API registers only
//! memory it allocates itself and posts only SEND/RECV, while the node must
//! register the pool it already has and the reader must post an RDMA READ;
//! it also keeps the raw handles private, so the two cannot be mixed. The
//! unsafe code is confined to this module, each block with the reason it
//! is sound.
//!
//! Why a TCP side channel: an RC queue pair must learn its peer's queue
//! pair number, LID/GID and starting packet sequence number before it can
//! carry anything; exchanging them over a TCP connection is the simplest
//! way that needs no RDMA connection manager. The same connection then
//! carries descriptors ([`send_descriptor`], [`recv_descriptor`]).
//!
//! What a reader does when this fails: [`Device::open_first`] answers
//! [`RdmaError::NoDevice`] on a machine without an RDMA device, or where
//! libibverbs has no provider for the one present, and the caller takes
//! the TCP path ([`crate::choose`]).

use std::ffi::CStr;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use crate::lease::Lease;
use kvplane_protocol::rdma::descriptor::{DecodeError, Descriptor, Gid, UseError, ENCODED_LEN};
pub use kvplane_protocol::rdma::endpoint::{QueuePairEndpoint, ENDPOINT_LEN};

/// The port every queue pair uses: the first (most devices have one).
const PORT: u8 = 1;

/// What went wrong on the verbs side.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// No RDMA device here, or libibverbs has no provider for it: use TCP.
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("{op} failed: {source}")]
    Verbs {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The device's first port cannot carry traffic.
    #[error("port {PORT} of RDMA device {device} is not active (state {state})")]
    PortDown { device: String, state: u32 },
    /// A sub-range outside the registered region.
    #[error("range {offset}+{len} is outside the registered region of {region_len} bytes")]
    Range { offset: usize, len: usize, region_len: usize },
    /// The descriptor may not be used, or what the READ brought back is not
    /// the block.
    #[error(transparent)]
    Unusable(#[from] UseError),
    /// The descriptor names a queue pair this one is not connected to.
    #[error("descriptor is for the node's queue pair {want}, this one is connected to {connected:?}")]
    WrongQueuePair { want: u32, connected: Option<u32> },
    /// An earlier READ failed or timed out; the queue pair is in error state.
    #[error("queue pair {0} is broken by an earlier failed READ; connect a new one")]
    Broken(u32),
    /// The READ completed with an error status.
    #[error("RDMA READ completed with status {status} ({name}, vendor error {vendor_err:#x})")]
    Completion { status: u32, name: String, vendor_err: u32 },
    /// The READ did not complete in time.
    #[error("RDMA READ did not complete within {0:?}")]
    Timeout(Duration),
    /// The side channel failed or sent something that is not an endpoint.
    #[error("side channel: {0}")]
    SideChannel(#[source] io::Error),
    /// A descriptor from the side channel did not decode.
    #[error(transparent)]
    Descriptor(#[from] DecodeError),
}

fn last_os_error(op: &'static str) -> RdmaError {
    RdmaError::Verbs { op, source: io::Error::last_os_error() }
}

fn errno(op: &'static str, rc: i32) -> Result<(), RdmaError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(RdmaError::Verbs { op, source: io::Error::from_raw_os_error(rc) })
    }
}

/// The devices libibverbs lists, freed on drop.
struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, RdmaError> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the list returned is freed in
        // Drop, exactly once.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        match NonNull::new(list) {
            None => Err(RdmaError::NoDevice(format!(
                "libibverbs lists no devices ({}): no RDMA NIC, no Soft-RoCE link, or no kernel support",
                io::Error::last_os_error()
            ))),
            Some(list) => Ok(DeviceList { list, len: usize::try_from(n).unwrap_or(0) }),
        }
    }

    fn first(&self) -> Option<*mut ffi::ibv_device> {
        // SAFETY: the list holds `len` device pointers (libibverbs' contract).
        (self.len > 0).then(|| unsafe { *self.list.as_ptr() })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once;
        // contexts opened from it stay valid after the free.
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// Whether this machine has an RDMA device libibverbs can use: the client's
/// `local_device` for [`crate::choose`].
pub fn device_present() -> bool {
    DeviceList::get().map(|l| l.len > 0).unwrap_or(false)
}

/// An open device with its protection domain: what memory regions and
/// queue pairs are created in.
pub struct Device {
    ctx: NonNull<ffi::ibv_context>,
    pd: NonNull<ffi::ibv_pd>,
    name: String,
    lid: u16,
    gid: Gid,
    gid_index: u8,
    mtu: ffi::ibv_mtu,
}

// SAFETY: libibverbs objects may be used from any thread (verbs are
// thread-safe); Device never hands out its pointers, and frees them only in
// Drop, when no MemoryRegion or QueuePair (each holds an Arc) is left.
unsafe impl Send for Device {}
// SAFETY: as above; no method mutates through `&self` outside libibverbs,
// which locks what it shares.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the first device libibverbs lists, on its first port, with the
    /// first non-zero GID of that port. [`RdmaError::NoDevice`] when there is
    /// none.
    pub fn open_first() -> Result<Arc<Device>, RdmaError> {
        let list = DeviceList::get()?;
        let dev = list.first().ok_or_else(|| {
            RdmaError::NoDevice(
                "libibverbs found no RDMA devices (no NIC, no Soft-RoCE link, or no provider library for the one present)".into(),
            )
        })?;
        // SAFETY: `dev` is a device of the live list; the name it returns is
        // a NUL-terminated string owned by the device.
        let name = unsafe {
            let p = ffi::ibv_get_device_name(dev);
            if p.is_null() {
                String::from("?")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        // SAFETY: `dev` is a device of the live list.
        let ctx = NonNull::new(unsafe { ffi::ibv_open_device(dev) }).ok_or_else(|| last_os_error("ibv_open_device"))?;
        drop(list);
        // From here the context is closed by Device's Drop or by `close`.
        let close = |e: RdmaError| {
            // SAFETY: `ctx` was opened above and nothing else refers to it.
            unsafe { ffi::ibv_close_device(ctx.as_ptr()) };
            e
        };

        let mut port = ffi::ibv_port_attr::default();
        // SAFETY: `port` is a full ibv_port_attr, larger than the legacy
        // struct this entry point fills.
        let rc = unsafe { ffi::ibv_query_port(ctx.as_ptr(), PORT, (&mut port as *mut ffi::ibv_port_attr).cast()) };
        errno("ibv_query_port", rc).map_err(close)?;
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE && port.state != ffi::ibv_port_state::IBV_PORT_ARMED {
            return Err(close(RdmaError::PortDown { device: name, state: port.state }));
        }
        let mut gid = Gid::default();
        let mut gid_index = 0u8;
        for index in 0..port.gid_tbl_len.clamp(0, 256) {
            let mut raw = ffi::ibv_gid { raw: [0; 16] };
            // SAFETY: `raw` is a valid out-pointer; index < the table length.
            let rc = unsafe { ffi::ibv_query_gid(ctx.as_ptr(), PORT, index, &mut raw) };
            // SAFETY: every bit pattern of the union is a valid [u8; 16].
            let bytes = unsafe { raw.raw };
            if rc == 0 && bytes != [0; 16] {
                gid = Gid(bytes);
                gid_index = index as u8;
                break;
            }
        }
        // SAFETY: `ctx` is open.
        let pd = NonNull::new(unsafe { ffi::ibv_alloc_pd(ctx.as_ptr()) }).ok_or_else(|| close(last_os_error("ibv_alloc_pd")))?;
        Ok(Arc::new(Device { ctx, pd, name, lid: port.lid, gid, gid_index, mtu: port.active_mtu }))
    }

    /// The kernel's name for the device (`mlx5_0`, `rxe0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn gid(&self) -> Gid {
        self.gid
    }

    pub fn lid(&self) -> u16 {
        self.lid
    }

    /// Registers `len` bytes at `addr` for remote reads: the node's pool, or
    /// part of it.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped and allocated for as long as the returned
    /// region lives (dropping it deregisters); remote readers holding a
    /// descriptor read it at any time while their lease holds, so the caller
    /// must not reuse a leased block for other data before the lease ends.
    pub unsafe fn register(self: &Arc<Self>, addr: *mut u8, len: usize) -> Result<MemoryRegion, RdmaError> {
        // SAFETY: the caller's promise above.
        unsafe { self.register_with(addr, len, ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ) }
    }

    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    ///
    /// As [`Device::register`]: the range stays mapped while the region lives.
    unsafe fn register_with(self: &Arc<Self>, addr: *mut u8, len: usize, access: ffi::ibv_access_flags) -> Result<MemoryRegion, RdmaError> {
        // SAFETY: the caller guarantees the range is mapped for the region's
        // lifetime; the protection domain is alive (self).
        let mr = unsafe { ffi::ibv_reg_mr(self.pd.as_ptr(), addr.cast(), len, access.0 as i32) };
        let mr = NonNull::new(mr).ok_or_else(|| last_os_error("ibv_reg_mr"))?;
        Ok(MemoryRegion { dev: Arc::clone(self), mr, addr: addr as u64, len })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every region and queue pair holds an Arc of this device,
        // so none is left; the pd and context are freed once, pd first.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd.as_ptr());
            ffi::ibv_close_device(self.ctx.as_ptr());
        }
    }
}

/// A registered range of memory; deregistered on drop.
pub struct MemoryRegion {
    dev: Arc<Device>,
    mr: NonNull<ffi::ibv_mr>,
    addr: u64,
    len: usize,
}

// SAFETY: the region's keys are read-only after registration and it is
// deregistered once, in Drop; libibverbs allows that from any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Start address of the region.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The key a remote reader presents.
    pub fn rkey(&self) -> u32 {
        // SAFETY: `mr` is registered until Drop.
        unsafe { self.mr.as_ref().rkey }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is registered until Drop.
        unsafe { self.mr.as_ref().lkey }
    }

    /// The descriptor of `len` bytes at `offset` in this region, for the
    /// reader whose queue pair is connected to the node's `qp_num`, under
    /// `lease` (from [`crate::Leases::grant`]). `crc32c` is the block's.
    pub fn describe(&self, qp_num: u32, offset: usize, len: u32, crc32c: u32, lease: Lease) -> Result<Descriptor, RdmaError> {
        let n = len as usize;
        if offset.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(RdmaError::Range { offset, len: n, region_len: self.len });
        }
        let d = Descriptor {
            gid: self.dev.gid,
            lid: self.dev.lid,
            qp_num,
            addr: self.addr + offset as u64,
            rkey: self.rkey(),
            len,
            crc32c,
            lease: lease.id,
            expires_at_ms: lease.expires_at_ms,
        };
        d.validate()?;
        Ok(d)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register_with` and deregistered once.
        unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// A reliable-connected queue pair with its completion queue: on the node,
/// the target of a reader's READs; on the reader, where READs are posted.
pub struct QueuePair {
    dev: Arc<Device>,
    cq: NonNull<ffi::ibv_cq>,
    qp: NonNull<ffi::ibv_qp>,
    psn: u32,
    remote: Option<QueuePairEndpoint>,
    broken: bool,
}

// SAFETY: a queue pair is used through `&mut self` only (one READ at a
// time), and libibverbs allows its use from any thread.
unsafe impl Send for QueuePair {}

/// The errno a provider without a post_send or poll_cq entry point gets
/// (Linux's ENOSYS).
const ENOSYS: i32 = 38;

/// Room in the send and completion queues (READs go one at a time).
const MAX_WR: u32 = 4;

impl QueuePair {
    /// A new RC queue pair in the INIT state, ready for [`QueuePair::connect`].
    pub fn new(dev: &Arc<Device>) -> Result<QueuePair, RdmaError> {
        // SAFETY: the context is open; no completion channel.
        let cq = unsafe { ffi::ibv_create_cq(dev.ctx.as_ptr(), MAX_WR as i32, ptr::null_mut(), ptr::null_mut(), 0) };
        let cq = NonNull::new(cq).ok_or_else(|| last_os_error("ibv_create_cq"))?;
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq.as_ptr(),
            recv_cq: cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap { max_send_wr: MAX_WR, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the pd and cq are alive; `init` is fully initialised.
        let qp = match NonNull::new(unsafe { ffi::ibv_create_qp(dev.pd.as_ptr(), &mut init) }) {
            Some(qp) => qp,
            None => {
                let e = last_os_error("ibv_create_qp");
                // SAFETY: the cq was created above and is used by nothing.
                unsafe { ffi::ibv_destroy_cq(cq.as_ptr()) };
                return Err(e);
            }
        };
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let mut this = QueuePair { dev: Arc::clone(dev), cq, qp, psn: nanos & 0x00ff_ffff, remote: None, broken: false };

        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        this.modify(&mut attr, mask, "ibv_modify_qp(INIT)")?;
        Ok(this)
    }

    fn modify(&mut self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask, op: &'static str) -> Result<(), RdmaError> {
        // SAFETY: the qp is alive; `attr` is initialised for every field the
        // mask names.
        errno(op, unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32) })
    }

    /// The queue pair number: the node puts it in its descriptors.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the qp is alive; qp_num is set at creation.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> QueuePairEndpoint {
        QueuePairEndpoint { gid: self.dev.gid, lid: self.dev.lid, qp_num: self.qp_num(), psn: self.psn }
    }

    /// Connects to the peer's queue pair (INIT -> RTR -> RTS).
    pub fn connect(&mut self, remote: &QueuePairEndpoint) -> Result<(), RdmaError> {
        let global = remote.gid != Gid::default();
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: self.dev.mtu.min(ffi::IBV_MTU_4096),
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: ffi::ibv_ah_attr {
                grh: ffi::ibv_global_route {
                    dgid: ffi::ibv_gid { raw: remote.gid.0 },
                    flow_label: 0,
                    sgid_index: self.dev.gid_index,
                    hop_limit: 0xff,
                    traffic_class: 0,
                },
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: u8::from(global),
                port_num: PORT,
            },
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_AV
            | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTR)")?;

        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: self.psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, "ibv_modify_qp(RTS)")?;
        self.remote = Some(*remote);
        Ok(())
    }

    /// One-sided RDMA READ of the block `d` describes into `dest` (exactly
    /// the block's length), waiting at most `timeout` for it to complete.
    /// Refuses an expired descriptor (at `now_ms`) before touching the wire.
    /// The bytes are not checked here: [`crate::get`], through which a
    /// client reads, checks them against the descriptor's CRC-32C (checking
    /// here as well made two passes over every block). A failed or
    /// timed-out READ leaves the queue pair broken: connect a new one.
    ///
    /// `dest` is registered for the READ and deregistered after it; a
    /// reader that reads often would register its buffers once instead.
    pub fn read(&mut self, d: &Descriptor, now_ms: u64, dest: &mut [u8], timeout: Duration) -> Result<(), RdmaError> {
        d.check_usable(now_ms)?;
        if dest.len() != d.len as usize {
            return Err(UseError::Length { have: dest.len(), want: d.len }.into());
        }
        let connected = self.remote.map(|r| r.qp_num);
        if connected != Some(d.qp_num) {
            return Err(RdmaError::WrongQueuePair { want: d.qp_num, connected });
        }
        if self.broken {
            return Err(RdmaError::Broken(self.qp_num()));
        }
        // SAFETY: `dest` is a live, exclusively borrowed buffer for the whole
        // of this call; the region is dropped (deregistered) before return,
        // so the device cannot write it afterwards, even after a timeout.
        let local = unsafe { self.dev.register_with(dest.as_mut_ptr(), dest.len(), ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE)? };
        let result = self.post_read_and_wait(d, &local, timeout);
        drop(local);
        if result.is_err() {
            self.broken = true;
        }
        result
    }

    fn post_read_and_wait(&mut self, d: &Descriptor, local: &MemoryRegion, timeout: Duration) -> Result<(), RdmaError> {
        let mut sge = ffi::ibv_sge { addr: local.addr, length: d.len, lkey: local.lkey() };
        let mut wr = ffi::ibv_send_wr {
            wr_id: d.lease,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            wr: ffi::ibv_send_wr__bindgen_ty_2 { rdma: ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: d.addr, rkey: d.rkey } },
            ..Default::default()
        };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the qp and its context are alive; `wr` and `sge` outlive the
        // call (the provider copies them into its send queue); post_send is
        // the provider's entry point that the static inline ibv_post_send
        // calls.
        let rc = unsafe {
            let ctx = self.qp.as_ref().context;
            match (*ctx).ops.post_send {
                Some(post) => post(self.qp.as_ptr(), &mut wr, &mut bad),
                None => ENOSYS,
            }
        };
        errno("ibv_post_send", rc)?;

        let started = Instant::now();
        let mut wc = [ffi::ibv_wc::default()];
        loop {
            // SAFETY: the cq is alive; `wc` has room for one completion.
            let n = unsafe {
                let ctx = self.cq.as_ref().context;
                match (*ctx).ops.poll_cq {
                    Some(poll) => poll(self.cq.as_ptr(), 1, wc.as_mut_ptr()),
                    None => -ENOSYS,
                }
            };
            if n < 0 {
                return Err(RdmaError::Verbs { op: "ibv_poll_cq", source: io::Error::other("polling the completion queue failed") });
            }
            if n == 1 {
                break;
            }
            if started.elapsed() >= timeout {
                return Err(RdmaError::Timeout(timeout));
            }
            std::thread::yield_now();
        }
        match wc[0].error() {
            None => Ok(()),
            Some((status, vendor_err)) => {
                // SAFETY: ibv_wc_status_str returns a static string for any status.
                let name = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(status)) }.to_string_lossy().into_owned();
                Err(RdmaError::Completion { status, name, vendor_err })
            }
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once, the qp before its cq.
        unsafe {
            ffi::ibv_destroy_qp(self.qp.as_ptr());
            ffi::ibv_destroy_cq(self.cq.as_ptr());
        }
    }
}

fn side(e: io::Error) -> RdmaError {
    RdmaError::SideChannel(e)
}

fn exchange(stream: &mut TcpStream, qp: &mut QueuePair) -> Result<(), RdmaError> {
    stream.write_all(&qp.endpoint().encode()).map_err(side)?;
    let mut b = [0u8; ENDPOINT_LEN];
    stream.read_exact(&mut b).map_err(side)?;
    let remote = QueuePairEndpoint::decode(&b).map_err(side)?;
    qp.connect(&remote)
}

/// The node's side of the side channel: accepts one reader on `listener`,
/// and returns a queue pair connected to the reader's and the stream, on
/// which the node then sends descriptors.
pub fn accept(listener: &TcpListener, dev: &Arc<Device>) -> Result<(QueuePair, TcpStream), RdmaError> {
    let (mut stream, _) = listener.accept().map_err(side)?;
    let mut qp = QueuePair::new(dev)?;
    exchange(&mut stream, &mut qp)?;
    Ok((qp, stream))
}

/// The reader's side of the side channel: connects to the node at `addr`
/// and returns a queue pair connected to the node's and the stream.
pub fn connect(addr: impl ToSocketAddrs, dev: &Arc<Device>) -> Result<(QueuePair, TcpStream), RdmaError> {
    let mut stream = TcpStream::connect(addr).map_err(side)?;
    let mut qp = QueuePair::new(dev)?;
    exchange(&mut stream, &mut qp)?;
    Ok((qp, stream))
}

/// Sends one descriptor on the side channel.
pub fn send_descriptor(stream: &mut impl Write, d: &Descriptor) -> Result<(), RdmaError> {
    stream.write_all(&d.encode()?).map_err(side)
}

/// Receives one descriptor from the side channel.
pub fn recv_descriptor(stream: &mut impl Read) -> Result<Descriptor, RdmaError> {
    let mut b = [0u8; ENCODED_LEN];
    stream.read_exact(&mut b).map_err(side)?;
    Ok(Descriptor::decode(&b)?)
}
