//! Low-latency operations (`cuda/ll.cu` and the `cuda/ll_*.cuh` parts around it): starting them
//! ([`start`]: kernel parameters, the NCCL exchange with NCCL peers, cancellations), their
//! launch geometry ([`geometry`]), handles built on the device ([`handle`]), and the report of
//! invalid routing rows that dispatches reading the caller's `topk_idx` write ([`report`]).
//!
//! A dispatch sends one message per (token, destination rank) into the destination's receive
//! region (a slot per source token, per buffer set); its receive kernel packs the messages into
//! the expert-major output and writes the handle's row map, which the combine's send kernel
//! reads to send each expert output row back to its source.

pub(crate) mod geometry;
pub(crate) mod handle;
pub(crate) mod report;
pub(crate) mod start;
