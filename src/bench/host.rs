//! The benchmark on the host backend: one thread per rank.

use std::borrow::Cow;
use std::sync::Arc;

use epflow_core::host::{HostCombineOutput, HostDispatchOutput, HostRank};
use epflow_core::ops::{CombineOutputs, DispatchOutputs};
use epflow_core::scenario::ll_identity_expert_outputs;
use epflow_core::{Algorithm, Error, HostData, HostTensor, TensorTag};

use super::runner::BenchRank;

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
}
