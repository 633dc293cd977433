//! The built `libnccl_ep.so` from outside, on any machine: `nm -D` lists the 18 functions of
//! `nccl_ep.h` and the epflow marker; a C program compiled with `cc` against the generated
//! header links it and checks the version, the size and magic checks, `ncclInvalidArgument` on
//! bad arguments and a clean error without a GPU; epflow's NCCL EP backend refuses to load it.
//! Without `cc` or `nm` those checks print SKIPPED.

use std::path::PathBuf;
use std::process::Command;

/// The directory cargo wrote the library to with this test (`target/<profile>/deps`, beside
/// the test executable; `cargo build` copies it one level up).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    exe.parent().expect("deps dir").to_path_buf()
}

fn library() -> PathBuf {
    let lib = lib_dir().join("libnccl_ep.so");
    assert!(lib.exists(), "{} was not built (cargo builds the cdylib with the tests)", lib.display());
    lib
}

fn have(tool: &str) -> bool {
    let ok = Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIPPED: no `{tool}` on this machine");
    }
    ok
}

#[test]
fn exports_the_18_functions_and_the_marker() {
    if !have("nm") {
        return;
    }
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(library()).output().expect("run nm");
    let text = String::from_utf8_lossy(&out.stdout);
    let exported: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().nth(2)).collect();
    for (name, _) in nccl_ep::header::FUNCTIONS {
        assert!(exported.contains(name), "{name} is not exported:\n{text}");
    }
    assert!(exported.contains(&nccl_ep_sys::EPFLOW_MARKER), "the marker is not exported");
    let ours: Vec<&&str> = exported.iter().filter(|n| n.starts_with("ncclEp")).collect();
    assert_eq!(ours.len(), 18, "exactly NCCL EP's 18 functions: {ours:?}");
    let soname = Command::new("objdump").args(["-p"]).arg(library()).output();
    if let Ok(o) = soname {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("SONAME               libnccl_ep.so.0"), "SONAME is not libnccl_ep.so.0:\n{text}");
    }
}

#[test]
fn a_c_program_checks_the_api() {
    if !have("cc") {
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("nccl-ep-abi-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = dir.join("api_check");
    let lib = library();
    let status = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("tests/c/api_check.c"))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(lib_dir())
        .arg("-l:libnccl_ep.so")
        .status()
        .expect("run cc");
    assert!(status.success(), "the C program does not compile against include/nccl_ep.h");
    // Programs record the SONAME, libnccl_ep.so.0: that name must be on the library path (the
    // README's symlink).
    let so0 = dir.join("libnccl_ep.so.0");
    let _ = std::fs::remove_file(&so0);
    std::os::unix::fs::symlink(&lib, &so0).expect("symlink libnccl_ep.so.0");
    let no_gpu = !epflow_kernels::device::driver_present() || epflow_kernels::device_count() == 0;
    let mut run = Command::new(&exe);
    run.env("LD_LIBRARY_PATH", &dir);
    if no_gpu {
        run.arg("--no-gpu");
    }
    let out = run.output().expect("run the C program");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "api_check failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    // Every refusal says why, on one line.
    assert!(
        stderr.contains("NCCL EP (epflow) WARN ncclEpCreateGroup: config: ncclEpGroupConfig_t.size is 8"),
        "{stderr}"
    );
    assert!(stderr.contains("NCCL EP (epflow) WARN ncclEpCreateGroup: config.version is 99"), "{stderr}");
    assert!(
        stderr.contains("WARN ncclEpHandleDestroy: handle (0x") && stderr.contains("is not a live handle"),
        "{stderr}"
    );
    assert!(
        stderr.contains("WARN ncclEpGroupDestroy: ep_group (0x") && stderr.contains("is not a live group"),
        "{stderr}"
    );
}

#[test]
fn epflow_s_own_nccl_ep_backend_refuses_this_library() {
    match nccl_ep_sys::NcclEp::load_from(library()) {
        Err(nccl_ep_sys::LoadError::IsEpflow { path }) => assert!(path.ends_with("libnccl_ep.so")),
        other => panic!("expected IsEpflow, got {other:?}"),
    }
}
