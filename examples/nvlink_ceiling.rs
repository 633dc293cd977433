//! The NVLink all-to-all ceiling of this machine, for judging the high-throughput kernels: every
//! GPU copies `--mb` MB to every other GPU at once, and the example prints the time and the
//! ingress bandwidth per GPU. By default with the copy engines (`cuMemcpyDtoDAsync` between
//! peer-mapped buffers, one stream per pair); with `--sms N`, with SM loads and stores instead
//! (`GpuRank::sm_copy`: N blocks of 512 threads per GPU, shared out over its peers, as the
//! high-throughput kernels' sending warps store), and with `--local` also a copy of the same size
//! within each GPU at the same time on its own N blocks (a dispatch also copies its own rows and
//! the received ones in HBM). With `--tma` (and `--sms N`), the N blocks per GPU move the bytes
//! with the Tensor Memory Accelerator's bulk copies instead (`GpuRank::tma_copy`: one issuing
//! thread per block, `--stages` shared-memory buffers of `--chunk` bytes, default 14 of 14336 B,
//! a 7168-wide BF16 row each); `--local` then copies locally with bulk copies too. Every copied
//! region is checked against its source at the end. High-throughput dispatch at the reference
//! config moves ~53 MB per pair on 4 GPUs, ~58 MB on 2.
//!
//! ```sh
//! cargo run --release --example nvlink_ceiling [-- --mb 56 --iters 20 --sms 132 --local --tma]
//! ```

use std::time::Instant;

use cudarc::driver::CudaStream;
use epflow::core::GroupConfig;
use epflow_kernels::device::DeviceBuffer;
use epflow_kernels::{BulkStages, CopyRange, GpuRank, GpuWorld, device_count};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n = device_count();
    if n < 2 {
        eprintln!("SKIPPED: needs 2 or more GPUs, this machine has {n}");
        return Ok(());
    }
    let (mb, iters, sms) = (arg("--mb", 53), arg("--iters", 20), arg("--sms", 0));
    let local = std::env::args().any(|a| a == "--local");
    let tma = std::env::args().any(|a| a == "--tma");
    let (chunk, stages) = (arg("--chunk", 14336) as u32, arg("--stages", 14) as u32);
    let bytes = mb << 20;
    let devices: Vec<usize> = (0..n.min(8)).collect();
    // A group only to open the contexts and enable peer access between every pair.
    let ranks = GpuWorld::create(&devices, GroupConfig::high_throughput(8 * devices.len(), 1024))?;
    let r = ranks.len();
    let src: Vec<DeviceBuffer> =
        ranks.iter().map(|k| DeviceBuffer::zeroed(k.context(), bytes)).collect::<Result<_, _>>()?;
    // A pattern per source (word i of source s: i * 2654435761 + s), checked after the runs.
    let pattern = |s: usize| -> Vec<u32> {
        (0..bytes / 4).map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(s as u32)).collect()
    };
    for (s, b) in src.iter().enumerate() {
        b.write(0, &pattern(s))?;
    }
    // dst[d] holds one region per source.
    let dst: Vec<DeviceBuffer> =
        ranks.iter().map(|k| DeviceBuffer::zeroed(k.context(), bytes * r)).collect::<Result<_, _>>()?;
    // SM copies: each peer's share of the N blocks (at least one each).
    let peer_blocks = (sms / (r - 1).max(1)).max(1) as u32;
    let streams: Vec<Vec<_>> = ranks
        .iter()
        .map(|k| (0..r).map(|_| k.context().new_stream()).collect::<Result<Vec<_>, _>>())
        .collect::<Result<_, _>>()?;
    let shape = BulkStages { chunk, stages };
    // `copy` with SM stores or bulk copies on `blocks` blocks of `rank`, on `stream`.
    let probe = |rank: &GpuRank, stream: &CudaStream, copy: CopyRange<'_>, blocks: u32| {
        // SAFETY: every buffer lives until the end of main, after every stream is synchronized;
        // each (source, destination) pair has its own region of the destination buffer.
        unsafe { if tma { rank.tma_copy(stream, copy, blocks, shape) } else { rank.sm_copy(stream, copy, blocks) } }
    };
    let mut times = Vec::with_capacity(iters);
    for it in 0..iters + 3 {
        let t = Instant::now();
        for s in 0..r {
            ranks[s].context().bind_to_thread()?;
            for d in (0..r).filter(|&d| d != s) {
                if sms > 0 {
                    let copy = CopyRange { dst: &dst[d], dst_offset: s * bytes, src: &src[s], bytes };
                    probe(&ranks[s], &streams[s][d], copy, peer_blocks)?;
                    continue;
                }
                let to = dst[d].ptr() + (s * bytes) as u64;
                // SAFETY: both ranges are live cuMemAlloc allocations of `bytes` (peer access is
                // enabled between every pair); the copy is ordered on its own stream.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoDAsync_v2(to, src[s].ptr(), bytes, streams[s][d].cu_stream())
                }
                .result()?;
            }
            if local && sms > 0 {
                // The own region of this GPU's destination buffer, on the stream of pair (s, s).
                let copy = CopyRange { dst: &dst[s], dst_offset: s * bytes, src: &src[s], bytes };
                probe(&ranks[s], &streams[s][s], copy, sms as u32)?;
            }
        }
        for ss in &streams {
            for st in ss {
                st.synchronize()?;
            }
        }
        if it >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    // Every region that was written must hold its source's pattern.
    let mut got = vec![0u8; bytes];
    for (d, b) in dst.iter().enumerate() {
        for s in (0..r).filter(|&s| s != d || (local && sms > 0)) {
            b.read(s * bytes, &mut got)?;
            let want: Vec<u8> = pattern(s).iter().flat_map(|w| w.to_le_bytes()).collect();
            if got != want {
                return Err(format!("GPU {d}'s copy from GPU {s} differs from its source").into());
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let ingress = (r - 1) as f64 * bytes as f64 / med / 1e9;
    let kind = if tma { format!("bulk copies ({stages} x {chunk} B)") } else { "SM stores".to_string() };
    let how = match (sms, local) {
        (0, _) => "copy engines".to_string(),
        (n, false) => format!("{kind}, {n} blocks per GPU"),
        (n, true) => format!("{kind}, {n} blocks per GPU, with a local copy of {mb} MB on {n} more"),
    };
    println!(
        "{r} GPUs, {mb} MB to every peer: median {:.1} us per all-to-all, {ingress:.1} GB/s ingress per GPU ({how})",
        med * 1e6
    );
    Ok(())
}
