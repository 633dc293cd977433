//! A loom model of the reactor's register / complete / wake protocol and of its inbox
//! (push + unpark vs drain + park), with a bounded preemption count. The real source files
//! `src/wait.rs` and `src/inbox.rs` are compiled here against loom's primitives.

#![allow(dead_code)]

mod sync {
    pub(crate) use loom::future::AtomicWaker;
    pub(crate) use loom::sync::Mutex;
    pub(crate) use loom::sync::atomic::{AtomicU8, Ordering};
    pub(crate) use loom::thread::{Thread, park};

    /// A timed park may return without an unpark: model it as a yield.
    pub(crate) fn park_timeout(_: std::time::Duration) {
        loom::thread::yield_now();
    }
}

#[path = "../src/inbox.rs"]
mod inbox;
#[path = "../src/wait.rs"]
mod wait;

use std::task::{Context, Poll};

use futures::task::{ArcWake, waker};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, Ordering};

struct Flag(AtomicBool);

impl ArcWake for Flag {
    fn wake_by_ref(arc_self: &std::sync::Arc<Self>) {
        arc_self.0.store(true, Ordering::SeqCst);
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// If the future sees Pending, the reactor's completion must wake it afterwards.
#[test]
fn completion_is_never_missed() {
    model(|| {
        let state = Arc::new(wait::WaitState::new());
        let flag = std::sync::Arc::new(Flag(AtomicBool::new(false)));
        let w = waker(flag.clone());
        let reactor = {
            let state = state.clone();
            loom::thread::spawn(move || state.complete(wait::READY))
        };
        let seen = state.poll(&mut Context::from_waker(&w));
        assert!(reactor.join().unwrap(), "the first completion wins");
        match seen {
            Poll::Ready(s) => assert_eq!(s, wait::READY),
            Poll::Pending => assert!(flag.0.load(Ordering::SeqCst), "pending future was never woken"),
        }
    });
}

/// A wait re-registered from another task (a new waker) is woken on that waker.
#[test]
fn latest_waker_is_woken() {
    model(|| {
        let state = Arc::new(wait::WaitState::new());
        let (f1, f2) =
            (std::sync::Arc::new(Flag(AtomicBool::new(false))), std::sync::Arc::new(Flag(AtomicBool::new(false))));
        let (w1, w2) = (waker(f1.clone()), waker(f2.clone()));
        let reactor = {
            let state = state.clone();
            loom::thread::spawn(move || state.complete(wait::TIMED_OUT))
        };
        let first = state.poll(&mut Context::from_waker(&w1));
        let second = state.poll(&mut Context::from_waker(&w2));
        reactor.join().unwrap();
        if second.is_pending() {
            assert!(f2.0.load(Ordering::SeqCst), "the last registered waker must be woken");
        }
        if let Poll::Ready(s) = first {
            assert_eq!(s, wait::TIMED_OUT);
            assert_eq!(second, Poll::Ready(wait::TIMED_OUT));
        }
    });
}

/// Cancellation and completion race: exactly one of them wins.
#[test]
fn cancel_and_complete_exclusive() {
    model(|| {
        let state = Arc::new(wait::WaitState::new());
        let reactor = {
            let state = state.clone();
            loom::thread::spawn(move || state.complete(wait::READY))
        };
        let cancelled = state.cancel();
        let completed = reactor.join().unwrap();
        assert!(cancelled ^ completed, "cancelled={cancelled} completed={completed}");
        assert_eq!(state.is_cancelled(), cancelled);
    });
}

/// The reactor drains, finds nothing, parks: a push racing with that park is never lost.
#[test]
fn inbox_push_wakes_a_parking_consumer() {
    model(|| {
        let inbox = Arc::new(inbox::Inbox::<u32>::new());
        let consumer = {
            let inbox = inbox.clone();
            loom::thread::spawn(move || {
                let mut got = Vec::new();
                loop {
                    if inbox.drain_into(&mut got) > 0 {
                        return got;
                    }
                    inbox.wait(None);
                }
            })
        };
        inbox.push(7, consumer.thread());
        assert_eq!(consumer.join().unwrap(), vec![7]);
    });
}
