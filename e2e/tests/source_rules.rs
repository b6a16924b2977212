//! Rules the sources keep, checked on every run: every document a comment or document cites
//! exists in the repository, with the section it names; no product function is longer than
//! [`MAX_FN_LINES`] lines unless it is one `match` over a closed set and says so; and within
//! each product crate the arrows between its parts (the top-level modules of `src/`, and the
//! children of each module that is a directory) go one way: no module reaches back, through any
//! path, to a module that uses it.

#![allow(
    clippy::tests_outside_test_module,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use regex::Regex;
use syn::spanned::Spanned;
use syn::visit::Visit;

/// The longest a product function may be.
const MAX_FN_LINES: usize = 120;

/// What a longer function says in a comment just above it.
const CLOSED_MATCH: &str = "one match over a closed set";

/// The crates whose `src/` is the product.
const PRODUCT: [&str; 6] = [
    "shared",
    "shell",
    "controller",
    "agent",
    "entrypoint",
    "objstore",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ is in the repository")
        .to_path_buf()
}

/// Every file git tracks (or would: untracked but not ignored), relative to the root.
fn tracked() -> Vec<PathBuf> {
    let out = Command::new("git")
        .args([
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "-z",
        ])
        .current_dir(repo())
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git ls-files failed");
    out.stdout
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned()))
        .filter(|p| repo().join(p).is_file())
        .collect()
}

fn is_text_source(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    matches!(
        ext,
        "rs" | "sh" | "md" | "yaml" | "yml" | "toml" | "py" | "tpl" | "json" | "proto"
    ) || name == "Makefile"
        || name.ends_with("Containerfile")
        || path.starts_with(".ci")
}

/// The file's text with comment continuations joined, so a citation broken over two comment
/// lines reads as one.
fn joined(text: &str) -> String {
    let continuation = Regex::new(r"\n[ \t]*(?://[!/]?|#|\*)?[ \t]*").unwrap();
    continuation.replace_all(text, " ").into_owned()
}

/// The headings of a Markdown document, without `#`s and backticks.
fn headings(doc: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(doc).unwrap_or_default();
    let mut in_code = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            found.push(line.trim_start_matches('#').trim().replace('`', ""));
        }
    }
    found
}

/// Citations in `text` of a document that does not exist (relative to the root or to `file`'s
/// folder), and of a section its document lacks.
fn broken_citations(root: &Path, file: &Path, text: &str) -> Vec<String> {
    let url = Regex::new(r"[a-z]+://[^\s)>\]`]+").unwrap();
    let doc = Regex::new(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md\b").unwrap();
    let named = Regex::new(r"\b([A-Z][A-Z_]{3,})(?:\.md)? (?:document|doc)\b").unwrap();
    // Formats, not documents: "a JSON document".
    let formats = ["JSON", "YAML", "TOML", "HTML", "XML"];
    let section =
        Regex::new(r#"(docs/architecture\.md|architecture\.md|README(?:\.md)?)[,:]? +"([^"]+)""#)
            .unwrap();
    let text = url.replace_all(&joined(text), "URL").into_owned();
    let dir = file.parent().unwrap_or(Path::new(""));
    let exists = |cited: &str| {
        let cited = cited.trim_start_matches("./");
        !cited.is_empty()
            && (root.join(cited).is_file()
                || root.join(dir).join(cited).is_file()
                || (!cited.contains('/') && root.join("docs").join(cited).is_file()))
    };
    let mut broken = Vec::new();
    for m in doc.find_iter(&text) {
        if !exists(m.as_str()) {
            broken.push(format!(
                "{}: cites {}, which is not in the repository",
                file.display(),
                m.as_str()
            ));
        }
    }
    for c in named.captures_iter(&text) {
        if formats.contains(&&c[1]) {
            continue;
        }
        if !exists(&format!("{}.md", &c[1])) && !exists(&c[1]) {
            broken.push(format!(
                "{}: cites a {} document, which is not in the repository",
                file.display(),
                &c[1]
            ));
        }
    }
    for c in section.captures_iter(&text) {
        let doc = if c[1].starts_with("README") {
            root.join("README.md")
        } else {
            root.join("docs/architecture.md")
        };
        let wanted = c[2].replace('`', "");
        if !headings(&doc).iter().any(|h| h.starts_with(&wanted)) {
            broken.push(format!(
                "{}: cites section \"{}\" of {}, which has no such heading",
                file.display(),
                &c[2],
                doc.strip_prefix(root).unwrap_or(&doc).display()
            ));
        }
    }
    broken
}

#[test]
fn every_cited_document_and_section_exists() {
    let root = repo();
    let mut broken = Vec::new();
    // This file's own examples of broken citations are left out.
    let itself = Path::new("e2e/tests/source_rules.rs");
    for file in tracked()
        .iter()
        .filter(|f| is_text_source(f) && f.as_path() != itself)
    {
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        broken.extend(broken_citations(&root, file, &text));
    }
    assert!(
        broken.is_empty(),
        "broken citations:\n{}",
        broken.join("\n")
    );
}

#[test]
fn a_citation_of_a_missing_document_or_section_is_caught() {
    let root = repo();
    let file = Path::new("agent/src/example.rs");
    let good = "//! As docs/architecture.md \"The two flows\" says, and README.md too\n\
                //! (<https://example.com/SPEC.md>).";
    assert!(broken_citations(&root, file, good).is_empty());
    for bad in [
        "// see DESIGN.md",
        "//! (docs/architecture.md \"A section nobody wrote\")",
        "/// the order the\n    /// PROTOCOL document gives",
        "//! as in `notes/cuda-checkpoint.md`",
        "// holds a JSON document and the AGENTS doc",
    ] {
        assert_eq!(broken_citations(&root, file, bad).len(), 1, "{bad}");
    }
}

/// A function longer than allowed: where, how long, its name.
#[derive(Debug)]
struct Long {
    file: PathBuf,
    line: usize,
    lines: usize,
    name: String,
}

struct Functions<'a> {
    file: &'a Path,
    source: Vec<&'a str>,
    long: Vec<Long>,
}

fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("test")
            || (a.path().is_ident("cfg")
                && a.meta
                    .require_list()
                    .is_ok_and(|l| l.tokens.to_string().contains("test")))
    })
}

