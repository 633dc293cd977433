//! `epflow launch -n N -- <cmd>`: one process per GPU on this host. On one host the NCCL id is
//! made here and passed in `EPFLOW_NCCL_ID`; across hosts (`--nnodes`, `--master-addr`) each
//! host runs `epflow launch`, and the processes get torchrun's variables (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) and meet over TCP.
//!
//! With `--restarts K` (one host), a rank's process that fails while others still run is started
//! again (at most K times) with `EPFLOW_REJOIN=1` and `EPFLOW_RESTART` (its count), while the others keep running:
//! the new process takes the dead one's place in the running group (`GpuWorld::rejoin`), its
//! meetings with the survivors on `EPFLOW_MEETING_PORT` (`MASTER_PORT` + 1), which every process
//! gets (`epflow_kernels::setup::meeting::launch_meetings`).

use std::process::{Child, Command, ExitCode};
use std::time::Duration;

use epflow_core::config::MAX_RANKS;

use crate::cli::LaunchArgs;

/// The job's ranks, `nprocs` x `nnodes`: 1 to [`MAX_RANKS`], without overflow (the flags' own
/// bounds, `-n` and `--nnodes`, are checked by clap).
fn world_size(nprocs: usize, nnodes: usize) -> Result<usize, String> {
    let max_local = epflow_kernels::MAX_GPU_RANKS;
    if nprocs == 0 || nprocs > max_local {
        return Err(format!(
            "-n is {nprocs}: it must be 1 to {max_local} processes per host (epflow_kernels::MAX_GPU_RANKS)"
        ));
    }
    if nnodes == 0 {
        return Err("--nnodes must be at least 1".into());
    }
    match nprocs.checked_mul(nnodes) {
        Some(w) if w <= MAX_RANKS => Ok(w),
        _ => Err(format!(
            "-n {nprocs} x --nnodes {nnodes} is more than the {MAX_RANKS} ranks a group may have (epflow_core::config::MAX_RANKS)"
        )),
    }
}

