//! `EPFLOW_ABI_PROFILE=1`: the host time of every low-latency `ncclEpDispatch` and
//! `ncclEpCombine`, split into phases, printed per group when it is destroyed. The time before
//! the kernel launch is what a program that waits for each call sees added to the device time
//! (the stream is idle until the launch); the phases say where it goes. The first
//! [`WARMUP_CALLS`] calls of each channel are not counted (their first launches load the kernel
//! modules, milliseconds that would swamp the means), and the `EPFLOW_HOST_STEPS` sums of the
//! process are restarted when the dispatch channel's warm-up ends.
//!
//! With `EPFLOW_ABI_STAMPS=<folder>` as well, every timed call's entry and launch are kept by
//! the wall clock (`CLOCK_REALTIME`, which every process of a host shares) and written to
//! `<folder>/abi-stamps-rank<r>.tsv` when the group is destroyed: one line per call, `channel
//! call entry_ns launched_ns`. Calls are collective, so line `i` of every rank's file is the same
//! operation: the files say how far apart the ranks entered and launched it, which a program
//! that times kernels (as `ep_bench`'s CUPTI column does) sees as the earlier rank's wait.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The phases of one call, in order.
pub(crate) const PHASES: [&str; 4] = [
    "checks (arguments, capture, earlier verdicts)",
    "start (validation, kernel parameters)",
    "send (slot, launch)",
    "complete (outputs, verdict bookkeeping)",
];

/// The index in [`PHASES`] of the phase that ends with the launch.
const SEND_PHASE: usize = 2;

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
    /// `EPFLOW_ABI_STAMPS`: the folder the per-call stamps go to, and the stamps.
    stamps: Option<(PathBuf, Mutex<Vec<Stamp>>)>,
}

/// One timed call by the wall clock: channel, its call number on the channel (warm-up included),
/// and the nanoseconds since the epoch at its entry and right after its launch.
#[derive(Debug, Clone, Copy)]
struct Stamp {
    channel: usize,
    call: u64,
    entry_ns: u64,
    launched_ns: u64,
}

/// Nanoseconds since the Unix epoch by the wall clock.
fn wall_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

impl Profile {
    /// Reads `EPFLOW_ABI_PROFILE`.
    pub(crate) fn from_env() -> Self {
        let d = &epflow_core::tuning::Environment::get().diagnostics;
        let on = d.abi_profile;
        let stamps = d.abi_stamps.clone().filter(|_| on).map(|d| (d, Mutex::new(Vec::new())));
        Profile { on, nanos: Default::default(), calls: Default::default(), begun: Default::default(), stamps }
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
        let entry_ns = if self.stamps.is_some() { wall_ns() } else { 0 };
        Timer { profile: self, channel, phase: 0, last: Some(Instant::now()), call: n, entry_ns }
    }

    /// A timer that records nothing (calls outside the profile).
    pub(crate) fn untimed(&self) -> Timer<'_> {
        Timer { profile: self, channel: 0, phase: 0, last: None, call: 0, entry_ns: 0 }
    }

    /// Keeps one call's wall-clock stamps (with `EPFLOW_ABI_STAMPS`).
    fn stamp(&self, s: Stamp) {
        if let Some((_, v)) = &self.stamps {
            v.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
    }

    /// Writes the kept stamps of rank `rank` (with `EPFLOW_ABI_STAMPS`): the file written, or
    /// the error, as a line for the report; None when stamps are off.
    pub(crate) fn write_stamps(&self, rank: usize) -> Option<String> {
        let (dir, v) = self.stamps.as_ref()?;
        let stamps = v.lock().unwrap_or_else(|e| e.into_inner());
        let path = dir.join(format!("abi-stamps-rank{rank}.tsv"));
        let mut text = String::from("channel\tcall\tentry_ns\tlaunched_ns\n");
        for s in stamps.iter() {
            text.push_str(&format!("{}\t{}\t{}\t{}\n", s.channel, s.call, s.entry_ns, s.launched_ns));
        }
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::File::create(&path))
            .and_then(|mut f| f.write_all(text.as_bytes()));
        Some(match written {
            Ok(()) => format!("{} calls' wall-clock stamps written to {}", stamps.len(), path.display()),
            Err(e) => format!("could not write the stamps to {}: {e}", path.display()),
        })
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
    /// The call's number on its channel (warm-up included) and its entry by the wall clock
    /// (0 unless stamps are kept).
    call: u64,
    entry_ns: u64,
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
        if self.phase == SEND_PHASE + 1 && self.entry_ns != 0 {
            let s = Stamp { channel: self.channel, call: self.call, entry_ns: self.entry_ns, launched_ns: wall_ns() };
            self.profile.stamp(s);
        }
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

    #[test]
    fn stamps_one_line_per_launched_call_in_order() {
        let dir = std::env::temp_dir().join(format!("epflow-abi-stamps-{}", std::process::id()));
        let mut p = Profile::from_env();
        p.on = true;
        p.stamps = Some((dir.clone(), Mutex::new(Vec::new())));
        for channel in [0, 1] {
            for _ in 0..=WARMUP_CALLS + 1 {
                let mut t = p.timer(channel);
                for _ in 0..PHASES.len() {
                    t.next();
                }
            }
        }
        // A call that never reached its launch leaves no stamp.
        p.timer(0).next();
        let line = p.write_stamps(3).expect("stamps are on");
        assert!(line.starts_with("4 calls' wall-clock stamps written to"), "{line}");
        let text = std::fs::read_to_string(dir.join("abi-stamps-rank3.tsv")).unwrap();
        let rows: Vec<Vec<u64>> =
            text.lines().skip(1).map(|l| l.split('\t').map(|f| f.parse().unwrap()).collect()).collect();
        let calls: Vec<(u64, u64)> = rows.iter().map(|r| (r[0], r[1])).collect();
        assert_eq!(calls, [(0, 16), (0, 17), (1, 16), (1, 17)]);
        assert!(rows.iter().all(|r| r[2] > 0 && r[3] >= r[2]), "{rows:?}");
        std::fs::remove_dir_all(&dir).unwrap();
        p.stamps = None;
        assert!(p.write_stamps(0).is_none());
    }
}
