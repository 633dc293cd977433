//! What the examples share to parse their flags (with clap) and to size what they allocate: range
//! checked numbers, a timed barrier, and the memory check against the GPU before any allocation
//! (the host's is `epflow::core::host::memory::check_host_alloc`).
//!
//! Each example includes this file (`#[path = "common/flags.rs"] mod flags;`) and uses part of
//! it, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::fmt::Display;
use std::str::FromStr;
use std::sync::Arc;

use epflow::core::error::human_bytes;
use epflow::core::{Error, Result};

/// A clap value parser for an integer in `lo..=hi`: a bad or out-of-range value is a usage error
/// (exit code 2) that names the range.
pub(crate) fn int_in<T>(lo: T, hi: T) -> impl Fn(&str) -> std::result::Result<T, String> + Clone + Send + Sync + 'static
where
    T: FromStr + PartialOrd + Display + Copy + Send + Sync + 'static,
{
    move |s: &str| {
        let v: T = s.trim().parse().map_err(|_| format!("`{s}` is not a whole number in {lo}..={hi}"))?;
        if v < lo || v > hi { Err(format!("{v} is out of range: use {lo}..={hi}")) } else { Ok(v) }
    }
}

/// A clap value parser for a finite number in `lo..=hi` (NaN and infinities are refused).
pub(crate) fn finite_in(
    lo: f64,
    hi: f64,
) -> impl Fn(&str) -> std::result::Result<f64, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number"))?;
        if !v.is_finite() {
            Err(format!("`{s}` is not a finite number: use {lo}..={hi}"))
        } else if v < lo || v > hi {
            Err(format!("{v} is out of range: use {lo}..={hi}"))
        } else {
            Ok(v)
        }
    }
}

/// A clap value parser for a finite number greater than `lo` and at most `hi`.
pub(crate) fn positive_up_to(
    hi: f64,
) -> impl Fn(&str) -> std::result::Result<f64, String> + Clone + Send + Sync + 'static {
    let inner = finite_in(0.0, hi);
    move |s: &str| match inner(s)? {
        v if v > 0.0 => Ok(v),
        v => Err(format!("{v} must be greater than 0 (and at most {hi})")),
    }
}

/// `--backend`: where the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BackendKind {
    /// One rank per GPU of the host (up to 8), or per `--devices` entry.
    Gpu,
    /// Four ranks on the host backend.
    Host,
}

/// `--order`: where the receive kernels of stream-ordered operations run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OrderFlag {
    /// On the micro-batch's stream, after its earlier work.
    OnStream,
    /// On the communication streams.
    Ordered,
}

impl OrderFlag {
    /// The pipeline's [`StreamOrder`](epflow::core::backend::StreamOrder).
    pub(crate) fn stream_order(self) -> epflow::core::backend::StreamOrder {
        match self {
            OrderFlag::OnStream => epflow::core::backend::StreamOrder::OnStream,
            OrderFlag::Ordered => epflow::core::backend::StreamOrder::Ordered,
        }
    }
}

/// The most ranks an example runs on one host.
pub(crate) const MAX_LOCAL_RANKS: usize = 8;

/// `--devices 0,1`: the GPU of each rank, 1 to [`MAX_LOCAL_RANKS`] entries (`0,0` puts two
/// ranks on one GPU: a functional check only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Devices(pub(crate) Vec<usize>);

/// A clap value parser for [`Devices`].
pub(crate) fn devices(s: &str) -> std::result::Result<Devices, String> {
    let list = s
        .split(',')
        .map(|d| d.trim().parse::<usize>().map_err(|_| format!("`{d}` is not a device number (e.g. 0,1)")))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if list.len() > MAX_LOCAL_RANKS {
        return Err(format!("{} devices: at most {MAX_LOCAL_RANKS} ranks per host", list.len()));
    }
    Ok(Devices(list))
}

/// A barrier of the ranks' threads whose wait ends with an error after a deadline (a rank that
/// failed before reaching it never leaves the others waiting).
#[derive(Debug)]
pub(crate) struct TimedBarrier {
    /// Threads arrived in the current generation, and the generation.
    state: std::sync::Mutex<(usize, u64)>,
    turned: std::sync::Condvar,
    parties: usize,
}

impl TimedBarrier {
    /// A barrier of `parties` threads.
    pub(crate) fn new(parties: usize) -> Self {
        TimedBarrier { state: std::sync::Mutex::new((0, 0)), turned: std::sync::Condvar::new(), parties }
    }

    /// Waits until every party has arrived, or fails after `timeout` naming how many had.
    pub(crate) fn wait(&self, timeout: std::time::Duration) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = st.1;
        st.0 += 1;
        if st.0 == self.parties {
            *st = (0, generation + 1);
            self.turned.notify_all();
            return Ok(());
        }
        let (st, waited) =
            self.turned.wait_timeout_while(st, timeout, |s| s.1 == generation).unwrap_or_else(|e| e.into_inner());
        if waited.timed_out() && st.1 == generation {
            return Err(Error::Backend(format!(
                "{} of {} ranks reached the barrier within {timeout:?} (did a rank fail?)",
                st.0, self.parties
            )));
        }
        Ok(())
    }
}

/// `Err(OutOfMemory)` unless the GPU of `ctx` has `bytes` free for `what` now (before the
/// example allocates them).
pub(crate) fn check_device_memory(
    ctx: &Arc<cudarc::driver::CudaContext>,
    what: impl FnOnce() -> String,
    bytes: u128,
) -> Result<()> {
    let (free, _total) = ctx.mem_get_info().map_err(|e| Error::Backend(format!("cuMemGetInfo: {e:?}")))?;
    if bytes > free as u128 {
        return Err(Error::Unsupported(format!(
            "{} needs {} of GPU memory, more than the GPU has free ({})",
            what(),
            human_bytes(bytes),
            human_bytes(free as u128)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod flag_tests {
    use super::*;

    #[test]
    fn numbers_are_range_checked() {
        let f = finite_in(0.0, 10.0);
        assert_eq!(f("2.5"), Ok(2.5));
        for bad in ["nan", "NaN", "inf", "-inf", "1e30", "-1", "abc", ""] {
            assert!(f(bad).is_err(), "{bad} accepted");
        }
        let p = positive_up_to(5.0);
        assert!(p("0").is_err());
        assert_eq!(p("5"), Ok(5.0));
        assert_eq!(devices("0, 1"), Ok(Devices(vec![0, 1])));
        assert!(devices("0,0,0,0,0,0,0,0,0").is_err());
        assert!(devices("0,x").is_err());
        let i = int_in(1usize, 8);
        assert_eq!(i("8"), Ok(8));
        for bad in ["0", "9", "1e9", "abc", "-1", "18446744073709551616"] {
            assert!(i(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn a_barrier_opens_for_all_and_times_out_without_them() {
        let b = std::sync::Arc::new(TimedBarrier::new(2));
        let other = std::sync::Arc::clone(&b);
        let t = std::thread::spawn(move || other.wait(std::time::Duration::from_secs(20)));
        assert!(b.wait(std::time::Duration::from_secs(20)).is_ok());
        assert!(t.join().unwrap().is_ok());
        let e = b.wait(std::time::Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("1 of 2 ranks"), "{e}");
    }
}
