//! Every `EPFLOW_*` knob lives in one typed place (`epflow_core::tuning`): no other library
//! source reads the environment for an `EPFLOW_*` name, and the reader's table and the docs'
//! table name the same knobs.

use std::path::{Path, PathBuf};

use epflow::core::tuning::KNOBS;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = entry.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Knobs of the test harnesses (documented with them), which library files may read in their
/// own tests.
const TEST_KNOBS: &[&str] = &["EPFLOW_BLESS"];

#[test]
fn no_library_source_reads_an_epflow_variable_outside_the_tuning_module() {
    let mut files = Vec::new();
    sources(&root().join("src"), &mut files);
    for krate in std::fs::read_dir(root().join("crates")).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.is_dir() {
            sources(&src, &mut files);
        }
    }
    assert!(files.len() > 50, "{} library sources found", files.len());
    let tuning = root().join("crates/core/src/tuning.rs");
    let mut offenders = Vec::new();
    for f in files.iter().filter(|f| **f != tuning) {
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in text.lines().enumerate() {
            let reads = line.contains("env::var") || line.contains("var_os(");
            let names_knob = line.contains("\"EPFLOW_") && !TEST_KNOBS.iter().any(|k| line.contains(k));
            if reads && names_knob {
                offenders.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(offenders.is_empty(), "EPFLOW_* read outside epflow_core::tuning:\n{}", offenders.join("\n"));
}

#[test]
fn the_docs_table_names_every_knob() {
    let doc = std::fs::read_to_string(root().join("docs/tuning-and-diagnostics.md")).unwrap();
    let missing: Vec<&str> = KNOBS.iter().map(|k| k.name).filter(|n| !doc.contains(&format!("`{n}`"))).collect();
    assert!(missing.is_empty(), "docs/tuning-and-diagnostics.md lacks {missing:?}");
}
