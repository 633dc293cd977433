//! Where a survivor's rejoin meetings come from ([`MeetingSource`]), for the async
//! `Group::admit` of GPU ranks, and the slot a rank keeps it in.

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
