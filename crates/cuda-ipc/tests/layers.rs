//! The core's modules import one another in one direction: no import
//! circle among the crate's top-level modules (`crate::x` paths in code,
//! not in comments or tests). A new circle fails here with its members.
//! The same holds for the Python extension (`crates/cuda-ipc-py`), checked
//! here because that crate has no test binary of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module of a source file (`src/exchange/set.rs` -> `exchange`).
fn module_of(rel: &Path) -> String {
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// `crate::name` paths in the code of `text` (comments and the test
/// module at the end left out).
fn imports(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or("");
    let mut out = BTreeSet::new();
    for line in code.lines() {
        // The code before a comment (a `//` inside a string cuts a line
        // short: it can only hide an import, never invent one).
        let line = line.split("//").next().unwrap_or("");
        for (i, _) in line.match_indices("crate::") {
            let name: String = line[i + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// The imports between the top-level modules of the crate whose sources
/// are in `src`.
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap();
            let module = module_of(rel);
            if module == "lib" || rel.to_string_lossy().ends_with("tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let deps = edges.entry(module.clone()).or_default();
            deps.extend(imports(&text).into_iter().filter(|d| *d != module));
        }
    }
    edges
}

/// A circle through `from`, if there is one (depth-first search).
fn circle(edges: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        edges: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        target: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in edges.get(at).into_iter().flatten() {
            if next == target {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(edges, next, target, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![from.to_string()];
    walk(edges, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

/// Fails, naming its members, on an import circle among the top-level
/// modules in `src` (of which there are more than `at_least`).
fn assert_no_circle(src: &Path, at_least: usize) {
    let edges = edges(src);
    assert!(
        edges.len() > at_least,
        "read only {} modules in {}",
        edges.len(),
        src.display()
    );
    for module in edges.keys() {
        if let Some(path) = circle(&edges, module) {
            panic!(
                "import circle in {}: {} -> {module}; a module may only import modules below it",
                src.display(),
                path.join(" -> ")
            );
        }
    }
}

#[test]
fn the_core_has_no_import_circle() {
    assert_no_circle(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), 15);
}

#[test]
fn the_python_extension_has_no_import_circle() {
    assert_no_circle(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda-ipc-py/src"),
        10,
    );
}

#[test]
fn a_circle_is_found() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    edges.entry("a".into()).or_default().insert("b".into());
    edges.entry("b".into()).or_default().insert("c".into());
    assert!(circle(&edges, "a").is_none());
    edges.entry("c".into()).or_default().insert("a".into());
    assert_eq!(circle(&edges, "a").unwrap(), ["a", "b", "c"]);
    assert_eq!(
        imports("use crate::device::Device; // crate::fence\n// crate::arena\n"),
        BTreeSet::from(["device".to_string()])
    );
}
