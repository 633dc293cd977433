//! The benchmark on the NCCL EP backend (`--backend nccl-ep`): NVIDIA's NCCL EP driven through
//! epflow's backend trait, one process, one thread per GPU.

use std::borrow::Cow;
use std::time::Duration;

use epflow_core::ops::{CombineOutputs, DispatchOutputs};
use epflow_core::{Error, HostTensor};
use epflow_kernels::DeviceTensor;
use epflow_nccl_ep::{NcclEpCombineOutput, NcclEpDispatchOutput, NcclEpRank};

use super::rank::BenchRank;

/// An NCCL EP rank with the world's barrier.
pub(super) struct NcclEpBench<W: Fn()> {
    pub rank: NcclEpRank,
    pub wait: W,
}

impl<W: Fn()> BenchRank for NcclEpBench<W> {
    type B = NcclEpRank;

    fn backend(&self) -> &NcclEpRank {
        &self.rank
    }

    fn upload(&self, t: &HostTensor) -> Result<DeviceTensor, Error> {
        self.rank.upload(t)
    }

    fn dispatch_to_host<'a>(
        &self,
        out: &'a NcclEpDispatchOutput,
    ) -> Result<Cow<'a, DispatchOutputs<HostTensor>>, Error> {
        let ctx = self.rank.context();
        let o = out.outputs();
        let get = |t: Option<&DeviceTensor>| t.map(|t| t.download(ctx)).transpose();
        Ok(Cow::Owned(DispatchOutputs {
            tokens: o.tokens.download(ctx)?,
            scales: None,
            topk_weights: get(o.topk_weights.as_ref())?,
            topk_idx: get(o.topk_idx.as_ref())?,
            counts: get(o.counts.as_ref())?,
        }))
    }

    fn combine_to_host<'a>(&self, out: &'a NcclEpCombineOutput) -> Result<Cow<'a, CombineOutputs<HostTensor>>, Error> {
        Ok(Cow::Owned(CombineOutputs {
            tokens: out.tokens().download(self.rank.context())?,
            topk_weights: None,
            masked: None,
        }))
    }

    fn identity_experts<'a>(&self, out: &'a NcclEpDispatchOutput) -> Result<Cow<'a, DeviceTensor>, Error> {
        Ok(Cow::Borrowed(out.tokens()))
    }

    fn barrier(&self) {
        (self.wait)();
    }

    fn dispatch_time(&self, out: &NcclEpDispatchOutput) -> Option<(Duration, Duration)> {
        out.elapsed_halves()
    }

    fn combine_time(&self, out: &NcclEpCombineOutput) -> Option<(Duration, Duration)> {
        out.elapsed_halves()
    }

    fn rows_in_arrival_order(&self) -> bool {
        true
    }
}
