//! The structs NCCL EP's API version 2 (NVIDIA/nccl-extensions `nccl_ep/`) grew, as this
//! library reads them: each is the v1 struct followed by the fields v2 appended (NVIDIA's
//! append-only rule), so a v1 caller's struct is read with the new fields zero
//! ([`crate::check::api_struct`]). NCCL 2.31's dev branch gives `ncclEpGroupConfig_t` only
//! `zero_copy` (104 bytes, API version 1); it is read as v2 with the rest zero.
//!
//! Every new field is checked here: a value whose feature epflow implements is accepted, one
//! whose feature it does not is `ncclInvalidUsage` naming the field (never silently ignored),
//! and a value that is no enumerator is `ncclInvalidArgument`.

use std::ffi::{c_int, c_uint};

use nccl_ep_sys as ep;

use epflow_core::CombineQuant;

use crate::status::{Fail, Res};

/// `ncclEpZeroCopyMode_t`: the library decides.
pub(crate) const ZERO_COPY_AUTO: c_int = 0;
/// `ncclEpZeroCopyMode_t`: staged copies (what epflow does).
pub(crate) const ZERO_COPY_OFF: c_int = 1;
/// `ncclEpZeroCopyMode_t`: peers write the caller's registered tensors directly.
pub(crate) const ZERO_COPY_ON: c_int = 2;
/// `ncclEpOverflowPolicy_t`: the default (TRAP).
pub(crate) const OVERFLOW_AUTO: c_int = 0;
/// `ncclEpOverflowPolicy_t`: a receive overflow is an error.
pub(crate) const OVERFLOW_TRAP: c_int = 1;
/// `ncclEpOverflowPolicy_t`: overflowing tokens are dropped.
pub(crate) const OVERFLOW_DROP: c_int = 2;
/// `ncclEpExpertIdKind_t`: the library's numbering (epflow's: local).
pub(crate) const EXPERT_ID_AUTO: c_int = 0;
/// `ncclEpExpertIdKind_t`: local expert ids.
pub(crate) const EXPERT_ID_LOCAL: c_int = 1;
/// `ncclEpExpertIdKind_t`: global expert ids.
pub(crate) const EXPERT_ID_GLOBAL: c_int = 2;
/// `ncclEpDispQuant_t` / `ncclEpCombQuant_t`: no quantization.
pub(crate) const QUANT_NONE: c_int = 0;
/// `ncclEpDispQuant_t`: the caller's tokens are already quantized; their scales are forwarded.
pub(crate) const DISP_QUANT_FWD: c_int = 1;
/// `ncclEpDispQuant_t`: BF16 in, FP8 out with one FP32 scale per 128 channels (low-latency).
pub(crate) const DISP_QUANT_DS_FP8E3M4: c_int = 2;
/// `ncclEpCombQuant_t`: NVFP4 combine (low-latency).
pub(crate) const COMB_QUANT_NVFP4: c_int = 1;
/// `NCCL_EP_API_VERSION` of NCCL EP's API v2 (NVIDIA/nccl-extensions).
pub(crate) const API_VERSION: c_uint = 2;
/// `ncclFloat4x2`: two FP4 values per byte, the `ncclDataType_t` the v2 header adds.
pub(crate) const NCCL_FLOAT4X2: c_int = 12;

/// `ncclEpGroupConfig_t` of API v2 (112 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GroupConfig {
    /// The v1 fields (96 bytes).
    pub(crate) v1: ep::NcclEpGroupConfig,
    /// `ncclEpZeroCopyMode_t` (also NCCL 2.31's 104-byte config).
    pub(crate) zero_copy: c_int,
    /// `ncclEpOverflowPolicy_t` (high-throughput).
    pub(crate) overflow_policy: c_int,
    /// Upper bound of every handle's top-k (0: unset).
    pub(crate) num_topk: c_uint,
    /// v2's tail padding.
    pub(crate) padding_v2: [u8; 4],
}

/// `ncclEpLayoutInfo_t` of API v2 (48 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct LayoutInfo {
    /// The v1 fields (40 bytes).
    pub(crate) v1: ep::NcclEpLayoutInfo,
    /// `ncclEpExpertIdKind_t`: the numbering of the received `topk_idx`.
    pub(crate) recv_topk_idx_kind: c_int,
    /// v2's tail padding.
    pub(crate) padding_v2: [u8; 4],
}

/// `ncclEpCombineInputs_t` of API v2 (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CombineInputs {
    /// The v1 fields (24 bytes).
    pub(crate) v1: ep::NcclEpCombineInputs,
    /// Scales of quantized expert outputs.
    pub(crate) scales: *mut ep::NcclEpTensor,
}

