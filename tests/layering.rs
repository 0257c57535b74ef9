//! The import structure of the actors crate, checked from its sources: the router's
//! layers import downwards only (edges → service → flows → state, docs/architecture.md
//! "The router's layers"), no import circle passes through a router file, no worker
//! module (workers, denoise, controlnet) imports the router, and the wire layer
//! (`wire/`, `node.rs`) imports no other module of the crate.
//!
//! The graph is built per file: a file imports another when it names an item of that
//! file's module through a `crate::`, `super::` or `self::` path (a `use` or a path
//! in code), or, in a module's `mod.rs`, through one of its child modules. Comments and
//! string literals are skipped. A path resolves to the deepest file module it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A file's module path (`router::flow::edit`) by file, for every .rs file of the crate.
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap();
            let mut segs: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().to_string())
                .collect();
            if segs.last().is_some_and(|s| s == "mod" || s == "lib") {
                segs.pop();
            }
            out.insert(segs, p);
        }
    }
    out
}

/// `s` without comments and the contents of string and char literals.
fn code_only(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'r' && b.get(i + 1).is_some_and(|&c| c == b'"' || c == b'#') {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            j += 1;
            while j < b.len() && !b[j..].starts_with(&close) {
                j += 1;
            }
            out.push_str("\"\"");
            i = j + close.len();
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            i += 1;
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            out.push_str("' '");
            i += 3;
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            let end = s[i + 2..].find('\'').map_or(b.len(), |k| i + 2 + k + 1);
            out.push_str("' '");
            i = end;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// `code` without its inline test modules (`#[cfg(test)] mod tests { use super::*; }`
/// names the file's own module, and tests are no part of the layering).
fn without_tests(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at..];
        let Some(open) = rest.find('{') else { break };
        // Only a module: `#[cfg(test)] mod NAME {` (a test-only item keeps its text).
        let head = rest[..open].split_whitespace().collect::<Vec<_>>();
        if head.len() != 3 || head[1] != "mod" {
            out.replace_range(at..at + "#[cfg(test)]".len(), "");
            continue;
        }
        let mut depth = 0;
        let mut end = out.len();
        for (k, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = at + open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.replace_range(at..end, "");
    }
    out
}

/// Every path a file names, as segments (`crate::router::flow::edit` and the
/// members of `use` groups, expanded).
fn paths(code: &str) -> Vec<Vec<String>> {
    let toks = tokens(code);
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let prev_is_sep = i > 0 && toks[i - 1] == "::";
        if !prev_is_sep && is_ident(&toks[i]) {
            let (mut found, next) = path_at(&toks, i);
            out.append(&mut found);
            i = next.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

fn tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let cs: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_alphanumeric() || c == '_' {
            let s = i;
            while i < cs.len() && (cs[i].is_alphanumeric() || cs[i] == '_') {
                i += 1;
            }
            out.push(cs[s..i].iter().collect());
        } else if c == ':' && cs.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

/// The paths starting at token `i` (a group `a::{b, c::d}` gives several), and the
/// index after them.
fn path_at(toks: &[String], i: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = vec![toks[i].clone()];
    let mut j = i + 1;
    loop {
        if toks.get(j).is_some_and(|t| t == "::") {
            match toks.get(j + 1).map(String::as_str) {
                Some("{") => {
                    let mut out = Vec::new();
                    let mut k = j + 2;
                    loop {
                        match toks.get(k).map(String::as_str) {
                            Some("}") | None => return (out, k + 1),
                            Some(",") => k += 1,
                            Some(t) if is_ident(t) => {
                                let (inner, next) = path_at(toks, k);
                                for p in inner {
                                    let mut full = prefix.clone();
                                    if p != ["self"] {
                                        full.extend(p);
                                    }
                                    out.push(full);
                                }
                                // `x as y`
                                k = next;
                                if toks.get(k).is_some_and(|t| t == "as") {
                                    k += 2;
                                }
                            }
                            Some(_) => k += 1,
                        }
                    }
                }
                Some(t) if is_ident(t) => {
                    prefix.push(t.to_string());
                    j += 2;
                }
                _ => return (vec![prefix], j + 1),
            }
        } else {
            return (vec![prefix], j);
        }
    }
}

/// The crate's file-level import graph: file module → the file modules it names.
fn graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mods = modules(src);
    let mut g = BTreeMap::new();
    for (me, file) in &mods {
        let text = std::fs::read_to_string(file).unwrap();
        let is_dir_module = file
            .file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs")
            || me.is_empty();
        let mut deps = BTreeSet::new();
        for p in paths(&without_tests(&code_only(&text))) {
            // A bare `super` or `crate` names no item (`pub(super)`, `use super::*`).
            if p.len() < 2 {
                continue;
            }
            let abs: Vec<String> = match p[0].as_str() {
                "crate" => p[1..].to_vec(),
                "super" | "self" => {
                    // `super` of a file module is its parent module; in a mod.rs it is
                    // the directory's parent.
                    let mut base = me.clone();
                    let mut k = 0;
                    while p.get(k).is_some_and(|s| s == "super" || s == "self") {
                        if p[k] == "super" {
                            base.pop();
                        }
                        k += 1;
                    }
                    base.extend(p[k..].iter().cloned());
                    base
                }
                // A child module named from its parent's mod.rs.
                first if is_dir_module && p.len() > 1 => {
                    let mut child = me.clone();
                    child.push(first.to_string());
                    if !mods.contains_key(&child) {
                        continue;
                    }
                    child.extend(p[1..].iter().cloned());
                    child
                }
                _ => continue,
            };
            // The deepest file module the path names.
            let mut target = abs.clone();
            while !target.is_empty() && !mods.contains_key(&target) {
                target.pop();
            }
            if target.is_empty() || &target == me {
                continue;
            }
            // A parent naming its child module in a `mod` declaration is no import;
            // naming its items is (the loop above only sees paths, not declarations).
            deps.insert(target);
        }
        g.insert(me.clone(), deps);
    }
    g
}

/// The strongly connected components of more than one file (import circles).
fn circles(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    // Files that reach each other: a transitive closure is small enough here.
    let nodes: Vec<&Vec<String>> = g.keys().collect();
    let reach = |from: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(n) = stack.pop() {
            for d in g.get(&n).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    stack.push(d.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&Vec<String>, BTreeSet<Vec<String>>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for n in &nodes {
        if done.contains(*n) {
            continue;
        }
        let comp: Vec<Vec<String>> = nodes
            .iter()
            .filter(|m| *m == n || (reaches[*n].contains(**m) && reaches[**m].contains(*n)))
            .map(|m| (*m).clone())
            .collect();
        for m in &comp {
            done.insert(m.clone());
        }
        if comp.len() > 1 {
            out.push(comp);
        }
    }
    out
}

fn name(m: &[String]) -> String {
    m.join("::")
}

fn actors_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("actors/src")
}

#[test]
fn no_import_circle_passes_through_the_router() {
    let g = graph(&actors_src());
    assert!(g.len() > 50, "the crate's files were found ({})", g.len());
    let bad: Vec<String> = circles(&g)
        .into_iter()
        .filter(|c| c.iter().any(|m| m.first().is_some_and(|s| s == "router")))
        .map(|c| c.iter().map(|m| name(m)).collect::<Vec<_>>().join(" <-> "))
        .collect();
    assert!(
        bad.is_empty(),
        "import circles through the router:\n{}",
        bad.join("\n")
    );
}

#[test]
fn no_worker_module_imports_the_router() {
    let g = graph(&actors_src());
    let mut bad = Vec::new();
    for (m, deps) in &g {
        let worker = ["workers", "denoise", "controlnet"]
            .iter()
            .any(|w| m.first().is_some_and(|s| s == w));
        for d in deps {
            if worker && d.first().is_some_and(|s| s == "router") {
                bad.push(format!("{} imports {}", name(m), name(d)));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The wire layer is a leaf that the router and the workers both import: `wire/` and
/// `node.rs` import nothing of the crate but each other (message types live there, not
/// in the module of the worker that answers them).
#[test]
fn the_wire_layer_imports_no_other_module_of_the_crate() {
    let g = graph(&actors_src());
    let leaf = |m: &[String]| m.first().is_some_and(|s| s == "wire" || s == "node");
    let mut bad = Vec::new();
    for (m, deps) in g.iter().filter(|(m, _)| leaf(m)) {
        for d in deps.iter().filter(|d| !leaf(d)) {
            bad.push(format!("{} imports {}", name(m), name(d)));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The router's layers import downwards only: edges (http, bus, watchdog, the process
/// entry in router/mod.rs, the mesh toward peer pods) → service → flow → state.
#[test]
fn the_router_layers_import_downwards_only() {
    let g = graph(&actors_src());
    let layer = |m: &[String]| -> Option<u8> {
        if m.first().map(String::as_str) != Some("router") {
            return None;
        }
        Some(match m.get(1).map(String::as_str) {
            None | Some("http") | Some("bus") | Some("mesh") | Some("watchdog") => 3,
            Some("service") => 2,
            Some("flow") => 1,
            Some("state") => 0,
            Some(other) => panic!("router::{other} is in no layer: add it to this test"),
        })
    };
    let mut bad = Vec::new();
    for (m, deps) in &g {
        let Some(lm) = layer(m) else { continue };
        for d in deps {
            if layer(d).is_some_and(|ld| ld > lm) {
                bad.push(format!("{} imports {}", name(m), name(d)));
            }
        }
    }
    assert!(bad.is_empty(), "upward imports:\n{}", bad.join("\n"));
    // Flows and state know nothing of HTTP.
    for (m, _) in g.iter().filter(|(m, _)| matches!(layer(m), Some(0..=1))) {
        let file = modules(&actors_src())[m].clone();
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        assert!(!code.contains("axum"), "{} uses axum", file.display());
    }
}

/// The checker itself: a circle and an upward import it must see, in a crate made
/// for it.
#[test]
fn the_checker_sees_circles_and_groups() {
    let d = tempfile::tempdir().unwrap();
    let w = |p: &str, s: &str| {
        let p = d.path().join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    };
    w("lib.rs", "pub mod router; pub mod workers;");
    w(
        "router/mod.rs",
        "pub mod a; pub mod b;\npub fn run() { a::f(); }",
    );
    w(
        "router/a.rs",
        "// crate::workers::x in a comment is no import\nuse super::{b::{self, G}};\npub fn f() { let _ = \"crate::workers\"; }",
    );
    w(
        "router/b.rs",
        "pub struct G; pub fn g() { crate::router::a::f() }",
    );
    w("workers/mod.rs", "pub mod x;");
    w(
        "workers/x.rs",
        "use crate::daemon::y; pub fn h() {}\n#[cfg(test)]\nmod tests { use crate::router::b; }",
    );
    let g = graph(d.path());
    let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    assert_eq!(g[&m("router::a")], [m("router::b")].into_iter().collect());
    assert_eq!(g[&m("router")], [m("router::a")].into_iter().collect());
    assert!(g[&m("workers::x")].is_empty(), "{:?}", g[&m("workers::x")]);
    let c = circles(&g);
    assert_eq!(c, vec![vec![m("router::a"), m("router::b")]]);
}
