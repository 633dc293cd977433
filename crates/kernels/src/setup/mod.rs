//! Process setup for one process per GPU: the environment `epflow launch` (or torchrun) gives
//! each process, the NCCL communicator it joins, and the TCP rendezvous of the NCCL id across
//! hosts.

pub mod bootstrap;
pub(crate) mod rendezvous;
