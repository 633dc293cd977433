//! NCCL EP's active mask (`enable_mask`; `ncclEpMaskQuery`, `ncclEpMaskUpdate`,
//! `ncclEpMaskClean`, and the masking side of `ncclEpGetAsyncError` / `ncclEpErrorClear`) on
//! epflow's rank masking ([`epflow_core::mask`]). The group's mask is epflow's: a peer that misses
//! the device deadline is masked on every rank and later operations skip it.
//!
//! Differences from NCCL EP 0.1: an update can mask ranks but not bring one back (epflow's mask
//! only grows until a clean), and a clean is epflow's `unmask_all`, a collective of **every**
//! rank, the masked ones included (NCCL EP's is the survivors'): a rank whose process is gone
//! cannot be cleaned back; the application rebuilds the group instead.

use epflow_core::mask::RankSet;

use crate::status::{Fail, Res};

/// `ncclEpMaskQuery`'s `mask_status`: per rank, 1 active, 0 masked.
pub(crate) fn status_of(masked: &RankSet, num_ranks: usize) -> Vec<i32> {
    (0..num_ranks).map(|r| i32::from(!masked.contains(r))).collect()
}

/// The ranks an `ncclEpMaskUpdate` of `update` (per rank, 1 active, 0 masked) masks: those at 0.
/// A masked rank at 1 is refused with `ncclInvalidUsage`: only `ncclEpMaskClean` brings ranks
/// back. Any value but 0 and 1 is `ncclInvalidArgument`.
pub(crate) fn ranks_to_mask(update: &[i32], masked: &RankSet) -> Res<RankSet> {
    let mut out = RankSet::new();
    for (r, &v) in update.iter().enumerate() {
        match v {
            0 => out.insert(r)?,
            1 if masked.contains(r) => {
                return Err(Fail::usage(format!(
                    "ncclEpMaskUpdate: rank {r} is masked and the update marks it active: epflow brings masked \
                     ranks back only with ncclEpMaskClean (a collective of every rank)"
                )));
            }
            1 => {}
            v => return Err(Fail::arg(format!("ncclEpMaskUpdate: mask[{r}] is {v}, not 0 (masked) or 1 (active)"))),
        }
    }
    Ok(out)
}

/// The asynchronous error flag of a group with masking: raised once the host sees a rank masked
/// that it had not seen masked (a timeout masked it; ranks masked through `ncclEpMaskUpdate` do
/// not raise it), lowered only by `ncclEpErrorClear`, which a clean does not do.
#[derive(Debug, Default)]
pub(crate) struct MaskFlag {
    seen: RankSet,
    raised: bool,
}

impl MaskFlag {
    /// `ncclEpGetAsyncError`: whether the flag is up, given the mask `now`.
    pub(crate) fn poll(&mut self, now: &RankSet) -> bool {
        if !now.difference(&self.seen).is_empty() {
            self.raised = true;
        }
        self.seen = self.seen.union(now);
        self.raised
    }

    /// The application masked `ranks` itself.
    pub(crate) fn masked_by_update(&mut self, ranks: &RankSet) {
        self.seen = self.seen.union(ranks);
    }

    /// `ncclEpErrorClear` with the mask `now`.
    pub(crate) fn clear(&mut self, now: &RankSet) {
        self.raised = false;
        self.seen = *now;
    }

    /// `ncclEpMaskClean` cleared the mask (the flag stays as it is).
    pub(crate) fn cleaned(&mut self) {
        self.seen = RankSet::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nccl_ep_sys as ep;

    fn set(r: &[usize]) -> RankSet {
        RankSet::from_ranks(r.iter().copied(), 8).unwrap()
    }

    #[test]
    fn status_is_one_for_active_ranks() {
        assert_eq!(status_of(&set(&[1, 3]), 4), vec![1, 0, 1, 0]);
        assert_eq!(status_of(&RankSet::new(), 2), vec![1, 1]);
    }

    #[test]
    fn updates_mask_and_never_unmask() {
        assert_eq!(ranks_to_mask(&[1, 0, 1, 0], &RankSet::new()).unwrap(), set(&[1, 3]));
        assert_eq!(ranks_to_mask(&[1, 0], &set(&[1])).unwrap(), set(&[1]));
        assert_eq!(ranks_to_mask(&[1, 1], &set(&[1])).unwrap_err().code, ep::NCCL_INVALID_USAGE);
        assert_eq!(ranks_to_mask(&[1, 2], &RankSet::new()).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
        // An update longer than a rank set holds is refused, not truncated (issue 64 item 3).
        let mut long = vec![1; 1025];
        long[1024] = 0;
        let e = ranks_to_mask(&long, &RankSet::new()).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (ep::NCCL_INVALID_ARGUMENT, "RankSet::insert: rank 1024 is out of range: the ranks are 0..1024")
        );
    }

    #[test]
    fn the_flag_rises_on_a_timeout_mask_and_stays_until_cleared() {
        let mut f = MaskFlag::default();
        assert!(!f.poll(&RankSet::new()));
        // An application's own mask does not raise it.
        f.masked_by_update(&set(&[2]));
        assert!(!f.poll(&set(&[2])));
        // A timeout masks rank 1: up, and it stays up.
        assert!(f.poll(&set(&[1, 2])));
        assert!(f.poll(&set(&[1, 2])));
        f.clear(&set(&[1, 2]));
        assert!(!f.poll(&set(&[1, 2])));
        // A clean, then rank 1 masked again: up again; a clean alone does not lower it.
        f.cleaned();
        assert!(f.poll(&set(&[1])));
        f.cleaned();
        assert!(f.poll(&RankSet::new()));
    }
}
