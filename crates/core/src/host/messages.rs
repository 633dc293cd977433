//! The headers host ranks send each other; payload rows stay in the sender's staging buffer.

use crate::ops::Pass;
use crate::routing::TokenCopy;

/// One message from one rank to another for one operation.
#[derive(Clone, Debug)]
pub(crate) enum Message {
    /// The sender cancelled its side of the operation before sending.
    Cancelled,
    /// High-throughput handle creation: the copies the sender will send to the receiver.
    HandlePlan { copies: Vec<TokenCopy> },
    /// Dispatch: the copies; row `token` of the sender's staged tokens (and weights) for each.
    Dispatch { pass: Pass, copies: Vec<TokenCopy> },
    /// Low-latency combine: per `(token, k)` entry, the row of the sender's staged expert outputs.
    LlCombine { entries: Vec<(u32, u16, u32)> },
    /// High-throughput combine: the receiver's copies (in its copy order) are the sender's staged
    /// rows `first_row ..`, as are their `K` weight gradients in the backward pass.
    HtCombine { pass: Pass, first_row: usize },
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
