//! Rank masking on GPUs ([`epflow_core::mask`]): the mask word in each rank's signal page (peers
//! OR bits into it over NVLink), its mirror in the mapped status page that the host reads, and
//! the two kernels the host launches: `ep_mask_spread` (an application's mask) and
//! `ep_mask_rejoin` (`unmask_all`). The kernels of the operations mask at their own deadline
//! (`ll_base.cuh`: `spread_mask`; `ll_receive.cuh`: `wait_sources_masked`).

use std::sync::atomic::Ordering;

use cudarc::driver::CudaStream;
use epflow_core::Error;
use epflow_core::mask::{MaskedRanks, RankSet};
use epflow_core::protocol::{Channel, op_label};

use super::GpuRank;
use crate::device::{bind, cuda};
use crate::layout::BufferLayout;
use crate::op::mask_kernels;
use crate::params::{MaskParams, status};
use crate::setup::bootstrap::{Bootstrap, all_gather_u64};
use crate::state::shared::peer_array;

impl GpuRank {
    /// The rank's view: the mirror its kernels last wrote, and the epoch.
    pub(super) fn mask_view(&self) -> MaskedRanks {
        let bits = if self.shared.config.rank_masking { self.shared.mask_mirror() } else { 0 };
        MaskedRanks { ranks: RankSet::from_low_bits(bits), epoch: self.core.mask_epoch() }
    }

    fn check_masking(&self, what: &str) -> Result<(), Error> {
        if !self.shared.config.rank_masking {
            return Err(Error::Unsupported(format!(
                "{what} needs a group with rank_masking (GroupConfig::with_rank_masking)"
            )));
        }
        Ok(())
    }

    /// [`Error::RankMasked`] if the group masked this rank: the operation is refused before it
    /// takes a number (its kernels would neither send nor wait).
    pub(super) fn check_not_masked(&self, channel: Channel) -> Result<(), Error> {
        let me = self.shared.rank;
        if self.shared.config.rank_masking && (self.shared.mask_mirror() >> me) & 1 == 1 {
            return Err(Error::RankMasked { op: op_label(channel, self.core.peek_seq(channel)), rank: me });
        }
        Ok(())
    }

    pub(super) fn mask_params(&self) -> MaskParams {
        mask_kernels::mask_params(&self.shared)
    }

    /// Enqueues one thread of `f` (a kernel of `ll.cu` taking a `MaskParams`) with `m` on
    /// `stream`, of this rank's context.
    pub(super) fn launch_mask_kernel(
        &self,
        f: &cudarc::driver::CudaFunction,
        m: MaskParams,
        stream: &CudaStream,
        what: &str,
    ) -> Result<(), Error> {
        mask_kernels::launch(&self.shared, f, m, stream, what)
    }

    /// Runs one thread of `f` with `m` on the handle stream and waits for it.
    fn run_mask_kernel(&self, f: &cudarc::driver::CudaFunction, m: MaskParams, what: &str) -> Result<(), Error> {
        mask_kernels::run(&self.shared, f, m, what)
    }

    pub(super) fn mask_ranks_now(&self, ranks: &RankSet) -> Result<(), Error> {
        let s = &self.shared;
        ranks.check_range("mask_ranks", s.num_ranks)?;
        self.check_masking("mask_ranks")?;
        let m = MaskParams { bits: ranks.low_bits(), ..self.mask_params() };
        self.run_mask_kernel(&s.functions.mask_spread, m, "mask ranks")
    }

    /// `unmask_all` (see [`epflow_core::mask`], "Recovery"): waits for this rank's streams,
    /// then `ep_mask_rejoin` meets every rank on the device, agrees on the next operation
    /// numbers and resets the credits and the mask; the host then numbers from there.
    pub(super) fn unmask_all_now(&self) -> Result<(), Error> {
        self.check_masking("unmask_all")?;
        if self.shared.nccl.is_some() {
            return Err(Error::Unsupported(
                "unmask_all: a group with NCCL peers takes masked ranks back only through a rejoin (GpuRank::admit \
                 with GpuWorld::rejoin_with): the pairs with a masked peer were revoked"
                    .into(),
            ));
        }
        let next = Channel::ALL.map(|c| self.core.peek_seq(c));
        self.meet_and_renumber(next, "unmask_all", false)
    }

    /// `unmask_all` at the end of a rejoin meeting of a group with NCCL peers, whose signal
    /// pages are not mapped (so the device meeting cannot hold it): the ranks agree over
    /// `meeting` on the next operation numbers (each channel's largest), then `ep_mask_rejoin`
    /// runs for this rank alone (it resets this rank's credits and mask) and the host numbers
    /// from there; a last round makes sure every rank has reset before any sends again (an
    /// NVLink peer's credits and arrivals land in this rank's page). Collective over the
    /// meeting.
    pub(super) fn unmask_all_over(&self, meeting: &(impl Bootstrap + ?Sized)) -> Result<(), Error> {
        self.check_masking("unmask_all")?;
        let mine = Channel::ALL.map(|c| self.core.peek_seq(c));
        let all = all_gather_u64(meeting, &mine)?;
        let next = [0, 1, 2].map(|c| all.chunks_exact(3).map(|w| w[c]).max().unwrap_or(0));
        self.meet_and_renumber(next, "unmask_all", true)?;
        all_gather_u64(meeting, &[0]).map(drop)
    }

