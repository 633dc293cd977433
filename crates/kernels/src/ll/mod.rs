//! Low-latency operations (`cuda/ll.cu` and the `cuda/ll_*.cuh` parts around it): starting them
//! ([`start`]: kernel parameters, the NCCL exchange with NCCL peers, cancellations) and handles
//! built on the device ([`handle`]). Their launch geometry is beside the launches
//! (`op/ll_geometry.rs`); the report of invalid routing rows that dispatches reading the
//! caller's `topk_idx` write is in `state/ll_report.rs`.
//!
//! A dispatch sends one message per (token, destination rank) into the destination's receive
//! region (a slot per source token, per buffer set); its receive kernel packs the messages into
//! the expert-major output and writes the handle's row map, which the combine's send kernel
//! reads to send each expert output row back to its source.

pub(crate) mod handle;
pub(crate) mod start;
