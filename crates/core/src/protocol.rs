//! The buffer-set protocol every backend follows, and the slots that enforce it locally.
//!
//! ## Channels and sequence numbers
//!
//! A group has three independent message channels: [`Channel::Dispatch`],
//! [`Channel::Combine`] and [`Channel::Handle`] (the count exchange of high-throughput handle
//! creation). Each rank numbers the operations it starts on a channel `0, 1, 2, ...` in call
//! order; since every rank calls collectives in the same order, operation `j` means the same
//! collective everywhere.
//!
//! ## Buffer sets, signals and credits
//!
//! Operation `j` uses buffer set `j % S` (`S` = [`crate::GroupConfig::buffer_sets`]). On each
//! receiver there is one cell per (set, source rank):
//!
//! 1. **Credit** — before writing operation `j` into a receiver's cell, the sender waits until
//!    the receiver has consumed operation `j - S` from that cell (each receiver publishes, per
//!    cell, the sequence number + 1 of the last operation it consumed). So a slow receiver is
//!    never overwritten; the sender waits, with the group's timeout.
//! 2. **Payload, then signal** — the sender writes its payload, then stores `j + 1` into the
//!    cell's arrival signal with release ordering.
//! 3. **Complete** — the receiver waits (acquire) until every source's signal reads `j + 1`,
//!    consumes the payloads, and then publishes its consumption (the credit of step 1).
//!
//! Signals carry sequence numbers, so nothing needs clearing between operations, and a signal
//! from the wrong operation can never be mistaken for the right one.
//!
//! ## Slots
//!
//! Locally, the outputs of operation `j` live in the memory of set `j % S` until they are dropped;
//! operation `j + S` must wait for them: that is a [`SlotGuard`] from the channel's [`SlotPool`].
//!
//! ## Fences: buffer sets released in stream order
//!
//! Outputs consumed by device work still queued when they are dropped leave *fences* with their
//! slot ([`SlotGuard::fence`], e.g. CUDA events recorded on the consumers' streams): the slot is
//! free for the host at once, and the next operation on the set takes the fences
//! ([`SlotGuard::take_fences`]) and makes its own writes wait for them on the device.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The message channels of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// Dispatch operations.
    Dispatch,
    /// Combine operations.
    Combine,
    /// High-throughput handle creation (count exchange).
    Handle,
}

impl Channel {
    /// All channels, in index order.
    pub const ALL: [Channel; 3] = [Channel::Dispatch, Channel::Combine, Channel::Handle];

    /// `"dispatch"`, `"combine"` or `"handle"`.
    pub const fn name(self) -> &'static str {
        match self {
            Channel::Dispatch => "dispatch",
            Channel::Combine => "combine",
            Channel::Handle => "handle",
        }
    }

    /// 0, 1 or 2.
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A fence a dropped output leaves with its buffer set (backend-defined: CUDA events on GPUs).
pub type Fence = Arc<dyn Any + Send + Sync>;

/// The buffer sets of one channel on one rank: set `j % S` is held from the send of operation
/// `j` until its outputs are dropped.
pub struct SlotPool {
    channel: Channel,
    in_use: Vec<AtomicBool>,
    fences: Vec<Mutex<Vec<Fence>>>,
}

impl fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotPool").field("channel", &self.channel).field("sets", &self.in_use.len()).finish()
    }
}

impl SlotPool {
    /// A pool of `sets` free slots.
    pub fn new(channel: Channel, sets: usize) -> Arc<Self> {
        Arc::new(SlotPool {
            channel,
            in_use: (0..sets).map(|_| AtomicBool::new(false)).collect(),
            fences: (0..sets).map(|_| Mutex::default()).collect(),
        })
    }

    /// Number of sets.
    pub fn sets(&self) -> usize {
        self.in_use.len()
    }

    /// The channel.
    pub fn channel(&self) -> Channel {
        self.channel
    }

    /// The set operation `seq` uses.
    pub fn set_of(&self, seq: u64) -> usize {
        (seq % self.in_use.len() as u64) as usize
    }

    /// Whether operation `seq`'s set is free now.
    pub fn is_free(&self, seq: u64) -> bool {
        !self.in_use[self.set_of(seq)].load(Ordering::Acquire)
    }

    /// A probe that turns true when operation `seq`'s set is free.
    pub fn free_probe(self: &Arc<Self>, seq: u64) -> impl Fn() -> bool + Send + Sync + 'static {
        let pool = Arc::clone(self);
        move || pool.is_free(seq)
    }

    /// Takes operation `seq`'s set if it is free.
    pub fn try_acquire(self: &Arc<Self>, seq: u64) -> Option<SlotGuard> {
        let set = self.set_of(seq);
        self.in_use[set].compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).ok().map(|_| SlotGuard {
            pool: Arc::clone(self),
            set,
            fences: Vec::new(),
        })
    }
}

/// A held buffer set; dropping it frees the set (leaving its fences for the next holder).
#[derive(Debug)]
pub struct SlotGuard {
    pool: Arc<SlotPool>,
    set: usize,
    fences: Vec<Fence>,
}

impl SlotGuard {
    /// The set index.
    pub fn set(&self) -> usize {
        self.set
    }

    /// Leaves `fence` for the next holder of the set: work still queued on the device reads the
    /// set's memory until it passes.
    pub fn fence(&mut self, fence: Fence) {
        self.fences.push(fence);
    }

