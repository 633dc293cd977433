//! NCCL window tensors (`ncclEpTensor_t.win_hdl` and `win_offset`, the storage NCCL EP's
//! `zero_copy` mode asks for): a descriptor with no `data` and a window handle addresses the
//! window's local buffer at `win_offset`, which the caller's NCCL reports
//! (`ncclWinGetUserPtr`, NCCL 2.28 and later). `data` wins when both are set, as in NCCL EP.
//!
//! Only a group's communicator can resolve a window, and [`crate::check::tensor`] reads
//! descriptors without one: each API call that has a group runs its reads [`within`] the
//! group, which resolves the windows read on the calling thread during the call. Outside any
//! (e.g. `ncclEpTensorAlloc`), a window tensor is refused by name.
//!
//! epflow's kernels then write and read the window's memory as any caller memory: the rows
//! still move through epflow's own paths (no peer writes into a caller's window).

use std::cell::RefCell;
use std::sync::Arc;

use nccl_ep_sys as ep;

use crate::status::{Fail, Res};

/// What resolves a window to the device address of its local buffer: a group (its caller's
/// communicator).
pub(crate) trait WindowBase: Send + Sync {
    /// The device address at which window `win`'s local buffer starts.
    fn window_base(&self, win: ep::NcclWindow) -> Res<u64>;
}

thread_local! {
    /// The resolvers of the calls running on this thread, innermost last.
    static RESOLVERS: RefCell<Vec<Arc<dyn WindowBase>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `base` resolving the window tensors read on this thread meanwhile.
pub(crate) fn within<R>(base: Arc<dyn WindowBase>, f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            RESOLVERS.with(|r| r.borrow_mut().pop());
        }
    }
    RESOLVERS.with(|r| r.borrow_mut().push(base));
    let _pop = Pop;
    f()
}

/// The device address of window `win` at byte `offset`, for tensor `what`.
pub(crate) fn address(win: ep::NcclWindow, offset: u64, what: &str) -> Res<u64> {
    let Some(base) = RESOLVERS.with(|r| r.borrow().last().cloned()) else {
        return Err(Fail::usage(format!(
            "{what}: an NCCL window tensor (win_hdl) is resolved through a group's communicator, and this call has none: pass a device pointer"
        )));
    };
    let b = base.window_base(win)?;
    if b == 0 {
        return Err(Fail::usage(format!("{what}: NCCL reports no local buffer for its window")));
    }
    b.checked_add(offset).ok_or_else(|| Fail::arg(format!("{what}: win_offset {offset} overflows the address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window whose base is its handle's value (a test stand-in for NCCL).
    struct Fake;
    impl WindowBase for Fake {
        fn window_base(&self, win: ep::NcclWindow) -> Res<u64> {
            Ok(win as u64)
        }
    }

    #[test]
    fn windows_resolve_within_a_call_only() {
        let win = 0x10_0000 as ep::NcclWindow;
        let e = address(win, 16, "outputs.tokens").unwrap_err();
        assert_eq!(e.code, ep::NCCL_INVALID_USAGE);
        assert!(e.message.contains("outputs.tokens"), "{}", e.message);
        assert_eq!(within(Arc::new(Fake), || address(win, 16, "t")), Ok(0x10_0010));
        assert_eq!(
            within(Arc::new(Fake), || address(std::ptr::null_mut(), 0, "t")).unwrap_err().code,
            ep::NCCL_INVALID_USAGE
        );
        assert!(address(win, 0, "t").is_err(), "the resolver is gone after the call");
    }
}
