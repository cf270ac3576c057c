//! Every crate's modules import one another in one direction: no import
//! circle among the modules of a folder, at any level, in the core, the
//! channel, the bench, the CLI and the Python extension (paths in code, not
//! in comments or tests). A new circle fails here with its folder and
//! members.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

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

/// The imports among the modules of crate source folder `src`, at every
/// level, by folder (the crate root is the empty path): among the modules
/// directly under `src` (a folder with all it holds counting as one
/// module), and likewise among the submodules of every module folder.
/// Paths are read from the code: `crate::`, `super::` and `self::` paths,
/// `use` trees included, and a name that a module brings in with `use`
/// counts as the module it names (so a re-export cannot hide an import).
/// Test modules are left out.
#[allow(clippy::too_many_lines)] // one reading of the folder, in its steps
fn imports_under(src: &Path) -> Edges {
    /// The module path of a file under `src` (`report/targets.rs` ->
    /// `report::targets`, `sections/mod.rs` -> `sections`).
    fn module_path(rel: &Path) -> Vec<String> {
        let mut path: Vec<String> = rel
            .iter()
            .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if matches!(
            path.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            path.pop();
        }
        path
    }
    /// The paths of a `use` tree (`a::{b, c::d as e}`) at the start of
    /// `s`, each after `prefix`, with `as e` last where renamed; returns
    /// how much of `s` the tree took.
    fn tree(s: &str, prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
        let skip = |i: usize| i + s[i..].len() - s[i..].trim_start().len();
        let mut path = prefix.to_vec();
        let mut i = 0;
        loop {
            i = skip(i);
            if s[i..].starts_with('{') {
                i += 1;
                loop {
                    i = skip(i);
                    if s[i..].starts_with('}') {
                        return i + 1;
                    }
                    let took = tree(&s[i..], &path, out);
                    if took == 0 {
                        return i;
                    }
                    i = skip(i + took);
                    if s[i..].starts_with(',') {
                        i += 1;
                    } else {
                        return i + usize::from(s[i..].starts_with('}'));
                    }
                }
            }
            if s[i..].starts_with('*') {
                i += 1;
                break;
            }
            let ident: String = s[i..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if ident.is_empty() {
                break;
            }
            i += ident.len();
            if ident != "self" || path.is_empty() {
                path.push(ident);
            }
            if s[i..].starts_with("::") {
                i += 2;
            } else {
                break;
            }
        }
        let after = skip(i);
        if let Some(alias) = s[after..].strip_prefix("as ") {
            let alias: String = alias
                .trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            path.push(format!("as {alias}"));
        }
        if path.len() > prefix.len() {
            out.push(path);
        }
        i
    }

    // Every source file: its module path and its code, test modules and
    // comments left out.
    let mut files = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let stem = path.file_stem().unwrap().to_string_lossy().to_string();
            if stem.starts_with("tests") || stem.ends_with("tests") {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let mut code = String::new();
                let mut lines = text.lines().peekable();
                while let Some(line) = lines.next() {
                    let next = lines.peek().map_or("", |l| l.trim());
                    if line.trim() == "#[cfg(test)]"
                        && next.starts_with("mod ")
                        && next.ends_with('{')
                    {
                        break; // the test module at the end
                    }
                    code.push_str(line.split("//").next().unwrap_or(""));
                    code.push('\n');
                }
                files.push((module_path(path.strip_prefix(src).unwrap()), code));
            }
        }
    }
    let modules: BTreeSet<Vec<String>> = files.iter().map(|(m, _)| m.clone()).collect();
    let is_module = |p: &[String]| modules.iter().any(|m| m.starts_with(p));

    // Every path in the code, made absolute; `use` paths relative to a
    // module's own submodules too.
    let mut uses = Vec::new(); // (file's module, absolute path)
    for (me, code) in &files {
        let mut starts: Vec<usize> = ["crate::", "super::", "self::"]
            .iter()
            .flat_map(|p| code.match_indices(p).map(|(i, _)| i))
            .filter(|&i| {
                !code[..i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
            })
            .collect();
        starts.extend(code.match_indices("use ").map(|(i, _)| i + 4).filter(|&i| {
            !code[..i - 4]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        }));
        for start in starts {
            let mut paths = Vec::new();
            tree(&code[start..], &[], &mut paths);
            for p in paths {
                let mut at = me.clone();
                let mut rest = &p[..];
                match rest.first().map(String::as_str) {
                    Some("crate") => {
                        at.clear();
                        rest = &rest[1..];
                    }
                    Some("super" | "self") => {
                        while let Some(first) = rest.first() {
                            match first.as_str() {
                                "super" => drop(at.pop()),
                                "self" => {}
                                _ => break,
                            }
                            rest = &rest[1..];
                        }
                    }
                    Some(first) => {
                        let mut child = me.clone();
                        child.push(first.to_string());
                        if !is_module(&child) {
                            continue; // another crate, or an item
                        }
                    }
                    None => continue,
                }
                at.extend(rest.iter().cloned());
                uses.push((me.clone(), at));
            }
        }
    }
    // What a name brought in by a module's `use` stands for.
    let mut aliases: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
    for (me, target) in &uses {
        let mut target = target.clone();
        let name = match target.last() {
            Some(last) if last.starts_with("as ") => {
                let name = last["as ".len()..].to_string();
                target.pop();
                name
            }
            Some(last) => last.clone(),
            None => continue,
        };
        let mut key = me.clone();
        key.push(name);
        if key != target {
            aliases.insert(key, target);
        }
    }
    // The edges at every level: from the module holding the importing file
    // to the module holding the imported item, in the folder both share.
    let mut edges = Edges::new();
    for (me, target) in &uses {
        let mut target: Vec<String> = target
            .iter()
            .filter(|c| !c.starts_with("as "))
            .cloned()
            .collect();
        for _ in 0..8 {
            match (1..=target.len()).find_map(|n| aliases.get(&target[..n]).map(|a| (n, a))) {
                Some((n, a)) => {
                    target = a
                        .iter()
                        .cloned()
                        .chain(target[n..].iter().cloned())
                        .collect();
                }
                None => break,
            }
        }
        let shared = me.iter().zip(&target).take_while(|(a, b)| a == b).count();
        if shared < me.len() && shared < target.len() && is_module(&target[..=shared]) {
            edges
                .entry(me[..shared].to_vec())
                .or_default()
                .entry(me[shared].clone())
                .or_default()
                .insert(target[shared].clone());
        }
    }
    edges
}

