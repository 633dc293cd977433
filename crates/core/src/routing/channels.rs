//! A rank's high-throughput routing cut into the **channels** of the GPU kernels, and the
//! count-exchange messages that create a high-throughput handle.
//!
//! A rank's `B` tokens are split into `C` channels of `ceil(B / C)` consecutive tokens; channel
//! `c` of every rank runs on the `c`-th block pair of a kernel. The [`ChannelPlan`] lists, per
//! destination, the tokens that have an expert there (ascending: [`SendPlan`]'s copies), cut by
//! channel; the count exchange tells every rank how many rows each (source, channel) sends it
//! ([`ChannelReceive`]), hence where they go in its `[N x H]` output (sorted by source rank,
//! then token, as [`crate::routing`] says).

#[cfg(doc)]
use super::SendPlan;
use super::{ExpertPlacement, Routing};

/// A rank's send plan by destination and channel, and the messages of its count exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelPlan {
    /// Tokens per channel.
    pub tokens_per_channel: usize,
    /// Per destination, the tokens with an expert there, ascending; concatenated.
    pub send_list: Vec<i32>,
    /// `[R][C + 1]`: absolute offsets into `send_list` where each (destination, channel) starts
    /// (entry `C` is where the destination ends).
    pub send_off: Vec<i32>,
    /// `[B][R]`: index of token `t` among its channel's copies to rank `d`, or -1.
    pub copy_ord: Vec<i32>,
    /// `[R][C + L]`: to each rank, the rows per channel, then the selections per local expert.
    pub msgs: Vec<i32>,
}

impl ChannelPlan {
    /// The plan of `routing` with `channels` channels (the copies are [`SendPlan`]'s, computed
    /// here without per-copy allocations: handle creation is on every batch's critical path).
    pub fn new(routing: &Routing, placement: ExpertPlacement, channels: usize) -> Self {
        let (b, r, l) = (routing.num_tokens(), placement.num_ranks, placement.local_experts());
        let channels = channels.max(1);
        let tpc = b.div_ceil(channels).max(1);
        let words = channels + l;
        let mut per_dest: Vec<Vec<i32>> = vec![Vec::with_capacity(b); r];
        let mut msgs = vec![0i32; r * words];
        let mut hit = vec![false; r];
        for t in 0..b {
            for &e in routing.row(t) {
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                let d = placement.owner(e);
                msgs[d * words + channels + placement.local_index(e)] += 1;
                hit[d] = true;
            }
            for (d, h) in hit.iter_mut().enumerate() {
                if std::mem::take(h) {
                    per_dest[d].push(t as i32);
                }
            }
        }
        let mut out = ChannelPlan {
            tokens_per_channel: tpc,
            send_list: Vec::with_capacity(per_dest.iter().map(Vec::len).sum()),
            send_off: Vec::with_capacity(r * (channels + 1)),
            copy_ord: vec![-1; b * r],
            msgs,
        };
        for (d, tokens) in per_dest.iter().enumerate() {
            let base = out.send_list.len();
            let mut c = 0;
            for (i, &t) in tokens.iter().enumerate() {
                let t = t as usize;
                while c * tpc <= t && c < channels {
                    out.send_off.push((base + i) as i32);
                    c += 1;
                }
                let first = out.send_off[d * (channels + 1) + c - 1] as usize;
                out.copy_ord[t * r + d] = (base + i - first) as i32;
            }
            out.send_list.extend_from_slice(tokens);
            while c <= channels {
                out.send_off.push((base + tokens.len()) as i32);
                c += 1;
            }
            for ch in 0..channels {
                let o = d * (channels + 1) + ch;
                out.msgs[d * words + ch] = out.send_off[o + 1] - out.send_off[o];
            }
        }
        out
    }

    /// Per destination, `(first, rows)` of its block of the send list.
    pub fn send_blocks(&self, num_ranks: usize, channels: usize) -> Vec<(usize, usize)> {
        (0..num_ranks)
            .map(|d| {
                let first = self.send_off[d * (channels + 1)] as usize;
                (first, self.send_off[d * (channels + 1) + channels] as usize - first)
            })
            .collect()
    }
}

/// What a rank receives, from the count-exchange messages of every source (`[R][C + L]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelReceive {
    /// `[R][C]`: the first output row of each (source, channel).
    pub recv_base: Vec<i32>,
    /// `[R][C]`: rows received from each (source, channel).
    pub recv_cnt: Vec<i32>,
    /// `N`, rows received.
    pub num_recv: usize,
    /// `[L]`: selections received per local expert.
    pub expert_counts: Vec<i32>,
}

