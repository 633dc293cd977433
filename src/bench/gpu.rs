//! The benchmark on the GPU backend: one process, one thread per GPU.

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::Duration;

use epflow_core::backend::Backend;
use epflow_core::graph::{PendingReplay, StepBackend};
use epflow_core::ops::{
    CombineInputs, CombineOptions, CombineOutputs, DispatchInputs, DispatchOptions, DispatchOutputs, HandleOptions,
    Layout,
};
use epflow_core::scenario::Scenario;
use epflow_core::verify::{Report, Tolerance, check_bf16};
use epflow_core::{Error, HostTensor};
use epflow_kernels::{DeviceTensor, GpuCombineOutput, GpuDispatchOutput, GpuHandle, GpuRank};

use super::rank::{BenchRank, DeviceClock, LoopPlan};
use super::stats::RankTimes;

/// A GPU rank with the world's barrier (`wait`: a spin barrier between threads, or an NCCL
/// barrier between processes).
pub(super) struct GpuBench<W: Fn()> {
    pub rank: GpuRank,
    pub wait: W,
    /// The identity experts' BF16 rows of an FP8 dispatch, kept across iterations (as a
    /// server's experts write into fixed buffers): allocating and freeing this buffer per
    /// iteration (470 MB at 128 tokens, expert-major) made the next operations slower.
    dequantized: Mutex<Option<DeviceTensor>>,
}

/// Two CUDA events on a stream ([`DeviceClock`]).
struct EventClock {
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    start: cudarc::driver::CudaEvent,
    lap: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
}

impl DeviceClock for EventClock {
    fn lap(&mut self) -> Result<(), Error> {
        self.lap.record(&self.stream).map_err(|e| Error::Backend(format!("record: {e}")))
    }

    fn stop(&mut self) -> Result<(), Error> {
        self.end.record(&self.stream).map_err(|e| Error::Backend(format!("record: {e}")))
    }

    fn elapsed_us(&self) -> Result<(f64, f64), Error> {
        self.end.synchronize().map_err(|e| Error::Backend(format!("event: {e}")))?;
        let us = |to: &cudarc::driver::CudaEvent| {
            self.start.elapsed_ms(to).map(|ms| f64::from(ms) * 1e3).map_err(|e| Error::Backend(format!("elapsed: {e}")))
        };
        Ok((us(&self.end)?, us(&self.lap)?))
    }

    fn started(&self) -> Result<bool, Error> {
        self.start.try_is_complete().map_err(|e| Error::Backend(format!("event: {e}")))
    }
}

impl<W: Fn()> GpuBench<W> {
    /// `rank` with the barrier `wait`.
    pub(super) fn new(rank: GpuRank, wait: W) -> Self {
        GpuBench { rank, wait, dequantized: Mutex::new(None) }
    }
}

impl<W: Fn()> BenchRank for GpuBench<W> {
    type B = GpuRank;

    fn backend(&self) -> &GpuRank {
        &self.rank
    }

    fn upload(&self, t: &HostTensor) -> Result<DeviceTensor, Error> {
        self.rank.upload(t)
    }

    fn set_op_timing(&self, on: bool) {
        self.rank.set_timing(on);
    }

    fn step_stream(&self) -> Option<std::sync::Arc<cudarc::driver::CudaStream>> {
        self.rank.context().new_stream().ok()
    }

    fn start_device_clock(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        busy: Duration,
    ) -> Result<Option<Box<dyn DeviceClock>>, Error> {
        self.rank.delay_on(stream, busy)?;
        if self.rank.nccl_peers() == 0 {
            self.rank.meet_on(stream)?;
        }
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = || self.rank.context().new_event(timed).map_err(|e| Error::Backend(format!("event: {e}")));
        let (start, end) = (event()?, event()?);
        start.record(stream).map_err(|e| Error::Backend(format!("record: {e}")))?;
        let lap = event()?;
        Ok(Some(Box::new(EventClock { stream: std::sync::Arc::clone(stream), start, lap, end })))
    }

