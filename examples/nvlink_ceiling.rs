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
//! a 7168-wide BF16 row each); `--local` then copies locally with bulk copies too. With
//! `--balanced` (and `--sms N`), the SM stores' warps take 16 KB pieces from a counter instead of
//! a fixed share each (`GpuRank::sm_copy_balanced`), so blocks the memory system serves faster
//! copy more. Every copied
//! region is checked against its source at the end. With the copy engines, `--local-sms N` adds
//! `--local-copies K` (default 2) local copies of the same size on N blocks of SM stores per GPU at
//! the same time (a dispatch through the copy engines would still copy its own rows and compact
//! the received ones in HBM), and `--chunks K` splits each peer copy into K copies, each followed
//! by a stream write of a flag word in the source's memory (`cuStreamWriteValue32`, what a
//! receiving kernel would poll; `--no-flags` leaves them out), on `--piece-streams S` streams per
//! pair in turn. `--gate-us G` times on the device instead of the host clock: every stream waits
//! behind a G µs spin, and CUDA events measure from its end to the last stream's end (the host's
//! enqueueing out of the figure). High-throughput dispatch at the reference
//! config moves ~53 MB per pair on 4 GPUs, ~58 MB on 2.
//!
//! ```sh
//! cargo run --release --example nvlink_ceiling [-- --mb 56 --iters 20 --sms 132 --local --tma]
//! cargo run --release --example nvlink_ceiling -- --mb 56 --gate-us 1500 --local-sms 32 --chunks 8
//! ```

use std::time::Instant;

use cudarc::driver::CudaStream;
use epflow::core::GroupConfig;
use epflow_kernels::device::DeviceBuffer;
use epflow_kernels::{BulkStages, CopyRange, GpuRank, GpuWorld, device_count};

#[path = "common/flags.rs"]
mod flags;

