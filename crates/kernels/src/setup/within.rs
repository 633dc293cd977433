//! A blocking set-up that can wait forever for a peer (NCCL's communicator set-up and first
//! connection), run on a thread of its own and given up at a deadline ([`within`]), with
//! whatever it made cleaned up on either side of that deadline.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use epflow_core::Error;

/// How far [`within`]'s set-up thread got, as the waiting thread sees it.
enum Setup<T> {
    /// Making the resource (the first blocking step).
    Making,
    /// Made, connecting (the second): what to abort if the waiting thread gives up now.
    Made(Arc<T>),
    /// The waiting thread gave up (or took the result): what is made after is aborted by the
    /// set-up thread itself.
    GivenUp,
}

/// Runs `make`, then `connect` on what it made, on a thread of its own, and waits at most
/// `limit` for both.
///
/// - Both end in time: the resource made.
/// - Either fails in time: its error; a resource made (`connect` failed) is `abort`ed.
/// - The deadline passes: `timeout()`'s error. A resource made by then (still connecting) is
///   `abort`ed at once by the waiting thread, so nothing it started is left running (an NCCL
///   connecting kernel left spinning would hold up every later synchronization of its context);
///   one made after is `abort`ed by the set-up thread when `make` returns. Either way `abort`
///   runs once, and the resource is dropped when the set-up thread ends. A set-up thread stuck
///   in `make` or `connect` for good is left behind (nothing can stop a blocking foreign call).
///
/// `name` names the thread.
pub(crate) fn within<T, M, C>(
    name: &str,
    limit: Duration,
    timeout: impl FnOnce() -> Error,
    make: M,
    connect: C,
    abort: fn(&T),
) -> Result<T, Error>
where
    T: Send + Sync + 'static,
    M: FnOnce() -> Result<T, Error> + Send + 'static,
    C: FnOnce(&T) -> Result<(), Error> + Send + 'static,
{
    let state: Arc<Mutex<Setup<T>>> = Arc::new(Mutex::new(Setup::Making));
    let slot = Arc::clone(&state);
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let done = make().map(Arc::new).and_then(|made| {
                let mut state = slot.lock().unwrap_or_else(|e| e.into_inner());
                if matches!(*state, Setup::GivenUp) {
                    abort(&made);
                    return Err(Error::Backend("set-up made after its deadline".into()));
                }
                *state = Setup::Made(Arc::clone(&made));
                drop(state);
                connect(&made).map(|()| made)
            });
            // The waiting thread may have gone: the result is dropped here then.
            let _ = tx.send(done);
        })
        .map_err(|e| Error::Backend(format!("no thread for the set-up ({name}): {e}")))?;
    let done = rx.recv_timeout(limit).unwrap_or_else(|_| Err(timeout()));
    let kept = std::mem::replace(&mut *state.lock().unwrap_or_else(|e| e.into_inner()), Setup::GivenUp);
    match done {
        Ok(made) => {
            drop(kept);
            Arc::try_unwrap(made).map_err(|_| Error::Backend(format!("{name}: still shared after its set-up")))
        }
        Err(e) => {
            if let Setup::Made(made) = kept {
                abort(&made);
            }
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A resource that counts its aborts and tells a channel when it is dropped.
    struct Thing {
        aborts: AtomicUsize,
        dropped: mpsc::Sender<usize>,
    }

    impl Drop for Thing {
        fn drop(&mut self) {
            let _ = self.dropped.send(self.aborts.load(Ordering::SeqCst));
        }
    }

    fn abort(t: &Thing) {
        t.aborts.fetch_add(1, Ordering::SeqCst);
    }

    fn timed_out() -> Error {
        Error::Timeout { op: "test set-up".into(), rank: 0, waiting_for: "a peer".into(), after: Duration::ZERO }
    }

    /// The aborts a resource had when it was dropped (waits for the drop, generously).
    fn aborts_at_drop(dropped: &mpsc::Receiver<usize>) -> usize {
        dropped.recv_timeout(Duration::from_secs(30)).expect("the resource was never dropped")
    }

    fn thing(dropped: &mpsc::Sender<usize>) -> Thing {
        Thing { aborts: AtomicUsize::new(0), dropped: dropped.clone() }
    }

    #[test]
    fn a_set_up_in_time_gives_its_resource_unaborted() {
        let (tx, rx) = mpsc::channel();
        let t = within("t", Duration::from_secs(30), timed_out, move || Ok(thing(&tx)), |_| Ok(()), abort).unwrap();
        assert_eq!(t.aborts.load(Ordering::SeqCst), 0);
        drop(t);
        assert_eq!(aborts_at_drop(&rx), 0);
    }

    #[test]
    fn a_failed_make_passes_its_error_and_aborts_nothing() {
        let r = within::<Thing, _, _>(
            "t",
            Duration::from_secs(30),
            timed_out,
            || Err(Error::Backend("no peer".into())),
            |_| Ok(()),
            abort,
        );
        assert!(matches!(r, Err(Error::Backend(m)) if m == "no peer"));
    }

    #[test]
    fn a_failed_connect_aborts_what_was_made_once() {
        let (tx, rx) = mpsc::channel();
        let r = within(
            "t",
            Duration::from_secs(30),
            timed_out,
            move || Ok(thing(&tx)),
            |_| Err(Error::Backend("connect".into())),
            abort,
        );
        assert!(matches!(r, Err(Error::Backend(m)) if m == "connect"));
        assert_eq!(aborts_at_drop(&rx), 1);
    }

    #[test]
    fn a_connect_past_the_deadline_is_aborted_by_the_waiting_side() {
        let (tx, rx) = mpsc::channel();
        let (release, held) = mpsc::channel::<()>();
        let r = within(
            "t",
            Duration::from_millis(50),
            timed_out,
            move || Ok(thing(&tx)),
            move |_| {
                // Blocks until the test lets it go: past the deadline whatever the machine's speed.
                let _ = held.recv();
                Ok(())
            },
            abort,
        );
        assert!(matches!(r, Err(Error::Timeout { .. })));
        // Aborted before `within` returned, while `connect` still blocks; not again after.
        release.send(()).unwrap();
        assert_eq!(aborts_at_drop(&rx), 1);
    }

    #[test]
    fn a_resource_made_past_the_deadline_is_aborted_by_the_set_up_thread() {
        let (tx, rx) = mpsc::channel();
        let (release, held) = mpsc::channel::<()>();
        let (connected, was_connected) = mpsc::channel::<()>();
        let r = within(
            "t",
            Duration::from_millis(50),
            timed_out,
            move || {
                let _ = held.recv();
                Ok(thing(&tx))
            },
            move |_| {
                let _ = connected.send(());
                Ok(())
            },
            abort,
        );
        assert!(matches!(r, Err(Error::Timeout { .. })));
        release.send(()).unwrap();
        assert_eq!(aborts_at_drop(&rx), 1);
        // Never connected: the thread saw the give-up before `connect`.
        assert!(was_connected.recv_timeout(Duration::from_millis(10)).is_err());
    }
}
