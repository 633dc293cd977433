//! The NVLink all-to-all ceiling of this machine, for judging the high-throughput kernels: every
//! GPU copies `--mb` MB to every other GPU at once with the copy engines (`cuMemcpyDtoDAsync`
//! between peer-mapped buffers, one stream per pair), and the example prints the time and the
//! ingress bandwidth per GPU. High-throughput dispatch at the reference config moves ~53 MB per
//! pair on 4 GPUs.
//!
//! ```sh
//! cargo run --release --example nvlink_ceiling [-- --mb 53 --iters 20]
//! ```

use std::time::Instant;

use epflow::core::GroupConfig;
use epflow_kernels::device::DeviceBuffer;
use epflow_kernels::{GpuWorld, device_count};

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
    let (mb, iters) = (arg("--mb", 53), arg("--iters", 20));
    let bytes = mb << 20;
    let devices: Vec<usize> = (0..n.min(8)).collect();
    // A group only to open the contexts and enable peer access between every pair.
    let ranks = GpuWorld::create(&devices, GroupConfig::high_throughput(8 * devices.len(), 1024))?;
    let r = ranks.len();
    let src: Vec<DeviceBuffer> =
        ranks.iter().map(|k| DeviceBuffer::zeroed(k.context(), bytes)).collect::<Result<_, _>>()?;
    // dst[d] holds one region per source.
    let dst: Vec<DeviceBuffer> =
        ranks.iter().map(|k| DeviceBuffer::zeroed(k.context(), bytes * r)).collect::<Result<_, _>>()?;
    let streams: Vec<Vec<_>> = ranks
        .iter()
        .map(|k| (0..r).map(|_| k.context().new_stream()).collect::<Result<Vec<_>, _>>())
        .collect::<Result<_, _>>()?;
    let mut times = Vec::with_capacity(iters);
    for it in 0..iters + 3 {
        let t = Instant::now();
        for s in 0..r {
            ranks[s].context().bind_to_thread()?;
            for d in (0..r).filter(|&d| d != s) {
                let to = dst[d].ptr() + (s * bytes) as u64;
                // SAFETY: both ranges are live cuMemAlloc allocations of `bytes` (peer access is
                // enabled between every pair); the copy is ordered on its own stream.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoDAsync_v2(to, src[s].ptr(), bytes, streams[s][d].cu_stream())
                }
                .result()?;
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
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let ingress = (r - 1) as f64 * bytes as f64 / med / 1e9;
    println!(
        "{r} GPUs, {mb} MB to every peer: median {:.1} us per all-to-all, {ingress:.1} GB/s ingress per GPU (copy engines)",
        med * 1e6
    );
    Ok(())
}
