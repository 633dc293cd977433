//! # epflow-async
//!
//! The async runtime of epflow: NCCL EP's staged ("send-only") dispatch and combine become
//! futures whose awaited half is the completion, so a tokio (or any) executor can keep several
//! micro-batches in flight and overlap expert compute with communication.
//!
//! ```no_run
//! # async fn example<B: epflow_core::backend::Backend>(group: epflow_async::Group<B>, idx: B::Tensor, x: B::Tensor) -> epflow_core::Result<()> {
//! use epflow_core::ops::DispatchInputs;
//! let handle = group.create_handle(&idx).await?;
//! let staged = group.dispatch(&handle, DispatchInputs::new(&x)).send_only().await?; // send half
//! // ... overlap: run another micro-batch's experts here ...
//! let received = staged.await?; // complete half
//! # Ok(()) }
//! ```
//!
//! ## Table of contents
//!
//! - [`Group`]: one rank's group; `create_handle`, `dispatch`, `combine` return futures.
//! - [`OpFuture`], [`SendOnly`], [`Staged`], [`HandleFuture`]: the futures;
//!   [`Staged::complete_on`] and [`OpFuture::complete_on`] ([`CompleteOn`]) complete in a
//!   caller's stream order, [`HandleFuture::complete_on`] ([`HandleOn`]) creates a handle in it.
//! - [`completion`]: [`Completion`] of stream-ordered operations, and [`CompletionMode`] (reactor
//!   wakes or a bounded spin in the task).
//! - [`reactor`]: the completion reactor thread, and [`reactor::wait_for`] for custom probes.
//! - [`Group::replay`] ([`ReplayFuture`]): one replay of a captured step
//!   ([`epflow_core::graph`]), awaited like any operation.
//! - Rank masking ([`epflow_core::mask`]): [`Group::masked_ranks`], [`Group::mask`],
//!   [`Group::unmask_all`] ([`UnmaskFuture`]) and [`Group::mask_events`] ([`MaskEvents`], a
//!   stream a server task awaits).
//! - [`pipeline`]: runs a sequence of micro-batches through dispatch → experts → combine with
//!   several in flight.
//!
//! Guarantees: every wait has the group's timeout (then [`epflow_core::Error::Timeout`] and the
//! group is poisoned: later operations fail fast with [`epflow_core::Error::Poisoned`]; with
//! rank masking the ranks waited for are masked instead, and the operation goes on without them); a new
//! operation waits for a free buffer set instead of overwriting one whose outputs are alive;
//! dropping any future at any point frees nothing still in use and leaves no peer waiting.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod completion;
mod driver;
mod group;
mod inbox;
mod lane;
mod mask;
pub mod pipeline;
pub mod reactor;
mod replay;
mod sync;
mod wait;

pub use completion::{Completion, CompletionMode};
pub use group::{CompleteOn, Group, HandleFuture, HandleOn, OpFuture, SendOnly, Staged};
pub use mask::{MaskEvents, UnmaskFuture};
pub use replay::ReplayFuture;
