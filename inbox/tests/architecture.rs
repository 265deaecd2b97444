//! docs/architecture.md kept true: each crate's dependencies (from `cargo
//! metadata`) against the table "What each crate may depend on", and no
//! two modules of a library crate importing each other, directly or round a
//! circle (read from the `crate::` and `super::` paths of its sources), and
//! no source file over 800 lines outside its tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("the workspace root"))
}

/// The names in backticks in `cell`.
fn ticked(cell: &str) -> BTreeSet<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The table's rows: crate, may depend on, must not.
fn table() -> Vec<(String, BTreeSet<String>, BTreeSet<String>)> {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md"))
        .unwrap_or_else(|e| panic!("docs/architecture.md: {e}"));
    let start = doc
        .find("| crate | may depend on | must not |")
        .unwrap_or_else(|| panic!("the dependency table in docs/architecture.md"));
    doc[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = ticked(cells[1]).into_iter().next().unwrap_or_default();
            (name, ticked(cells[2]), ticked(cells[3]))
        })
        .collect()
}

/// Each workspace package's normal dependencies (optional ones included).
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("cargo metadata: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("cargo metadata: {e}"));
    let mut all = BTreeMap::new();
    for package in meta["packages"].as_array().into_iter().flatten() {
        let deps = package["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str().map(str::to_owned))
            .collect();
        if let Some(name) = package["name"].as_str() {
            all.insert(name.to_owned(), deps);
        }
    }
    all
}

#[test]
fn each_crate_depends_only_on_what_the_table_allows() {
    let rows = table();
    assert_eq!(
        rows.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
        [
            "inbox-core",
            "inbox-postgres",
            "inbox-kafka",
            "inbox-testkit",
            "xtask"
        ],
        "the table's rows"
    );
    let deps = dependencies();
    for (name, allowed, forbidden) in &rows {
        let have = deps
            .get(name)
            .unwrap_or_else(|| panic!("{name} is no workspace package"));
        let outside: Vec<&String> = have.difference(allowed).collect();
        assert!(
            outside.is_empty(),
            "{name} depends on {outside:?}, which docs/architecture.md does not list"
        );
        let banned: Vec<&String> = have.intersection(forbidden).collect();
        assert!(banned.is_empty(), "{name} must not depend on {banned:?}");
    }
}

/// A library crate's modules: the module path of each source file.
fn modules(src: &Path) -> BTreeMap<Vec<String>, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir:?}: {e}")) {
            let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap_or(&path);
            let mut parts: Vec<String> = rel
                .iter()
                .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
            // a file's own test module imports what it likes
            let text = match text.find("#[cfg(test)]\nmod tests") {
                Some(at) => text[..at].to_owned(),
                None => text,
            };
            // comments (doc links among them) import nothing
            let text: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(parts, text);
        }
    }
    out
}

/// The paths a `use` tree names, expanded (`a::{b, c::d}` gives `a::b`,
/// `a::c::d`).
fn expand(tree: &str, prefix: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    match tree.find('{') {
        None => out.push(format!(
            "{prefix}{}",
            tree.split(" as ").next().unwrap_or(tree)
        )),
        Some(open) => {
            let head = &tree[..open];
            let inner = tree[open + 1..].trim_end().trim_end_matches('}');
            let mut depth = 0;
            let mut last = 0;
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&inner[last..i], &format!("{prefix}{head}"), out);
                        last = i + 1;
                    }
                    _ => {}
                }
            }
            if !inner[last..].trim().is_empty() {
                expand(&inner[last..], &format!("{prefix}{head}"), out);
            }
        }
    }
}

/// Every path of `text` that starts at `crate::` or `super::`, as
/// segments.
fn paths(text: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    // use trees, braces and all
    for stmt in text.split("use ").skip(1) {
        let Some(end) = stmt.find(';') else { continue };
        let tree: String = stmt[..end].split_whitespace().collect::<Vec<_>>().join(" ");
        if tree.starts_with("crate::") || tree.starts_with("super::") {
            expand(&tree, "", &mut found);
        }
    }
    // paths written inline
    for start in ["crate::", "super::"] {
        for (at, _) in text.match_indices(start) {
            if text[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let path: String = text[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            found.push(path);
        }
    }
    found
        .into_iter()
        .map(|p| {
            p.split("::")
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty() && s != "self" && s != "*")
                .collect()
        })
        .collect()
}

/// The module a path from `from` points into (its longest prefix that is a
/// module), when it is one of `known`.
fn target(from: &[String], path: &[String], known: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    let mut at: Vec<String> = Vec::new();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => rest = &rest[1..],
        Some("super") => {
            at = from.to_vec();
            while rest.first().map(String::as_str) == Some("super") {
                at.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    let mut best = None;
    for segment in rest {
        at.push(segment.clone());
        if known.contains(&at) {
            best = Some(at.clone());
        } else {
            break;
        }
    }
    best
}

/// Between two modules, the import between the children of their common
/// parent (`None` when one contains the other).
fn sibling_edge(from: &[String], to: &[String]) -> Option<(Vec<String>, Vec<String>)> {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    if common == from.len() || common == to.len() {
        return None;
    }
    Some((from[..=common].to_vec(), to[..=common].to_vec()))
}

/// A circle in `edges`, when there is one.
fn circle(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        node: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        path: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.clone());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.clone());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, edges, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        if let Some(found) = visit(node, edges, &mut Vec::new(), &mut done) {
            return Some(found);
        }
    }
    None
}

