//! The shared memory of a host world: per (receiver, channel, buffer set, source) a cell with its
//! arrival signal, credit and message header; per (rank, channel, buffer set) the staging buffer
//! whose rows receivers read directly (the host model of a GPU's peer-readable send buffer).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::bf16;

use super::messages::Message;
use crate::config::GroupConfig;
use crate::protocol::Channel;

/// One (receiver, channel, set, source) cell of the protocol in [`crate::protocol`].
#[derive(Debug, Default)]
pub(crate) struct Cell {
    /// `seq + 1` of the operation whose message is in the cell.
    arrived: AtomicU64,
    /// `seq + 1` of the last operation the receiver consumed from the cell (the sender's credit).
    consumed: AtomicU64,
    msg: Mutex<Option<Message>>,
}

impl Cell {
    fn lock(&self) -> MutexGuard<'_, Option<Message>> {
        self.msg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether operation `seq` may be written: `seq - sets` has been consumed.
    pub(crate) fn has_credit(&self, seq: u64, sets: usize) -> bool {
        let sets = sets as u64;
        seq < sets || self.consumed.load(Ordering::Acquire) > seq - sets
    }

    /// Writes operation `seq`'s message, then signals its arrival.
    pub(crate) fn deliver(&self, seq: u64, msg: Message) {
        *self.lock() = Some(msg);
        self.arrived.store(seq + 1, Ordering::Release);
    }

    /// Whether operation `seq`'s message has arrived.
    pub(crate) fn has_arrived(&self, seq: u64) -> bool {
        self.arrived.load(Ordering::Acquire) == seq + 1
    }

    /// Takes operation `seq`'s message (its payload stays in the sender's staging buffer until
    /// [`Cell::release`]).
    pub(crate) fn take(&self) -> Option<Message> {
        self.lock().take()
    }

    /// Empties the cell for the group's next epoch (`unmask_all`, an admission; with the cell
    /// quiet): drops its message, forgets its arrival (no operation number matches 0), and sets
    /// the credit as if every operation before `next` had been consumed. A stale arrival left
    /// behind would let the receiver of operation `next` take the cell before its new sender
    /// wrote it (a dead rank's last message, dropped here, still marked as arrived).
    pub(crate) fn reset(&self, next: u64) {
        drop(self.take());
        self.arrived.store(0, Ordering::Release);
        self.consumed.store(next, Ordering::Release);
    }

    /// Returns the credit: the sender may reuse this cell and its staging buffer.
    pub(crate) fn release(&self, seq: u64) {
        self.consumed.store(seq + 1, Ordering::Release);
    }
}

/// A rank's staged payload for one operation: the rows and values receivers gather from.
#[derive(Debug, Default)]
pub(crate) struct Staging {
    pub(crate) bf16: Vec<bf16>,
    pub(crate) fp8: Vec<u8>,
    pub(crate) scales: Vec<f32>,
    pub(crate) weights: Vec<f32>,
}

impl Staging {
    pub(crate) fn clear(&mut self) {
        self.bf16.clear();
        self.fp8.clear();
        self.scales.clear();
        self.weights.clear();
    }
}

/// All cells and staging buffers of a world.
#[derive(Debug)]
pub(crate) struct Mailboxes {
    num_ranks: usize,
    sets: usize,
    cells: Vec<Cell>,
    staging: Vec<RwLock<Staging>>,
}

impl Mailboxes {
    pub(crate) fn new(config: &GroupConfig, num_ranks: usize) -> Self {
        let sets = config.buffer_sets;
        let per_rank = Channel::ALL.len() * sets;
        Mailboxes {
            num_ranks,
            sets,
            cells: (0..num_ranks * per_rank * num_ranks).map(|_| Cell::default()).collect(),
            staging: (0..num_ranks * per_rank).map(|_| RwLock::default()).collect(),
        }
    }

    fn set(&self, seq: u64) -> usize {
        (seq % self.sets as u64) as usize
    }

    /// The cell on `receiver` where `source` writes operation `seq` of `channel`.
    pub(crate) fn cell(&self, receiver: usize, channel: Channel, seq: u64, source: usize) -> &Cell {
        let r = self.num_ranks;
        &self.cells[((receiver * Channel::ALL.len() + channel.index()) * self.sets + self.set(seq)) * r + source]
    }

    fn staging_lock(&self, rank: usize, channel: Channel, seq: u64) -> &RwLock<Staging> {
        &self.staging[(rank * Channel::ALL.len() + channel.index()) * self.sets + self.set(seq)]
    }

    /// `rank`'s staging buffer of operation `seq`, to fill (only after every credit is in).
    pub(crate) fn staging_mut(&self, rank: usize, channel: Channel, seq: u64) -> RwLockWriteGuard<'_, Staging> {
        self.staging_lock(rank, channel, seq).write().unwrap_or_else(|e| e.into_inner())
    }

    /// `rank`'s staging buffer of operation `seq`, to read.
    pub(crate) fn staging(&self, rank: usize, channel: Channel, seq: u64) -> RwLockReadGuard<'_, Staging> {
        self.staging_lock(rank, channel, seq).read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn sets(&self) -> usize {
        self.sets
    }
}
