//! The host backend: a world of `R` ranks inside one process, on host memory.
//!
//! It runs every operation — handle creation, dispatch and combine, forward and backward,
//! synchronous and staged (send-only, then complete) — with the semantics of the GPU backend
//! and the protocol of [`crate::protocol`]: buffer sets, arrival signals carrying sequence
//! numbers, credits, slots, timeouts, cancellation markers. It is what CI tests, what the
//! examples run without a GPU, and the default of `epflow bench` on a machine with no GPU.
//!
//! ```
//! use epflow_core::host::HostWorld;
//! use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions};
//! use epflow_core::{GroupConfig, HostTensor, bf16};
//!
//! let config = GroupConfig::low_latency(8, 4, 128);
//! let ranks = HostWorld::create(2, config).unwrap();
//! std::thread::scope(|s| {
//!     for rank in &ranks {
//!         s.spawn(move || {
//!             // Token t of this rank goes to experts t and (t + 4) % 8, weights 0.5 each.
//!             let idx: Vec<i64> = (0..4).flat_map(|t| [t, (t + 4) % 8]).collect();
//!             let handle = rank.create_handle(&HostTensor::topk_idx(4, 2, idx)).unwrap();
//!             let x = HostTensor::tokens(4, 128, vec![bf16::from_f32(1.5); 4 * 128]);
//!             let out = rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap();
//!             assert_eq!(out.counts().unwrap().iter().sum::<i32>(), 8); // 2 ranks x 4 tokens, 1 per local expert
//!             // Identity experts: send the received rows straight back.
//!             let w = HostTensor::topk_weights(4, 2, vec![0.5; 8]);
//!             let y = rank
//!                 .combine(&handle, CombineInputs::new(out.tokens()).with_weights(&w), &CombineOptions::default())
//!                 .unwrap();
//!             assert!(y.tokens().as_bf16().unwrap().iter().all(|v| v.to_f32() == 1.5));
//!         });
//!     }
//! });
//! ```

mod graph;
mod handle;
mod mailbox;
mod mask;
pub mod memory;
mod messages;
mod op;
mod outputs;
mod rank;
mod rejoin;

pub use graph::{HostReplay, HostStep};
pub use handle::HostHandle;
pub use op::{HostOp, HostOpOutput};
pub use outputs::{HostCombineOutput, HostDispatchOutput};
pub use rank::{HostRank, HostStaged, HostWorld};
pub use rejoin::HostRendezvous;

use crate::config::GroupConfig;
use mailbox::Mailboxes;

/// The host backend's stream ([`crate::backend::Backend::Stream`]): host ranks run each
/// operation in program order, so work "on" it needs no ordering, and stream-ordered completion
/// ([`crate::backend::PendingOp::complete_on`]) completes on the host (the outputs come once the
/// peers' data is in).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostStream;

/// What every rank of a host world shares.
#[derive(Debug)]
pub struct HostWorldShared {
    pub(crate) config: GroupConfig,
    pub(crate) num_ranks: usize,
    pub(crate) group_id: u64,
    pub(crate) mailboxes: Mailboxes,
    /// Every rank's mask word ([`crate::mask`]).
    pub(crate) masks: mask::HostMasks,
    /// The latest mask epoch any rank completed (where a replacement starts).
    pub(crate) epoch: std::sync::atomic::AtomicU64,
    /// Per rank: whether its `HostRank` exists, is gone, or a replacement is joining.
    pub(crate) slots: std::sync::Mutex<Vec<Slot>>,
    /// Per rank: its operations not yet dropped (a dead rank's detached ones run on until their
    /// timeout; its replacement waits for them).
    pub(crate) ops_alive: Vec<std::sync::atomic::AtomicUsize>,
}

/// Where a rank of a host world stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Its `HostRank` exists.
    Live,
    /// Its `HostRank` was dropped (the rank's thread ended).
    Gone,
    /// A replacement was made and has not finished joining.
    Joining,
}
