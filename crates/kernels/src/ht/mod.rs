//! High-throughput operations (`cuda/ht.cu` and its `ht_*.cuh` parts, and `cuda/nccl.cu` over
//! NCCL): handles built on the device over NVLink ([`device`]; their state and the words they
//! report in are in `state/ht_plan.rs` and `state/ht_result.rs`) or by the host with a count
//! exchange (`state/ht_exchange.rs`), starting dispatch and combine ([`start`]) and the same
//! over NCCL ([`nccl`]).
//! The launch geometry is beside the launches (`op/ht_geometry.rs`).
//!
//! ## Channels
//!
//! A rank's `B` tokens are split into `C` channels of `ceil(B / C)` consecutive tokens; channel
//! `c` of every rank runs on the `c`-th block pair of the kernel. The handle's send plan
//! ([`epflow_core::routing::ChannelPlan`]) lists, per destination, the tokens that have an expert
//! there (ascending), cut by channel; the count exchange tells every rank how many rows each
//! (source, channel) sends it, hence where they go in its `[N x H]` output (sorted by source
//! rank, then token, as the reference says). Rows stream through rings of fixed depth, so the
//! group's buffers do not grow with the token count.

pub(crate) mod device;
pub(crate) mod nccl;
pub(crate) mod start;
