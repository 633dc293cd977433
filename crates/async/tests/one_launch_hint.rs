//! The driver tells a backend when the complete half will follow the send at once
//! (`PendingOp::will_complete_at_once`, which lets the GPU backend run both halves as one
//! launch): for an operation awaited directly or completed whole in a stream's order (async
//! `complete_on`, blocking `blocking_dispatch_on`), and never for a staged one (`send_only`),
//! whose complete half comes later, even when that is completed in stream order.

mod common;

use std::sync::{Arc, Mutex};

use epflow_async::Group;
use epflow_core::backend::blocking_dispatch_on;
use epflow_core::ops::{DispatchInputs, DispatchOptions};
use epflow_core::protocol::Channel;
use epflow_core::{HostTensor, bf16};

use common::stub::{Stub, StubHooks};
use common::tokio_rt;

/// What each operation was told before its send: (sequence number, told to complete at once).
#[derive(Debug, Default)]
struct Told(Mutex<Vec<(u64, bool)>>);

impl StubHooks for Told {
    fn sent(&self, _: Channel, seq: u64, at_once: bool) {
        self.0.lock().unwrap().push((seq, at_once));
    }
}

#[test]
fn only_whole_operations_are_told_to_complete_at_once() {
    let rt = tokio_rt();
    let told = Arc::new(Told::default());
    let g = Group::new(Stub::new(991, Arc::clone(&told)));
    let x = HostTensor::tokens(1, 8, vec![bf16::ONE; 8]);
    let idx = HostTensor::topk_idx(1, 1, vec![0]);
    rt.block_on(async {
        let h = g.create_handle(&idx).await.unwrap();
        // #0: awaited directly.
        g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap();
        // #1: staged; its complete half is awaited later.
        let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
        staged.await.unwrap();
        // #2: staged, then completed in stream order.
        let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
        drop(staged.complete_on(&()).await.unwrap());
        // #3: awaited directly again.
        g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap();
        // #4: the whole operation in stream order.
        drop(g.dispatch(&h, DispatchInputs::new(&x)).complete_on(&()).await.unwrap());
        // #5: the same, blocking.
        let (_, settle) =
            blocking_dispatch_on(g.backend(), &h, DispatchInputs::new(&x), &DispatchOptions::default(), &()).unwrap();
        settle.settle().unwrap();
    });
    assert_eq!(*told.0.lock().unwrap(), vec![(0, true), (1, false), (2, false), (3, true), (4, true), (5, true)]);
}
