//! The built `libnccl_ep.so` from outside, on any machine: `nm -D` lists the 18 functions of
//! `nccl_ep.h` and the epflow marker; a C program (`gcc -std=c11`) and a C++ program
//! (`g++ -std=c++17`) compiled against the generated header link it and check the version, the
//! size, magic and version checks, `ncclInvalidArgument` on bad arguments and on values that
//! name no live group or handle, and a clean error without a GPU; epflow's NCCL EP backend
//! refuses to load it. Without `gcc`, `g++` or `nm` those checks print SKIPPED.

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

/// Compiles `source` (under `tests/c/`) with `compiler` and `flags` against the generated
/// header, linked against the built `libnccl_ep.so`, runs it (`--no-gpu` on a machine without
/// one) with the library under its SONAME on the library path, and returns its stdout and
/// stderr once it passed. `None`: no such compiler here (said loudly).
fn build_and_run(compiler: &str, flags: &[&str], source: &str) -> Option<(String, String)> {
    if !have(compiler) {
        return None;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("nccl-ep-abi-c-{}-{compiler}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = dir.join(source.replace('.', "_"));
    let lib = library();
    let out = Command::new(compiler)
        .args(flags)
        .args(["-Wall", "-Wextra", "-pedantic", "-Werror", "-o"])
        .arg(&exe)
        .arg(root.join("tests/c").join(source))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(lib_dir())
        .arg("-l:libnccl_ep.so")
        .output()
        .expect("run the compiler");
    assert!(
        out.status.success(),
        "{source} does not compile with {compiler} {flags:?} against include/nccl_ep.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    let out = run.output().expect("run the program");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{source} failed:\n{stdout}\n{stderr}");
    Some((stdout, stderr))
}

#[test]
fn a_c_program_checks_the_api() {
    let Some((stdout, stderr)) = build_and_run("gcc", &["-std=c11"], "api_check.c") else {
        return;
    };
    assert!(stdout.contains("api_check: all checks passed"), "{stdout}");
    // Every refusal says why, on one line.
    assert!(
        stderr.contains("NCCL EP (epflow) WARN ncclEpCreateGroup: config: ncclEpGroupConfig_t.size is 8"),
        "{stderr}"
    );
    assert!(stderr.contains("NCCL EP (epflow) WARN ncclEpCreateGroup: config.version is 99"), "{stderr}");
    assert!(stderr.contains("WARN ncclEpCreateGroup: config.overflow_policy is NCCL_EP_OVERFLOW_DROP"), "{stderr}");
    assert!(stderr.contains("ncclEpGroupConfig_t.size is 100; this library reads sizes 96 (API v1), 104"), "{stderr}");
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
fn a_cpp_program_compiles_against_the_header_and_checks_the_api() {
    let Some((stdout, stderr)) = build_and_run("g++", &["-std=c++17"], "api_check.cpp") else {
        return;
    };
    assert!(stdout.contains("api_check_cpp: all checks passed"), "{stdout}");
    assert!(stderr.contains("WARN ncclEpCreateGroup: config.version is 7"), "{stderr}");
}

#[test]
fn the_header_compiles_as_c_and_cpp_in_every_standard_mode() {
    // Compile only: a unit that includes the header twice (it is guarded), in C11, C17, C++17
    // and C++20, pedantic, warnings as errors.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("nccl-ep-abi-h-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let unit = "#include \"nccl_ep.h\"\n#include \"nccl_ep.h\"\nint main(void) { return (int)sizeof(ncclEpGroupConfig_t) - 96; }\n";
    let modes = [
        ("gcc", "-std=c11", "c"),
        ("gcc", "-std=c17", "c"),
        ("g++", "-std=c++17", "c++"),
        ("g++", "-std=c++20", "c++"),
    ];
    for (compiler, std, lang) in modes {
        if !have(compiler) {
            continue;
        }
        let src = dir.join(format!("unit.{}", if lang == "c" { "c" } else { "cpp" }));
        std::fs::write(&src, unit).expect("write the unit");
        let out = Command::new(compiler)
            .args([std, "-fsyntax-only", "-Wall", "-Wextra", "-pedantic", "-Werror", "-I"])
            .arg(root.join("include"))
            .arg(&src)
            .output()
            .expect("run the compiler");
        assert!(out.status.success(), "{compiler} {std}:\n{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn epflow_s_own_nccl_ep_backend_refuses_this_library() {
    match nccl_ep_sys::NcclEp::load_from(library()) {
        Err(nccl_ep_sys::LoadError::IsEpflow { path }) => assert!(path.ends_with("libnccl_ep.so")),
        other => panic!("expected IsEpflow, got {other:?}"),
    }
}
