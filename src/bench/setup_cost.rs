//! What making a GPU group cost: its wall time, and the device memory it took (the drop of the
//! devices' free memory across the making, so NCCL's communicators count as well as epflow's own
//! buffers).

use std::time::Instant;

use epflow_kernels::FreeMemory;
use serde::Serialize;

use super::BenchError;

/// The cost of one group's set-up, as `epflow bench` reports it.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct SetupCost {
    /// Wall time of the group's creation (`GpuWorld::create_with` or `join_with`), seconds.
    pub seconds: f64,
    /// Free device memory before the creation minus after it, bytes, summed over `gpus`.
    pub device_memory_bytes: u64,
    /// Of that, epflow's own buffers (`GpuRank::device_memory_bytes` of the ranks measured), bytes.
    pub buffer_bytes: u64,
    /// The distinct GPUs measured.
    pub gpus: usize,
    /// The ranks whose set-up this is (every rank of one process; one rank of a launch).
    pub ranks: usize,
}

impl SetupCost {
    /// The device memory the set-up took beyond epflow's buffers (NCCL's communicators, the
    /// kernels' modules), bytes; 0 where the devices' other tenants freed memory meanwhile.
    pub(crate) fn other_bytes(&self) -> u64 {
        self.device_memory_bytes.saturating_sub(self.buffer_bytes)
    }

    /// One line for the text report.
    pub(crate) fn describe(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let whose = if self.ranks == 1 { "one rank's".to_string() } else { format!("{} ranks'", self.ranks) };
        format!(
            "Group set-up ({whose}): {:.3} s; device memory taken {:.3} GB over {} GPU{} ({:.3} GB epflow's buffers, {:.3} GB the rest: NCCL's communicators and the kernels)",
            self.seconds,
            gb(self.device_memory_bytes),
            self.gpus,
            if self.gpus == 1 { "" } else { "s" },
            gb(self.buffer_bytes),
            gb(self.other_bytes())
        )
    }
}

/// Runs `make` (which creates the group on `devices`, a GPU per rank, repeats allowed) and
/// measures it ([`epflow_kernels::FreeMemory`], opened first, so a context's own memory is not
/// counted); `buffers` gives the epflow buffer bytes of what `make` returned.
pub(crate) fn measure<T>(
    devices: &[usize],
    make: impl FnOnce() -> Result<T, BenchError>,
    buffers: impl FnOnce(&T) -> u64,
) -> Result<(T, SetupCost), BenchError> {
    let run = |what: &str, e: epflow_core::Error| BenchError::Run(format!("{what}: {e}"));
    let memory = FreeMemory::of(devices).map_err(|e| run("open the GPUs to measure the set-up", e))?;
    let before = memory.bytes().map_err(|e| run("free memory before the set-up", e))?;
    let start = Instant::now();
    let made = make()?;
    let seconds = start.elapsed().as_secs_f64();
    let after = memory.bytes().map_err(|e| run("free memory after the set-up", e))?;
    let cost = SetupCost {
        seconds,
        device_memory_bytes: before.saturating_sub(after),
        buffer_bytes: buffers(&made),
        gpus: memory.gpus(),
        ranks: devices.len(),
    };
    Ok((made, cost))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rest_is_what_the_buffers_do_not_explain() {
        let c = SetupCost {
            seconds: 1.5,
            device_memory_bytes: 3_000_000_000,
            buffer_bytes: 2_000_000_000,
            gpus: 1,
            ranks: 8,
        };
        assert_eq!(c.other_bytes(), 1_000_000_000);
        let line = c.describe();
        assert!(
            line.contains("8 ranks'") && line.contains("1.500 s") && line.contains("3.000 GB over 1 GPU ("),
            "{line}"
        );
        assert!(line.contains("1.000 GB the rest"), "{line}");
        // Another tenant freed memory meanwhile: no negative rest.
        let c = SetupCost { device_memory_bytes: 1, ..c };
        assert_eq!(c.other_bytes(), 0);
        assert!(SetupCost { ranks: 1, gpus: 2, ..c }.describe().contains("one rank's"));
    }

    #[test]
    fn a_set_up_on_no_device_measures_time_and_buffers_only() {
        let (made, cost) = measure(&[], || Ok(5u32), |&m| u64::from(m) * 2).unwrap();
        assert_eq!(made, 5);
        assert_eq!((cost.device_memory_bytes, cost.buffer_bytes, cost.gpus, cost.ranks), (0, 10, 0, 0));
        assert!(cost.seconds >= 0.0);
        // A failed set-up is the caller's error, unchanged.
        let failed = measure(&[], || Err::<u32, _>(BenchError::Usage("no".into())), |_| 0);
        assert!(matches!(failed, Err(BenchError::Usage(m)) if m == "no"));
    }
}
