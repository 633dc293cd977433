//! The benchmark on the host backend: one thread per rank.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use epflow_core::graph::{PendingReplay, StepBackend};
use epflow_core::host::{HostCombineOutput, HostDispatchOutput, HostRank};
use epflow_core::ops::{
    CombineInputs, CombineOptions, CombineOutputs, DispatchInputs, DispatchOptions, DispatchOutputs, HandleOptions,
    Layout,
};
use epflow_core::scenario::{Scenario, ll_identity_expert_outputs};
use epflow_core::verify::{Report, Tolerance, check_bf16};
use epflow_core::{Algorithm, Error, HostData, HostTensor, TensorTag, bf16};

use super::rank::{BenchRank, LoopPlan};
use super::stats::RankTimes;

/// A host rank with the world's barrier.
pub(super) struct HostBench {
    pub rank: HostRank,
    pub barrier: Arc<super::SpinBarrier>,
}

impl BenchRank for HostBench {
    type B = HostRank;

    fn backend(&self) -> &HostRank {
        &self.rank
    }

    fn upload(&self, t: &HostTensor) -> Result<HostTensor, Error> {
        Ok(t.clone())
    }

    fn step_stream(&self) -> Option<epflow_core::host::HostStream> {
        Some(epflow_core::host::HostStream)
    }

    fn dispatch_to_host<'a>(&self, out: &'a HostDispatchOutput) -> Result<Cow<'a, DispatchOutputs<HostTensor>>, Error> {
        Ok(Cow::Borrowed(out.outputs()))
    }

    fn combine_to_host<'a>(&self, out: &'a HostCombineOutput) -> Result<Cow<'a, CombineOutputs<HostTensor>>, Error> {
        Ok(Cow::Borrowed(out.outputs()))
    }

    fn identity_experts<'a>(&self, out: &'a HostDispatchOutput) -> Result<Cow<'a, HostTensor>, Error> {
        let cfg = self.rank.config();
        match (out.tokens().data(), cfg.algorithm) {
            (HostData::Bf16(_), _) => Ok(Cow::Borrowed(out.tokens())),
            (HostData::Fp8(_), Algorithm::LowLatency) => {
                let rows = self.rank.num_ranks() * cfg.fixed_max_tokens().unwrap_or(0);
                Ok(Cow::Owned(ll_identity_expert_outputs(
                    out.tokens().data(),
                    out.scales().and_then(HostTensor::as_f32),
                    out.counts().unwrap_or_default(),
                    rows,
                    cfg.hidden,
                )))
            }
            (HostData::Fp8(q), Algorithm::HighThroughput) => {
                let n = out.tokens().shape()[0];
                let rows = epflow_core::reference::Rows::Fp8 {
                    q: q.clone(),
                    scales: out.scales().and_then(HostTensor::as_f32).unwrap_or_default().to_vec(),
                };
                let data = epflow_core::scenario::identity_rows(&rows, cfg.hidden);
                Ok(Cow::Owned(HostTensor::new(TensorTag::Tokens, &[n, cfg.hidden], HostData::Bf16(data))))
            }
            _ => Err(Error::Backend("unexpected dispatch output dtype".into())),
        }
    }

    fn barrier(&self) {
        self.barrier.wait();
    }

    fn graph_replays(
        &self,
        sc: &Scenario,
        plan: &LoopPlan,
        want: Option<&[bf16]>,
    ) -> Option<Result<(RankTimes, Option<Report>), Error>> {
        Some(self.time_graph(sc, plan, want))
    }
}

impl HostBench {
    /// `--graph` on the host backend: the step is the closure of dispatch and combine (expert
    /// outputs from the reference, as on GPUs), replayed inside `launch_step`; host clock.
    fn time_graph(
        &self,
        sc: &Scenario,
        plan: &LoopPlan,
        want: Option<&[bf16]>,
    ) -> Result<(RankTimes, Option<Report>), Error> {
        let rank = &self.rank;
        let r = rank.rank();
        let layout = plan.layout;
        let experts = sc.ll_reference_expert_outputs(r, layout)?;
        let (topk, x, w) = (sc.topk_idx(r), sc.tokens(r), sc.weights(r));
        let out = Arc::new(Mutex::new(Vec::new()));
        let written = Arc::clone(&out);
        let step = rank.capture(move |rank| {
            let handle = rank.create_handle_with(&topk, &HandleOptions::with_layout(layout))?;
            let (din, cin) = match layout {
                Layout::RankMajor => (DispatchInputs::new(&x).with_weights(&w), CombineInputs::new(&experts)),
                Layout::ExpertMajor => (DispatchInputs::new(&x), CombineInputs::new(&experts).with_weights(&w)),
            };
            drop(rank.dispatch(&handle, din, &DispatchOptions::default())?);
            let y = rank.combine(&handle, cin, &CombineOptions::default())?;
            *written.lock().unwrap_or_else(|e| e.into_inner()) = y.tokens().as_bf16().unwrap_or_default().to_vec();
            Ok(())
        })?;
        let mut times = RankTimes::default();
        let mut check = None;
        for i in 0..plan.warmup + plan.iters {
            self.barrier.wait();
            let t = std::time::Instant::now();
            rank.launch_step(&step)?.finish()?;
            if i >= plan.warmup {
                times.samples_us.push(t.elapsed().as_secs_f64() * 1e6);
            }
            if let (0, Some(want)) = (i, want) {
                let got = out.lock().unwrap_or_else(|e| e.into_inner()).clone();
                check = Some(check_bf16("graph combine", want, &got, Tolerance::Exact));
            }
        }
        Ok((times, check))
    }
}
