//! Tensor descriptors (shape, strides, dtype, tag) and host tensors.
//!
//! The tags are NCCL EP's: they say what a tensor holds, so an operation can reject a
//! weights tensor passed where tokens were expected even when shapes happen to agree.

use half::bf16;

use crate::dtype::DType;

/// What a tensor holds (NCCL EP's tensor tags).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorTag {
    /// Token activations, expert inputs or expert outputs: `[rows x H]` (or `[L x R*M x H]`).
    Tokens,
    /// Top-k routing weights, fp32 `[rows x K]`.
    TopkWeights,
    /// Top-k expert indices, int64 `[rows x K]`, `-1` = masked.
    TopkIdx,
    /// FP8 scales, fp32 `[rows x H/128]` (or `[L x R*M x H/128]`).
    Scales,
    /// Per-local-expert receive counters, int32 `[L]`, in device memory.
    RecvExpertCountsDevice,
    /// Per-local-expert receive counters, int32 `[L]`, in (pinned) host memory.
    RecvExpertCountsHost,
    /// Per token, the top-k entries on masked ranks, int32 `[B]` (rank masking; epflow's own,
    /// NCCL EP has no such tag).
    MaskedEntries,
}

/// Shape, strides (in elements), element type and tag of a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorDesc {
    /// Size of each dimension, outermost first.
    pub shape: Vec<usize>,
    /// Distance in elements between neighbours along each dimension.
    pub strides: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// What the tensor holds.
    pub tag: TensorTag,
}

impl TensorDesc {
    /// A row-major contiguous descriptor.
    pub fn contiguous(tag: TensorTag, dtype: DType, shape: &[usize]) -> Self {
        TensorDesc { strides: contiguous_strides(shape), shape: shape.to_vec(), dtype, tag }
    }

    /// Number of elements (`usize::MAX` if the product does not fit: no size wraps).
    pub fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |acc, &d| acc.saturating_mul(d))
    }

    /// Bytes the elements take when contiguous (saturating, as [`TensorDesc::numel`]).
    pub fn size_bytes(&self) -> usize {
        self.numel().saturating_mul(self.dtype.size_bytes())
    }

    /// Whether the strides are row-major contiguous. Size-1 dimensions may have any stride.
    pub fn is_contiguous(&self) -> bool {
        if self.strides.len() != self.shape.len() {
            return false;
        }
        let expected = contiguous_strides(&self.shape);
        self.shape.iter().zip(self.strides.iter().zip(&expected)).all(|(&n, (&s, &e))| n <= 1 || s == e)
    }
}

/// Row-major strides of `shape`, in elements.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// The elements of a host tensor, typed.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// BF16 elements.
    Bf16(Vec<bf16>),
    /// fp32 elements.
    F32(Vec<f32>),
    /// int32 elements.
    I32(Vec<i32>),
    /// int64 elements.
    I64(Vec<i64>),
    /// FP8 e4m3 bit patterns.
    Fp8(Vec<u8>),
    /// Opaque bytes ([`DType::U8`]).
    U8(Vec<u8>),
}

impl HostData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::Bf16(_) => DType::Bf16,
            HostData::F32(_) => DType::F32,
            HostData::I32(_) => DType::I32,
            HostData::I64(_) => DType::I64,
            HostData::Fp8(_) => DType::Fp8E4m3,
            HostData::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::Bf16(v) => v.len(),
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
            HostData::I64(v) => v.len(),
            HostData::Fp8(v) | HostData::U8(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor in host memory: a descriptor and its (row-major) elements.
///
/// Construction never fails; operations validate the descriptor and that the data holds as
/// many elements as the shape says.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    desc: TensorDesc,
    data: HostData,
}

impl HostTensor {
    /// A contiguous tensor of `shape` over `data`; the dtype is the data's.
    pub fn new(tag: TensorTag, shape: &[usize], data: HostData) -> Self {
        HostTensor { desc: TensorDesc::contiguous(tag, data.dtype(), shape), data }
    }

