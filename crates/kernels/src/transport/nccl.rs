//! The NCCL transport: ranks that NVLink cannot reach (another host), or every rank when asked
//! ([`Transport::Nccl`](super::Transport::Nccl)), exchange their messages with NCCL's grouped `ncclSend`/`ncclRecv`
//! (any NCCL ≥ 2.28, loaded at run time through cudarc) instead of the NVLink stores.
//!
//! ## What travels
//!
//! Every operation sends one message per (token, destination rank), packed per peer, plus one
//! 8-byte arrival word per peer (`(seq + 1) << 1 | cancelled`, the word the NVLink kernels
//! store remotely), so cancellations reach the peers as with NVLink.
//!
//! - **Low-latency** reuses the NVLink kernels with the peer's bit set in `nccl_mask`: dispatch
//!   writes a peer's slots (one per token, as in the peer's receive region) into local staging
//!   and NCCL moves the whole region (`max_tokens` slots: the receiver cannot know the count in
//!   advance, as for the NVLink buffers); combine packs, per source, its `(token, k)` rows in
//!   ascending order (the dispatch receive kernel numbers them and reports how many) and NCCL
//!   moves exactly those rows: the source knows the count from its own routing.
//! - **High-throughput** runs entirely over NCCL as soon as one peer needs it: handle creation
//!   exchanges the counts with NCCL, dispatch packs each destination's rows contiguously
//!   (`ep_nccl_ht_pack`) and NCCL writes them straight into the receivers' outputs, combine
//!   brings the copies back and `ep_nccl_ht_reduce` sums them in the reference's order.
//!
//! ## Ordering and buffers
//!
//! NCCL operations are stream-ordered on the channel's stream and use one communicator per
//! channel (dispatch, combine, handle), so the channels never wait on each other, as with
//! NVLink. A receive region is written only by this rank's own `ncclRecv`, which is enqueued
//! after the previous operation on that buffer set was consumed: no credits are needed for NCCL
//! peers.
//!
//! ## Hanging peers
//!
//! A peer that never posts its side leaves NCCL's kernel waiting; the host deadline of the
//! operation still fires (`Error::Timeout`), and dropping the unfinished operation aborts the
//! rank's communicators (`ncclCommAbort`), which ends the kernel. The group is unusable after.
//! Under rank masking, low-latency groups reach each NCCL peer through a communicator of that
//! pair alone instead, so the group survives it (`transport/nccl_pairs.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use epflow_core::Error;

use crate::device::{DeviceBuffer, bind};

/// A [`Error::Backend`] for a failed NCCL call.
pub(crate) fn nccl_err(what: &str, e: nccl::NcclError) -> Error {
    Error::Backend(format!("NCCL: {what}: {:?}", e.0))
}

/// The three NCCL communicators of a rank (dispatch, combine, handle channels), aborted when
/// dropped. Other backends built on NCCL (the NCCL EP backend, `epflow-nccl-ep`) use them too.
#[derive(Debug)]
pub struct NcclComms {
    comms: [nccl_sys::ncclComm_t; 3],
    aborted: AtomicBool,
}

// SAFETY: NCCL communicators may be used from any thread; epflow issues the operations of one
// communicator (one channel) from one thread at a time (the channel's turn), and `abort` is
// guarded by `aborted`.
unsafe impl Send for NcclComms {}
// SAFETY: as above.
unsafe impl Sync for NcclComms {}

impl NcclComms {
    /// No communicators: a group whose NCCL peers are reached through pair communicators
    /// (rank masking, `transport/nccl_pairs.rs`) makes no communicator of the whole group.
    /// Every use is refused.
    pub(crate) fn none() -> Self {
        NcclComms { comms: [std::ptr::null_mut(); 3], aborted: AtomicBool::new(true) }
    }

