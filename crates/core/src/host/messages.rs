//! What host ranks send each other.

use half::bf16;

use crate::ops::Pass;
use crate::reference::Rows;
use crate::routing::TokenCopy;

/// One message from one rank to another for one operation.
#[derive(Clone, Debug)]
pub(crate) enum Message {
    /// The sender cancelled its side of the operation before sending.
    Cancelled,
    /// High-throughput handle creation: the copies the sender will send to the receiver.
    HandlePlan { copies: Vec<TokenCopy> },
    /// Dispatch: one row per copy (in copy order); in HT forward also each copy's `K` weights.
    Dispatch { pass: Pass, copies: Vec<TokenCopy>, rows: Rows, weights: Vec<f32> },
    /// Low-latency combine: one expert-output row per `(token, k)` entry.
    LlCombine { entries: Vec<(u32, u16)>, rows: Vec<bf16> },
    /// High-throughput combine: one row per copy the receiver sent here (in its copy order), and
    /// in the backward pass `K` weight gradients per row.
    HtCombine { pass: Pass, rows: Vec<bf16>, weights: Vec<f32> },
}

impl Message {
    /// A short name for order-mismatch errors.
    pub(crate) fn kind(&self) -> String {
        match self {
            Message::Cancelled => "cancellation".into(),
            Message::HandlePlan { .. } => "handle creation".into(),
            Message::Dispatch { pass, .. } => format!("{pass:?} dispatch").to_lowercase(),
            Message::LlCombine { .. } => "low-latency combine".into(),
            Message::HtCombine { pass, .. } => format!("{pass:?} combine").to_lowercase(),
        }
    }
}