/// `ncclEpDispatchConfig_t` of API v2 (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DispatchConfig {
    /// The v1 fields (20 bytes).
    pub(crate) v1: ep::NcclEpDispatchConfig,
    /// `ncclEpDispQuant_t`.
    pub(crate) quant_recipe: c_int,
}

/// `ncclEpCombineConfig_t` of API v2 (20 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CombineConfig {
    /// The v1 fields (16 bytes).
    pub(crate) v1: ep::NcclEpCombineConfig,
    /// `ncclEpCombQuant_t`.
    pub(crate) quant_recipe: c_int,
}

const _: () = {
    assert!(std::mem::size_of::<GroupConfig>() == 112);
    assert!(std::mem::offset_of!(GroupConfig, zero_copy) == 96);
    assert!(std::mem::offset_of!(GroupConfig, num_topk) == 104);
    assert!(std::mem::size_of::<LayoutInfo>() == 48);
    assert!(std::mem::offset_of!(LayoutInfo, recv_topk_idx_kind) == 40);
    assert!(std::mem::size_of::<CombineInputs>() == 32);
    assert!(std::mem::size_of::<DispatchConfig>() == 24);
    assert!(std::mem::size_of::<CombineConfig>() == 20);
};

impl GroupConfig {
    /// A v1 config read as v2 (the new fields zero).
    #[cfg(test)]
    pub(crate) fn from_v1(v1: ep::NcclEpGroupConfig) -> Self {
        GroupConfig { v1, zero_copy: 0, overflow_policy: 0, num_topk: 0, padding_v2: [0; 4] }
    }

    /// Refuses the v2 fields whose features epflow does not implement; returns the ones it
    /// acts on.
    pub(crate) fn check_v2_fields(&self, max_top_k: usize) -> Res<GroupFields> {
        match self.zero_copy {
            ZERO_COPY_AUTO | ZERO_COPY_OFF => {}
            ZERO_COPY_ON => crate::status::info(
                "config.zero_copy is NCCL_EP_ZERO_COPY_ON: window tensors (win_hdl) are read and written in place, and epflow moves the rows through its own buffers as in every mode (peers never write into a caller's window)",
            ),
            z => return Err(Fail::arg(format!("config.zero_copy is {z}, not an ncclEpZeroCopyMode_t"))),
        }
        let drop_overflow = match self.overflow_policy {
            OVERFLOW_AUTO | OVERFLOW_TRAP => false,
            OVERFLOW_DROP => true,
            o => return Err(Fail::arg(format!("config.overflow_policy is {o}, not an ncclEpOverflowPolicy_t"))),
        };
        let num_topk = match self.num_topk as usize {
            0 => None,
            k if k <= max_top_k => Some(k),
            k => return Err(Fail::arg(format!("config.num_topk is {k}: must be 0 (unset) or 1 to {max_top_k}"))),
        };
        Ok(GroupFields { num_topk, drop_overflow })
    }
}

/// The v2 fields of a group config that epflow acts on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct GroupFields {
    /// `num_topk`: the most top-k of any handle (`None`: unset).
    pub(crate) num_topk: Option<usize>,
    /// `overflow_policy` is `NCCL_EP_OVERFLOW_DROP` (high-throughput: `overflow.rs`; AUTO and
    /// TRAP refuse a dispatch whose rows do not fit).
    pub(crate) drop_overflow: bool,
}

/// The numbering of the top-k ids a dispatch writes (`recv_topk_idx_kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertIds {
    /// AUTO or LOCAL: the receiving rank's local expert ids (`0..L`), `-1` where not routed here.
    Local,
    /// GLOBAL: the global ids (`rank * L + local`), `-1` where not routed here.
    Global,
}

impl LayoutInfo {
    /// The numbering `recv_topk_idx_kind` asks for (AUTO resolves to LOCAL, as in NCCL EP).
    pub(crate) fn check_v2_fields(&self) -> Res<ExpertIds> {
        match self.recv_topk_idx_kind {
            EXPERT_ID_AUTO | EXPERT_ID_LOCAL => Ok(ExpertIds::Local),
            EXPERT_ID_GLOBAL => Ok(ExpertIds::Global),
            k => Err(Fail::arg(format!("layout_info.recv_topk_idx_kind is {k}, not an ncclEpExpertIdKind_t"))),
        }
    }
}

/// What a dispatch's `quant_recipe` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DispatchQuant {
    /// NONE: tokens travel in their type (BF16).
    None,
    /// DS_FP8E3M4 (low-latency): BF16 in, FP8 e4m3 out with one fp32 scale per 128 channels.
    DsFp8,
    /// FWD (low-latency and high-throughput): tokens the caller quantized and their scales,
    /// carried as bytes.
    Fwd,
}