impl ChannelReceive {
    /// The layout of `received` (`num_ranks` messages of `channels + L` words).
    pub fn from_messages(received: &[i32], num_ranks: usize, channels: usize) -> Self {
        let words = received.len() / num_ranks.max(1);
        let l = words.saturating_sub(channels);
        let mut recv_base = Vec::with_capacity(num_ranks * channels);
        let mut recv_cnt = Vec::with_capacity(num_ranks * channels);
        let mut expert_counts = vec![0i32; l];
        let mut n = 0usize;
        for s in 0..num_ranks {
            let m = &received[s * words..(s + 1) * words];
            for &c in &m[..channels] {
                recv_base.push(n as i32);
                recv_cnt.push(c);
                n += c.max(0) as usize;
            }
            for (acc, &c) in expert_counts.iter_mut().zip(&m[channels..]) {
                *acc += c;
            }
        }
        ChannelReceive { recv_base, recv_cnt, num_recv: n, expert_counts }
    }

    /// Per source, `(first, rows)` of its block of the output.
    pub fn recv_blocks(&self, num_ranks: usize, channels: usize) -> Vec<(usize, usize)> {
        (0..num_ranks)
            .map(|s| {
                let rows: i32 = self.recv_cnt[s * channels..(s + 1) * channels].iter().map(|&x| x.max(0)).sum();
                (self.recv_base.get(s * channels).map_or(0, |&b| b as usize), rows as usize)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_splits_copies_by_destination_and_channel() {
        // 8 experts on 2 ranks (L = 4), 5 tokens, top-2, 2 channels of 3 tokens.
        let idx = vec![0, 5, 1, 2, 6, -1, 7, 4, -1, -1];
        let routing = Routing::new(idx, 5, 2, 8).unwrap();
        let plan = ChannelPlan::new(&routing, ExpertPlacement::new(8, 2), 2);
        assert_eq!(plan.tokens_per_channel, 3);
        // To rank 0: tokens 0, 1; to rank 1: tokens 0, 2, 3.
        assert_eq!(plan.send_list, vec![0, 1, 0, 2, 3]);
        assert_eq!(plan.send_off, vec![0, 2, 2, 2, 4, 5]);
        assert_eq!(plan.copy_ord, vec![0, 0, 1, -1, -1, 1, -1, 0, -1, -1]);
        assert_eq!(plan.send_blocks(2, 2), vec![(0, 2), (2, 3)]);
        // Messages: [rows c0, rows c1, selections of local experts 0..4].
        assert_eq!(&plan.msgs[..6], &[2, 0, 1, 1, 1, 0]);
        assert_eq!(&plan.msgs[6..], &[2, 1, 1, 1, 1, 1]);
        let both = [plan.msgs[6..].to_vec(), plan.msgs[6..].to_vec()].concat();
        let recv = ChannelReceive::from_messages(&both, 2, 2);
        assert_eq!(recv.recv_cnt, vec![2, 1, 2, 1]);
        assert_eq!(recv.recv_base, vec![0, 2, 3, 5]);
        assert_eq!(recv.num_recv, 6);
        assert_eq!(recv.expert_counts, vec![2, 2, 2, 2]);
        assert_eq!(recv.recv_blocks(2, 2), vec![(0, 3), (3, 3)]);
    }

    #[test]
    fn empty_and_tiny_plans() {
        let routing = Routing::new(vec![], 0, 2, 8).unwrap();
        let plan = ChannelPlan::new(&routing, ExpertPlacement::new(8, 4), 24);
        assert!(plan.send_list.is_empty());
        assert_eq!(plan.send_off.len(), 4 * 25);
        assert!(plan.send_off.iter().all(|&o| o == 0));
        let routing = Routing::new(vec![7, -1], 1, 2, 8).unwrap();
        let plan = ChannelPlan::new(&routing, ExpertPlacement::new(8, 4), 24);
        assert_eq!(plan.send_list, vec![0]);
        assert_eq!(plan.copy_ord, vec![-1, -1, -1, 0]);
        assert_eq!(plan.send_off[3 * 25], 0);
        assert_eq!(plan.send_off[3 * 25 + 1], 1);
    }
}