    fn dispatch_to_host<'a>(&self, out: &'a GpuDispatchOutput) -> Result<Cow<'a, DispatchOutputs<HostTensor>>, Error> {
        Ok(Cow::Owned(out.to_host()?))
    }

    fn combine_to_host<'a>(&self, out: &'a GpuCombineOutput) -> Result<Cow<'a, CombineOutputs<HostTensor>>, Error> {
        Ok(Cow::Owned(out.to_host()?))
    }

    fn identity_experts<'a>(&self, out: &'a GpuDispatchOutput) -> Result<Cow<'a, DeviceTensor>, Error> {
        let Some(s) = out.scales() else { return Ok(Cow::Borrowed(out.tokens())) };
        let mut kept = self.dequantized.lock().unwrap_or_else(|e| e.into_inner());
        match kept.as_ref() {
            Some(t) if t.desc().shape == out.tokens().desc().shape => {
                self.rank.dequantize_fp8_into(out.tokens(), s, t)?;
            }
            _ => *kept = Some(self.rank.dequantize_fp8(out.tokens(), s)?),
        }
        Ok(Cow::Owned(kept.as_ref().expect("set above").clone()))
    }

    fn barrier(&self) {
        (self.wait)();
    }

    fn graph_replays(
        &self,
        sc: &Scenario,
        plan: &LoopPlan,
        want: Option<&[epflow_core::bf16]>,
    ) -> Option<Result<(RankTimes, Option<Report>), Error>> {
        Some(self.time_graph(sc, plan, want))
    }

    fn dispatch_time(&self, out: &GpuDispatchOutput) -> Option<(Duration, Duration)> {
        out.elapsed_halves()
    }

    fn combine_time(&self, out: &GpuCombineOutput) -> Option<(Duration, Duration)> {
        out.elapsed_halves()
    }

    fn handle_time(&self, h: &GpuHandle) -> Option<Duration> {
        h.creation_elapsed()
    }
}

impl<W: Fn()> GpuBench<W> {
    /// `--graph`: dispatch + combine of `sc` captured as one step (identity experts' outputs,
    /// computed from the reference, in the combine's input buffer), replayed `plan`'s times
    /// behind the barrier; device time of each replay from CUDA events around it on the step's
    /// stream.
    fn time_graph(
        &self,
        sc: &Scenario,
        plan: &LoopPlan,
        want: Option<&[epflow_core::bf16]>,
    ) -> Result<(RankTimes, Option<Report>), Error> {
        let rank = &self.rank;
        let r = rank.rank();
        let cuda = |what: &str, e: cudarc::driver::DriverError| Error::Backend(format!("{what}: {e}"));
        let topk = rank.upload(&sc.topk_idx(r))?;
        let x = rank.upload(&sc.tokens(r))?;
        let w = rank.upload(&sc.weights(r))?;
        let experts = sc.ll_reference_expert_outputs(r, plan.layout)?;
        let y = rank.upload(&experts)?;
        let handle = rank.graph_handle(&topk, &HandleOptions::with_layout(plan.layout))?;
        let stream = rank.context().new_stream().map_err(|e| cuda("new stream", e))?;
        let step = rank.capture(&stream, |cap| {
            let dopts = DispatchOptions::default();
            let cin = match plan.layout {
                Layout::RankMajor => {
                    cap.dispatch(&handle, DispatchInputs::new(&x).with_weights(&w), &dopts)?;
                    CombineInputs::new(&y)
                }
                Layout::ExpertMajor => {
                    cap.dispatch(&handle, DispatchInputs::new(&x), &dopts)?;
                    CombineInputs::new(&y).with_weights(&w)
                }
            };
            cap.combine(&handle, cin, &CombineOptions::default()).map(drop)
        })?;
        let (start, end) = (
            rank.context()
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda("event", e))?,
            rank.context()
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda("event", e))?,
        );
        let mut times = RankTimes::default();
        let mut check = None;
        for i in 0..plan.warmup + plan.iters {
            (self.wait)();
            start.record(&stream).map_err(|e| cuda("record", e))?;
            let replay = rank.launch_step(&step)?;
            end.record(&stream).map_err(|e| cuda("record", e))?;
            let probe = replay.probe();
            while !probe.ready() {
                std::hint::spin_loop();
            }
            replay.finish()?;
            let us = start.elapsed_ms(&end).map_err(|e| cuda("elapsed", e))? as f64 * 1e3;
            if i == 0 {
                if let Some(want) = want {
                    let got = handle.graph_combine_output().map(|t| t.download(rank.context())).transpose()?;
                    let got = got.as_ref().and_then(HostTensor::as_bf16).unwrap_or_default();
                    check = Some(check_bf16("graph combine", want, got, Tolerance::Exact));
                }
            }
            if i >= plan.warmup {
                times.samples_us.push(us);
            }
        }
        Ok((times, check))
    }
}