    /// The fences the previous holders of the set left (the new holder's writes wait for them).
    pub fn take_fences(&mut self) -> Vec<Fence> {
        std::mem::take(&mut *self.pool.fences[self.set].lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if !self.fences.is_empty() {
            let mut f = self.pool.fences[self.set].lock().unwrap_or_else(|e| e.into_inner());
            f.append(&mut self.fences);
        }
        self.pool.in_use[self.set].store(false, Ordering::Release);
    }
}

/// A group's poison flag: after the first failure that leaves the collective protocol unknown
/// (a timeout, a device error), every operation fails fast with the first reason.
#[derive(Debug, Default)]
pub struct Poison {
    poisoned: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Poison {
    /// Poisons with `reason` (the first reason is kept).
    pub fn poison(&self, reason: impl Into<String>) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason.into());
        }
        self.poisoned.store(true, Ordering::Release);
    }

    /// Whether poisoned.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// `Err(Error::Poisoned)` with the first reason, if poisoned.
    pub fn check(&self) -> Result<()> {
        if !self.is_poisoned() {
            return Ok(());
        }
        let r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        Err(Error::Poisoned { reason: r.clone().unwrap_or_default() })
    }

    /// Passes `result` through, poisoning the group first if its error [`Error::poisons`].
    pub fn track<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            if e.poisons() {
                self.poison(e.to_string());
            }
        }
        result
    }
}

/// Spin, then yield, then sleep with growing pauses (capped at 200 us): waits that end within
/// microseconds stay fast, long waits cost little CPU. Yielding lasts until [`Backoff::YIELD_FOR`]
/// has passed since the first yield, so a wait as long as a high-throughput operation (hundreds
/// of microseconds) never sleeps: a sleeping thread woke tens of microseconds late on the test
/// machines (benches/NOTES.md item 160: blocking high-throughput operations 25-30 us faster).
#[derive(Debug, Default)]
pub struct Backoff {
    step: u32,
    since: Option<Instant>,
}

impl Backoff {
    /// How long a wait yields before it starts to sleep.
    pub const YIELD_FOR: Duration = Duration::from_millis(2);

    /// Waits a little; each call waits at least as long as the one before.
    pub fn snooze(&mut self) {
        if self.step < 64 {
            std::hint::spin_loop();
            self.step += 1;
            return;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if self.step < 128 || since.elapsed() < Self::YIELD_FOR {
            std::thread::yield_now();
            self.step = (self.step + 1).min(128);
            return;
        }
        let us = 1u64 << ((self.step - 128) / 16).min(7);
        std::thread::sleep(Duration::from_micros(us.min(200)));
        self.step = self.step.saturating_add(1);
    }
}

/// `start + timeout`, or the farthest instant this platform can represent after `start` (so a huge
/// timeout means "practically never", not an overflow panic).
pub fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(CENTURY))
        .or_else(|| start.checked_add(Duration::from_secs(24 * 3600)))
        .unwrap_or(start)
}

/// Polls `ready` until it returns `Ok(true)`, an error, or `deadline` passes (then `Ok(false)`).
pub fn wait_until(deadline: Instant, mut ready: impl FnMut() -> Result<bool>) -> Result<bool> {
    let mut backoff = Backoff::default();
    loop {
        if ready()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        backoff.snooze();
    }
}

/// A label like `"dispatch #3"` for errors and traces.
pub fn op_label(channel: Channel, seq: u64) -> String {
    format!("{} #{seq}", channel.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_spins_then_yields_until_its_yield_time_then_sleeps() {
        let mut b = Backoff::default();
        for _ in 0..64 {
            b.snooze();
        }
        assert_eq!((b.step, b.since), (64, None), "64 spins, no clock read");
        // Then yields: the step stops at 128 while the yield time lasts (here: an hour).
        b.since = Some(Instant::now() + Duration::from_secs(3600));
        for _ in 0..200 {
            b.snooze();
        }
        assert_eq!(b.step, 128);
        // Past the yield time it sleeps, and the pauses grow.
        b.since = Instant::now().checked_sub(Backoff::YIELD_FOR);
        b.snooze();
        assert_eq!(b.step, 129);
    }

    #[test]
    fn slots_alternate_and_free_on_drop() {
        let pool = SlotPool::new(Channel::Dispatch, 2);
        let a = pool.try_acquire(0).unwrap();
        let b = pool.try_acquire(1).unwrap();
        assert!(pool.try_acquire(2).is_none(), "set 0 is held by op 0");
        drop(a);
        let c = pool.try_acquire(2).unwrap();
        assert_eq!(c.set(), 0);
        assert_eq!(b.set(), 1);
    }

    #[test]
    fn deadlines_saturate() {
        let now = Instant::now();
        assert_eq!(deadline_after(now, Duration::from_secs(1)), now + Duration::from_secs(1));
        assert!(deadline_after(now, Duration::MAX) > now + Duration::from_secs(3600));
    }

    #[test]
    fn fences_pass_to_the_next_holder_of_the_set() {
        let pool = SlotPool::new(Channel::Combine, 2);
        let mut a = pool.try_acquire(0).unwrap();
        a.fence(Arc::new(7u32));
        drop(a);
        let mut c = pool.try_acquire(2).unwrap();
        let fences = c.take_fences();
        assert_eq!(fences.len(), 1);
        assert_eq!(fences[0].downcast_ref::<u32>(), Some(&7));
        assert!(c.take_fences().is_empty());
        assert!(pool.try_acquire(1).unwrap().take_fences().is_empty(), "set 1 had none");
    }

    #[test]
    fn poison_keeps_first_reason() {
        let p = Poison::default();
        assert!(p.check().is_ok());
        p.poison("first");
        p.poison("second");
        assert_eq!(p.check(), Err(Error::Poisoned { reason: "first".into() }));
    }
}
