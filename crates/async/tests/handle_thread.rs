//! An awaited handle creation does not block the executor's thread: the host part of the
//! creation (`Backend::start_handle`, which blocks on GPUs: the low-latency handle kernel, NCCL
//! EP's collective `ncclEpCreateHandle`) runs on the group's handle thread. Checked with a host
//! rank whose handle creation blocks until every party of a meeting has arrived: run on the
//! caller's thread, two ranks on one thread would wait for each other until the meeting's
//! timeout, and fail.

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::{Checked, assert_dispatch, checked};
use epflow_async::Group;
use epflow_core::backend::{Backend, HandleCreation, RankCore};
use epflow_core::handle::RoutingHandle;
use epflow_core::host::{HostCombineOutput, HostDispatchOutput, HostHandle, HostOp, HostRank, HostStream, HostWorld};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions};
use epflow_core::{Error, HostTensor, Result};

/// How long a party waits for the others before its creation fails.
const MEETING_TIMEOUT: Duration = Duration::from_secs(5);

/// A reusable meeting of `parties` threads, bounded by [`MEETING_TIMEOUT`].
#[derive(Debug)]
struct Meeting {
    parties: usize,
    /// (arrived in this round, rounds completed)
    state: Mutex<(usize, u64)>,
    all_in: Condvar,
}

impl Meeting {
    fn new(parties: usize) -> Arc<Self> {
        Arc::new(Meeting { parties, state: Mutex::new((0, 0)), all_in: Condvar::new() })
    }

    /// Blocks until every party has arrived in this round.
    fn arrive(&self) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        let round = s.1;
        s.0 += 1;
        if s.0 == self.parties {
            *s = (0, round + 1);
            self.all_in.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + MEETING_TIMEOUT;
        while s.1 == round {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Backend("handle creation: the other parties never arrived".into()));
            }
            s = self.all_in.wait_timeout(s, left).unwrap().0;
        }
        Ok(())
    }
}

/// A host rank whose handle creation first meets the other parties of `meeting`.
#[derive(Debug)]
struct Meets {
    rank: HostRank,
    meeting: Arc<Meeting>,
}

impl Backend for Meets {
    type Stream = HostStream;
    type Tensor = HostTensor;
    type Handle = HostHandle;
    type DispatchOutput = HostDispatchOutput;
    type CombineOutput = HostCombineOutput;
    type Op = HostOp;

    fn core(&self) -> &RankCore {
        self.rank.core()
    }

    fn start_handle(&self, topk_idx: &HostTensor, opts: &HandleOptions) -> Result<HandleCreation<HostHandle, HostOp>> {
        self.meeting.arrive()?;
        self.rank.start_handle(topk_idx, opts)
    }

    fn start_dispatch(
        &self,
        handle: &HostHandle,
        inputs: DispatchInputs<'_, HostTensor>,
        opts: &DispatchOptions,
    ) -> Result<HostOp> {
        self.rank.start_dispatch(handle, inputs, opts)
    }

    fn start_combine(
        &self,
        handle: &HostHandle,
        inputs: CombineInputs<'_, HostTensor>,
        opts: &CombineOptions,
    ) -> Result<HostOp> {
        self.rank.start_combine(handle, inputs, opts)
    }
}

/// Two low-latency ranks whose handle creations meet each other.
fn meeting_groups() -> Vec<Group<Meets>> {
    let meeting = Meeting::new(2);
    HostWorld::create(2, common::config())
        .unwrap()
        .into_iter()
        .map(|rank| Group::new(Meets { rank, meeting: Arc::clone(&meeting) }))
        .collect()
}

/// Both ranks create a handle and dispatch on it, all on the calling task; checks the handles
/// and the received tokens against the reference.
async fn both_ranks(gs: &[Group<Meets>], c: &Checked) {
    let idx: Vec<HostTensor> = (0..2).map(|r| c.sc.topk_idx(r)).collect();
    let (h0, h1) = futures::join!(gs[0].create_handle(&idx[0]), gs[1].create_handle(&idx[1]));
    let hs = [h0.unwrap(), h1.unwrap()];
    for (r, h) in hs.iter().enumerate() {
        assert_eq!(h.num_tokens(), idx[r].desc().shape[0], "rank {r}");
        assert_eq!(h.top_k(), common::K, "rank {r}");
    }
    let x: Vec<HostTensor> = (0..2).map(|r| c.sc.tokens(r)).collect();
    let (d0, d1) = futures::join!(
        gs[0].dispatch(&hs[0], DispatchInputs::new(&x[0])),
        gs[1].dispatch(&hs[1], DispatchInputs::new(&x[1])),
    );
    assert_dispatch(c, 0, 2, &d0.unwrap());
    assert_dispatch(c, 1, 2, &d1.unwrap());
}

#[test]
fn two_ranks_create_handles_on_one_current_thread_runtime() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (gs, c) = (meeting_groups(), checked(2, 41));
    rt.block_on(async {
        // Twice: the group's handle thread serves every creation.
        both_ranks(&gs, &c).await;
        both_ranks(&gs, &c).await;
    });
}

#[test]
fn two_ranks_create_handles_under_a_plain_executor() {
    let (gs, c) = (meeting_groups(), checked(2, 42));
    futures::executor::block_on(both_ranks(&gs, &c));
}

/// While rank 0's creation waits for its meeting, the current-thread runtime runs the task that
/// makes the meeting: the task is what lets the creation finish.
#[test]
fn a_current_thread_runtime_runs_other_tasks_while_a_creation_is_in_flight() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let meeting = Meeting::new(2);
    let rank = HostWorld::create(1, common::config()).unwrap().remove(0);
    let g = Group::new(Meets { rank, meeting: Arc::clone(&meeting) });
    let c = checked(1, 43);
    let idx = c.sc.topk_idx(0);
    let handle = rt.block_on(async {
        let other = tokio::spawn(async move { meeting.arrive() });
        let created = g.create_handle(&idx).await;
        assert_eq!(other.await.unwrap(), Ok(()));
        created.unwrap()
    });
    assert_eq!(handle.num_tokens(), idx.desc().shape[0]);
    let out = rt.block_on(g.dispatch(&handle, DispatchInputs::new(&c.sc.tokens(0)))).unwrap();
    assert_dispatch(&c, 0, 1, &out);
}
