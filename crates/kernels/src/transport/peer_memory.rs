//! The memory a rank lets its peers reach (dispatch and combine receive regions, the exchange
//! region, the signal page), as the ranks of a group made over a [`crate::setup::bootstrap::Bootstrap`]
//! trade it: CUDA IPC handles for ranks in other processes, addresses for ranks in this one (a
//! process cannot open its own IPC handles; peer access between its contexts reaches them).
//!
//! Each rank's record in the all-gather is [`RECORD_BYTES`] long: a header of eight u64 words
//! (host, process id, device, the four addresses, a random number drawn once per process), then
//! the four 64-byte IPC handles. A record is this process's when host, process id and the random
//! number are all this process's: processes of containers on one host may share the host's boot
//! id and a process id. A rank of this process keeps the exporting rank's [`RankMemory`] alive (found by
//! address in a registry of this process's exported memory), as ranks made together by
//! [`crate::GpuWorld::create`] keep each other's.

use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::CudaContext;
use epflow_core::Error;

use super::host_id;
use super::nvlink::{IpcMapping, enable_peer_access, ipc_export};
use crate::state::shared::{Kept, RankMemory};

/// Header words of a record: host, process id, device, four addresses, this process's nonce.
const HEADER_WORDS: usize = 8;
/// The regions a rank exports.
const REGIONS: usize = 4;
/// Bytes of one CUDA IPC handle.
const HANDLE_BYTES: usize = 64;
/// Bytes of one rank's record in the all-gather.
pub(crate) const RECORD_BYTES: usize = HEADER_WORDS * 8 + REGIONS * HANDLE_BYTES;

/// This process's exported memory, by its dispatch receive region's address (dead entries are
/// dropped as new ones come).
static EXPORTED: Mutex<Vec<(u64, Weak<RankMemory>)>> = Mutex::new(Vec::new());

/// A random number drawn once per process, which tells this process's records from those of a
/// process with the same host and process id (another container).
fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        // `RandomState`'s keys come from the operating system's randomness.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        h.finish()
    })
}

/// Whether a record with these header words comes from this process.
fn from_this_process(rec: &Record<'_>) -> bool {
    rec.host == host_id() && rec.pid == u64::from(std::process::id()) && rec.nonce == nonce()
}

/// The four exported addresses of `mem`, in the record's order.
fn addresses(mem: &RankMemory) -> [u64; REGIONS] {
    [mem.disp_recv.ptr(), mem.comb_recv.ptr(), mem.exchange.ptr(), mem.signals.ptr()]
}

/// `mem`'s record for the group's all-gather (see the module), and its four addresses. The
/// memory is registered, so that a rank of this process that opens the record keeps it alive.
pub(crate) fn exported(mem: &Arc<RankMemory>) -> Result<([u64; REGIONS], Vec<u8>), Error> {
    let own = addresses(mem);
    let header =
        [host_id(), u64::from(std::process::id()), mem.ctx.ordinal() as u64, own[0], own[1], own[2], own[3], nonce()];
    let mut record: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
    for ptr in own {
        record.extend_from_slice(&ipc_export(ptr)?);
    }
    let mut live = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|(_, w)| w.strong_count() > 0);
    let mine = Arc::downgrade(mem);
    if !live.iter().any(|(_, w)| w.ptr_eq(&mine)) {
        live.push((own[0], mine));
    }
    Ok((own, record))
}

/// One rank's record, read from the all-gather.
#[derive(Debug, PartialEq, Eq)]
struct Record<'a> {
    host: u64,
    pid: u64,
    device: usize,
    ptrs: [u64; REGIONS],
    nonce: u64,
    /// The four IPC handles.
    handles: &'a [u8],
}