impl Functions<'_> {
    fn check(&mut self, name: &syn::Ident, sig: &syn::Signature, block: &syn::Block) {
        let start = sig.fn_token.span().start().line;
        let end = block.brace_token.span.close().end().line;
        let lines = end + 1 - start;
        if lines <= MAX_FN_LINES {
            return;
        }
        // The comment lines just above the signature (attributes and docs included).
        let above = self.source[..start.saturating_sub(1)]
            .iter()
            .rev()
            .take_while(|l| {
                let l = l.trim_start();
                l.starts_with("//") || l.starts_with("#[")
            })
            .any(|l| l.contains(CLOSED_MATCH));
        if !above {
            self.long.push(Long {
                file: self.file.to_path_buf(),
                line: start,
                lines,
                name: name.to_string(),
            });
        }
    }
}

impl<'ast> Visit<'ast> for Functions<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_test_only(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_test_only(&f.attrs) {
            self.check(&f.sig.ident, &f.sig, &f.block);
            syn::visit::visit_item_fn(self, f);
        }
    }
    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test_only(&f.attrs) {
            self.check(&f.sig.ident, &f.sig, &f.block);
            syn::visit::visit_impl_item_fn(self, f);
        }
    }
    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(block) = &f.default {
            self.check(&f.sig.ident, &f.sig, block);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

fn long_functions(file: &Path, text: &str) -> Vec<Long> {
    let parsed =
        syn::parse_file(text).unwrap_or_else(|e| panic!("{} does not parse: {e}", file.display()));
    let mut visitor = Functions {
        file,
        source: text.lines().collect(),
        long: Vec::new(),
    };
    visitor.visit_file(&parsed);
    visitor.long
}

/// Generated code (the kubelet's gRPC stubs) is not written here and not held to the rule.
fn is_generated(text: &str) -> bool {
    text.lines()
        .take(5)
        .any(|l| l.contains("@generated") || l.contains("generated by"))
}

#[test]
fn no_product_function_is_longer_than_the_limit() {
    let root = repo();
    let mut long = Vec::new();
    for file in tracked() {
        let in_product = PRODUCT
            .iter()
            .any(|krate| file.starts_with(Path::new(krate).join("src")));
        if !in_product || file.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        // A crate's `tests.rs` modules are tests, wherever they sit.
        if file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(root.join(&file)).unwrap();
        if is_generated(&text) {
            continue;
        }
        long.extend(long_functions(&file, &text));
    }
    long.sort_by_key(|l| std::cmp::Reverse(l.lines));
    let listed: Vec<String> = long
        .iter()
        .map(|l| {
            format!(
                "{}:{} {} ({} lines)",
                l.file.display(),
                l.line,
                l.name,
                l.lines
            )
        })
        .collect();
    assert!(
        long.is_empty(),
        "product functions over {MAX_FN_LINES} lines (split them, or, for one match over a \
         closed set, say so in a comment above):\n{}",
        listed.join("\n")
    );
}

#[test]
fn a_long_function_is_caught_unless_it_says_it_is_one_closed_match() {
    let body = "    let x = 1;\n".repeat(MAX_FN_LINES);
    let long = format!("fn long() {{\n{body}}}\n");
    let found = long_functions(Path::new("x.rs"), &long);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].lines, MAX_FN_LINES + 2);
    let said = format!("// {CLOSED_MATCH}: every kind of event.\n{long}");
    assert!(long_functions(Path::new("x.rs"), &said).is_empty());
    let in_tests = format!("#[cfg(test)]\nmod tests {{\n{long}}}\n");
    assert!(long_functions(Path::new("x.rs"), &in_tests).is_empty());
    let short = format!(
        "fn short() {{\n{}}}\n",
        "    let x = 1;\n".repeat(MAX_FN_LINES - 2)
    );
    assert!(long_functions(Path::new("x.rs"), &short).is_empty());
}

