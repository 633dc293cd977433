//! Process setup for one process per GPU: the environment `epflow launch` (or torchrun) gives
//! each process, the NCCL communicator it joins, and the TCP rendezvous of the NCCL id across
//! hosts; or, for ranks all on this host, a bootstrap over TCP without NCCL (`tcp_bootstrap`);
//! where a rank's rejoin meetings come from (`meeting`); and a blocking set-up given up at a
//! deadline (`within`).

pub mod bootstrap;
pub mod meeting;
pub(crate) mod rendezvous;
pub mod tcp_bootstrap;
pub(crate) mod within;
