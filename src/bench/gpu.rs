//! The benchmark on the GPU backend: one process, one thread per GPU.

use std::borrow::Cow;
use std::time::Duration;

use epflow_core::ops::{CombineOutputs, DispatchOutputs};
use epflow_core::{Error, HostTensor};
use epflow_kernels::{DeviceTensor, GpuCombineOutput, GpuDispatchOutput, GpuRank};

use super::runner::BenchRank;

/// A GPU rank with the world's barrier (`wait`: a spin barrier between threads, or an NCCL
/// barrier between processes).
pub(super) struct GpuBench<W: Fn()> {
    pub rank: GpuRank,
    pub wait: W,
}

impl<W: Fn()> BenchRank for GpuBench<W> {
    type B = GpuRank;

    fn backend(&self) -> &GpuRank {
        &self.rank
    }

    fn upload(&self, t: &HostTensor) -> Result<DeviceTensor, Error> {
        self.rank.upload(t)
    }

    fn dispatch_to_host<'a>(&self, out: &'a GpuDispatchOutput) -> Result<Cow<'a, DispatchOutputs<HostTensor>>, Error> {
        Ok(Cow::Owned(out.to_host()?))
    }

    fn combine_to_host<'a>(&self, out: &'a GpuCombineOutput) -> Result<Cow<'a, CombineOutputs<HostTensor>>, Error> {
        Ok(Cow::Owned(out.to_host()?))
    }

    fn identity_experts<'a>(&self, out: &'a GpuDispatchOutput) -> Result<Cow<'a, DeviceTensor>, Error> {
        match out.scales() {
            Some(s) => Ok(Cow::Owned(self.rank.dequantize_fp8(out.tokens(), s)?)),
            None => Ok(Cow::Borrowed(out.tokens())),
        }
    }

    fn barrier(&self) {
        (self.wait)();
    }

    fn dispatch_time(&self, out: &GpuDispatchOutput) -> Option<(Duration, Duration)> {
        out.elapsed_halves()
    }

    fn combine_time(&self, out: &GpuCombineOutput) -> Option<(Duration, Duration)> {
        out.elapsed_halves()
    }
}
