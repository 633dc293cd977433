//! The headers host ranks send each other; payload rows stay in the sender's staging buffer.

use crate::routing::TokenCopy;
use crate::stamp::Stamp;

/// One message from one rank to another for one operation.
#[derive(Clone, Debug)]
pub(crate) enum Message {
    /// The sender cancelled its side of the operation before sending.
    Cancelled,
    /// Data, with the sender's [`Stamp`] (the receiver checks it against its own).
    Data { stamp: Stamp, body: Body },
}

/// What a data message carries.
#[derive(Clone, Debug)]
pub(crate) enum Body {
    /// High-throughput handle creation: the copies the sender will send to the receiver.
    HandlePlan { copies: Vec<TokenCopy> },
    /// Dispatch: the copies; row `token` of the sender's staged tokens (and weights) for each.
    Dispatch { copies: Vec<TokenCopy> },
    /// Low-latency combine: per `(token, k)` entry, the row of the sender's staged expert outputs.
    LlCombine { entries: Vec<(u32, u16, u32)> },
    /// High-throughput combine: the receiver's copies (in its copy order) are the sender's staged
    /// rows `first_row ..`, as are their `K` weight gradients in the backward pass.
    HtCombine { first_row: usize },
}

impl Body {
    /// A short name for order-mismatch errors.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Body::HandlePlan { .. } => "handle creation",
            Body::Dispatch { .. } => "dispatch",
            Body::LlCombine { .. } => "low-latency combine",
            Body::HtCombine { .. } => "high-throughput combine",
        }
    }
}
