//! # epflow
//!
//! Async expert-parallel (MoE) communication for GPUs: the facade crate.
#![forbid(unsafe_code)]

pub use epflow_core as core;