/// The circles of imports between sibling modules of the crate at `src`.
fn import_circle(src: &Path) -> Option<Vec<String>> {
    let files = modules(src);
    let known: BTreeSet<Vec<String>> = files.keys().cloned().collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (from, text) in &files {
        for path in paths(text) {
            let Some(to) = target(from, &path, &known) else {
                continue;
            };
            if let Some((a, b)) = sibling_edge(from, &to) {
                edges.entry(a).or_default().insert(b);
            }
        }
    }
    circle(&edges).map(|c| c.iter().map(|m| m.join("::")).collect())
}

#[test]
fn no_two_modules_import_each_other() {
    for krate in [
        "inbox-core",
        "inbox-postgres",
        "inbox-kafka",
        "inbox-testkit",
    ] {
        let found = import_circle(&root().join(krate).join("src"));
        assert_eq!(found, None, "{krate}: modules importing round a circle");
    }
}

#[test]
fn the_check_finds_a_circle_where_there_is_one() {
    let dir = std::env::temp_dir().join(format!("inbox-architecture-{}", std::process::id()));
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap_or(&dir)).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(path, text).unwrap_or_else(|e| panic!("{e}"));
    };
    write("lib.rs", "mod a;\nmod b;\nmod c;\n");
    write("a.rs", "use crate::b::B;\n");
    write("b.rs", "use crate::{c::{C, D as E}, model};\n");
    write("c/mod.rs", "mod x;\nmod y;\npub fn f() { crate::a::g() }\n");
    write("c/x.rs", "use super::y::Y;\nuse super::f;\n");
    write("c/y.rs", "use crate::a::A;\n");
    let found = import_circle(&dir);
    assert_eq!(
        found,
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]),
        "a -> b -> c (through c::x's parent, c's own path) -> a"
    );
    // a child using its parent and siblings one way only: no circle
    write("a.rs", "pub fn g() {}\n");
    assert_eq!(import_circle(&dir), None);
    write("c/y.rs", "use super::x::X;\n");
    assert_eq!(
        import_circle(&dir),
        Some(vec!["c::x".into(), "c::y".into(), "c::x".into()]),
        "siblings inside a folder"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The products of `inbox-core`: its folders over the rules at its root.
const PRODUCTS: [&str; 5] = ["drivers", "group", "observability", "outbox", "routing"];

/// The imports of a product by a module at the root of the crate at `src`
/// (one of its files other than the products' folders), as `from -> to`.
fn rules_importing_products(src: &Path) -> Vec<String> {
    let files = modules(src);
    let known: BTreeSet<Vec<String>> = files.keys().cloned().collect();
    let mut found = Vec::new();
    for (from, text) in &files {
        let at_root = from
            .first()
            .is_none_or(|top| !PRODUCTS.contains(&top.as_str()));
        if from.is_empty() || !at_root {
            continue;
        }
        for path in paths(text) {
            // `crate::Name` goes through the root's re-exports: not a product
            if let Some(to) = target(from, &path, &known)
                && to
                    .first()
                    .is_some_and(|top| PRODUCTS.contains(&top.as_str()))
            {
                found.push(format!("{} -> {}", from.join("::"), to.join("::")));
            }
        }
    }
    found
}

#[test]
fn the_core_rules_import_no_product() {
    let src = root().join("inbox-core").join("src");
    for product in PRODUCTS {
        assert!(
            src.join(product).is_dir(),
            "inbox-core/src/{product}/ is gone: update docs/architecture.md and PRODUCTS"
        );
    }
    assert_eq!(
        rules_importing_products(&src),
        Vec::<String>::new(),
        "inbox-core: a rule at the root imports a product (docs/architecture.md, \"The rooms of each crate\")"
    );
}

/// What a rule must not do: await, run on tokio, or read a clock (the
/// time comes in as an argument, so a rule is tested, and simulated, in
/// any time it is given).
const NOT_IN_A_RULE: [&str; 12] = [
    "async fn",
    ".await",
    "tokio",
    "block_on",
    "Instant::now",
    "SystemTime::now",
    "Utc::now",
    "Local::now",
    ".elapsed()",
    "thread::sleep",
    "std::fs",
    "std::net",
];

/// The lines of the rules at the root of the crate at `src` (its files and
/// folders other than the products', outside their tests and comments)
/// that do what [`NOT_IN_A_RULE`] names, but the traits adapters implement
/// (`consumer.rs`, `store.rs`: async by what they are) and `lib.rs`
/// (re-exports).
fn rules_doing_io(src: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut files = Vec::new();
    let entries = std::fs::read_dir(src).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
            .path();
        let top = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.is_dir() {
            if !PRODUCTS.contains(&top.as_str()) {
                rust_files(&path, &mut files);
            }
        } else if top.ends_with(".rs")
            && !["consumer.rs", "store.rs", "lib.rs"].contains(&top.as_str())
        {
            files.push(path);
        }
    }
    for path in files {
        let name = path
            .strip_prefix(src)
            .unwrap_or(&path)
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (n, line) in text
            .lines()
            .take_while(|l| !l.starts_with("#[cfg(test)]"))
            .enumerate()
        {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            if NOT_IN_A_RULE.iter().any(|bad| code.contains(bad)) {
                found.push(format!("{name}:{}: {}", n + 1, code));
            }
        }
    }
    found.sort();
    found
}