    /// Token rows `[rows x hidden]` in BF16.
    pub fn tokens(rows: usize, hidden: usize, data: Vec<bf16>) -> Self {
        Self::new(TensorTag::Tokens, &[rows, hidden], HostData::Bf16(data))
    }

    /// FP8 token rows `[rows x hidden]` (e4m3 bit patterns).
    pub fn tokens_fp8(rows: usize, hidden: usize, data: Vec<u8>) -> Self {
        Self::new(TensorTag::Tokens, &[rows, hidden], HostData::Fp8(data))
    }

    /// FP8 scales `[rows x hidden/128]`.
    pub fn scales(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        Self::new(TensorTag::Scales, &[rows, cols], HostData::F32(data))
    }

    /// Top-k weights `[rows x top_k]`.
    pub fn topk_weights(rows: usize, top_k: usize, data: Vec<f32>) -> Self {
        Self::new(TensorTag::TopkWeights, &[rows, top_k], HostData::F32(data))
    }

    /// Top-k indices `[rows x top_k]`, `-1` = masked.
    pub fn topk_idx(rows: usize, top_k: usize, data: Vec<i64>) -> Self {
        Self::new(TensorTag::TopkIdx, &[rows, top_k], HostData::I64(data))
    }

    /// Replaces the tag (keeps shape and data).
    pub fn with_tag(mut self, tag: TensorTag) -> Self {
        self.desc.tag = tag;
        self
    }

    /// Replaces the strides (host data stays row-major; operations reject non-contiguous strides).
    pub fn with_strides(mut self, strides: &[usize]) -> Self {
        self.desc.strides = strides.to_vec();
        self
    }

    /// Moves the elements out, leaving an empty buffer (for recycling).
    pub(crate) fn take_data(&mut self) -> HostData {
        let empty = match &self.data {
            HostData::Bf16(_) => HostData::Bf16(Vec::new()),
            HostData::F32(_) => HostData::F32(Vec::new()),
            HostData::I32(_) => HostData::I32(Vec::new()),
            HostData::I64(_) => HostData::I64(Vec::new()),
            HostData::Fp8(_) => HostData::Fp8(Vec::new()),
            HostData::U8(_) => HostData::U8(Vec::new()),
        };
        std::mem::replace(&mut self.data, empty)
    }

    /// Mutable elements (the shape stays).
    pub fn data_mut(&mut self) -> &mut HostData {
        &mut self.data
    }

    /// The descriptor.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }

    /// The elements.
    pub fn data(&self) -> &HostData {
        &self.data
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.desc.shape
    }

    /// BF16 elements, if the tensor is BF16.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match &self.data {
            HostData::Bf16(v) => Some(v),
            _ => None,
        }
    }

    /// fp32 elements, if the tensor is fp32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            HostData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// int64 elements, if the tensor is int64.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            HostData::I64(v) => Some(v),
            _ => None,
        }
    }

    /// int32 elements, if the tensor is int32.
    pub fn as_i32(&self) -> Option<&[i32]> {
        match &self.data {
            HostData::I32(v) => Some(v),
            _ => None,
        }
    }

    /// FP8 bit patterns, if the tensor is FP8.
    pub fn as_fp8(&self) -> Option<&[u8]> {
        match &self.data {
            HostData::Fp8(v) => Some(v),
            _ => None,
        }
    }

    /// The bytes, if the tensor holds opaque bytes ([`DType::U8`]).
    pub fn as_u8(&self) -> Option<&[u8]> {
        match &self.data {
            HostData::U8(v) => Some(v),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_contiguity() {
        assert_eq!(contiguous_strides(&[4, 3, 2]), vec![6, 2, 1]);
        let d = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[4, 8]);
        assert!(d.is_contiguous());
        assert_eq!(d.size_bytes(), 64);
        let mut padded = d.clone();
        padded.strides = vec![16, 1];
        assert!(!padded.is_contiguous());
        let one_row =
            TensorDesc { strides: vec![99, 1], ..TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[1, 8]) };
        assert!(one_row.is_contiguous());
    }
}
