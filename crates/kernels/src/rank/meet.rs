//! [`GpuRank::meet_on`]: the group's ranks meet on the device, in stream order (`ep_meet` in
//! `ll.cu`, on a board in each rank's signal page).

use std::sync::atomic::Ordering;

use cudarc::driver::CudaStream;
use epflow_core::Error;

use super::GpuRank;
use crate::device::bind;
use crate::params::MaskParams;

impl GpuRank {
    /// Enqueues on `stream` (of this rank's context) a meeting of the group's ranks on the
    /// device: what `stream` runs after it starts only once every rank's meeting kernel has
    /// started, so the ranks' streams leave it within about one NVLink write latency (~1 us) of
    /// each other. Returns at once; nothing waits on the host.
    ///
    /// Collective: every rank calls it, the same number of times (on any of its streams, in
    /// any order with its operations). A rank masked by rank masking is not waited for. A rank
    /// that never comes: this rank's kernel gives up at 90 % of the group timeout, and its next
    /// operation fails with [`Error::Timeout`] naming that rank and the meeting.
    ///
    /// A benchmark's tool (`epflow bench --queued` starts both ranks' timed operations
    /// together with it); an operation never needs it. Errors: [`Error::Unsupported`] with a
    /// peer reached through NCCL (the meeting is written over NVLink); CUDA failures.
    pub fn meet_on(&self, stream: &CudaStream) -> Result<(), Error> {
        if self.nccl_peers() != 0 {
            return Err(Error::Unsupported(
                "meet_on needs every peer on NVLink (some are reached through NCCL)".into(),
            ));
        }
        let s = &self.shared;
        bind(&s.ctx)?;
        let epoch = s.meetings.fetch_add(1, Ordering::Relaxed) + 1;
        let m = MaskParams { epoch, ..self.mask_params() };
        self.launch_mask_kernel(&s.functions.meet, m, stream, "launch the ranks' meeting")
    }
}
