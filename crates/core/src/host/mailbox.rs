//! The shared cells ranks write into: one per (receiver, channel, buffer set, source).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

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

    /// Takes operation `seq`'s message and returns the credit to the sender.
    pub(crate) fn consume(&self, seq: u64) -> Option<Message> {
        let msg = self.lock().take();
        self.consumed.store(seq + 1, Ordering::Release);
        msg
    }
}

/// All cells of a world.
#[derive(Debug)]
pub(crate) struct Mailboxes {
    num_ranks: usize,
    sets: usize,
    cells: Vec<Cell>,
}

impl Mailboxes {
    pub(crate) fn new(config: &GroupConfig, num_ranks: usize) -> Self {
        let sets = config.buffer_sets;
        let n = num_ranks * Channel::ALL.len() * sets * num_ranks;
        Mailboxes { num_ranks, sets, cells: (0..n).map(|_| Cell::default()).collect() }
    }

    /// The cell on `receiver` where `source` writes operation `seq` of `channel`.
    pub(crate) fn cell(&self, receiver: usize, channel: Channel, seq: u64, source: usize) -> &Cell {
        let set = (seq % self.sets as u64) as usize;
        let r = self.num_ranks;
        &self.cells[((receiver * Channel::ALL.len() + channel.index()) * self.sets + set) * r + source]
    }

    pub(crate) fn sets(&self) -> usize {
        self.sets
    }
}