/// The imports of one crate: by folder, each module's imported modules.
type Edges = BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>>;

/// The import circles among the modules of crate source folder `src`, at
/// every level (see [`imports_under`]). A circle is named by the folder it
/// lies in and its members, in import order.
fn circles_under(src: &Path) -> Vec<String> {
    let edges = imports_under(src);
    let mut found = Vec::new();
    for (folder, level) in &edges {
        if let Some(path) = level.keys().find_map(|m| circle(level, m)) {
            let folder = if folder.is_empty() {
                "the crate root".to_string()
            } else {
                folder.join("::")
            };
            found.push(format!(
                "{} -> {} (in {folder})",
                path.join(" -> "),
                path[0]
            ));
        }
    }
    found
}

/// The circles of crate `name` (a folder next to this crate's), or of this
/// crate for `None`.
fn circles_of(name: Option<&str>) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = match name {
        Some(n) => root.join("..").join(n).join("src"),
        None => root.join("src"),
    };
    assert!(src.is_dir(), "no folder {}", src.display());
    circles_under(&src)
}

#[test]
fn the_library_crates_have_no_import_circle() {
    for name in ["cuda-ipc-core", "cuda-ipc-exchange", "cuda-ipc-service"] {
        let found = circles_of(Some(name));
        assert!(found.is_empty(), "import circles in {name}: {found:#?}");
    }
}

/// The core's top-level modules and folders, lowest layer first, as its
/// lib.rs lists them: each imports only modules before it.
const CORE_ORDER: [&str; 16] = [
    "error",
    "units",
    "phases",
    "json",
    "handle",
    "mechanism",
    "container",
    "driver",
    "device",
    "sync",
    "memory",
    "kernels",
    "descriptor",
    "share",
    "fence",
    "floor",
];

/// The exchange's modules, lowest first (above the whole core).
const EXCHANGE_ORDER: [&str; 4] = ["torch", "set", "arena", "exchange"];

