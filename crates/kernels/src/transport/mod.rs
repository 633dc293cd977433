//! How the ranks of a GPU group reach each other: [`Transport`] chooses, per pair of ranks,
//! NVLink (peer memory, the `nvlink` module: peer access in one process, CUDA IPC across processes;
//! `peer_memory`: how ranks joined over a bootstrap trade that memory) or NCCL's grouped
//! send/recv ([`nccl`]: across hosts, or every pair when asked).

pub mod nccl;
pub(crate) mod nccl_pairs;
pub(crate) mod nccl_shared;
pub(crate) mod nvlink;
pub(crate) mod peer_memory;

use epflow_core::Error;

use crate::params::MAX_RANKS;

/// How the ranks of a GPU group reach each other.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// Detect: NVLink between ranks of one host, NCCL between hosts (the host of a rank is its
    /// kernel boot id; see [`crate::GpuWorld::join`]). One process driving several GPUs is
    /// always one host.
    #[default]
    Auto,
    /// The NVLink kernels between every pair of ranks (every pair needs peer access).
    NvLink,
    /// NCCL grouped send/recv between every pair of distinct ranks (`--backend nccl`).
    Nccl,
    /// NVLink inside a host, NCCL across: `hosts[r]` names the host of rank `r`. Detected by
    /// [`Transport::Auto`], or forced to test the cross-host path on one machine.
    Hierarchical {
        /// Host label of each rank (any values; equal labels share NVLink).
        hosts: Vec<u64>,
    },
}

impl Transport {
    /// A forced split of `num_ranks` ranks into `num_hosts` "hosts" of consecutive ranks.
    pub fn split_hosts(num_ranks: usize, num_hosts: usize) -> Result<Self, Error> {
        if num_hosts == 0 || num_ranks % num_hosts != 0 {
            return Err(Error::Unsupported(format!(
                "cannot split {num_ranks} ranks into {num_hosts} hosts of equal size"
            )));
        }
        let per = num_ranks / num_hosts;
        Ok(Transport::Hierarchical { hosts: (0..num_ranks).map(|r| (r / per) as u64).collect() })
    }

    /// The mask of ranks `rank` reaches through NCCL (bit `r` = rank `r`) for a group of
    /// `num_ranks` whose detected hosts are `hosts` (`None`: one host).
    pub fn nccl_mask(&self, rank: usize, num_ranks: usize, detected: Option<&[u64]>) -> Result<u32, Error> {
        if num_ranks > MAX_RANKS {
            return Err(Error::Unsupported(format!("at most {MAX_RANKS} ranks per group, not {num_ranks}")));
        }
        let others =
            |same: &dyn Fn(usize) -> bool| (0..num_ranks).filter(|&r| !same(r)).fold(0u32, |m, r| m | (1 << r));
        match self {
            Transport::NvLink => match detected {
                Some(h) if h.iter().any(|&x| x != h[rank]) => Err(Error::Unsupported(format!(
                    "Transport::NvLink asked for, but ranks {:?} run on another host than rank {rank}",
                    (0..num_ranks).filter(|&r| h[r] != h[rank]).collect::<Vec<_>>()
                ))),
                _ => Ok(0),
            },
            Transport::Auto => Ok(detected.map_or(0, |h| others(&|r| h[r] == h[rank]))),
            Transport::Nccl => Ok(others(&|r| r == rank)),
            Transport::Hierarchical { hosts } => {
                if hosts.len() != num_ranks {
                    return Err(Error::Unsupported(format!(
                        "Transport::Hierarchical names {} hosts for {num_ranks} ranks",
                        hosts.len()
                    )));
                }
                if let Some(h) = detected {
                    if let Some(r) = (0..num_ranks).find(|&r| h[r] != h[rank] && hosts[r] == hosts[rank]) {
                        return Err(Error::Unsupported(format!(
                            "Transport::Hierarchical puts rank {r} on rank {rank}'s host, but it runs on another one"
                        )));
                    }
                }
                Ok(others(&|r| hosts[r] == hosts[rank]))
            }
        }
    }
}

/// An identifier of this host and boot (the kernel's boot id, else the host name), hashed.
pub(crate) fn host_id() -> u64 {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    // FNV-1a: stable, and enough to tell hosts apart.
    text.trim().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_follow_the_transport() {
        assert_eq!(Transport::Nccl.nccl_mask(1, 4, None).unwrap(), 0b1101);
        assert_eq!(Transport::NvLink.nccl_mask(1, 4, None).unwrap(), 0);
        assert_eq!(Transport::Auto.nccl_mask(1, 4, None).unwrap(), 0);
        let split = Transport::split_hosts(4, 2).unwrap();
        assert_eq!(split, Transport::Hierarchical { hosts: vec![0, 0, 1, 1] });
        assert_eq!(split.nccl_mask(0, 4, None).unwrap(), 0b1100);
        assert_eq!(split.nccl_mask(3, 4, None).unwrap(), 0b0011);
        // Detected hosts: Auto follows them, NvLink refuses them.
        let hosts = [7u64, 7, 9, 9];
        assert_eq!(Transport::Auto.nccl_mask(2, 4, Some(&hosts)).unwrap(), 0b0011);
        assert!(Transport::NvLink.nccl_mask(2, 4, Some(&hosts)).is_err());
        // A forced split may not merge ranks of different real hosts.
        let one_host = Transport::split_hosts(4, 1).unwrap();
        assert!(one_host.nccl_mask(0, 4, Some(&hosts)).is_err());
        assert!(Transport::split_hosts(4, 3).is_err());
        assert!(Transport::Nccl.nccl_mask(0, 9, None).is_err());
        assert!(Transport::Hierarchical { hosts: vec![0, 1] }.nccl_mask(0, 4, None).is_err());
    }
}