/// Rank `r`'s record in `all`.
fn record(all: &[u8], r: usize) -> Result<Record<'_>, Error> {
    let bytes = all
        .get(r * RECORD_BYTES..(r + 1) * RECORD_BYTES)
        .ok_or_else(|| Error::Backend(format!("rank {r}'s memory record is missing ({} bytes gathered)", all.len())))?;
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or_default());
    Ok(Record {
        host: word(0),
        pid: word(1),
        device: word(2) as usize,
        ptrs: [word(3), word(4), word(5), word(6)],
        nonce: word(7),
        handles: &bytes[HEADER_WORDS * 8..],
    })
}

/// Rank `r`'s memory from the all-gather of every rank's [`exported`] records, reachable from
/// `ctx`: the four addresses, and what keeps them (IPC mappings of another process's memory,
/// or the memory itself for a rank of this process, whose device gets peer access from `ctx`'s).
pub(crate) fn open_exported(
    ctx: &Arc<CudaContext>,
    all: &[u8],
    r: usize,
) -> Result<([u64; REGIONS], Vec<Kept>), Error> {
    let rec = record(all, r)?;
    if from_this_process(&rec) {
        return in_this_process(ctx, r, rec.ptrs);
    }
    let mut mapped = [0u64; REGIONS];
    let mut keep: Vec<Kept> = Vec::with_capacity(REGIONS);
    for (p, handle) in mapped.iter_mut().zip(rec.handles.chunks_exact(HANDLE_BYTES)) {
        let mapping = IpcMapping::open(ctx, handle)?;
        *p = mapping.ptr;
        keep.push(Arc::new(mapping));
    }
    Ok((mapped, keep))
}

/// Rank `r`'s memory at `ptrs`, allocated by this process: kept alive from the registry,
/// reached through peer access when it is on another device.
fn in_this_process(
    ctx: &Arc<CudaContext>,
    r: usize,
    ptrs: [u64; REGIONS],
) -> Result<([u64; REGIONS], Vec<Kept>), Error> {
    let mem = EXPORTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(p, _)| *p == ptrs[0])
        .find_map(|(_, w)| w.upgrade())
        .filter(|m| addresses(m) == ptrs)
        .ok_or_else(|| {
            Error::Backend(format!("rank {r}'s memory (this process's) was freed before its peers reached it"))
        })?;
    let device = mem.ctx.ordinal();
    if device != ctx.ordinal() {
        enable_peer_access(&[ctx.ordinal(), device], &[Arc::clone(ctx), Arc::clone(&mem.ctx)], &[(0, 1)])?;
    }
    Ok((ptrs, vec![mem as Kept]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_in_rank_order() {
        let mut all = Vec::new();
        for r in 0..2u64 {
            let header = [7, 100 + r, r, 10 * r + 1, 10 * r + 2, 10 * r + 3, 10 * r + 4, 55 + r];
            all.extend(header.iter().flat_map(|w: &u64| w.to_le_bytes()));
            all.extend(std::iter::repeat_n(r as u8 + 1, REGIONS * HANDLE_BYTES));
        }
        let rec = record(&all, 1).unwrap();
        assert_eq!((rec.host, rec.pid, rec.device, rec.ptrs, rec.nonce), (7, 101, 1, [11, 12, 13, 14], 56));
        assert_eq!(rec.handles.len(), 256);
        assert!(rec.handles.iter().all(|&b| b == 2));
        let err = record(&all, 2).unwrap_err();
        assert!(err.to_string().contains("rank 2's memory record is missing (640 bytes gathered)"), "{err}");
    }

    /// Another process on this host with this process's id (a container's) is not this one.
    #[test]
    fn this_process_is_known_by_host_pid_and_nonce() {
        let mut bytes: Vec<u8> = [host_id(), u64::from(std::process::id()), 0, 1, 2, 3, 4, nonce()]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        bytes.resize(RECORD_BYTES, 0);
        assert!(from_this_process(&record(&bytes, 0).unwrap()));
        bytes[7 * 8..8 * 8].copy_from_slice(&nonce().wrapping_add(1).to_le_bytes());
        assert!(!from_this_process(&record(&bytes, 0).unwrap()), "same host and pid, another nonce");
    }
}
