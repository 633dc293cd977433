//! How work reaches the reactor thread: producers push into a locked inbox and unpark the
//! reactor; the reactor drains the inbox and parks only when it has nothing to poll. Thread
//! park/unpark keeps a token, so an unpark that lands before the park makes the park return at
//! once: no wake-up is lost between the reactor's last drain and its park.

use std::time::Duration;

use crate::sync::{Mutex, Thread, park, park_timeout};

/// A multi-producer inbox owned by one consumer thread.
#[derive(Debug)]
pub(crate) struct Inbox<T> {
    items: Mutex<Vec<T>>,
}

impl<T> Inbox<T> {
    pub(crate) fn new() -> Self {
        Inbox { items: Mutex::new(Vec::new()) }
    }

    /// Producer side: queues `item` and wakes the consumer.
    pub(crate) fn push(&self, item: T, consumer: &Thread) {
        self.items.lock().unwrap_or_else(|e| e.into_inner()).push(item);
        consumer.unpark();
    }

    /// Consumer side: moves everything queued into `into`; returns how many.
    pub(crate) fn drain_into(&self, into: &mut Vec<T>) -> usize {
        let mut items = self.items.lock().unwrap_or_else(|e| e.into_inner());
        let n = items.len();
        into.append(&mut items);
        n
    }

    /// Consumer side: sleeps until a push (or, with a timeout, until it passes).
    pub(crate) fn wait(&self, timeout: Option<Duration>) {
        match timeout {
            Some(t) => park_timeout(t),
            None => park(),
        }
    }
}