/// The modules of one level (a crate's top-level modules, or the children of one module) and,
/// for each, the modules of that level it names in code outside tests, with where.
type Arrows = std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>;

/// The top-level modules' arrows: [`arrows_in`] the crate root.
fn arrows(files: &[(PathBuf, String)]) -> Arrows {
    arrows_in(files, Path::new(""))
}

/// `files`: (path relative to `src/`, text). The level is the children of module directory
/// `dir` (`""`: the crate root): a child is `<name>.rs` or `<name>/…` below it, named by its
/// siblings as `crate::<dir>::<name>` or, from a file directly in `dir`, `super::<name>`
/// (`crate::<name>` at the root). The parent (`lib.rs`, `main.rs`, `mod.rs`) and test modules
/// (`tests.rs`, and everything from an inline `#[cfg(test)]` module on) are left out.
fn arrows_in(files: &[(PathBuf, String)], dir: &Path) -> Arrows {
    let ident = Regex::new(r"\b([a-z_][a-z0-9_]*)\b").unwrap();
    let path_of_dir: Vec<String> = dir
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let absolute = if path_of_dir.is_empty() {
        "crate::".to_owned()
    } else {
        format!("crate::{}::", path_of_dir.join("::"))
    };
    let sibling = |prefix: &str| {
        Regex::new(&format!(
            r"(?:^|[^a-z0-9_:]){}(?:([a-z_][a-z0-9_]*)|\{{([^}}]*)\}})",
            regex::escape(prefix)
        ))
        .unwrap()
    };
    let named_absolute = sibling(&absolute);
    let named_super = sibling("super::");
    let mut arrows = Arrows::new();
    for (path, text) in files {
        let Ok(rel) = path.strip_prefix(dir) else {
            continue;
        };
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_owned();
        if matches!(module.as_str(), "lib" | "main" | "mod")
            || path.file_name().is_some_and(|n| n == "tests.rs")
        {
            continue;
        }
        let direct_child = rel.components().count() == 1;
        let patterns: Vec<&Regex> = if direct_child && !path_of_dir.is_empty() {
            vec![&named_absolute, &named_super]
        } else {
            vec![&named_absolute]
        };
        let out = arrows.entry(module.clone()).or_default();
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            // An inline test module ends what counts; `#[cfg(test)] mod tests;` (its own file,
            // left out above) does not.
            if line.trim_start().starts_with("#[cfg(test)]")
                && !lines
                    .get(n + 1)
                    .is_some_and(|next| next.trim_end().ends_with(';'))
            {
                break;
            }
            let code = line.split("//").next().unwrap_or("");
            for c in patterns.iter().flat_map(|p| p.captures_iter(code)) {
                let targets: Vec<String> = match (c.get(1), c.get(2)) {
                    (Some(one), _) => vec![one.as_str().to_owned()],
                    (_, Some(group)) => ident
                        .captures_iter(group.as_str())
                        .map(|i| i[1].to_owned())
                        .filter(|i| i != "self")
                        .collect(),
                    _ => Vec::new(),
                };
                for target in targets.into_iter().filter(|t| *t != module) {
                    out.entry(target)
                        .or_insert_with(|| format!("{}:{}", path.display(), n + 1));
                }
            }
        }
    }
    arrows
}

