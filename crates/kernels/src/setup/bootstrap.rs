//! One process per GPU: the launch environment and the NCCL communicator every process joins.
//!
//! Variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the device of this process), and where the
//! NCCL unique id comes from: `EPFLOW_NCCL_ID` (256 hex digits, created by `epflow launch` on one
//! host), or else `MASTER_ADDR` and `MASTER_PORT` (as torchrun sets them): rank 0 creates the id
//! and hands it to every rank over TCP (the `rendezvous` module), across hosts.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::nccl::{Comm, Id};
use epflow_core::Error;

use crate::device::{context, cuda};
use crate::setup::rendezvous::RendezvousEnv;

/// How long the TCP rendezvous waits for every rank (or for rank 0) before it fails.
pub const RENDEZVOUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Where this process gets the NCCL unique id.
#[derive(Clone, Debug)]
pub enum IdSource {
    /// From the environment (`EPFLOW_NCCL_ID`, hex).
    Given(String),
    /// From rank 0 over TCP (`MASTER_ADDR`, `MASTER_PORT`).
    Rendezvous(RendezvousEnv),
}

/// What the launcher tells each process.
#[derive(Clone, Debug)]
pub struct LaunchEnv {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// The device this process drives.
    pub local_rank: usize,
    /// Where the NCCL unique id comes from.
    pub id: IdSource,
}

fn var(name: &str) -> Result<Option<String>, Error> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(Error::Unsupported(format!("environment variable {name}: {e}"))),
    }
}

fn number(name: &str) -> Result<usize, Error> {
    let v = var(name)?
        .ok_or_else(|| Error::Unsupported(format!("{name} is not set (start the processes with `epflow launch`)")))?;
    v.trim().parse().map_err(|_| Error::Unsupported(format!("{name}={v:?} is not a non-negative integer")))
}

impl LaunchEnv {
    /// The environment of this process, `None` when it was not started by a launcher (neither
    /// `EPFLOW_NCCL_ID` nor `MASTER_ADDR`). Bad or missing values are errors that name the
    /// variable. Nothing is contacted here; [`LaunchEnv::communicator`] does the rendezvous.
    pub fn from_env() -> Result<Option<Self>, Error> {
        let Some(nccl_id) = epflow_core::tuning::Environment::get().nccl_id.clone() else {
            return Ok(RendezvousEnv::from_env()?.map(|rv| LaunchEnv {
                rank: rv.rank,
                world_size: rv.world_size,
                local_rank: rv.local_rank,
                id: IdSource::Rendezvous(rv),
            }));
        };
        let (rank, world_size) = (number("RANK")?, number("WORLD_SIZE")?);
        let local_rank = match var("LOCAL_RANK")? {
            Some(_) => number("LOCAL_RANK")?,
            None => rank,
        };
        if world_size == 0 || rank >= world_size {
            return Err(Error::Unsupported(format!("RANK={rank} must be below WORLD_SIZE={world_size}")));
        }
        decode_id(&nccl_id)?;
        Ok(Some(LaunchEnv { rank, world_size, local_rank, id: IdSource::Given(nccl_id) }))
    }

    /// The NCCL unique id, hex: given, or (collective) created by rank 0 and exchanged over TCP.
    pub fn nccl_id(&self) -> Result<String, Error> {
        match &self.id {
            IdSource::Given(hex) => Ok(hex.clone()),
            IdSource::Rendezvous(rv) => {
                let mine = if rv.rank == 0 { new_unique_id()?.into_bytes() } else { Vec::new() };
                let got = rv.exchange(&mine, RENDEZVOUS_TIMEOUT)?;
                String::from_utf8(got).map_err(|_| Error::Backend("rendezvous: the NCCL id is not text".into()))
            }
        }
    }

    /// Joins the NCCL communicator of the launch on device `LOCAL_RANK` (collective).
    pub fn communicator(&self) -> Result<Comm, Error> {
        nccl_present()?;
        let id = decode_id(&self.nccl_id()?)?;
        let ctx: Arc<CudaContext> = context(self.local_rank)?;
        let stream = ctx.new_stream().map_err(|e| cuda("create stream", e))?;
        Comm::from_rank(stream, self.rank, self.world_size, id)
            .map_err(|e| Error::Backend(format!("NCCL: init rank {} of {}: {:?}", self.rank, self.world_size, e.0)))
    }
}

