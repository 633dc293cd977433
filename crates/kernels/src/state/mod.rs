//! What operations, handles and their reports share, below the rooms that start and finish
//! operations (`ll/`, `ht/`, `op/`, `graph/`, `rank/`), so that those import it and it imports
//! none of them.
//!
//! - `shared.rs`: [`shared::RankShared`], one rank's memory, streams, functions, peers and
//!   counters, shared by every operation of the rank.
//! - `handle.rs`: [`crate::GpuHandle`], a routing handle with its device memory and creation state.
//! - `ht_plan.rs`: a high-throughput handle being built on the device, and how its creation
//!   finishes; `ht_result.rs`: the mapped words it reports in.
//! - `ht_exchange.rs`: a high-throughput handle built by the host from a count exchange: the
//!   exchange's buffers and how its creation finishes.
//! - `ll_report.rs`: the same for a low-latency handle's kernel.

pub(crate) mod handle;
pub(crate) mod ht_exchange;
pub(crate) mod ht_plan;
pub(crate) mod ht_result;
pub(crate) mod ll_report;
pub(crate) mod shared;
