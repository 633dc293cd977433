//! Return codes and log lines: every entry point runs its body through [`entry`], which turns a
//! [`Fail`] (or a panic) into NCCL's `ncclResult_t` and prints one line saying why.

use std::panic::{AssertUnwindSafe, catch_unwind};

use epflow_core::{Error, ValidationError};
use nccl_ep_sys as ep;

/// Why a call failed: the `ncclResult_t` to return and the message to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fail {
    /// The code returned.
    pub(crate) code: ep::NcclResult,
    /// What is logged.
    pub(crate) message: String,
}

/// A call's result.
pub(crate) type Res<T> = Result<T, Fail>;

impl Fail {
    /// `ncclInvalidArgument`: a null pointer, a bad size or magic, a malformed tensor.
    pub(crate) fn arg(message: impl Into<String>) -> Self {
        Fail { code: ep::NCCL_INVALID_ARGUMENT, message: message.into() }
    }

    /// `ncclInvalidUsage`: well-formed but not allowed (unsupported option, wrong order, shapes
    /// that disagree with the group).
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Fail { code: ep::NCCL_INVALID_USAGE, message: message.into() }
    }
}

impl From<Error> for Fail {
    /// epflow's errors as NCCL codes: an invalid `topk_idx` entry (an expert id below -1 or at
    /// least `num_experts`, or one expert twice in a row), wherever it is found (on the host at
    /// handle creation, or on the device, at the creation's or a dispatch's verdict), is
    /// `ncclInvalidArgument`, as NCCL EP's argument checks, and so is a rank out of range; the
    /// rest of what the caller passed (config, validation, unsupported) is `ncclInvalidUsage`;
    /// a peer's failure, a timeout or a poisoned group
    /// `ncclRemoteError`; the driver's failures `ncclUnhandledCudaError`; the rest
    /// `ncclInternalError`.
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Validation(
                ValidationError::ExpertIndexOutOfRange { .. } | ValidationError::DuplicateExpert { .. },
            ) => ep::NCCL_INVALID_ARGUMENT,
            Error::Config(_)
            | Error::Validation(_)
            | Error::Unsupported(_)
            | Error::SlotsBusy { .. }
            | Error::StaleMaskEpoch { .. } => ep::NCCL_INVALID_USAGE,
            Error::Timeout { .. }
            | Error::RankMasked { .. }
            | Error::Poisoned { .. }
            | Error::PeerCancelled { .. }
            | Error::PeerMismatch { .. } => ep::NCCL_REMOTE_ERROR,
            Error::RankOutOfRange { .. } => ep::NCCL_INVALID_ARGUMENT,
            Error::Backend(_) => ep::NCCL_UNHANDLED_CUDA_ERROR,
            Error::OutOfMemory { .. } => ep::NCCL_SYSTEM_ERROR,
            _ => ep::NCCL_INTERNAL_ERROR,
        };
        Fail { code, message: e.to_string() }
    }
}

/// NCCL's name of a result code.
pub(crate) fn code_name(code: ep::NcclResult) -> &'static str {
    match code {
        ep::NCCL_SUCCESS => "ncclSuccess",
        ep::NCCL_UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError",
        ep::NCCL_SYSTEM_ERROR => "ncclSystemError",
        ep::NCCL_INTERNAL_ERROR => "ncclInternalError",
        ep::NCCL_INVALID_ARGUMENT => "ncclInvalidArgument",
        ep::NCCL_INVALID_USAGE => "ncclInvalidUsage",
        ep::NCCL_REMOTE_ERROR => "ncclRemoteError",
        _ => "ncclResult",
    }
}

/// Logs one line on standard error, as NCCL's `WARN` lines: `NCCL EP (epflow) WARN <text>`.
pub(crate) fn warn(text: &str) {
    eprintln!("NCCL EP (epflow) WARN {text}");
}

/// Logs a one-time notice (a change of how the group works, not a problem).
pub(crate) fn info(text: &str) {
    eprintln!("NCCL EP (epflow) INFO {text}");
}

/// Runs the body of entry point `name`: `Ok` is `ncclSuccess`; a [`Fail`] is logged and its
/// code returned; a panic (a bug) is caught at the C boundary, logged and returned as
/// `ncclInternalError`, never unwound into the caller.
pub(crate) fn entry(name: &str, body: impl FnOnce() -> Res<()>) -> ep::NcclResult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ep::NCCL_SUCCESS,
        Ok(Err(f)) => {
            warn(&format!("{name}: {} ({})", f.message, code_name(f.code)));
            f.code
        }
        Err(payload) => {
            let message = epflow_core::backend::panic_message(&*payload);
            warn(&format!("{name}: internal error: {message} (ncclInternalError); please report it"));
            ep::NCCL_INTERNAL_ERROR
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_maps_results_and_panics() {
        assert_eq!(entry("t", || Ok(())), ep::NCCL_SUCCESS);
        assert_eq!(entry("t", || Err(Fail::arg("x"))), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(entry("t", || Err(Fail::usage("x"))), ep::NCCL_INVALID_USAGE);
        assert_eq!(entry("t", || panic!("boom")), ep::NCCL_INTERNAL_ERROR);
    }

    #[test]
    fn epflow_errors_map_to_nccl_codes() {
        assert_eq!(Fail::from(Error::Unsupported("x".into())).code, ep::NCCL_INVALID_USAGE);
        assert_eq!(Fail::from(Error::Backend("x".into())).code, ep::NCCL_UNHANDLED_CUDA_ERROR);
        for bad in [-2, 16, i64::MIN] {
            let e = Fail::from(Error::Validation(ValidationError::invalid_topk_entry(3, 1, bad, None, 16)));
            assert_eq!(e.code, ep::NCCL_INVALID_ARGUMENT, "expert id {bad}");
            assert!(e.message.contains(&format!("topk_idx[3][1] = {bad} is outside [-1, 16)")), "{}", e.message);
        }
        let twice = Error::Validation(ValidationError::invalid_topk_entry(0, 2, 5, Some(0), 16));
        assert_eq!(Fail::from(twice).code, ep::NCCL_INVALID_ARGUMENT);
        let shape = Error::Validation(ValidationError::WrongDtype {
            tensor: "x",
            expected: epflow_core::DType::Bf16,
            got: epflow_core::DType::F32,
        });
        assert_eq!(Fail::from(shape).code, ep::NCCL_INVALID_USAGE);
        let poisoned = Error::Poisoned { reason: "a timeout".into() };
        assert_eq!(Fail::from(poisoned).code, ep::NCCL_REMOTE_ERROR);
    }
}