/// `Err` unless libnccl can be loaded.
pub fn nccl_present() -> Result<(), Error> {
    // SAFETY: only tries to open the shared library; no NCCL call is made.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Unsupported("NCCL (libnccl.so) not found: add its directory to LD_LIBRARY_PATH".into()))
    }
}

/// A new NCCL unique id, hex-encoded (for `EPFLOW_NCCL_ID`).
pub fn new_unique_id() -> Result<String, Error> {
    nccl_present()?;
    let id = Id::new().map_err(|e| Error::Backend(format!("NCCL: unique id: {:?}", e.0)))?;
    Ok(id.internal().iter().map(|&c| format!("{:02x}", c as u8)).collect())
}

fn decode_id(hex: &str) -> Result<Id, Error> {
    let bad = || Error::Unsupported(format!("EPFLOW_NCCL_ID must be 256 hex digits (got {} characters)", hex.len()));
    if hex.len() != 256 {
        return Err(bad());
    }
    let mut raw = [0 as std::ffi::c_char; 128];
    for (i, b) in raw.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())? as std::ffi::c_char;
    }
    Ok(Id::uninit(raw))
}

/// Waits until every rank of `comm` reaches this point (an NCCL all-reduce of one value).
pub fn barrier(comm: &Comm) -> Result<(), Error> {
    let stream = comm.stream();
    let mut v = stream.clone_htod(&[1.0f32]).map_err(|e| cuda("barrier buffer", e))?;
    comm.all_reduce_in_place(&mut v, &cudarc::nccl::ReduceOp::Sum)
        .map_err(|e| Error::Backend(format!("NCCL barrier: {:?}", e.0)))?;
    stream.synchronize().map_err(|e| cuda("barrier", e))
}

/// What joining a group one process per GPU needs from the processes' communicator
/// ([`crate::GpuWorld::join_over`]): who this process is, its device, and an all-gather of
/// bytes. Implemented for cudarc's [`Comm`]; the NCCL EP C API implements it over the
/// application's `ncclComm_t`.
pub trait Bootstrap {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The CUDA context of this process's device.
    fn context(&self) -> &Arc<CudaContext>;
    /// Gathers `mine` (the same length on every rank) from every rank, in rank order
    /// (collective, blocking).
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, Error>;
}

impl Bootstrap for Comm {
    fn rank(&self) -> usize {
        Comm::rank(self)
    }

    fn world_size(&self) -> usize {
        Comm::world_size(self)
    }

    fn context(&self) -> &Arc<CudaContext> {
        Comm::context(self)
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, Error> {
        all_gather(self, mine)
    }
}

/// Gathers `mine` (the same length on every rank) from every rank of `b`, in rank order.
pub fn all_gather_u64(b: &(impl Bootstrap + ?Sized), mine: &[u64]) -> Result<Vec<u64>, Error> {
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = b.all_gather_bytes(&bytes)?;
    Ok(all.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect())
}

/// Gathers `mine` (the same length on every rank) from every rank, in rank order.
pub fn all_gather<
    T: cudarc::nccl::NcclType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + Clone,
>(
    comm: &Comm,
    mine: &[T],
) -> Result<Vec<T>, Error> {
    let stream = comm.stream();
    let send = stream.clone_htod(mine).map_err(|e| cuda("gather buffer", e))?;
    let mut recv = stream.alloc_zeros::<T>(mine.len() * comm.world_size()).map_err(|e| cuda("gather buffer", e))?;
    comm.all_gather(&send, &mut recv).map_err(|e| Error::Backend(format!("NCCL all-gather: {:?}", e.0)))?;
    stream.clone_dtoh(&recv).map_err(|e| cuda("gather", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_ids_are_refused() {
        assert!(decode_id("abc").is_err());
        assert!(decode_id(&"zz".repeat(128)).is_err());
        assert!(decode_id(&"0f".repeat(128)).is_ok());
    }
}
