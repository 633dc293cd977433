//! # epflow-nccl-ep-abi (`libnccl_ep.so`)
//!
//! NCCL EP's C API (`nccl_ep.h` of NCCL EP 0.1.0, API version 1, as NCCL 2.30.7 ships it) on
//! epflow's kernels: `cargo build --release` writes `target/release/libnccl_ep.so`, a drop-in
//! for NVIDIA's library. Programs built against NVIDIA's header (`ep_test`, `ep_bench`, the
//! `nccl4py` bindings) run on epflow by putting this library first on the library path.
//! `include/nccl_ep.h` is this crate's header, generated from the Rust definitions
//! ([`header`]); `include/nccl_ep_v2.h` declares NCCL EP's API version 2 (NVIDIA/nccl-extensions),
//! also what `nccl_ep.h` declares when `NCCL_EP_API_VERSION` is defined to 2 before it.
//!
//! ## Building and installing the library
//!
//! `cargo build --release -p epflow-nccl-ep-abi` writes `target/release/libnccl_ep.so` (SONAME
//! `libnccl_ep.so.0`, as NVIDIA's) and the static `target/release/libnccl_ep.a`. One command
//! lays them out as NVIDIA ships NCCL EP:
//!
//! ```text
//! scripts/build-nccl-ep-lib.sh [DEST]     # DEST defaults to <cargo target dir>/nccl_ep
//! DEST/lib/libnccl_ep.so.0.1.0, libnccl_ep.so.0 -> libnccl_ep.so.0.1.0, libnccl_ep.so -> libnccl_ep.so.0
//! DEST/lib/libnccl_ep.a, libnccl_ep.a.libs (the system libraries it needs)
//! DEST/include/nccl_ep.h, nccl_ep_v2.h
//! ```
//!
//! Shared: `gcc app.c -I DEST/include -L DEST/lib -lnccl_ep`, run with `DEST/lib` on the
//! library path. Static: `gcc app.c -I DEST/include DEST/lib/libnccl_ep.a $(cat
//! DEST/lib/libnccl_ep.a.libs)`, today `-ldl -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc` (what
//! `cargo rustc --release -p epflow-nccl-ep-abi --lib -- --print native-static-libs` prints);
//! the program then needs no `libnccl_ep.so`. The tests link C programs both ways.
//!
//! ## Table of contents
//!
//! - `api.rs`: the 18 exported functions, and the `epflowNcclEpAbiVersion` marker that epflow's
//!   own NCCL EP backend uses to refuse this library.
//! - `status.rs`: `ncclResult_t` codes, log lines, panics caught at the boundary.
//! - `check.rs`: the size/magic checks of every struct, and tensor descriptors.
//! - `tensor.rs`: `ncclEpTensorAlloc` / `ncclEpTensorDestroy`; `owned.rs`: the layout of the
//!   descriptors they make (which `check.rs` recognises).
//! - `comm.rs`: the caller's `ncclComm_t` as epflow's bootstrap (through the caller's NCCL).
//! - `alloc.rs`: the group config's `alloc_fn` / `free_fn` as the rank's allocator of local
//!   scratch (peer-mapped memory stays `cuMemAlloc`).
//! - `capture.rs`: CUDA graph capture of low-latency calls (the group then numbers its
//!   operations on the device).
//! - `group.rs`: a group: the epflow GPU rank, the config's shape, operations in flight.
//! - `handle.rs`: handles: layout, top-k, routing.
//! - `expert_major.rs`: high-throughput `NCCL_EP_LAYOUT_EXPERT_MAJOR` on the flat layout.
//! - `last_use.rs`: the last use of a handle's own buffers on a caller's stream (waited for
//!   before they are freed).
//! - `overflow.rs`: API v2's `overflow_policy` DROP on high-throughput flat handles.
//! - `ids.rs`: API v2's GLOBAL expert ids, rewritten after a dispatch's receive.
//! - `live.rs`: the registry of live groups and handles (what `ncclEpGroup_t` and
//!   `ncclEpHandle_t` values name; destroyed ones are refused).
//! - `mask.rs`: the active mask (`enable_mask`, the mask calls) on epflow's rank masking.
//! - `ops.rs`: dispatch, combine and complete on the caller's stream and tensors.
//! - `profile.rs`: `EPFLOW_ABI_PROFILE=1`, host time per phase of low-latency calls (and, with
//!   `EPFLOW_ABI_STAMPS`, every call's entry and launch by the wall clock, per rank).
//! - [`test_hooks`]: NVIDIA's test-only entry points, so that NVIDIA's unit tests run here.
//! - `window.rs`: NCCL window tensors (`win_hdl`), resolved through the group's communicator
//!   within each call.
//! - `v2.rs`: the structs NCCL EP's API v2 grew (and NCCL 2.31's 104-byte group config), read
//!   from any accepted `size`; their unimplemented features refused by name.
//! - [`header`]: the C headers (API v1 and v2), generated.
//!
//! ## What is implemented
//!
//! Low-latency, expert-major and rank-major layouts, `send_only` + `ncclEpComplete`, the
//! active mask (`enable_mask`, NVLink peers); high-throughput, flat and expert-major layouts
//! (`expert_major.rs`, built on the flat one), forward and backward; an int64 or (API v2)
//! int32 `topk_idx`; API v2's local or GLOBAL received expert ids (`recv_topk_idx_kind`; `ids.rs` rewrites them after the receive); API v2's
//! `overflow_policy` DROP on high-throughput flat handles (`overflow.rs`). The caller's
//! `ncclComm_t` bootstraps the group (one process per GPU; ranks on one host share memory over
//! NVLink, other hosts go through NCCL). Operations run on the caller's stream and write the
//! caller's tensors. API v2's DS_FP8E3M4 recipe is epflow's low-latency FP8 dispatch, per call;
//! its FWD recipe (rows the caller quantized, `forwarded.rs`) travels as bytes in low-latency
//! and high-throughput groups (flat, expert-major, after a DROP); its NVFP4 combine
//! (`inputs.scales` each row's global scale) is epflow's (`epflow_core::nvfp4`, conversions of
//! its own, so Hopper runs it too). NCCL window tensors (`win_hdl`, API v2's `zero_copy`) are
//! resolved to their addresses through the caller's NCCL (`window.rs`). Refused with
//! `ncclInvalidUsage` and a log line: DS_FP8E3M4 and NVFP4 in high-throughput groups,
//! expert-major handles on a DROP group, CUDA graph capture of high-throughput calls
//! (low-latency calls are capturable: `capture.rs`).

#![warn(missing_docs)]

mod alloc;
pub mod api;
mod capture;
mod check;
mod comm;
mod expert_major;
mod forwarded;
mod group;
mod handle;
pub mod header;
mod ids;
mod last_use;
mod live;
mod mask;
mod ops;
mod overflow;
mod owned;
mod profile;
mod status;
mod tensor;
pub mod test_hooks;
mod v2;
mod window;
