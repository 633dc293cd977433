//! Launch geometry of the low-latency kernels (pure arithmetic, unit-tested): how many blocks of
//! how many threads, and how a row is cut among warps, from the operation's sizes and the SMs
//! it may use.

use crate::compile::ll_kernels::{Form, LlKernel};
use crate::params::LlParams;

/// Threads per block of the send kernels, the dispatch receive kernel and the plain one-launch
/// kernels.
const BLOCK_THREADS: u32 = 512;
/// Threads per block of the combine receive kernel.
const COMBINE_RECV_THREADS: u32 = 256;
/// Threads per block of the one-launch kernels' tagged forms (at most `EP_TAG_TOKENS` tokens):
/// their `__launch_bounds__(256, 2)` leave them 128 registers where 512 threads held them to 64
/// and they spilled (the dispatch ~200 bytes per thread on its receive's path, the combine 20):
/// 1-1.7 us of a rank-major 1- or 32-token operation (benches/NOTES.md items 109 and 111). Two
/// such blocks still fit on an SM. The plain forms keep 512 threads: in 256 (no spills either)
/// the rank-major 128-token operations were level and the expert-major ones 0.4-3 us slower,
/// their receives taking twice the rounds of copies and sums (item 111).
pub(crate) const TAGGED_ONE_LAUNCH_THREADS: u32 = 256;

/// Threads per block of a one-launch kernel in form `form`.
pub(crate) fn one_launch_threads(form: Form) -> u32 {
    match form {
        Form::Plain => BLOCK_THREADS,
        Form::Tagged => TAGGED_ONE_LAUNCH_THREADS,
    }
}

/// Threads per block of `which` for `p`.
pub(crate) fn block_threads(which: LlKernel, p: &LlParams) -> u32 {
    match which {
        LlKernel::CombineRecv => COMBINE_RECV_THREADS,
        LlKernel::DispatchOne | LlKernel::CombineOne => one_launch_threads(which.form(p)),
        _ => BLOCK_THREADS,
    }
}

/// The grid and block of `which` for `p` on at most `sms` SMs; sets the geometry fields of `p`
/// (`chunks`, `splits`, `recv_chunks`) the kernel reads. A one-launch kernel gets the larger of
/// its two halves' grids (at most `sms` blocks, one per SM, so a cooperative launch keeps every
/// block resident), both sized for its own block; each half loops over its work whatever the
/// grid.
pub(crate) fn ll_launch(which: LlKernel, p: &mut LlParams, sms: u32) -> (u32, u32) {
    let block = block_threads(which, p);
    (ll_grid(which, p, sms, block / 32), block)
}

