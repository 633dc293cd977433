//! [`LastUse`]: the last use of a handle's own device buffers on a caller's stream, which a use
//! on another stream waits for and which the buffers' owner waits for before they are freed.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
use cudarc::driver::{CudaEvent, CudaStream};

use crate::status::{Fail, Res};

/// An event after the last work enqueued on a caller's stream that uses some buffers; `what`
/// names them in errors and log lines.
pub(crate) struct LastUse {
    event: Mutex<Option<CudaEvent>>,
    what: &'static str,
}

impl LastUse {
    /// No use yet, of the buffers called `what`.
    pub(crate) fn new(what: &'static str) -> Self {
        LastUse { event: Mutex::new(None), what }
    }

    /// Records the last use on `stream`, after the work just enqueued there.
    pub(crate) fn record(&self, stream: &Arc<CudaStream>) -> Res<()> {
        let e = stream.record_event(Some(CU_EVENT_DISABLE_TIMING)).map_err(|e| {
            Fail::from(epflow_core::Error::Backend(format!("CUDA: record {}'s event: {e:?}", self.what)))
        })?;
        *self.event.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        Ok(())
    }

    /// Orders `stream` after the last use (a no-op when that was on `stream` itself).
    pub(crate) fn wait_on(&self, stream: &Arc<CudaStream>) -> Res<()> {
        if let Some(e) = &*self.event.lock().unwrap_or_else(|e| e.into_inner()) {
            stream.wait(e).map_err(|e| {
                Fail::from(epflow_core::Error::Backend(format!("CUDA: wait for {}'s last use: {e:?}", self.what)))
            })?;
        }
        Ok(())
    }
}

impl Drop for LastUse {
    /// Waits for the last use before the buffers beside it go: the handle may be destroyed (or
    /// its routing replaced) before the caller's stream passed them, and a caller's `free_fn`
    /// need not wait for the device as `cuMemFree` does. Declare it before the buffers it guards:
    /// fields drop in order.
    fn drop(&mut self) {
        if let Some(e) = self.event.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            if let Err(err) = e.synchronize() {
                crate::status::warn(&format!("{}: waiting for their last use failed: {err:?}", self.what));
            }
        }
    }
}