    /// Test support for the low-latency tagged areas, whose 32-bit tags wrap every 2^32 operations
    /// of a channel (`sends_tagged` in `ll_tagged.cuh`): moves every channel of the group to
    /// operation number `next`, through `unmask_all`'s meeting on the device. Every rank calls it
    /// with the same `next`, with no operation in flight and before any handle exists; a number
    /// below a channel's current one leaves that channel where it is. A jump past the operations
    /// that clear the tagged areas at a wrap clears them here instead (`clear_skipped_tag_wraps`).
    #[doc(hidden)]
    pub fn renumber_operations(&self, next: u64) -> Result<(), Error> {
        self.clear_skipped_tag_wraps(next)?;
        self.meet_and_renumber([next; 3], "renumber_operations", false)
    }

    /// Before `renumber_operations` moves the low-latency channels to `next`: zeroes this rank's
    /// tagged areas (every set) of each channel whose jump skips an operation that would have
    /// cleared them at a tag wrap ([`crate::layout::LlLayout::skips_a_tag_wrap_clear`]), so that
    /// no row left there carries a tag that comes again. Enqueued on the handle stream, before
    /// the meeting's kernel: a peer writes into these areas only after that meeting, and no
    /// operation is in flight (each finished one read every tagged word it was sent). Every rank
    /// decides alike: the channels' numbers and `next` are the same on every rank. `unmask_all`
    /// needs none of this: groups with rank masking never use the tagged areas (`tag_tokens` 0).
    fn clear_skipped_tag_wraps(&self, next: u64) -> Result<(), Error> {
        let s = &self.shared;
        let BufferLayout::Ll(l) = &s.layout else { return Ok(()) };
        bind(&s.ctx)?;
        let stream = &s.streams[Channel::Handle.index()];
        for (chan, region) in [(Channel::Dispatch, &s.mem.disp_recv), (Channel::Combine, &s.mem.comb_recv)] {
            let from = self.core.peek_seq(chan);
            if !l.skips_a_tag_wrap_clear(from, next.max(from)) {
                continue;
            }
            let (offset, bytes) = l.tagged_areas(chan == Channel::Dispatch);
            if offset + bytes > region.bytes() {
                return Err(Error::Backend(format!(
                    "renumber_operations: the {chan:?} tagged areas ({bytes} B at {offset}) pass the receive region ({} B)",
                    region.bytes()
                )));
            }
            // SAFETY: [offset, offset + bytes) lies inside this rank's live receive region of the
            // channel (checked above; `BufferLayout::dispatch_recv_bytes` / `combine_recv_bytes` size it
            // as every set's plain part, then every set's tagged part); no kernel of this rank is
            // running (no operation in flight), and peers write there only after the meeting
            // enqueued behind this on the same stream.
            unsafe { cudarc::driver::sys::cuMemsetD8Async(region.ptr() + offset as u64, 0, bytes, stream.cu_stream()) }
                .result()
                .map_err(|e| cuda("clear the tagged areas before renumber_operations", e))?;
        }
        Ok(())
    }

    /// `ep_mask_rejoin` with this rank's proposed next numbers `next` (every rank takes the
    /// largest), then the host numbers from there. `alone`: the kernel meets no peer (it runs as
    /// rank 0 of one, on this rank's own page), for groups whose ranks agreed on `next` over a
    /// bootstrap instead.
    fn meet_and_renumber(&self, next: [u64; 3], what: &str, alone: bool) -> Result<(), Error> {
        self.core.poison().check()?;
        let s = &self.shared;
        bind(&s.ctx)?;
        for st in &s.streams {
            st.synchronize().map_err(|e| cuda(&format!("wait for operations before {what}"), e))?;
        }
        let epoch = self.core.mask_epoch() + 1;
        let mut m = MaskParams { epoch, next, ..self.mask_params() };
        if alone {
            m.peer_signals = peer_array(&[s.mem.signals.ptr()]);
            (m.rank, m.num_ranks) = (0, 1);
        }
        self.run_mask_kernel(&s.functions.mask_rejoin, m, what)?;
        let err = s.mem.status.read_u64(status::ERROR);
        if err & 0xff == status::REJOIN_TIMEOUT {
            let e = Error::Timeout {
                op: format!("{what} #{epoch}"),
                rank: s.rank,
                waiting_for: format!("rank {} to come to {what}", (err >> 8) & 0xff),
                after: s.config.timeout,
            };
            s.poison.poison(e.to_string());
            return Err(e);
        }
        let next = [0, 1, 2].map(|c| s.mem.status.read_u64(status::REJOIN + c));
        for (turn, n) in s.turns.iter().zip(next) {
            turn.store(n, Ordering::Release);
        }
        self.core.rejoin_at(next);
        Ok(())
    }
}
