//! Captured steps on the host backend through the async API ([`Group::replay`]): the step's
//! closure replayed with fresh inputs and checked against the reference, replays mixed with
//! eager operations, and the capture rules' errors.

mod common;

use std::sync::{Arc, Mutex};

use common::{Checked, H, M, checked, config, groups, ll_round};
use epflow_async::Group;
use epflow_core::backend::Backend;
use epflow_core::host::HostRank;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions};
use epflow_core::scenario::ll_identity_expert_outputs;
use epflow_core::verify::{Tolerance, check_bf16};
use epflow_core::{Error, GroupConfig, HostTensor, bf16};

/// The caller's buffers of one rank: the inputs it refills before each replay, the output the
/// step writes.
#[derive(Default)]
struct Buffers {
    topk: Option<HostTensor>,
    x: Option<HostTensor>,
    w: Option<HostTensor>,
    out: Vec<bf16>,
}

/// Captures dispatch + identity experts + combine reading and writing `buffers`.
fn capture(g: &Group<HostRank>, buffers: &Arc<Mutex<Buffers>>) -> epflow_core::host::HostStep {
    let buffers = Arc::clone(buffers);
    g.backend()
        .capture(move |rank| {
            let mut b = buffers.lock().unwrap();
            let (topk, x, w) = (b.topk.clone().unwrap(), b.x.clone().unwrap(), b.w.clone().unwrap());
            let handle = rank.create_handle(&topk)?;
            let d = rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default())?;
            let counts = d.counts().unwrap().to_vec();
            let experts = ll_identity_expert_outputs(d.tokens().data(), None, &counts, rank.num_ranks() * M, H);
            drop(d);
            let y = rank.combine(&handle, CombineInputs::new(&experts).with_weights(&w), &CombineOptions::default())?;
            b.out = y.tokens().as_bf16().unwrap().to_vec();
            Ok(())
        })
        .unwrap()
}

fn refill(buffers: &Mutex<Buffers>, c: &Checked, r: usize) {
    let mut b = buffers.lock().unwrap();
    b.topk = Some(c.sc.topk_idx(r));
    b.x = Some(c.sc.tokens(r));
    b.w = Some(c.sc.weights(r));
    b.out.clear();
}

/// Every rank on its own thread (a host replay runs inside `launch_step`), 20 replays with fresh
/// inputs, an eager round after every 5th: each checked against the reference.
#[test]
fn host_replays_match_reference_and_mix_with_eager_operations() {
    let groups = groups(2, config());
    std::thread::scope(|s| {
        for g in groups {
            s.spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                let r = g.rank();
                let buffers = Arc::new(Mutex::new(Buffers::default()));
                let step = capture(&g, &buffers);
                for i in 0..20u64 {
                    let c = checked(2, 0x5eed + i);
                    refill(&buffers, &c, r);
                    rt.block_on(g.replay(&step)).unwrap();
                    let got = buffers.lock().unwrap().out.clone();
                    let rep = check_bf16("combine", &c.combine[r], &got, Tolerance::OneUlp);
                    assert!(rep.ok() && rep.checked > 0 || c.combine[r].is_empty(), "rank {r} replay {i}: {rep:?}");
                    if i % 5 == 4 {
                        rt.block_on(ll_round(&g, &c, i % 2 == 0)).unwrap();
                    }
                }
                assert_eq!(step.replays(), 20);
            });
        }
    });
}

/// A high-throughput group captures nothing; a poisoned group launches nothing; a replay's
/// error is the step's.
#[test]
fn host_capture_rules_are_errors() {
    let ht = groups(1, GroupConfig::high_throughput(16, H));
    let e = ht[0].backend().capture(|_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");

    let g = &groups(1, config())[0];
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let step = g.backend().capture(|_| Err(Error::Backend("the step's own error".into()))).unwrap();
    let e = rt.block_on(g.replay(&step)).unwrap_err();
    assert!(matches!(e, Error::Backend(ref m) if m.contains("own error")), "{e}");
    g.backend().poison().poison("test");
    let e = rt.block_on(g.replay(&step)).unwrap_err();
    assert!(matches!(e, Error::Poisoned { .. }), "{e}");
    assert_eq!(step.replays(), 1);
}