/// The service's modules, lowest first (above the core and the exchange).
const SERVICE_ORDER: [&str; 6] = ["checkpoint", "pinned", "loader", "saver", "keep", "service"];

/// What in the crate folder `name` breaks its layers: a top-level module
/// that imports one `order` puts above it (or itself, through a folder),
/// or a top-level module with no place in `order`.
fn layer_breaks(name: &str, order: &[&str]) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(name)
        .join("src");
    let place = |m: &str| order.iter().position(|o| *o == m);
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let module_name = path.file_stem().unwrap().to_string_lossy().to_string();
        let module = path.is_dir() || path.extension().is_some_and(|e| e == "rs");
        if module && module_name != "lib" && place(&module_name).is_none() {
            wrong.push(format!("{name}: {module_name} has no place in its order"));
        }
    }
    let edges = imports_under(&src);
    for (from, to) in edges.get(&Vec::new()).into_iter().flatten() {
        for to in to {
            // A name of a lower crate (`crate::error`, brought in by lib.rs)
            // has no place here: it is below every module of this crate.
            if place(to).is_some() && place(to) >= place(from) {
                wrong.push(format!("{name}: {from} imports {to}, a layer above it"));
            }
        }
    }
    wrong
}

/// Each library crate's folders are its layers; the compiler holds the
/// crates' order (the core cannot name the exchange, nor the exchange the
/// service).
#[test]
fn each_library_crate_imports_only_lower_layers() {
    let mut wrong = layer_breaks("cuda-ipc-core", &CORE_ORDER);
    wrong.extend(layer_breaks("cuda-ipc-exchange", &EXCHANGE_ORDER));
    wrong.extend(layer_breaks("cuda-ipc-service", &SERVICE_ORDER));
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn the_python_extension_has_no_import_circle() {
    let found = circles_of(Some("cuda-ipc-py"));
    assert!(found.is_empty(), "import circles: {found:#?}");
}

#[test]
fn a_circle_is_found() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    edges.entry("a".into()).or_default().insert("b".into());
    edges.entry("b".into()).or_default().insert("c".into());
    assert!(circle(&edges, "a").is_none());
    edges.entry("c".into()).or_default().insert("a".into());
    assert_eq!(circle(&edges, "a").unwrap(), ["a", "b", "c"]);
}

#[test]
fn the_bench_has_no_import_circle() {
    let found = circles_of(Some("cuda-ipc-bench"));
    assert!(found.is_empty(), "import circles: {found:#?}");
}

#[test]
fn the_cli_has_no_import_circle() {
    let found = circles_of(Some("cuda-ipc-cli"));
    assert!(found.is_empty(), "import circles: {found:#?}");
}

#[test]
fn the_channel_has_no_import_circle() {
    let found = circles_of(Some("cuda-ipc-channel"));
    assert!(found.is_empty(), "import circles: {found:#?}");
}

/// The bench's report folder on its own: its model, targets, format and
/// text table import one another in one direction.
#[test]
fn the_bench_report_has_no_import_circle() {
    let found: Vec<String> = circles_of(Some("cuda-ipc-bench"))
        .into_iter()
        .filter(|c| c.ends_with("(in report)"))
        .collect();
    assert!(found.is_empty(), "import circles: {found:#?}");
}

#[test]
fn circles_are_found_through_folders_super_and_re_exports() {
    let src = std::env::temp_dir().join(format!("layers-{}", std::process::id()));
    let write = |rel: &str, text: &str| {
        let path = src.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "mod a;\nmod b;\nuse b::Thing;\n");
    write("a.rs", "use crate::{Thing, b::Other};\n");
    write("b/mod.rs", "mod inner;\npub use inner::Thing;\n");
    write(
        "b/inner.rs",
        "pub struct Thing;\nuse super::{\n    super::a::Up, // crate::c\n};\n",
    );
    write("b/deep/x.rs", "use super::y::Z;\n");
    write("b/deep/y.rs", "use crate::b::deep::x::W;\n");
    write("b/deep/mod.rs", "mod x;\nmod y;\n");
    write("b/tests.rs", "use crate::a::Test;\n");
    let found = circles_under(&src);
    std::fs::remove_dir_all(&src).unwrap();
    assert_eq!(
        found,
        [
            "a -> b -> a (in the crate root)",
            "x -> y -> x (in b::deep)"
        ]
    );
}
