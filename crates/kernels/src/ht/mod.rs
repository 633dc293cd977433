//! High-throughput operations (`cuda/ht.cu` and its `ht_*.cuh` parts, and `cuda/nccl.cu` over
//! NCCL): handles built on the device over NVLink ([`device`], its state in [`plan`], the words it
//! reports in [`result`]) or by the host with a count exchange ([`exchange`]), starting dispatch
//! and combine ([`start`]), the same over NCCL ([`nccl`]) and the launch geometry ([`geometry`]).
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
pub(crate) mod exchange;
pub(crate) mod geometry;
pub(crate) mod nccl;
pub(crate) mod plan;
pub(crate) mod result;
pub(crate) mod start;
