//! The built `libnccl_ep.so` from outside, on any machine: `nm -D` lists the 18 functions of
//! `nccl_ep.h`, the epflow marker and NVIDIA's nine test hooks (C++ names; a C++ program
//! declaring them as NVIDIA's test header does links and calls them); a C program (`gcc -std=c11`) and a C++ program
//! (`g++ -std=c++17`) compiled against the generated header link it and check the version, the
//! size, magic and version checks, `ncclInvalidArgument` on bad arguments and on values that
//! name no live group or handle, and a clean error without a GPU; a C program compiled against
//! the API v2 header (`nccl_ep_v2.h`, and `nccl_ep.h` with `NCCL_EP_API_VERSION` 2) checks the
//! v2 layouts and refusals; both headers compile as C11, C17, C++17 and C++20, and mixing
//! versions in one unit is a compile error; the same C programs linked statically against
//! `libnccl_ep.a` (the crate's `staticlib`, which `cargo test` builds beside the shared
//! library) run without `libnccl_ep.so`; epflow's NCCL EP backend refuses to load the library.
//! Without `gcc`, `g++`, `nm` or the archive those checks print SKIPPED (with
//! `EPFLOW_STATIC_TEST=1`, a missing archive or `gcc` fails the static test instead).

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
    for name in nccl_ep::test_hooks::NAMES {
        assert!(exported.contains(&name), "NVIDIA's test hook {name} is not exported:\n{text}");
    }
    let ours: Vec<&&str> = exported.iter().filter(|n| n.starts_with("ncclEp")).collect();
    assert_eq!(ours.len(), 18, "exactly NCCL EP's 18 functions: {ours:?}");
    let hooks = exported.iter().filter(|n| n.contains("ncclEp") && n.contains("_test_")).count();
    assert_eq!(hooks, nccl_ep::test_hooks::NAMES.len(), "NVIDIA's test hooks and nothing else");
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
    // One directory per program and flags (tests run in parallel; each has its SONAME link).
    let tag: String = flags.concat().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let name = format!("{}{tag}", source.replace('.', "_"));
    let dir = std::env::temp_dir().join(format!("nccl-ep-abi-c-{}-{compiler}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = dir.join(&name);
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
        "{source} does not compile with {compiler} {flags:?} against include/:\n{}",
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
    assert!(stderr.contains("INFO config.zero_copy is NCCL_EP_ZERO_COPY_ON: window tensors"), "{stderr}");
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
fn nvidias_test_hooks_link_under_their_cpp_names() {
    let Some((stdout, stderr)) = build_and_run("g++", &["-std=c++17"], "test_hooks.cpp") else {
        return;
    };
    assert!(stdout.contains("test_hooks: all checks passed"), "{stdout}\n{stderr}");
    assert!(stderr.contains("ncclEpHandle_test_getSparseToDenseMap: NVIDIA's internal map"), "{stderr}");
}

#[test]
fn a_c_program_checks_api_v2_through_either_header() {
    for define in ["-DEPFLOW_INCLUDE_V2_HEADER", "-DNCCL_EP_API_VERSION=2"] {
        let Some((stdout, stderr)) = build_and_run("gcc", &["-std=c11", define], "api_check_v2.c") else {
            return;
        };
        assert!(stdout.contains("api_check_v2: all checks passed"), "{define}: {stdout}");
        for line in [
            "WARN ncclEpCreateGroup: config.version is 3",
            "WARN ncclEpCreateGroup: config.overflow_policy is 5, not an ncclEpOverflowPolicy_t",
            "INFO config.zero_copy is NCCL_EP_ZERO_COPY_ON: window tensors",
            "WARN ncclEpCreateGroup: config.zero_copy is 7, not an ncclEpZeroCopyMode_t",
            "WARN ncclEpCreateGroup: config.num_topk is 1000",
            "ncclEpGroupConfig_t.size is 100",
        ] {
            assert!(stderr.contains(line), "{define}: no `{line}` in:\n{stderr}");
        }
        // The 96-byte config's zero_copy (7, beyond its size) was never read: only one refusal
        // of it, the 112-byte one's.
        assert_eq!(stderr.matches("config.zero_copy is 7").count(), 1, "{define}:\n{stderr}");
    }
}

/// Compiles (syntax only) `unit` as `lang` with `compiler`, `std` and `defines`, pedantic,
/// warnings as errors, against `include/`; returns whether it compiled and the diagnostics.
fn compile_unit(compiler: &str, std: &str, lang: &str, defines: &[&str], unit: &str) -> (bool, String) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // One file per call: tests run in parallel.
    static UNITS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = UNITS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("nccl-ep-abi-h-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let src = dir.join(format!("unit{n}.{}", if lang == "c" { "c" } else { "cpp" }));
    std::fs::write(&src, unit).expect("write the unit");
    let out = Command::new(compiler)
        .args([std, "-fsyntax-only", "-Wall", "-Wextra", "-pedantic", "-Werror"])
        .args(defines)
        .arg("-I")
        .arg(root.join("include"))
        .arg(&src)
        .output()
        .expect("run the compiler");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

const MODES: [(&str, &str, &str); 4] =
    [("gcc", "-std=c11", "c"), ("gcc", "-std=c17", "c"), ("g++", "-std=c++17", "c++"), ("g++", "-std=c++20", "c++")];

#[test]
fn the_header_compiles_as_c_and_cpp_in_every_standard_mode() {
    // Compile only: units that include a header twice (each is guarded), in C11, C17, C++17
    // and C++20; the v2 header's static assertions check every v2 size and offset. Returning
    // 0 from main is not needed: the sizes are checked by `_Static_assert`/`static_assert`.
    let v1 = "#include \"nccl_ep.h\"\n#include \"nccl_ep.h\"\n\
              EPFLOW_NCCL_EP_STATIC_ASSERT(sizeof(ncclEpGroupConfig_t) == 96 && NCCL_EP_API_VERSION == 1, \"v1\");\n\
              int main(void) { ncclEpGroupConfig_t c = NCCL_EP_GROUP_CONFIG_INIT; return (int)c.version - 1; }\n";
    let v2 = "#include \"nccl_ep_v2.h\"\n#include \"nccl_ep.h\"\n#include \"nccl_ep_v2.h\"\n\
              EPFLOW_NCCL_EP_STATIC_ASSERT(sizeof(ncclEpGroupConfig_t) == 112 && NCCL_EP_API_VERSION == 2, \"v2\");\n\
              EPFLOW_NCCL_EP_STATIC_ASSERT(NCCL_EP_FIELD_END(ncclEpCombineConfig_t, quant_recipe) == 20, \"end\");\n\
              int main(void) { ncclEpGroupConfig_t c = NCCL_EP_GROUP_CONFIG_INIT; return (int)c.version - 2; }\n";
    let by_define = "#include \"nccl_ep.h\"\n\
              EPFLOW_NCCL_EP_STATIC_ASSERT(sizeof(ncclEpLayoutInfo_t) == 48, \"v2 by define\");\n\
              int main(void) { return (int)sizeof(ncclEpDispatchConfig_t) - 24; }\n";
    for (compiler, std, lang) in MODES {
        if !have(compiler) {
            continue;
        }
        for (what, defines, unit) in [
            ("nccl_ep.h", &[][..], v1),
            ("nccl_ep_v2.h", &[][..], v2),
            ("nccl_ep.h with NCCL_EP_API_VERSION=2", &["-DNCCL_EP_API_VERSION=2"][..], by_define),
        ] {
            let (ok, diag) = compile_unit(compiler, std, lang, defines, unit);
            assert!(ok, "{what}, {compiler} {std}:\n{diag}");
        }
    }
}

#[test]
fn one_unit_sees_one_api_version() {
    // The v2 header after the v1 one, or a version that is neither 1 nor 2: a #error that
    // says why, in C and C++.
    for (compiler, std, lang) in [MODES[0], MODES[2]] {
        if !have(compiler) {
            continue;
        }
        let (ok, diag) = compile_unit(
            compiler,
            std,
            lang,
            &[],
            "#include \"nccl_ep.h\"\n#include \"nccl_ep_v2.h\"\nint main(void) { return 0; }\n",
        );
        assert!(!ok && diag.contains("nccl_ep_v2.h: NCCL_EP_API_VERSION is not 2"), "{compiler}:\n{diag}");
        let (ok, diag) = compile_unit(
            compiler,
            std,
            lang,
            &["-DNCCL_EP_API_VERSION=3"],
            "#include \"nccl_ep.h\"\nint main(void) { return 0; }\n",
        );
        assert!(!ok && diag.contains("NCCL_EP_API_VERSION must be 1 (the default) or 2"), "{compiler}:\n{diag}");
    }
}

/// The system libraries `libnccl_ep.a` needs, as `cargo rustc --release -p epflow-nccl-ep-abi
/// --lib -- --print native-static-libs` names them (`scripts/build-nccl-ep-lib.sh` writes the
/// list to `lib/libnccl_ep.a.libs`).
const NATIVE_STATIC_LIBS: &[&str] = &["-ldl", "-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"];

#[test]
fn c_programs_linked_statically_against_libnccl_ep_a_run() {
    let strict = std::env::var_os("EPFLOW_STATIC_TEST").is_some_and(|v| v == "1");
    let archive = lib_dir().join("libnccl_ep.a");
    if !archive.exists() || !have("gcc") {
        assert!(!strict, "EPFLOW_STATIC_TEST=1: {} or gcc is missing", archive.display());
        eprintln!("SKIPPED: no {} (staticlib in Cargo.toml's crate-type?) or no gcc", archive.display());
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("nccl-ep-abi-static-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let no_gpu = !epflow_kernels::device::driver_present() || epflow_kernels::device_count() == 0;
    for (source, define, passed) in [
        ("api_check.c", None, "api_check: all checks passed"),
        ("api_check_v2.c", Some("-DEPFLOW_INCLUDE_V2_HEADER"), "api_check_v2: all checks passed"),
    ] {
        let exe = dir.join(source.replace('.', "_"));
        let out = Command::new("gcc")
            .args(["-std=c11", "-Wall", "-Wextra", "-pedantic", "-Werror"])
            .args(define)
            .arg("-o")
            .arg(&exe)
            .arg(root.join("tests/c").join(source))
            .arg("-I")
            .arg(root.join("include"))
            .arg(&archive)
            .args(NATIVE_STATIC_LIBS)
            .output()
            .expect("run gcc");
        assert!(
            out.status.success(),
            "{source} does not link statically against {}:\n{}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        if let Ok(o) = Command::new("readelf").arg("-d").arg(&exe).output() {
            let text = String::from_utf8_lossy(&o.stdout);
            assert!(text.contains("(NEEDED)"), "readelf -d lists no libraries:\n{text}");
            assert!(!text.contains("libnccl_ep"), "{source} still needs a shared libnccl_ep:\n{text}");
        }
        // No library path at all: everything of epflow's is inside the executable.
        let mut run = Command::new(&exe);
        run.env_remove("LD_LIBRARY_PATH").env_remove("LD_PRELOAD");
        if no_gpu {
            run.arg("--no-gpu");
        }
        let out = run.output().expect("run the program");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let _ = std::fs::remove_file(&exe);
        assert!(out.status.success() && stdout.contains(passed), "{source}, static:\n{stdout}\n{stderr}");
        assert!(stderr.contains("NCCL EP (epflow) WARN ncclEpCreateGroup: config.version is"), "{stderr}");
    }
}

#[test]
fn epflow_s_own_nccl_ep_backend_refuses_this_library() {
    match nccl_ep_sys::NcclEp::load_from(library()) {
        Err(nccl_ep_sys::LoadError::IsEpflow { path }) => assert!(path.ends_with("libnccl_ep.so")),
        other => panic!("expected IsEpflow, got {other:?}"),
    }
}