/// The grid of `which` for `p` on at most `sms` SMs with `warps` warps per block (a grid of one
/// block per SM aims at that many warps per SM: enough bytes in flight for NVLink).
fn ll_grid(which: LlKernel, p: &mut LlParams, sms: u32, warps: u32) -> u32 {
    let (b, r, k, h) = (p.num_tokens.max(1) as u32, p.num_ranks as u32, p.top_k as u32, p.hidden as usize);
    let target_warps = sms * warps;
    match which {
        LlKernel::DispatchSend => {
            p.chunks = row_chunks(h, target_warps / (b * r).max(1)) as i32;
            (b * r * p.chunks as u32).div_ceil(warps).clamp(1, sms)
        }
        LlKernel::DispatchRecv => {
            let payload = if p.fp8 != 0 { h } else { 2 * h };
            // Tasks (group, split): a group is a local expert, or a source rank in rank-major,
            // whose rows need more blocks each: up to 64 splits of a source's rows, and no more
            // than this rank's tokens (other sources' counts are alike in a decode step), but at
            // least 8, so that a source with many more rows still spreads over blocks. A split
            // takes every splits-th row: splits beyond a source's rows only add blocks that wait
            // and leave (at one token the one-launch grid was one per SM).
            let (groups, most) =
                if p.rank_major != 0 { (p.num_ranks, (b as i32).clamp(8, 64)) } else { (p.num_local, 4) };
            p.splits = (sms as i32 / groups.max(1)).clamp(1, most);
            // The rows a task copies (rank-major: its share of a source's rows; expert-major: an
            // expert's expected rows, b K / L over all sources, its share of them) share the
            // block's warps in pieces: enough pieces that every warp has one (at one to two rows
            // a task, a warp's piece is then one round of loads, not four in turn), at least 4,
            // at most a piece per warp, each a whole number of 16-byte vectors.
            let rows = if p.rank_major != 0 {
                b.div_ceil(p.splits as u32)
            } else {
                (b * k).div_ceil(p.num_local.max(1) as u32 * p.splits as u32)
            };
            p.recv_chunks = recv_pieces(payload, rows.max(1), warps);
            // One block more than the tasks where the SMs allow: it builds the return list
            // beside the copies (else block 0 does, after its own).
            let tasks = (groups.max(1) * p.splits) as u32;
            (tasks + 1).clamp(1, sms)
        }
        LlKernel::CombineSend => {
            // Rows going back per (source, token): up to K in expert-major, one in rank-major
            // (its pre-reduced row). The warps share out the return list's real rows only, so
            // the pieces aim at one per warp over the rows that sources with as many tokens as
            // this rank send back all together: b K in expert-major (~K / r of a token's rows
            // went to each rank), at most r b in plain rank-major rows (one per source and
            // token; cut for b rows, in 14 pieces at 128 tokens and 2 ranks, the warps had two
            // rounds of loads and stores and the combine took ~1.2 us longer, benches/NOTES.md
            // item 182). Tagged rows keep pieces for b rows: at 32 tokens, half as many pieces of
            // twice the bytes made the combine ~1 us slower. Any other count is still covered:
            // the warps loop. The grid may use every SM.
            let (per_source, all_sources) = match (p.rank_major != 0, p.tagged_rows()) {
                (true, false) => (1, r),
                (true, true) => (1, 1),
                (false, _) => (k, k),
            };
            p.chunks = row_chunks(h, target_warps / (b * all_sources).max(1)) as i32;
            let items = r * b * per_source * p.chunks as u32;
            items.div_ceil(warps).clamp(1, sms)
        }
        LlKernel::CombineRecv => {
            // Pieces of whole 8-channel groups (NVFP4: 16-channel blocks).
            let group = if p.nvfp4 != 0 { 16 } else { 8 };
            p.recv_chunks = if h % (4 * group) == 0 { 4 } else { 1 };
            let c = p.recv_chunks as u32;
            (b.min((2 * sms / c).max(1)) * c).min((sms / c).max(1) * c)
        }
        LlKernel::DispatchOne | LlKernel::CombineOne => {
            let (send, recv) = if which == LlKernel::DispatchOne {
                (LlKernel::DispatchSend, LlKernel::DispatchRecv)
            } else {
                (LlKernel::CombineSend, LlKernel::CombineRecv)
            };
            let grid = ll_grid(send, p, sms, warps).max(ll_grid(recv, p, sms, warps)).clamp(1, sms.max(1));
            // A combine with fewer blocks than pieces per row: rows are summed whole (every block
            // still takes its share of the (token, piece) items, as many as fit its threads at
            // once). A dispatch's pieces are its blocks' warps' and need no blocks.
            if which == LlKernel::CombineOne && grid < p.recv_chunks as u32 {
                p.recv_chunks = 1;
            }
            grid
        }
    }
}

/// Into how many pieces a dispatch receive's `warps` warps (of a block) copy a received row of
/// `payload` bytes when a task copies about `rows` rows: the largest power of two with rows x
/// pieces <= the block's warps, at least 4 and at most a piece per warp, halved until a piece is
/// whole 16-byte vectors.
pub(crate) fn recv_pieces(payload: usize, rows: u32, warps: u32) -> i32 {
    let most = (warps / rows.max(1)).max(4).min(warps);
    let mut c = 1u32 << (31 - most.leading_zeros());
    while c > 1 && payload % (16 * c as usize) != 0 {
        c /= 2;
    }
    c as i32
}

