//! The loader's errors, on any machine: a library that is absent, one that is not NCCL EP, and
//! NCCL EP builds of the wrong version. The stand-in libraries are compiled here from a few
//! lines of C (stub entry points, a chosen version); without a C compiler those cases print
//! SKIPPED.

use std::path::PathBuf;
use std::process::Command;

use nccl_ep_sys::{LoadError, NcclEp};

const ENTRY_POINTS: &[&str] = &[
    "ncclEpCreateGroup",
    "ncclEpCreateHandle",
    "ncclEpHandleDestroy",
    "ncclEpDispatch",
    "ncclEpCombine",
    "ncclEpComplete",
];

/// Compiles a stand-in library: every entry point (all but `skip`) as a stub,
/// `ncclEpGroupDestroy` returning 42 for a null group, and the given version functions.
fn stand_in(name: &str, skip: Option<&str>, ep_version: Option<i32>, nccl_version: Option<i32>) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("nccl-ep-sys-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let mut c = String::new();
    for f in ENTRY_POINTS.iter().filter(|f| Some(**f) != skip) {
        c.push_str(&format!("int {f}(void) {{ return 0; }}\n"));
    }
    c.push_str("int ncclEpGroupDestroy(void* g) { return g == 0 ? 42 : 0; }\n");
    if let Some(v) = ep_version {
        c.push_str(&format!("int ncclEpGetVersion(int* v) {{ *v = {v}; return 0; }}\n"));
    }
    if let Some(v) = nccl_version {
        c.push_str(&format!("int ncclGetVersion(int* v) {{ *v = {v}; return 0; }}\n"));
        c.push_str("const char* ncclGetErrorString(int r) { return r == 0 ? \"no error\" : \"stand-in error\"; }\n");
    }
    let src = dir.join(format!("{name}.c"));
    let lib = dir.join(format!("lib{name}.so"));
    std::fs::write(&src, c).ok()?;
    let ok = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).status().ok()?.success();
    ok.then_some(lib)
}

macro_rules! need {
    ($e:expr, $what:expr) => {
        match $e {
            Some(v) => v,
            None => {
                eprintln!("SKIPPED {}: no C compiler (cc) to build the stand-in library", $what);
                return;
            }
        }
    };
}

#[test]
fn an_absent_library_says_where_it_looked() {
    let e = NcclEp::load_with(Some("/nonexistent/libnccl_ep.so".into())).unwrap_err();
    assert!(matches!(e, LoadError::Open { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("NCCL_EP_LIB=/nonexistent/libnccl_ep.so"), "{msg}");
    let e = NcclEp::load_from("/nonexistent/libx.so").unwrap_err().to_string();
    assert!(e.contains("/nonexistent/libx.so"), "{e}");
}

#[test]
fn without_nccl_ep_lib_the_default_names_are_tried() {
    // CI has no NCCL EP: the error names the files tried and how to point at the library.
    match NcclEp::load_with(None) {
        Err(e @ LoadError::NotFound { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("libnccl_ep.so") && msg.contains("NCCL_EP_LIB"), "{msg}");
        }
        // cargo puts the workspace's own build folder on the tests' library path, where
        // epflow's libnccl_ep.so lies: it must be recognized and refused, with the way out.
        Err(e @ LoadError::IsEpflow { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("epflow's own libnccl_ep.so") && msg.contains("NCCL_EP_LIB"), "{msg}");
        }
        Err(other) => panic!("unexpected error: {other}"),
        Ok(lib) => eprintln!("note: an NCCL EP library is installed here: {lib:?}"),
    }
}

#[test]
fn a_library_without_the_entry_points_is_refused() {
    let lib = need!(stand_in("noep", Some("ncclEpDispatch"), Some(100), None), "missing symbol");
    let e = NcclEp::load_from(&lib).unwrap_err();
    assert!(matches!(e, LoadError::MissingSymbol { symbol: "ncclEpDispatch", .. }), "{e}");
    assert!(e.to_string().contains("NCCL EP 0.1"), "{e}");
}

#[test]
fn other_versions_are_refused_with_what_was_found() {
    let newer = need!(stand_in("ep02", None, Some(200), None), "wrong version");
    let e = NcclEp::load_from(&newer).unwrap_err().to_string();
    assert!(e.contains("NCCL EP 0.2.0") && e.contains("supports NCCL EP 0.1"), "{e}");
    let old_nccl = need!(stand_in("nccl228", None, None, Some(22809)), "wrong NCCL");
    let e = NcclEp::load_from(&old_nccl).unwrap_err().to_string();
    assert!(e.contains("NCCL 2.28.9"), "{e}");
    let unknown = need!(stand_in("noversion", None, None, None), "no version");
    let e = NcclEp::load_from(&unknown).unwrap_err().to_string();
    assert!(e.contains("cannot tell the version"), "{e}");
}

#[test]
fn a_supported_library_loads_and_its_functions_are_callable() {
    for (name, ep, nccl, want) in
        [("ep01", Some(100), None, "NCCL EP 0.1.0"), ("nccl230", None, Some(23007), "NCCL 2.30.7 (NCCL EP 0.1)")]
    {
        let path = need!(stand_in(name, None, ep, nccl), "supported version");
        let lib = NcclEp::load_with(Some(path.clone().into())).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(lib.version(), want);
        // SAFETY: the stand-in only compares the pointer with null.
        let r = unsafe { (lib.group_destroy)(std::ptr::null_mut()) };
        assert_eq!(r, 42);
    }
}