/// The NVLink all-to-all ceiling of this machine (2 or more GPUs). Bounds: `--mb` 1..=65536 (the
/// GPU memory it needs, `--mb` x (ranks + 1) per GPU, is checked first), `--iters` 1..=100000,
/// `--sms` and `--local-sms` 0..=1024, `--chunks` 1..=1024.
#[derive(Debug, clap::Parser)]
#[command(name = "nvlink_ceiling")]
struct Flags {
    /// MB each GPU copies to every other GPU.
    #[arg(long, default_value_t = 53, value_parser = flags::int_in(1usize, 65_536))]
    mb: usize,
    /// Timed repetitions.
    #[arg(long, default_value_t = 20, value_parser = flags::int_in(1usize, 100_000))]
    iters: usize,
    /// SM blocks per GPU for SM stores (0: the copy engines).
    #[arg(long, default_value_t = 0, value_parser = flags::int_in(0usize, 1024))]
    sms: usize,
    /// Also copy the same size within each GPU at the same time.
    #[arg(long)]
    local: bool,
    /// (with `--sms`) Bulk copies with the Tensor Memory Accelerator.
    #[arg(long)]
    tma: bool,
    /// (with `--sms`) Warps take 16 KB pieces from a counter.
    #[arg(long)]
    balanced: bool,
    /// (with `--tma`) Bytes per shared-memory stage, 16..=65536.
    #[arg(long, default_value_t = 14336, value_parser = flags::int_in(16u32, 65_536))]
    chunk: u32,
    /// (with `--tma`) Shared-memory stages, 1..=64.
    #[arg(long, default_value_t = 14, value_parser = flags::int_in(1u32, 64))]
    stages: u32,
    /// (copy engines) SM blocks per GPU for concurrent local copies.
    #[arg(long, default_value_t = 0, value_parser = flags::int_in(0usize, 1024))]
    local_sms: usize,
    /// (with `--local-sms`) Local copies, 1..=64.
    #[arg(long, default_value_t = 2, value_parser = flags::int_in(1usize, 64))]
    local_copies: usize,
    /// (copy engines) Pieces per peer copy, each followed by a flag write.
    #[arg(long, default_value_t = 1, value_parser = flags::int_in(1usize, 1024))]
    chunks: usize,
    /// (with `--chunks`) Streams per pair the pieces take in turn, 1..=64.
    #[arg(long, default_value_t = 1, value_parser = flags::int_in(1usize, 64))]
    piece_streams: usize,
    /// (with `--chunks`) No flag writes after the pieces.
    #[arg(long)]
    no_flags: bool,
    /// Time on the device: every stream waits behind a G µs spin first (0: host clock).
    #[arg(long, default_value_t = 0, value_parser = flags::int_in(0usize, 10_000_000))]
    gate_us: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let f = <Flags as clap::Parser>::parse();
    let n = device_count();
    if n < 2 {
        eprintln!("SKIPPED: needs 2 or more GPUs, this machine has {n}");
        return Ok(());
    }
    let (mb, iters, sms, local, tma, balanced) = (f.mb, f.iters, f.sms, f.local, f.tma, f.balanced);
    let (chunk, stages) = (f.chunk, f.stages);
    let (local_sms, local_copies, chunks) = (f.local_sms, f.local_copies, f.chunks);
    let (piece_streams, flagged) = (f.piece_streams, !f.no_flags);
    let bytes = mb << 20;
    let devices: Vec<usize> = (0..n.min(8)).collect();
    // A group only to open the contexts and enable peer access between every pair.
    let ranks = GpuWorld::create(&devices, GroupConfig::high_throughput(8 * devices.len(), 1024))?;
    let r = ranks.len();
    for k in &ranks {
        // The source, one region per source GPU, and the local copies beside the copy engines.
        let locals = if sms == 0 && local_sms > 0 { 1 + local_copies } else { 0 };
        let need = (bytes as u128) * (1 + r + locals) as u128;
        flags::check_device_memory(
            k.context(),
            || format!("GPU {}: --mb {mb} to and from {r} GPUs", k.device()),
            need,
        )?;
    }
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
        .map(|k| (0..r * piece_streams).map(|_| k.context().new_stream()).collect::<Result<Vec<_>, _>>())
        .collect::<Result<_, _>>()?;
    let shape = BulkStages { chunk, stages };
    // Local copies beside the copy engines: `local_copies` regions of `bytes` per GPU.
    let (local_src, local_dst): (Vec<DeviceBuffer>, Vec<DeviceBuffer>) = if sms == 0 && local_sms > 0 {
        let a = ranks.iter().map(|k| DeviceBuffer::zeroed(k.context(), bytes)).collect::<Result<_, _>>()?;
        let b =
            ranks.iter().map(|k| DeviceBuffer::zeroed(k.context(), bytes * local_copies)).collect::<Result<_, _>>()?;
        (a, b)
    } else {
        (Vec::new(), Vec::new())
    };
    let local_streams: Vec<_> =
        local_src.iter().zip(&ranks).map(|(_, k)| k.context().new_stream()).collect::<Result<_, _>>()?;
    // One flag word per (source, chunk), in the source's memory.
    let flags: Vec<DeviceBuffer> =
        ranks.iter().map(|k| DeviceBuffer::zeroed(k.context(), 4 * chunks * r)).collect::<Result<_, _>>()?;
    let piece = bytes.div_ceil(chunks).next_multiple_of(16);
    // `--gate-us G`: every rank's streams first wait behind a G µs spin on a gate stream, so the
    // host's enqueueing is hidden, and the time is the device's, from the gate's end to the last
    // stream's end (CUDA events, per rank; the larger rank's).
    let gate_us = f.gate_us as u64;
    let gates: Vec<_> = ranks.iter().map(|k| k.context().new_stream()).collect::<Result<_, _>>()?;
    let mut dev_times = Vec::with_capacity(iters);
    // `--balanced`: one work counter per (source, destination) pair, in the source's memory.
    let counters: Vec<Vec<DeviceBuffer>> = ranks
        .iter()
        .map(|k| (0..r).map(|_| DeviceBuffer::zeroed(k.context(), 8)).collect::<Result<_, _>>())
        .collect::<Result<_, _>>()?;
    // `copy` with SM stores or bulk copies on `blocks` blocks of `rank`, on `stream`.
    let probe = |rank: &GpuRank, stream: &CudaStream, copy: CopyRange<'_>, blocks: u32, counter: &DeviceBuffer| {
        // SAFETY: every buffer lives until the end of main, after every stream is synchronized;
        // each (source, destination) pair has its own region of the destination buffer and its
        // own counter.
        unsafe {
            match (tma, balanced) {
                (true, _) => rank.tma_copy(stream, copy, blocks, shape),
                (false, true) => rank.sm_copy_balanced(stream, copy, blocks, counter),
                (false, false) => rank.sm_copy(stream, copy, blocks),
            }
        }
    };
    let mut times = Vec::with_capacity(iters);
    for it in 0..iters + 3 {
        let t = Instant::now();
        let mut marks = Vec::new();
        if gate_us > 0 {
            for s in 0..r {
                ranks[s].context().bind_to_thread()?;
                ranks[s].delay_on(&gates[s], std::time::Duration::from_micros(gate_us))?;
                let start = ranks[s].context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
                start.record(&gates[s])?;
                for st in streams[s].iter().chain(local_streams.get(s)) {
                    st.wait(&start)?;
                }
                marks.push(start);
            }
        }
        for s in 0..r {
            ranks[s].context().bind_to_thread()?;
            for d in (0..r).filter(|&d| d != s) {
                if sms > 0 {
                    let copy = CopyRange { dst: &dst[d], dst_offset: s * bytes, src: &src[s], bytes };
                    probe(&ranks[s], &streams[s][d], copy, peer_blocks, &counters[s][d])?;
                    continue;
                }
                let to = dst[d].ptr() + (s * bytes) as u64;
                for k in 0..chunks {
                    let (at, n) = (k * piece, piece.min(bytes.saturating_sub(k * piece)));
                    let st = streams[s][d * piece_streams + k % piece_streams].cu_stream();
                    // SAFETY: both ranges lie inside live cuMemAlloc allocations of `bytes`
                    // (peer access is enabled between every pair); the copy is ordered on its own
                    // stream, the flag word inside this GPU's live `flags` buffer.
                    unsafe {
                        cudarc::driver::sys::cuMemcpyDtoDAsync_v2(to + at as u64, src[s].ptr() + at as u64, n, st)
                            .result()?;
                        if chunks > 1 && flagged {
                            let flag = flags[s].ptr() + (4 * (d * chunks + k)) as u64;
                            cudarc::driver::sys::cuStreamWriteValue32_v2(st, flag, (it + 1) as u32, 0).result()?;
                        }
                    }
                }
            }
            for k in 0..if local_src.is_empty() { 0 } else { local_copies } {
                let copy = CopyRange { dst: &local_dst[s], dst_offset: k * bytes, src: &local_src[s], bytes };
                // SAFETY: as `probe`: the buffers live until the end of main, the regions are disjoint.
                unsafe { ranks[s].sm_copy(&local_streams[s], copy, local_sms as u32) }?;
            }
            if local && sms > 0 {
                // The own region of this GPU's destination buffer, on the stream of pair (s, s).
                let copy = CopyRange { dst: &dst[s], dst_offset: s * bytes, src: &src[s], bytes };
                probe(&ranks[s], &streams[s][s], copy, sms as u32, &counters[s][s])?;
            }
        }
        let mut ends: Vec<Vec<_>> = Vec::new();
        if gate_us > 0 {
            for s in 0..r {
                ranks[s].context().bind_to_thread()?;
                let mut e = Vec::new();
                for st in streams[s].iter().chain(local_streams.get(s)) {
                    let ev =
                        ranks[s].context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
                    ev.record(st)?;
                    e.push(ev);
                }
                ends.push(e);
            }
        }
        for st in streams.iter().flatten().chain(&local_streams) {
            st.synchronize()?;
        }
        if gate_us > 0 && it >= 3 {
            let mut worst = 0f32;
            for (start, e) in marks.iter().zip(&ends) {
                for ev in e {
                    worst = worst.max(start.elapsed_ms(ev)?);
                }
            }
            dev_times.push(f64::from(worst) * 1e-3);
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
    if gate_us > 0 {
        times = dev_times;
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let ingress = (r - 1) as f64 * bytes as f64 / med / 1e9;
    let kind = match (tma, balanced) {
        (true, _) => format!("bulk copies ({stages} x {chunk} B)"),
        (false, true) => "SM stores, balanced".to_string(),
        (false, false) => "SM stores".to_string(),
    };
    let how = match (sms, local) {
        (0, _) if local_sms > 0 => format!(
            "copy engines in {chunks} piece(s) on {piece_streams} stream(s), flags {flagged}, with {local_copies} local copies of {mb} MB on {local_sms} blocks"
        ),
        (0, _) => format!("copy engines in {chunks} piece(s) on {piece_streams} stream(s), flags {flagged}"),
        (n, false) => format!("{kind}, {n} blocks per GPU"),
        (n, true) => format!("{kind}, {n} blocks per GPU, with a local copy of {mb} MB on {n} more"),
    };
    println!(
        "{r} GPUs, {mb} MB to every peer: median {:.1} us per all-to-all ({}), {ingress:.1} GB/s ingress per GPU ({how})",
        med * 1e6,
        if gate_us > 0 { "device, CUDA events" } else { "host clock" }
    );
    Ok(())
}