/// A path of arrows that comes back to where it started, with where each arrow is, if any.
fn cycle(arrows: &Arrows) -> Option<Vec<String>> {
    fn visit(
        arrows: &Arrows,
        module: &str,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|m| m == module) {
            let mut found: Vec<String> = path[start..].to_vec();
            found.push(module.to_owned());
            return Some(found);
        }
        if done.contains(module) {
            return None;
        }
        path.push(module.to_owned());
        for target in arrows.get(module).into_iter().flat_map(|t| t.keys()) {
            if arrows.contains_key(target)
                && let Some(found) = visit(arrows, target, path, done)
            {
                return Some(found);
            }
        }
        path.pop();
        done.insert(module.to_owned());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    for module in arrows.keys() {
        if let Some(found) = visit(arrows, module, &mut Vec::new(), &mut done) {
            return Some(
                found
                    .windows(2)
                    .map(|w| format!("{} -> {} ({})", w[0], w[1], arrows[&w[0]][&w[1]]))
                    .collect(),
            );
        }
    }
    None
}

#[test]
fn the_arrows_between_a_crates_parts_go_one_way() {
    let root = repo();
    let tracked = tracked();
    let mut cycles = Vec::new();
    for krate in PRODUCT {
        let src = Path::new(krate).join("src");
        let files: Vec<(PathBuf, String)> = tracked
            .iter()
            .filter(|f| f.starts_with(&src) && f.extension().is_some_and(|e| e == "rs"))
            .map(|f| {
                let text = std::fs::read_to_string(root.join(f)).unwrap();
                (f.strip_prefix(&src).unwrap().to_path_buf(), text)
            })
            .collect();
        // The crate's parts, then the children of every module that is a directory.
        let mut levels: BTreeSet<PathBuf> = files
            .iter()
            .filter(|(f, _)| f.file_name().is_some_and(|n| n == "mod.rs"))
            .filter_map(|(f, _)| f.parent().map(Path::to_path_buf))
            .collect();
        levels.insert(PathBuf::new());
        for level in levels {
            if let Some(found) = cycle(&arrows_in(&files, &level)) {
                cycles.push(format!(
                    "{krate}/src/{}: {}",
                    level.display(),
                    found.join(", ")
                ));
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "modules that reach back to a module that uses them:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn an_arrow_back_is_caught_with_where_it_is() {
    let file = |path: &str, text: &str| (PathBuf::from(path), text.to_owned());
    let one_way = [
        file("engine/mod.rs", "use crate::{criu, gpu};\n"),
        file(
            "gpu.rs",
            "use crate::criu::Dump; // crate::engine in a comment\n",
        ),
        file(
            "criu.rs",
            "#[cfg(test)]\nmod tests;\nuse crate::sys;\n#[cfg(test)]\nmod more {\n    use crate::engine;\n}\n",
        ),
        file("engine/tests.rs", "use crate::engine::x;\n"),
    ];
    assert_eq!(cycle(&arrows(&one_way)), None);
    // Code after an out-of-line test module's declaration still counts.
    assert!(arrows(&one_way)["criu"].contains_key("sys"));
    let back = [
        file("engine/mod.rs", "use crate::{criu, gpu};\n"),
        file("gpu.rs", "fn f() {\n    crate::engine::blocking(x);\n}\n"),
        file("criu.rs", ""),
    ];
    let nested = [
        file("cluster/mod.rs", "pub mod node;\npub mod plan;\n"),
        file("cluster/node.rs", "use super::plan::decide;\n"),
        file(
            "cluster/plan.rs",
            "use crate::cluster::node::Pod;\nuse crate::engine;\n",
        ),
    ];
    let found = cycle(&arrows_in(&nested, Path::new("cluster"))).expect("found below the root");
    assert_eq!(
        found,
        [
            "node -> plan (cluster/node.rs:1)".to_owned(),
            "plan -> node (cluster/plan.rs:1)".to_owned()
        ]
    );
    let found = cycle(&arrows(&back)).expect("the arrow back is found");
    assert_eq!(
        found,
        [
            "engine -> gpu (engine/mod.rs:1)".to_owned(),
            "gpu -> engine (gpu.rs:2)".to_owned()
        ]
    );
}
