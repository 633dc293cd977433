//! The low-latency kernels by name: which operation half each runs, and its compiled forms
//! (what [`super::Functions`] loads and the launches pick from).

use crate::params::LlParams;

/// The kernels of a low-latency operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LlKernel {
    /// Dispatch send half.
    DispatchSend,
    /// Dispatch complete half.
    DispatchRecv,
    /// Combine send half.
    CombineSend,
    /// Combine complete half.
    CombineRecv,
    /// Dispatch in one launch: the send half, then the complete half, in one cooperative grid.
    DispatchOne,
    /// Combine in one launch.
    CombineOne,
}

impl LlKernel {
    /// Whether it is a one-launch kernel (both halves).
    pub(crate) fn is_one_launch(self) -> bool {
        matches!(self, LlKernel::DispatchOne | LlKernel::CombineOne)
    }

    /// Every low-latency kernel, in the order `epflow diag launch` reports them.
    pub(crate) const ALL: [LlKernel; 6] = [
        LlKernel::DispatchSend,
        LlKernel::DispatchRecv,
        LlKernel::DispatchOne,
        LlKernel::CombineSend,
        LlKernel::CombineRecv,
        LlKernel::CombineOne,
    ];

    /// The `extern "C"` name of its function in `ll.cu`.
    pub(crate) fn function_name(self) -> &'static str {
        match self {
            LlKernel::DispatchSend => "ep_ll_dispatch_send",
            LlKernel::DispatchRecv => "ep_ll_dispatch_recv",
            LlKernel::CombineSend => "ep_ll_combine_send",
            LlKernel::CombineRecv => "ep_ll_combine_recv",
            LlKernel::DispatchOne => "ep_ll_dispatch_kernel",
            LlKernel::CombineOne => "ep_ll_combine_kernel",
        }
    }

    /// The `extern "C"` name of its variant for tagged messages: a combine that takes tagged
    /// rows ([`LlParams::tagged_rows`]; the complete half and the one-launch kernel), a one-launch
    /// dispatch sent as tagged messages ([`LlParams::sends_tagged`]). The dispatch's two-launch
    /// kernels handle both forms.
    pub(crate) fn tagged_function_name(self) -> Option<&'static str> {
        match self {
            LlKernel::DispatchOne => Some("ep_ll_dispatch_kernel_tagged"),
            LlKernel::CombineRecv => Some("ep_ll_combine_recv_tagged"),
            LlKernel::CombineOne => Some("ep_ll_combine_kernel_tagged"),
            _ => None,
        }
    }

    /// The `extern "C"` name of its variant for forwarded dispatches
    /// ([`LlParams::fwd_token_bytes`] set), in form `form`: the dispatch kernels only (a
    /// forwarded row travels in the BF16 message; the combine is the same).
    pub(crate) fn forwarded_function_name(self, form: Form) -> Option<&'static str> {
        match (self, form) {
            (LlKernel::DispatchSend, _) => Some("ep_ll_dispatch_send_fwd"),
            (LlKernel::DispatchRecv, _) => Some("ep_ll_dispatch_recv_fwd"),
            (LlKernel::DispatchOne, Form::Plain) => Some("ep_ll_dispatch_kernel_fwd"),
            (LlKernel::DispatchOne, Form::Tagged) => Some("ep_ll_dispatch_kernel_tagged_fwd"),
            _ => None,
        }
    }

    /// The `extern "C"` name of its variant for NVFP4 combines ([`LlParams::nvfp4`] set): the
    /// combine kernels only, plain (an NVFP4 combine's rows are never tagged).
    pub(crate) fn nvfp4_function_name(self) -> Option<&'static str> {
        match self {
            LlKernel::CombineSend => Some("ep_ll_combine_send_nvfp4"),
            LlKernel::CombineRecv => Some("ep_ll_combine_recv_nvfp4"),
            LlKernel::CombineOne => Some("ep_ll_combine_kernel_nvfp4"),
            _ => None,
        }
    }

    /// Which of its compiled forms runs `p`'s operation.
    pub(crate) fn form(self, p: &LlParams) -> Form {
        match self {
            LlKernel::CombineRecv | LlKernel::CombineOne if p.tagged_rows() => Form::Tagged,
            LlKernel::DispatchOne if p.sends_tagged() => Form::Tagged,
            _ => Form::Plain,
        }
    }

    /// Whether it belongs to a combine (channel 1) rather than a dispatch.
    pub(crate) fn is_combine(self) -> bool {
        matches!(self, LlKernel::CombineSend | LlKernel::CombineRecv | LlKernel::CombineOne)
    }

    /// Its launch's name in the `EPFLOW_HOST_STEPS` diagnostic.
    pub(crate) fn step_name(self) -> &'static str {
        match self {
            LlKernel::DispatchSend => "launch: dispatch send kernel",
            LlKernel::DispatchRecv => "launch: dispatch receive kernel",
            LlKernel::CombineSend => "launch: combine send kernel",
            LlKernel::CombineRecv => "launch: combine receive kernel",
            LlKernel::DispatchOne => "launch: dispatch one-launch kernel",
            LlKernel::CombineOne => "launch: combine one-launch kernel",
        }
    }
}

/// The compiled forms of a low-latency kernel (one `extern "C"` function each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// The kernel as named by [`LlKernel::function_name`].
    Plain,
    /// Tagged messages or rows ([`LlKernel::tagged_function_name`]).
    Tagged,
}