#[test]
fn the_core_rules_await_nothing_and_read_no_clock() {
    assert_eq!(
        rules_doing_io(&root().join("inbox-core").join("src")),
        Vec::<String>::new(),
        "inbox-core: a rule at the root does I/O or reads the clock: pass the time in, let a driver await (docs/architecture.md)"
    );
}

#[test]
fn the_rule_check_finds_a_clock_read() {
    let dir = std::env::temp_dir().join(format!("inbox-arch-clock-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(
        dir.join("rule.rs"),
        "//! Instant::now in a comment is fine\nfn due() -> bool { std::time::Instant::now() > x() }\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(dir.join("store.rs"), "async fn begin();\n").unwrap_or_else(|e| panic!("{e}"));
    // a rule in a folder of its own is a rule; a product's is not
    for folder in ["model", "drivers"] {
        std::fs::create_dir_all(dir.join(folder)).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(
            dir.join(folder).join("mod.rs"),
            "async fn run() { x.await }\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(
        rules_doing_io(&dir),
        vec![
            "model/mod.rs:1: async fn run() { x.await }".to_owned(),
            "rule.rs:2: fn due() -> bool { std::time::Instant::now() > x() }".to_owned()
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every `.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// How many lines of `text` come before its unit tests (the first
/// `#[cfg(test)]` at the start of a line: a file's tests are its last
/// module).
fn lines_outside_tests(text: &str) -> usize {
    text.lines()
        .take_while(|l| !l.starts_with("#[cfg(test)]"))
        .count()
}

/// The files of the workspace's `src` folders longer than `limit` lines
/// outside their tests.
fn files_over(limit: usize) -> Vec<String> {
    let mut long = Vec::new();
    for krate in [
        "inbox-core",
        "inbox-postgres",
        "inbox-kafka",
        "inbox-testkit",
        "inbox",
        "xtask",
        "runs",
    ] {
        let mut files = Vec::new();
        rust_files(&root().join(krate).join("src"), &mut files);
        for f in files {
            let text =
                std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            let n = lines_outside_tests(&text);
            if n > limit {
                long.push(format!("{} ({n} lines)", f.display()));
            }
        }
    }
    long
}

#[test]
fn no_source_file_is_over_800_lines_outside_its_tests() {
    assert_eq!(
        files_over(800),
        Vec::<String>::new(),
        "split these by what they do (docs/architecture.md)"
    );
}

#[test]
fn the_length_check_counts_up_to_the_tests() {
    assert_eq!(
        lines_outside_tests("fn a() {}\n\nfn b() {}\n#[cfg(test)]\nmod tests {\n}\n"),
        3
    );
    assert_eq!(lines_outside_tests("fn a() {}\n"), 1);
    // a smaller limit finds the long files this workspace has
    assert!(!files_over(300).is_empty());
}
