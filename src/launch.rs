//! `epflow launch -n N -- <cmd>`: one process per GPU on this host.

use std::process::{Child, Command, ExitCode};
use std::time::Duration;

use crate::cli::LaunchArgs;

pub fn main(args: &LaunchArgs) -> ExitCode {
    if args.nprocs == 0 {
        eprintln!("error: -n must be at least 1");
        return ExitCode::from(2);
    }
    let Some((program, rest)) = args.command.split_first() else {
        eprintln!("error: give the command to run after --");
        return ExitCode::from(2);
    };
    let id = match epflow_kernels::bootstrap::new_unique_id() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut children: Vec<(usize, Child)> = Vec::new();
    for rank in 0..args.nprocs {
        let mut cmd = Command::new(program);
        cmd.args(rest)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", args.nprocs.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", args.nprocs.to_string())
            .env("EPFLOW_NCCL_ID", &id);
        // NVLink multicast stays off unless the caller decided otherwise.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        match cmd.spawn() {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                eprintln!("error: cannot start {program:?} for rank {rank}: {e}");
                for (_, c) in &mut children {
                    let _ = c.kill();
                }
                return ExitCode::from(2);
            }
        }
    }
    let mut code = 0u8;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait() {
                Ok(Some(status)) => {
                    let (rank, _) = children.remove(i);
                    if !status.success() && code == 0 {
                        code = status.code().map_or(1, |c| c.clamp(1, 255) as u8);
                        eprintln!("[launch] rank {rank} failed ({status}); stopping the others");
                        for (_, c) in &mut children {
                            let _ = c.kill();
                        }
                    }
                }
                Ok(None) => i += 1,
                Err(e) => {
                    eprintln!("[launch] cannot wait for rank {}: {e}", children[i].0);
                    children.remove(i);
                    code = code.max(1);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ExitCode::from(code)
}