pub(crate) fn main(args: &LaunchArgs) -> ExitCode {
    let world = match world_size(args.nprocs, args.nnodes) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let Some((program, rest)) = args.command.split_first() else {
        eprintln!("error: give the command to run after --");
        return ExitCode::from(2);
    };
    let master_addr = args.master_addr.clone().or_else(|| std::env::var("MASTER_ADDR").ok());
    if args.nnodes == 0 || args.node_rank >= args.nnodes {
        eprintln!("error: --node-rank ({}) must be below --nnodes ({})", args.node_rank, args.nnodes);
        return ExitCode::from(2);
    }
    if args.nnodes > 1 && master_addr.is_none() {
        eprintln!("error: --nnodes {} needs --master-addr (rank 0's host) or MASTER_ADDR", args.nnodes);
        return ExitCode::from(2);
    }
    let master_port = match args.master_port {
        Some(0) => {
            eprintln!("error: --master-port 0 is not a port number (1-65535)");
            return ExitCode::from(2);
        }
        Some(p) => p,
        None => match std::env::var("MASTER_PORT") {
            Ok(v) => match v.trim().parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => {
                    eprintln!("error: MASTER_PORT={v:?} is not a port number (1-65535)");
                    return ExitCode::from(2);
                }
            },
            Err(_) => 29500,
        },
    };
    // One host without a master address: the id is made here.
    let id = match &master_addr {
        Some(_) => None,
        None => match epflow_kernels::setup::bootstrap::new_unique_id() {
            Ok(id) => Some(id),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        },
    };
    // A rejoin maps the newcomer's memory with CUDA IPC: every rank on one host.
    if args.restarts > 0 && args.nnodes > 1 {
        eprintln!(
            "error: --restarts takes one host (--nnodes 1): a replacement rejoins over CUDA IPC, and NCCL peers cannot be masked"
        );
        return ExitCode::from(2);
    }
    // `--restarts`: the rejoin meetings' port, beside the rendezvous's.
    let meeting_port = match (args.restarts, master_port.checked_add(1)) {
        (0, _) => None,
        (_, Some(p)) => Some(p),
        (_, None) => {
            eprintln!("error: --restarts needs the port after --master-port ({master_port}) for the rejoin meetings");
            return ExitCode::from(2);
        }
    };
    // Starts local process `local`; `restart` counts this rank's restarts (0: the first start).
    let start = |local: usize, restart: usize| -> std::io::Result<Child> {
        // Below `world` (node_rank < nnodes), so no overflow.
        let rank = args.node_rank * args.nprocs + local;
        let mut cmd = Command::new(program);
        cmd.args(rest)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nprocs.to_string());
        match (&id, &master_addr) {
            (Some(id), _) => {
                cmd.env("EPFLOW_NCCL_ID", id).env_remove("MASTER_ADDR");
            }
            (None, Some(addr)) => {
                cmd.env("MASTER_ADDR", addr).env("MASTER_PORT", master_port.to_string()).env_remove("EPFLOW_NCCL_ID");
            }
            (None, None) => {}
        }
        if let Some(port) = meeting_port {
            cmd.env("EPFLOW_MEETING_PORT", port.to_string());
        }
        if restart > 0 {
            cmd.env("EPFLOW_REJOIN", "1").env("EPFLOW_RESTART", restart.to_string());
        } else {
            cmd.env_remove("EPFLOW_REJOIN").env_remove("EPFLOW_RESTART");
        }
        // NVLink multicast stays off unless the caller decided otherwise.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        cmd.spawn()
    };
    // (local process, its restarts so far, the child).
    let mut children: Vec<(usize, usize, Child)> = Vec::new();
    for local in 0..args.nprocs {
        match start(local, 0) {
            Ok(c) => children.push((local, 0, c)),
            Err(e) => {
                eprintln!("error: cannot start {program:?} for rank {}: {e}", args.node_rank * args.nprocs + local);
                for (_, _, c) in &mut children {
                    let _ = c.kill();
                }
                return ExitCode::from(2);
            }
        }
    }
    let mut code = 0u8;
    let mut restarts_left = args.restarts;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            let rank = args.node_rank * args.nprocs + children[i].0;
            match children[i].2.try_wait() {
                Ok(Some(status)) => {
                    let (local, restarts, _) = children.remove(i);
                    if status.success() || code != 0 {
                        continue;
                    }
                    // A replacement needs survivors to meet: none are left once the others
                    // have exited.
                    if restarts_left > 0 && !children.is_empty() {
                        restarts_left -= 1;
                        eprintln!(
                            "[launch] rank {rank} failed ({status}); starting it again with EPFLOW_REJOIN=1 ({} restart(s) left)",
                            restarts_left
                        );
                        match start(local, restarts + 1) {
                            Ok(c) => children.push((local, restarts + 1, c)),
                            Err(e) => {
                                eprintln!("[launch] cannot start rank {rank} again: {e}; stopping the others");
                                code = 1;
                                children.iter_mut().for_each(|(_, _, c)| drop(c.kill()));
                            }
                        }
                        continue;
                    }
                    code = status.code().map_or(1, |c| c.clamp(1, 255) as u8);
                    eprintln!("[launch] rank {rank} failed ({status}); stopping the others");
                    children.iter_mut().for_each(|(_, _, c)| drop(c.kill()));
                }
                Ok(None) => i += 1,
                Err(e) => {
                    eprintln!("[launch] cannot wait for rank {rank}: {e}");
                    children.remove(i);
                    code = code.max(1);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn world_size_is_bounded_without_overflow() {
        assert_eq!(world_size(2, 3), Ok(6));
        assert_eq!(world_size(8, 128), Ok(1024));
        assert_eq!(
            world_size(8, 129),
            Err("-n 8 x --nnodes 129 is more than the 1024 ranks a group may have (epflow_core::config::MAX_RANKS)"
                .to_string())
        );
        assert_eq!(
            world_size(9_223_372_036_854_775_809, 2),
            Err("-n is 9223372036854775809: it must be 1 to 8 processes per host (epflow_kernels::MAX_GPU_RANKS)"
                .to_string())
        );
        assert_eq!(world_size(1, 0), Err("--nnodes must be at least 1".to_string()));
        assert_eq!(world_size(0, 1).map_err(|e| e.contains("1 to 8")), Err(true));
    }
}