/// Into how many pieces to split a row of `hidden` channels so that about `want` warps share it:
/// the largest divisor of `hidden / 256` not above `want` (pieces stay multiples of 256 channels,
/// whole FP8 scale blocks and 16-byte vectors). 1 when `hidden` is not a multiple of 256.
pub(crate) fn row_chunks(hidden: usize, want: u32) -> u32 {
    if hidden % 256 != 0 {
        return 1;
    }
    let units = (hidden / 256) as u32;
    (1..=units.min(want.max(1))).rev().find(|c| units % c == 0).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_names_a_function_of_the_ll_module() {
        for k in LlKernel::ALL {
            assert!(crate::compile::sources::LL.kernels.contains(&k.function_name()), "{k:?}");
            assert_eq!(k.is_combine(), k.function_name().contains("combine"), "{k:?}");
        }
    }

    #[test]
    fn rows_split_in_whole_256_channel_pieces() {
        assert_eq!(row_chunks(7168, 4), 4); // 28 units
        assert_eq!(row_chunks(7168, 5), 4);
        assert_eq!(row_chunks(7168, 1000), 28);
        assert_eq!(row_chunks(2048, 3), 2);
        assert_eq!(row_chunks(4096, 0), 1);
        assert_eq!(row_chunks(1000, 8), 1);
        assert_eq!(row_chunks(128, 8), 1);
    }

    fn params(tokens: i32) -> LlParams {
        LlParams {
            num_tokens: tokens,
            num_ranks: 2,
            top_k: 8,
            max_tokens: 128,
            hidden: 7168,
            num_local: 128,
            ..LlParams::default()
        }
    }

    #[test]
    fn the_reference_config_on_an_h200() {
        // 132 SMs, H = 7168, K = 8, 2 ranks, 128 local experts.
        let mut p = params(128);
        // 2112 warps over 256 (token, rank) items: rows in 7 pieces of 4 units, 112 blocks.
        assert_eq!(ll_launch(LlKernel::DispatchSend, &mut p, 132), (112, 512));
        assert_eq!(p.chunks, 7);
        // A block per local expert (8 rows each, in 4 pieces), and one for the return list.
        assert_eq!(ll_launch(LlKernel::DispatchRecv, &mut p, 132), (129, 512));
        assert_eq!((p.recv_chunks, p.splits), (4, 1));
        // 2112 warps over 1024 (token, k) rows: 2 pieces each; 2 x 128 x 8 x 2 items, a warp
        // each up to every SM.
        assert_eq!(ll_launch(LlKernel::CombineSend, &mut p, 132), (132, 512));
        assert_eq!(p.chunks, 2);
        // Rank-major: one row per (source, token), 256 over both sources, in 7 pieces: 1792
        // items, a warp each on 112 blocks.
        let mut q = LlParams { rank_major: 1, ..params(128) };
        assert_eq!(ll_launch(LlKernel::CombineSend, &mut q, 132), (112, 512));
        assert_eq!(q.chunks, 7);
        assert_eq!(ll_launch(LlKernel::CombineRecv, &mut p, 132), (132, 256));
        // One token: rows cut finely, small grids.
        let mut p = params(1);
        assert_eq!(ll_launch(LlKernel::DispatchSend, &mut p, 132), (4, 512));
        assert_eq!(p.chunks, 28);
        assert_eq!(ll_launch(LlKernel::CombineSend, &mut p, 132), (28, 512));
        assert_eq!(ll_launch(LlKernel::CombineRecv, &mut p, 132), (4, 256));
        // A bound on SMs bounds every grid.
        let mut p = params(128);
        for k in [
            LlKernel::DispatchSend,
            LlKernel::DispatchRecv,
            LlKernel::CombineSend,
            LlKernel::CombineRecv,
            LlKernel::DispatchOne,
            LlKernel::CombineOne,
        ] {
            assert!(ll_launch(k, &mut p, 24).0 <= 24, "{k:?}");
        }
        // Rank-major receive: a task per (source, split), 64 splits of each source's rows (2
        // rows a task, in 8 pieces), and the return list's block.
        let mut p = LlParams { rank_major: 1, ..params(128) };
        assert_eq!(ll_launch(LlKernel::DispatchRecv, &mut p, 132), (129, 512));
        assert_eq!((p.splits, p.recv_chunks), (64, 8));
        // No SM left for the list: block 0 builds it.
        assert_eq!(ll_launch(LlKernel::DispatchRecv, &mut p, 32), (32, 512));
        assert_eq!((p.splits, p.recv_chunks), (16, 4));
        // Few tokens: splits follow them, down to 8 per source, a row a task in a piece per
        // warp; at one token the one-launch dispatch takes 17 blocks (its send needs 4), not one
        // per SM.
        for (tokens, splits) in [(1, 8), (8, 8), (20, 20), (64, 64)] {
            let mut p = LlParams { rank_major: 1, ..params(tokens) };
            assert_eq!(ll_launch(LlKernel::DispatchRecv, &mut p, 132), (2 * splits as u32 + 1, 512), "{tokens}");
            assert_eq!((p.splits, p.recv_chunks), (splits, 16), "{tokens}");
        }
        let mut p = LlParams { rank_major: 1, ..params(1) };
        assert_eq!(ll_launch(LlKernel::DispatchOne, &mut p, 132), (17, 512));
    }

    #[test]
    fn forms_pick_the_function_and_the_block() {
        // Tagged combine rows (a rank-major combine of at most `tag_tokens` tokens): the tagged
        // one-launch combine and complete half, the one-launch one in 256-thread blocks.
        let p = LlParams { rank_major: 1, tag_tokens: 32, ..params(32) };
        assert_eq!(LlKernel::CombineOne.form(&p), Form::Tagged);
        assert_eq!(LlKernel::CombineRecv.form(&p), Form::Tagged);
        assert_eq!(block_threads(LlKernel::CombineOne, &p), 256);
        // The halves of a staged operation have one form each, whatever the layout.
        for k in [LlKernel::DispatchSend, LlKernel::DispatchRecv, LlKernel::CombineSend] {
            assert_eq!(k.form(&p), Form::Plain, "{k:?}");
            assert_eq!(block_threads(k, &p), 512, "{k:?}");
        }
        // Expert-major, over the tagged area's rows: the plain 512-thread kernels.
        let p = LlParams { tag_tokens: 32, ..params(128) };
        assert_eq!(LlKernel::CombineOne.form(&p), Form::Plain);
        assert_eq!(block_threads(LlKernel::CombineOne, &p), 512);
        // Every tagged form names a function of the module.
        for k in [LlKernel::DispatchOne, LlKernel::CombineRecv, LlKernel::CombineOne] {
            assert!(crate::compile::sources::LL.kernels.contains(&k.tagged_function_name().unwrap()), "{k:?}");
        }
        // The combine kernels have NVFP4 forms in the module; the dispatch kernels none.
        for k in LlKernel::ALL {
            match k.nvfp4_function_name() {
                Some(name) => assert!(crate::compile::sources::LL.kernels.contains(&name), "{k:?}"),
                None => assert!(!k.is_combine(), "{k:?} has no NVFP4 form"),
            }
        }
        // The dispatch kernels have forwarded forms in the module, in both forms; the combine none.
        for k in LlKernel::ALL {
            for form in [Form::Plain, Form::Tagged] {
                match k.forwarded_function_name(form) {
                    Some(name) => assert!(crate::compile::sources::LL.kernels.contains(&name), "{k:?} {form:?}"),
                    None => assert!(k.is_combine(), "{k:?} has no forwarded form"),
                }
            }
        }
    }

    #[test]
    fn one_launch_grids_cover_both_halves_on_at_most_one_block_per_sm() {
        // 128 tokens: the larger of the two halves' grids, both halves' fields set.
        let mut p = params(128);
        assert_eq!(ll_launch(LlKernel::DispatchOne, &mut p, 132), (129, 512));
        assert_eq!((p.chunks, p.recv_chunks, p.splits), (7, 4, 1));
        assert_eq!(ll_launch(LlKernel::CombineOne, &mut p, 132), (132, 512));
        assert_eq!((p.chunks, p.recv_chunks), (2, 4));
        // Rank-major: the receive's grid, the send's plain rows' pieces sized for the warps of
        // both sources (a warp each: 2 x 128 x 7 items on 132 x 16 warps); at 32 tokens, tagged
        // rows in 256-thread blocks, pieces for one source's rows (2 x 32 x 28 items on 132 x 8
        // warps), and plain ones (`tag_tokens` 16) for both sources' rows, still a row's 28 (the
        // most: 256-channel pieces).
        let mut q = LlParams { rank_major: 1, ..params(128) };
        assert_eq!(ll_launch(LlKernel::CombineOne, &mut q, 132), (132, 512));
        assert_eq!((q.chunks, q.recv_chunks), (7, 4));
        let mut q = LlParams { rank_major: 1, tag_tokens: 32, ..params(32) };
        assert_eq!(ll_launch(LlKernel::CombineOne, &mut q, 132), (132, 256));
        assert_eq!(q.chunks, 28);
        let mut q = LlParams { rank_major: 1, tag_tokens: 16, ..params(32) };
        assert_eq!(ll_launch(LlKernel::CombineOne, &mut q, 132), (128, 512));
        assert_eq!(q.chunks, 28);
        // One token: the combine's grid follows its send (8 rows in 28 pieces, a warp each); the
        // dispatch's follows its receive (a block per local expert, at most a row each, copied
        // in a piece per warp, and the list's block).
        let mut p = params(1);
        assert_eq!(ll_launch(LlKernel::CombineOne, &mut p, 132), (28, 512));
        assert_eq!(p.recv_chunks, 4);
        assert_eq!(ll_launch(LlKernel::DispatchOne, &mut p, 132), (129, 512));
        assert_eq!(p.recv_chunks, 16);
        // FP8 rows (7168 bytes) too are cut in 16 whole-vector pieces; an odd payload in fewer.
        assert_eq!(recv_pieces(7168, 1, 16), 16);
        assert_eq!(recv_pieces(7168, 3, 16), 4);
        assert_eq!(recv_pieces(16 * 6, 1, 16), 2);
        assert_eq!(recv_pieces(16 * 7, 1, 16), 1);
        // Fewer SMs than a combine receive group: rows are summed whole.
        for sms in 1..=3 {
            let (grid, _) = ll_launch(LlKernel::CombineOne, &mut p, sms);
            assert!(grid <= sms);
            assert_eq!(p.recv_chunks, 1, "{sms} SMs");
        }
        // A dispatch sent as tagged messages runs in blocks of 256 threads: its send aims at 8
        // warps per SM (rows in 14 pieces at 32 tokens, a warp each on 112 blocks; 28 at one),
        // its receive copies a row in at most 8 pieces (one per warp).
        let tagged = |tokens| LlParams { rank_major: 1, tag_dispatch_tokens: 32, ..params(tokens) };
        let mut p = tagged(32);
        assert_eq!(ll_launch(LlKernel::DispatchOne, &mut p, 132), (112, 256));
        assert_eq!((p.chunks, p.splits, p.recv_chunks), (14, 32, 8));
        let mut p = tagged(1);
        assert_eq!(ll_launch(LlKernel::DispatchOne, &mut p, 132), (17, 256));
        assert_eq!((p.chunks, p.splits, p.recv_chunks), (28, 8, 8));
        // Beyond the tagged bound, the plain kernel's 512.
        let mut p = tagged(33);
        assert_eq!(LlKernel::DispatchOne.form(&p), Form::Plain);
        assert_eq!(ll_launch(LlKernel::DispatchOne, &mut p, 132).1, 512);
        assert_eq!(recv_pieces(14336, 1, 8), 8);
        for sms in [1, 2, 7, 24, 132] {
            for tokens in [1, 7, 128] {
                let mut p = params(tokens);
                for k in [LlKernel::DispatchOne, LlKernel::CombineOne] {
                    let (grid, block) = ll_launch(k, &mut p, sms);
                    assert!((1..=sms).contains(&grid) && block == 512, "{k:?} {sms} SMs {tokens} tokens");
                    assert!(p.recv_chunks >= 1 && p.chunks >= 1);
                }
            }
        }
    }
}
