//! What a rank receives: [`LlRecvLayout`] (low-latency, per local expert), [`RankRecvLayout`]
//! (low-latency rank-major, per source rank) and [`HtRecvLayout`] (flat).

use super::TokenCopy;

/// Where one received row came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowSource {
    /// The source rank.
    pub src_rank: u32,
    /// The token's row on the source rank.
    pub token: u32,
    /// The top-k slot that chose this expert (low-latency rows only; 0 in HT rows).
    pub k: u16,
}

/// The low-latency receive layout of one rank: for each local expert, its rows in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LlRecvLayout {
    rows: Vec<Vec<RowSource>>,
}

impl LlRecvLayout {
    /// Builds the layout from the copies received, visited in ascending source rank
    /// (`received[s]` = the copies rank `s` sent here, in its order).
    pub fn from_received<'a>(
        local_experts: usize,
        received: impl IntoIterator<Item = (usize, &'a [TokenCopy])>,
    ) -> Self {
        let mut rows = vec![Vec::new(); local_experts];
        for (src, copies) in received {
            for c in copies {
                for s in &c.selections {
                    rows[s.local_expert as usize].push(RowSource { src_rank: src as u32, token: c.token, k: s.k });
                }
            }
        }
        LlRecvLayout { rows }
    }

    /// Number of local experts.
    pub fn local_experts(&self) -> usize {
        self.rows.len()
    }

    /// The rows of local expert `l`.
    pub fn rows(&self, local_expert: usize) -> &[RowSource] {
        &self.rows[local_expert]
    }

    /// Rows per local expert (the `[L]` receive counters).
    pub fn counts(&self) -> Vec<i32> {
        self.rows.iter().map(|r| r.len() as i32).collect()
    }
}

/// The low-latency rank-major receive layout of one rank: per source rank, the tokens it sent
/// here, in its token order (row `i` of source `s` is output row `s * M + i`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankRecvLayout {
    sources: Vec<Vec<RowSource>>,
}

impl RankRecvLayout {
    /// Builds the layout from the copies received, visited in ascending source rank, for
    /// `num_ranks` sources. A row's `k` is the first top-k entry that chose an expert of this
    /// rank: the slot combine returns the row's pre-reduced sum in.
    pub fn from_received<'a>(num_ranks: usize, received: impl IntoIterator<Item = (usize, &'a [TokenCopy])>) -> Self {
        let mut sources = vec![Vec::new(); num_ranks];
        for (src, copies) in received {
            sources[src] = copies
                .iter()
                .filter_map(|c| {
                    let first = c.selections.iter().map(|s| s.k).min()?;
                    Some(RowSource { src_rank: src as u32, token: c.token, k: first })
                })
                .collect();
        }
        RankRecvLayout { sources }
    }

    /// Number of source ranks.
    pub fn num_ranks(&self) -> usize {
        self.sources.len()
    }

    /// The rows received from source `s`, in its token order.
    pub fn rows(&self, src: usize) -> &[RowSource] {
        &self.sources[src]
    }

    /// Rows per source rank (the `[R]` receive counters).
    pub fn counts(&self) -> Vec<i32> {
        self.sources.iter().map(|r| r.len() as i32).collect()
    }
}

/// The high-throughput receive layout of one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HtRecvLayout {
    rows: Vec<RowSource>,
    expert_counts: Vec<i32>,
}

impl HtRecvLayout {
    /// Builds the layout from the copies received, visited in ascending source rank.
    pub fn from_received<'a>(
        local_experts: usize,
        received: impl IntoIterator<Item = (usize, &'a [TokenCopy])>,
    ) -> Self {
        let mut rows = Vec::new();
        let mut expert_counts = vec![0i32; local_experts];
        for (src, copies) in received {
            for c in copies {
                rows.push(RowSource { src_rank: src as u32, token: c.token, k: 0 });
                for s in &c.selections {
                    expert_counts[s.local_expert as usize] += 1;
                }
            }
        }
        HtRecvLayout { rows, expert_counts }
    }

    /// `N`, rows received.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    /// The received rows in order.
    pub fn rows(&self) -> &[RowSource] {
        &self.rows
    }

    /// Received tokens per local expert (`[L]`).
    pub fn expert_counts(&self) -> &[i32] {
        &self.expert_counts
    }
}