impl DispatchConfig {
    /// The recipe asked for: NONE, DS_FP8E3M4 or FWD.
    pub(crate) fn check_v2_fields(&self) -> Res<DispatchQuant> {
        match self.quant_recipe {
            QUANT_NONE => Ok(DispatchQuant::None),
            DISP_QUANT_DS_FP8E3M4 => Ok(DispatchQuant::DsFp8),
            DISP_QUANT_FWD => Ok(DispatchQuant::Fwd),
            q => Err(Fail::arg(format!("config.quant_recipe is {q}, not an ncclEpDispQuant_t"))),
        }
    }
}

impl CombineConfig {
    /// The recipe asked for: NONE, or NVFP4 (epflow's NVFP4 combine, `epflow_core::nvfp4`).
    pub(crate) fn check_v2_fields(&self) -> Res<CombineQuant> {
        match self.quant_recipe {
            QUANT_NONE => Ok(CombineQuant::None),
            COMB_QUANT_NVFP4 => Ok(CombineQuant::Nvfp4),
            q => Err(Fail::arg(format!("config.quant_recipe is {q}, not an ncclEpCombQuant_t"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_fields_are_read_and_unknown_values_refused() {
        let g = GroupConfig::default();
        assert_eq!(g.check_v2_fields(16), Ok(GroupFields::default()));
        assert_eq!(
            GroupConfig { zero_copy: ZERO_COPY_OFF, overflow_policy: OVERFLOW_TRAP, num_topk: 8, ..g }
                .check_v2_fields(16),
            Ok(GroupFields { num_topk: Some(8), drop_overflow: false })
        );
        // ON: window tensors resolve in place (`window.rs`); the mode itself changes nothing.
        assert_eq!(GroupConfig { zero_copy: ZERO_COPY_ON, ..g }.check_v2_fields(16), Ok(GroupFields::default()));
        assert_eq!(
            GroupConfig { overflow_policy: OVERFLOW_DROP, ..g }.check_v2_fields(16),
            Ok(GroupFields { num_topk: None, drop_overflow: true })
        );
        assert_eq!(
            GroupConfig { overflow_policy: 3, ..g }.check_v2_fields(16).unwrap_err().code,
            ep::NCCL_INVALID_ARGUMENT
        );
        assert_eq!(GroupConfig { zero_copy: 9, ..g }.check_v2_fields(16).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(GroupConfig { num_topk: 17, ..g }.check_v2_fields(16).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);

        let info =
            LayoutInfo { v1: ep::NcclEpLayoutInfo::default(), recv_topk_idx_kind: EXPERT_ID_LOCAL, padding_v2: [0; 4] };
        assert_eq!(info.check_v2_fields(), Ok(ExpertIds::Local));
        assert_eq!(LayoutInfo { recv_topk_idx_kind: EXPERT_ID_AUTO, ..info }.check_v2_fields(), Ok(ExpertIds::Local));
        let global = LayoutInfo { recv_topk_idx_kind: EXPERT_ID_GLOBAL, ..info };
        assert_eq!(global.check_v2_fields(), Ok(ExpertIds::Global));
        let bad = LayoutInfo { recv_topk_idx_kind: 3, ..info }.check_v2_fields().unwrap_err();
        assert_eq!(bad.code, ep::NCCL_INVALID_ARGUMENT);
        assert!(bad.message.contains("layout_info.recv_topk_idx_kind"), "{}", bad.message);

        assert_eq!(DispatchConfig::default().check_v2_fields(), Ok(DispatchQuant::None));
        let ds = DispatchConfig { quant_recipe: DISP_QUANT_DS_FP8E3M4, ..Default::default() };
        assert_eq!(ds.check_v2_fields(), Ok(DispatchQuant::DsFp8));
        let fwd = DispatchConfig { quant_recipe: DISP_QUANT_FWD, ..Default::default() };
        assert_eq!(fwd.check_v2_fields(), Ok(DispatchQuant::Fwd));
        assert_eq!(
            DispatchConfig { quant_recipe: 3, ..Default::default() }.check_v2_fields().unwrap_err().code,
            ep::NCCL_INVALID_ARGUMENT
        );
        assert_eq!(CombineConfig::default().check_v2_fields(), Ok(CombineQuant::None));
        let nvfp4 = CombineConfig { quant_recipe: COMB_QUANT_NVFP4, ..Default::default() };
        assert_eq!(nvfp4.check_v2_fields(), Ok(CombineQuant::Nvfp4));
        let bad = CombineConfig { quant_recipe: 2, ..Default::default() }.check_v2_fields().unwrap_err();
        assert_eq!(bad.code, ep::NCCL_INVALID_ARGUMENT);
    }
}
