//! `EPFLOW_HOST_STEPS=1`, a diagnostic: the host time of the steps an operation's send takes
//! before and after its launch (binding, input waits, fences, the row map, the launch, the event
//! records; a high-throughput operation's launch as one step), and of a handle's creation
//! (`handle: ...`: low-latency built on the device, the checks, the memory, the kernel's launch
//! and the wait for it; built on the host, the wait for `topk_idx`, the copies, validation,
//! slots; high-throughput built on the device, the checks, memory and parameters before its
//! send), summed per step over the process and printed by [`report`] (`epflow bench` at its end,
//! `libnccl_ep.so` when a group is destroyed). Events timed around a launch on an idle stream
//! count this host time, so it is part of every host-observed figure.
//!
//! Off (the default) a step costs one relaxed load.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);
/// Per step: (total nanoseconds, count), by name.
static TOTALS: Mutex<BTreeMap<&'static str, (u128, u64)>> = Mutex::new(BTreeMap::new());

fn on() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = epflow_core::tuning::Environment::get().diagnostics.host_steps;
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        s => s == 2,
    }
}

/// A stopwatch over consecutive steps of one call; inert when the diagnostic is off.
#[derive(Debug)]
pub struct Steps {
    last: Option<Instant>,
}

impl Steps {
    /// Starts timing now (if `EPFLOW_HOST_STEPS=1`).
    pub fn start() -> Self {
        Steps { last: on().then(Instant::now) }
    }

    /// A stopwatch that records nothing, whatever `EPFLOW_HOST_STEPS` says (for a caller whose
    /// steps are not the ones the diagnostic names).
    pub fn inert() -> Self {
        Steps { last: None }
    }

    /// Charges the time since the previous step (or the start) to `step`.
    pub fn step(&mut self, step: &'static str) {
        let Some(last) = self.last else { return };
        let now = Instant::now();
        let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
        let t = totals.entry(step).or_default();
        t.0 += (now - last).as_nanos();
        t.1 += 1;
        drop(totals);
        // The bookkeeping above is charged to no step.
        self.last = Some(Instant::now());
    }
}

/// Turns the diagnostic on for the rest of the process, whatever `EPFLOW_HOST_STEPS` says (for
/// `epflow diag ops`, which reads the steps itself).
pub fn enable() {
    STATE.store(2, Ordering::Relaxed);
}

/// The steps timed so far, as (step, mean host microseconds, count), and forgets them: the next
/// call sees only what was timed in between. Empty when the diagnostic is off.
pub fn take() -> Vec<(&'static str, f64, u64)> {
    if !on() {
        return Vec::new();
    }
    let totals = std::mem::take(&mut *TOTALS.lock().unwrap_or_else(|e| e.into_inner()));
    means(&totals)
}

/// Per step of `totals`: (step, mean host microseconds, count).
fn means(totals: &BTreeMap<&'static str, (u128, u64)>) -> Vec<(&'static str, f64, u64)> {
    totals.iter().map(|(&step, &(ns, n))| (step, ns as f64 / 1e3 / n.max(1) as f64, n)).collect()
}

/// One line per step timed so far: its mean host time in microseconds and its count (empty when
/// the diagnostic is off or nothing was timed).
pub fn report() -> Vec<String> {
    if !on() {
        return Vec::new();
    }
    let totals = means(&TOTALS.lock().unwrap_or_else(|e| e.into_inner()));
    totals.into_iter().map(|(step, us, n)| format!("EPFLOW_HOST_STEPS {step}: {us:.2} us mean over {n}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_records_nothing() {
        // The test environment does not set EPFLOW_HOST_STEPS.
        if epflow_core::tuning::Environment::get().diagnostics.host_steps {
            return;
        }
        let mut s = Steps::start();
        s.step("never");
        assert!(report().is_empty());
        assert!(TOTALS.lock().unwrap().get("never").is_none());
    }
}