    /// One process, rank `r` on context `ctxs[r]`, with one thread per rank: three
    /// `ncclCommInitRank`s each over fresh ids. Unlike [`NcclComms::init_all`] it takes several
    /// ranks on one GPU, which NCCL allows from 2.30 with `NCCL_MULTI_RANK_GPU_ENABLE=1`.
    pub fn init_threads(ctxs: &[Arc<CudaContext>]) -> Result<Vec<NcclComms>, Error> {
        let ids = decode_ids(&new_ids()?);
        let n = ctxs.len();
        std::thread::scope(|sc| {
            let joins: Vec<_> = ctxs
                .iter()
                .enumerate()
                .map(|(r, ctx)| sc.spawn(move || bind(ctx).and_then(|()| NcclComms::init_rank(&ids, r, n))))
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().unwrap_or_else(|_| Err(Error::Backend("ncclCommInitRank panicked".into()))))
                .collect()
        })
    }

    /// One process, every device of `devices` (rank `r` on `devices[r]`): three
    /// `ncclCommInitAll`s. Returns one set of communicators per rank.
    pub fn init_all(devices: &[usize]) -> Result<Vec<NcclComms>, Error> {
        crate::setup::bootstrap::nccl_present()?;
        let n = devices.len();
        let list: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut per_chan = Vec::with_capacity(3);
        for _ in 0..3 {
            let mut comms = vec![std::ptr::null_mut(); n];
            // SAFETY: `comms` has room for `n` communicators and `list` names `n` devices.
            unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, list.as_ptr()) }
                .map_err(|e| nccl_err("ncclCommInitAll", e))?;
            per_chan.push(comms);
        }
        Ok((0..n)
            .map(|r| NcclComms {
                comms: [per_chan[0][r], per_chan[1][r], per_chan[2][r]],
                aborted: AtomicBool::new(false),
            })
            .collect())
    }

    /// One rank of a multi-process group: three `ncclCommInitRank`s over `ids` (the same on every
    /// rank). Collective; the caller's context must be current.
    pub fn init_rank(ids: &[nccl_sys::ncclUniqueId; 3], rank: usize, world: usize) -> Result<NcclComms, Error> {
        let mut comms = [std::ptr::null_mut(); 3];
        for (c, id) in comms.iter_mut().zip(ids) {
            // SAFETY: `c` is a valid out pointer; every rank passes the same id and world size.
            unsafe { nccl::comm_init_rank(c, world as i32, *id, rank as i32) }
                .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        }
        Ok(NcclComms { comms, aborted: AtomicBool::new(false) })
    }

    /// The communicator of channel `chan` (0 dispatch, 1 combine, 2 handle).
    pub fn comm(&self, chan: usize) -> Result<nccl_sys::ncclComm_t, Error> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::Backend("the NCCL communicators were aborted after a timeout".into()));
        }
        Ok(self.comms[chan])
    }

    /// Aborts every communicator (ends NCCL kernels waiting for a peer). Idempotent.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            for c in self.comms {
                // SAFETY: a communicator created in `init_*`, aborted once (guarded above;
                // `none` starts aborted).
                let _ = unsafe { nccl::comm_abort(c) };
            }
        }
    }

    /// Connects every pair of ranks on every communicator with one tiny exchange, so the first
    /// operation never blocks the host in NCCL's lazy connection setup. Collective: every rank
    /// calls it at once (one thread per rank in one process).
    pub fn connect(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        rank: usize,
        world: usize,
    ) -> Result<(), Error> {
        bind(ctx)?;
        let buf = DeviceBuffer::zeroed(ctx, 2 * 8 * world)?;
        for chan in 0..3 {
            let xfers: Vec<Xfer> = (0..world)
                .filter(|&p| p != rank)
                .map(|p| Xfer {
                    peer: p,
                    send: (buf.ptr() + 8 * p as u64, 8),
                    recv: (buf.ptr() + 8 * (world + p) as u64, 8),
                })
                .collect();
            issue(self.comm(chan)?, stream, &xfers)?;
        }
        stream.synchronize().map_err(|e| crate::device::cuda("connect NCCL peers", e))
    }
}

impl Drop for NcclComms {
    fn drop(&mut self) {
        // Local and never waits for peers (unlike ncclCommDestroy after a failure).
        self.abort();
    }
}

/// One peer's share of a grouped exchange: `(device address, bytes)` to send and to receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Xfer {
    pub peer: usize,
    pub send: (u64, usize),
    pub recv: (u64, usize),
}

/// Enqueues `xfers` as one NCCL group on `stream`. Both sides of a pair agree on every size, so
/// empty sends and receives are skipped on both.
pub(crate) fn issue(comm: nccl_sys::ncclComm_t, stream: &CudaStream, xfers: &[Xfer]) -> Result<(), Error> {
    nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
    let mut result = Ok(());
    for x in xfers {
        result = result.and(post(comm, stream, x));
    }
    let end = nccl::group_end().map(|_| ()).map_err(|e| nccl_err("ncclGroupEnd", e));
    result.and(end)
}

/// Posts `x`'s send and receive on `comm` (empty ones skipped), inside an NCCL group the
/// caller opened. The addresses must stay valid until `stream` passes the group's end.
pub(crate) fn post(comm: nccl_sys::ncclComm_t, stream: &CudaStream, x: &Xfer) -> Result<(), Error> {
    let st = stream.cu_stream() as nccl_sys::cudaStream_t;
    let peer = x.peer as i32;
    let mut result = Ok(());
    if x.send.1 > 0 {
        // SAFETY: `send.0` addresses `send.1` readable device bytes kept alive by the operation
        // until its completion event; the stream belongs to the communicator's device.
        let r =
            unsafe { nccl::send(x.send.0 as *const _, x.send.1, nccl_sys::ncclDataType_t::ncclUint8, peer, comm, st) };
        result = result.and(r.map(|_| ()).map_err(|e| nccl_err("ncclSend", e)));
    }
    if x.recv.1 > 0 {
        // SAFETY: as above, for `recv.1` writable device bytes.
        let r =
            unsafe { nccl::recv(x.recv.0 as *mut _, x.recv.1, nccl_sys::ncclDataType_t::ncclUint8, peer, comm, st) };
        result = result.and(r.map(|_| ()).map_err(|e| nccl_err("ncclRecv", e)));
    }
    result
}

/// Three fresh NCCL unique ids (dispatch, combine, handle communicators) as 48 words.
pub(crate) fn new_ids() -> Result<[u64; 48], Error> {
    crate::setup::bootstrap::nccl_present()?;
    let mut out = [0u64; 48];
    for c in 0..3 {
        let id = cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        for (i, w) in out[c * 16..(c + 1) * 16].iter_mut().enumerate() {
            let mut b = [0u8; 8];
            for (j, x) in b.iter_mut().enumerate() {
                *x = id.internal[i * 8 + j] as u8;
            }
            *w = u64::from_le_bytes(b);
        }
    }
    Ok(out)
}

pub(crate) fn decode_ids(words: &[u64]) -> [cudarc::nccl::sys::ncclUniqueId; 3] {
    std::array::from_fn(|c| {
        let mut internal = [0 as std::ffi::c_char; 128];
        for (i, w) in words[c * 16..(c + 1) * 16].iter().enumerate() {
            for (j, b) in w.to_le_bytes().into_iter().enumerate() {
                internal[i * 8 + j] = b as std::ffi::c_char;
            }
        }
        cudarc::nccl::sys::ncclUniqueId { internal }
    })
}

/// Words per peer of a count exchange over NCCL: the NVLink message, then the operation number
/// and the cancellation flag.
pub(crate) fn exchange_row_words(words: usize) -> usize {
    words + 2
}
