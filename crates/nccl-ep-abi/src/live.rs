//! Which `ncclEpGroup_t` and `ncclEpHandle_t` values are live.
//!
//! The C caller holds a token, never a pointer to Rust memory: `ncclEpCreateGroup` and the
//! handle calls insert the object into a [`Registry`] and hand out its token; every call looks
//! the token up before touching the object, and destroy removes it. A value that was destroyed
//! already (a second destroy, a use after destroy) or never came from this library is then
//! `ncclInvalidArgument` with a log line, instead of freed memory read or freed twice (the
//! SIGABRT of issue 70). Tokens come from one counter shared by groups and handles and are
//! never reused, so a stale handle never names a newer handle, and a group's token is never a
//! handle's.
//!
//! A call holds its own `Arc` of the object while it runs, so a destroy racing with it (which
//! the C API forbids) frees nothing under it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::status::{Fail, Res};

/// Spacing of tokens: multiples of 16 look like aligned pointers to tools that print them.
const TOKEN_STRIDE: usize = 16;

/// The next token's index (0 is never handed out: a token is never NULL).
static NEXT: AtomicUsize = AtomicUsize::new(1);

/// A fresh token, never handed out before.
fn fresh_token() -> Res<usize> {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    n.checked_mul(TOKEN_STRIDE)
        .ok_or_else(|| Fail::usage("this process created more groups and handles than tokens exist"))
}

/// The live objects of one kind (groups or handles), by token.
pub(crate) struct Registry<T> {
    /// What the objects are, for messages (`"group"`, `"handle"`).
    kind: &'static str,
    live: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T> Registry<T> {
    /// An empty registry of `kind` objects.
    pub(crate) const fn new(kind: &'static str) -> Self {
        Registry { kind, live: Mutex::new(BTreeMap::new()) }
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<usize, Arc<T>>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `value` and returns its token (what the C caller holds).
    pub(crate) fn insert(&self, value: Arc<T>) -> Res<usize> {
        let token = fresh_token()?;
        self.map().insert(token, value);
        Ok(token)
    }

    /// The object of `token` (argument `what` of the call): `ncclInvalidArgument` for NULL and
    /// for a token that is not live.
    pub(crate) fn get(&self, token: usize, what: &str) -> Res<Arc<T>> {
        self.checked(token, what)?;
        self.map().get(&token).cloned().ok_or_else(|| self.not_live(token, what))
    }

    /// Takes the object of `token` out (its destroy): a second removal of the same token fails
    /// as [`Registry::get`] does.
    pub(crate) fn remove(&self, token: usize, what: &str) -> Res<Arc<T>> {
        self.checked(token, what)?;
        self.map().remove(&token).ok_or_else(|| self.not_live(token, what))
    }

    /// How many objects are live.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }

    fn checked(&self, token: usize, what: &str) -> Res<()> {
        if token == 0 {
            return Err(Fail::arg(format!("{what} is NULL")));
        }
        Ok(())
    }

    fn not_live(&self, token: usize, what: &str) -> Fail {
        Fail::arg(format!(
            "{what} ({token:#x}) is not a live {}: destroyed already, or not made by this library",
            self.kind
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nccl_ep_sys as ep;

    #[test]
    fn tokens_are_looked_up_and_refused_once_removed() {
        let r: Registry<u32> = Registry::new("handle");
        let a = r.insert(Arc::new(7)).unwrap();
        let b = r.insert(Arc::new(8)).unwrap();
        assert_ne!(a, b);
        assert_eq!((a % TOKEN_STRIDE, b % TOKEN_STRIDE), (0, 0));
        assert_eq!((*r.get(a, "handle").unwrap(), *r.get(b, "handle").unwrap()), (7, 8));
        assert_eq!(*r.remove(a, "handle").unwrap(), 7);
        assert_eq!(r.len(), 1);
        // A second destroy, and any use after the first, is ncclInvalidArgument with the reason.
        for e in [r.remove(a, "handle").unwrap_err(), r.get(a, "handle").unwrap_err()] {
            assert_eq!(e.code, ep::NCCL_INVALID_ARGUMENT);
            assert!(e.message.contains("not a live handle: destroyed already"), "{}", e.message);
        }
        assert_eq!(*r.get(b, "handle").unwrap(), 8, "the other handle is untouched");
        let null = r.get(0, "handle").unwrap_err();
        assert_eq!((null.code, null.message.as_str()), (ep::NCCL_INVALID_ARGUMENT, "handle is NULL"));
        assert_eq!(r.get(12345, "handle").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT, "never made here");
    }

    #[test]
    fn tokens_are_never_reused_across_registries() {
        let groups: Registry<u8> = Registry::new("group");
        let handles: Registry<u8> = Registry::new("handle");
        let g = groups.insert(Arc::new(1)).unwrap();
        groups.remove(g, "ep_group").unwrap();
        let h = handles.insert(Arc::new(2)).unwrap();
        assert_ne!(g, h, "a destroyed group's token is not reissued");
        let e = handles.get(g, "handle").unwrap_err();
        assert!(e.message.contains("not a live handle"), "{}", e.message);
        assert_eq!(groups.get(h, "ep_group").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
    }
}
