//! Where a survivor's rejoin meetings come from ([`MeetingSource`]), for the async
//! `Group::admit` of GPU ranks, and the slot a rank keeps it in; under `epflow launch
//! --restarts`, the launch's meetings ([`launch_meetings`]) and whether this process is a
//! replacement ([`rejoining`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use epflow_core::Error;

use super::bootstrap::Bootstrap;

/// Where a survivor's rejoin meetings come from, for the async `Group::admit` (the
/// [`epflow_core::backend::Backend::admit`] of a [`crate::GpuRank`]): called once per meeting
/// with the caller's timeout, it returns this rank's end of a fresh bootstrap that every rank of
/// the group joins, the newcomers at their ranks (e.g. a
/// [`super::tcp_bootstrap::TcpBootstrap`] on a port the server chose). Set it with
/// [`crate::GpuRank::set_meeting_source`].
pub type MeetingSource = Arc<dyn Fn(Duration) -> Result<Box<dyn Bootstrap + Send>, Error> + Send + Sync>;

/// A rank's [`MeetingSource`], once set.
#[derive(Default)]
pub(crate) struct MeetingSourceSlot(Mutex<Option<MeetingSource>>);

impl MeetingSourceSlot {
    /// The source, if one was set.
    pub(crate) fn get(&self) -> Option<MeetingSource> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sets (or replaces) the source.
    pub(crate) fn set(&self, source: MeetingSource) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(source);
    }
}

impl std::fmt::Debug for MeetingSourceSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.get().is_some() { "MeetingSource(set)" } else { "MeetingSource(none)" })
    }
}

/// Under `epflow launch --restarts K`: the rejoin meetings of `launch`'s rank, TCP bootstraps
/// of every process of the launch on `EPFLOW_MEETING_PORT` (rank 0's host: `MASTER_ADDR`, or
/// this host when the launch gave an NCCL id), on device `device`. Give it to a survivor's rank
/// with [`crate::GpuRank::set_meeting_source`] (its `Group::admit` then meets there) and call it
/// once in a replacement for the meeting of [`crate::GpuWorld::rejoin`]. `None` when the launch
/// gave no meeting port (no `--restarts`).
pub fn launch_meetings(launch: &super::bootstrap::LaunchEnv, device: usize) -> Option<MeetingSource> {
    let port = epflow_core::tuning::Environment::get().meeting_port?;
    let host = match &launch.id {
        super::bootstrap::IdSource::Rendezvous(rv) => rv.master_addr.clone(),
        super::bootstrap::IdSource::Given(_) => "127.0.0.1".to_string(),
    };
    let (rank, world) = (launch.rank, launch.world_size);
    Some(Arc::new(move |wait| {
        let links = super::tcp_bootstrap::TcpLinks::connect(rank, world, &host, port, wait)?;
        Ok(Box::new(super::tcp_bootstrap::TcpBootstrap::new(links, device)?) as Box<dyn Bootstrap + Send>)
    }))
}

/// Whether `epflow launch --restarts` started this process again in place of its rank's failed
/// one (`EPFLOW_REJOIN=1`): it then takes the rank's place in the running group with
/// [`crate::GpuWorld::rejoin`] on a meeting of [`launch_meetings`], instead of joining the group
/// as at its creation (the survivors' NCCL communicator cannot take a new process).
pub fn rejoining() -> bool {
    epflow_core::tuning::Environment::get().rejoin
}
