//! `EPFLOW_ABI_PROFILE=1`: the host time of every low-latency `ncclEpDispatch` and
//! `ncclEpCombine`, split into phases, printed per group when it is destroyed. The time before
//! the kernel launch is what a program that waits for each call sees added to the device time
//! (the stream is idle until the launch); the phases say where it goes. The first
//! [`WARMUP_CALLS`] calls of each channel are not counted (their first launches load the kernel
//! modules, milliseconds that would swamp the means), and the `EPFLOW_HOST_STEPS` sums of the
//! process are restarted when the dispatch channel's warm-up ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The phases of one call, in order.
pub(crate) const PHASES: [&str; 4] = [
    "checks (arguments, capture, earlier verdicts)",
    "start (validation, kernel parameters)",
    "send (slot, launch)",
    "complete (outputs, verdict bookkeeping)",
];

/// Calls per channel that the profile leaves out before it starts counting (ep_bench warms up
/// with 10 pairs).
pub(crate) const WARMUP_CALLS: u64 = 16;

/// Sums per (channel, phase) over a group's calls; off unless `EPFLOW_ABI_PROFILE=1`.
#[derive(Debug)]
pub(crate) struct Profile {
    on: bool,
    nanos: [[AtomicU64; PHASES.len()]; 2],
    calls: [AtomicU64; 2],
    /// Calls begun per channel, warm-up included.
    begun: [AtomicU64; 2],
}

impl Profile {
    /// Reads `EPFLOW_ABI_PROFILE`.
    pub(crate) fn from_env() -> Self {
        Profile {
            on: std::env::var("EPFLOW_ABI_PROFILE").is_ok_and(|v| v == "1"),
            nanos: Default::default(),
            calls: Default::default(),
            begun: Default::default(),
        }
    }

    /// A timer of one call on `channel` (0 dispatch, 1 combine), started now; inert for the
    /// channel's first [`WARMUP_CALLS`] calls.
    pub(crate) fn timer(&self, channel: usize) -> Timer<'_> {
        if !self.on {
            return self.untimed();
        }
        let n = self.begun[channel].fetch_add(1, Ordering::Relaxed);
        if n < WARMUP_CALLS {
            return self.untimed();
        }
        if n == WARMUP_CALLS && channel == 0 {
            // The host steps timed so far belong to the warm-up.
            drop(epflow_kernels::device::host_steps::take());
        }
        Timer { profile: self, channel, phase: 0, last: Some(Instant::now()) }
    }

    /// A timer that records nothing (calls outside the profile).
    pub(crate) fn untimed(&self) -> Timer<'_> {
        Timer { profile: self, channel: 0, phase: 0, last: None }
    }

    /// The averages, one line per channel and phase (none when off or nothing was timed).
    pub(crate) fn report(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for (c, name) in ["ncclEpDispatch", "ncclEpCombine"].iter().enumerate() {
            let n = self.calls[c].load(Ordering::Relaxed);
            if !self.on || n == 0 {
                continue;
            }
            let us: Vec<f64> =
                self.nanos[c].iter().map(|t| t.load(Ordering::Relaxed) as f64 / n as f64 / 1e3).collect();
            let parts: Vec<String> = PHASES.iter().zip(&us).map(|(p, u)| format!("{p} {u:.2}")).collect();
            lines.push(format!(
                "{name}: {n} low-latency calls after {WARMUP_CALLS} of warm-up, host us per call: {} = {:.2} total",
                parts.join(", "),
                us.iter().sum::<f64>()
            ));
        }
        lines
    }
}

/// Times one call's phases: [`Timer::next`] closes the current phase.
pub(crate) struct Timer<'a> {
    profile: &'a Profile,
    channel: usize,
    phase: usize,
    last: Option<Instant>,
}

impl Timer<'_> {
    /// Ends the current phase (the last one also counts the call).
    pub(crate) fn next(&mut self) {
        let Some(last) = self.last else { return };
        let now = Instant::now();
        if let Some(sum) = self.profile.nanos[self.channel].get(self.phase) {
            sum.fetch_add((now - last).as_nanos() as u64, Ordering::Relaxed);
        }
        self.phase += 1;
        self.last = Some(now);
        if self.phase == PHASES.len() {
            self.profile.calls[self.channel].fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_only_complete_calls_and_only_when_on() {
        let mut p = Profile::from_env();
        p.on = true;
        for _ in 0..=WARMUP_CALLS {
            let mut t = p.timer(1);
            for _ in 0..PHASES.len() {
                t.next();
            }
        }
        for _ in 0..=WARMUP_CALLS {
            p.timer(0).next();
        }
        let lines = p.report();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("ncclEpCombine: 1 low-latency calls after 16 of warm-up"), "{lines:?}");
        p.on = false;
        assert!(p.report().is_empty());
    }
}
