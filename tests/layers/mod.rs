//! The layers of `src/`, and the test that holds them: imports point one way, from the edge
//! (command line, config file) down to pure data, and no two modules need each other.
//!
//! | layer | what it holds | modules |
//! | --- | --- | --- |
//! | L0 pure data and codecs | bytes in, typed values out; names of the wire contract; no I/O | `lsn`, `pem`, `report`, `redaction`, `connection_url`, `validation`, `contract`, `envelope`, `pgoutput`, `cloudevents`, `watermark`, `lockdown`, `routing`, `outbox_schema`, `partition` |
//! | L1 settings | plain data the transports read, never the reverse; metric names and the state they count | `config`, `secrets`, `metrics` |
//! | L2 transports | the sessions to the servers: Postgres SQL and replication, RabbitMQ, the sink seam, the HTTP endpoint | `postgres`, `replication`, `publisher`, `stream_publisher`, `sink`, `metrics::http` |
//! | L3 beside the pipeline | what `run`, the admin commands and `check` share; the consumer side | `stream_state`, `error`, `admin`, `check`, `inbox`, `topology` |
//! | L4 the pipeline | `run`'s driver and event loop | `pipeline` |
//! | L5 the edge | argv, environment, config file, the binary | `cli`, `config_file`, `main`, the crate root (`lib.rs`) |
//!
//! A module may import only its own layer or a lower one. A table entry covers the module
//! and its submodules unless a deeper entry names a submodule (`metrics::http`).
//!
//! What counts as an import: every path that names a module of the crate, in `use` trees
//! and inline (`crate::config::redact_url(...)`, in attributes too), `super::` and `self::`
//! resolved to the module they name, and a parent's paths into its own children
//! (`socket::connect` in `publisher/mod.rs`). Comments, doc links and string literals do not
//! count (a doc link compiles into no dependency). Test modules (`#[cfg(test)]`) count like
//! the rest: a test that needs a higher layer belongs in that layer.
//!
//! Cycles: no two files may reach each other, and no two table entries either. The one
//! edge left out of the cycle check is a parent's into its own descendants (a `mod.rs`
//! declares and re-exports its children, and the children use what it defines): that is one
//! module's outside and inside, not two modules.
//!
//! The same table, with the reasons, is `docs/architecture/layers.md`; the test checks that
//! it names every entry.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first: (name, modules). See the module doc.
pub const LAYERS: &[(&str, &[&str])] = &[
    (
        "L0 pure data and codecs",
        &[
            "lsn",
            "pem",
            "item_length",
            "report",
            "redaction",
            "connection_url",
            "validation",
            "contract",
            "envelope",
            "pgoutput",
            "cloudevents",
            "watermark",
            "lockdown",
            "routing",
            "outbox_schema",
            "partition",
        ],
    ),
    ("L1 settings", &["config", "secrets", "metrics"]),
    (
        "L2 transports",
        &[
            "postgres",
            "replication",
            "publisher",
            "stream_publisher",
            "sink",
            "metrics::http",
        ],
    ),
    (
        "L3 beside the pipeline",
        &[
            "stream_state",
            "error",
            "admin",
            "check",
            "inbox",
            "topology",
        ],
    ),
    ("L4 the pipeline", &["pipeline"]),
    ("L5 the edge", &["cli", "config_file", "main", "crate"]),
];

/// Table entries for modules another branch of issue 22 is building (the sink seam,
/// `src/sink/`): allowed to name no module yet. Remove an entry once its module landed.
const PLANNED: &[&str] = &[];

/// Import cycles another branch of issue 22 is breaking, as (file, file) pairs: allowed
/// until then, and an error once they are gone (so the exception is removed with them).
/// None left: keep it empty (the check below then only fails on new cycles).
const KNOWN_CYCLES: &[(&str, &str)] = &[];

/// One file of `src/` and the module it is.
#[derive(Debug, Clone)]
struct SourceFile {
    /// Relative to the package root, e.g. `src/publisher/socket.rs`.
    path: String,
    /// Module path without `crate::`, e.g. `publisher::socket`; `crate` for `lib.rs`, `main`
    /// for the binary.
    module: String,
    /// The code with comments and literals blanked (same length, same lines).
    code: String,
}

/// One reference from a file to another module.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Edge {
    from: String,
    to: String,
    path: String,
    line: usize,
    text: String,
}

fn root() -> PathBuf {
    PathBuf::from(option_env!("CARGO_MANIFEST_DIR").unwrap_or("."))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/a/b.rs` → `a::b`, `src/a/mod.rs` → `a`, `src/lib.rs` → `crate`, `src/main.rs` →
/// `main`.
fn module_of(rel: &str) -> String {
    let inner = rel.strip_prefix("src/").expect("under src/");
    match inner {
        "lib.rs" => return "crate".into(),
        "main.rs" => return "main".into(),
        _ => {}
    }
    let inner = inner.strip_suffix(".rs").expect(".rs");
    let inner = inner.strip_suffix("/mod").unwrap_or(inner);
    inner.replace('/', "::")
}

fn load() -> Vec<SourceFile> {
    let root = root();
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(&root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            let text = std::fs::read_to_string(&p).expect("read source");
            SourceFile {
                module: module_of(&rel),
                path: rel,
                code: code_only(&text),
            }
        })
        .collect()
}

/// The text with comments and the contents of string, byte-string and char literals
/// replaced by spaces (newlines kept), so that a scan for paths sees code only.
fn code_only(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = Vec::with_capacity(b.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let prev_ident = i > 0 && is_ident(b[i - 1]);
        if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push(' ');
                    out.push(' ');
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push(' ');
                    out.push(' ');
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if !prev_ident && (c == 'r' || (c == 'b' && b.get(i + 1) == Some(&'r'))) && {
            let start = if c == 'b' { i + 2 } else { i + 1 };
            let mut j = start;
            while b.get(j) == Some(&'#') {
                j += 1;
            }
            b.get(j) == Some(&'"')
        } {
            // A raw string: r"..." or r#"..."# (or br...).
            let start = if c == 'b' { i + 2 } else { i + 1 };
            let mut j = start;
            while b.get(j) == Some(&'#') {
                j += 1;
            }
            let hashes = j - start;
            out.extend_from_slice(&b[i..=j]);
            i = j + 1;
            loop {
                if i >= b.len() {
                    break;
                }
                if b[i] == '"' && (0..hashes).all(|h| b.get(i + 1 + h) == Some(&'#')) {
                    for _ in 0..=hashes {
                        out.push(b[i]);
                        i += 1;
                    }
                    break;
                }
                out.push(blank(b[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' && i + 1 < b.len() {
                    out.push(' ');
                    out.push(blank(b[i + 1]));
                    i += 2;
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            if i < b.len() {
                out.push('"');
                i += 1;
            }
        } else if c == '\'' && (!prev_ident || (b[i - 1] == 'b' && (i < 2 || !is_ident(b[i - 2]))))
        {
            // A char literal ('a', '\n', '\u{1F600}', '\'') or a lifetime ('a, 'static).
            let end = if b.get(i + 1) == Some(&'\\') {
                (i + 2..b.len()).find(|&k| b[k] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    out.push('\'');
                    out.extend(std::iter::repeat_n(' ', end - i - 1));
                    out.push('\'');
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out.into_iter().collect()
}

fn is_ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Reads an identifier at `i`.
fn ident_at(code: &[u8], i: usize) -> Option<(String, usize)> {
    let start = i;
    let mut j = i;
    while j < code.len() && is_ident_char(code[j]) {
        j += 1;
    }
    (j > start && !code[start].is_ascii_digit())
        .then(|| (String::from_utf8_lossy(&code[start..j]).into_owned(), j))
}

fn skip_ws(code: &[u8], mut i: usize) -> usize {
    while i < code.len() && code[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The inline module path (`mod tests { ... }`) at every byte, as the stack of open
/// braces: each brace that opens a `mod NAME {` carries the name.
struct Braces {
    /// (offset of `{`, offset of its `}`, inline module name if any)
    spans: Vec<(usize, usize, Option<String>)>,
}

impl Braces {
    fn new(code: &str) -> Braces {
        let bytes = code.as_bytes();
        let mut open: Vec<(usize, Option<String>)> = Vec::new();
        let mut spans = Vec::new();
        for (i, &c) in bytes.iter().enumerate() {
            if c == b'{' {
                open.push((i, inline_mod_name(bytes, i)));
            } else if c == b'}' {
                if let Some((start, name)) = open.pop() {
                    spans.push((start, i, name));
                }
            }
        }
        Braces { spans }
    }

    /// The inline modules enclosing `at`, outermost first.
    fn inline_path(&self, at: usize) -> Vec<String> {
        let mut mods: Vec<(usize, String)> = self
            .spans
            .iter()
            .filter(|(s, e, n)| n.is_some() && *s < at && at < *e)
            .map(|(s, _, n)| (*s, n.clone().unwrap_or_default()))
            .collect();
        mods.sort();
        mods.into_iter().map(|(_, n)| n).collect()
    }
}

/// `mod NAME {` ending at the brace at `brace`: the name.
fn inline_mod_name(code: &[u8], brace: usize) -> Option<String> {
    let mut j = brace;
    while j > 0 && code[j - 1].is_ascii_whitespace() {
        j -= 1;
    }
    let end = j;
    while j > 0 && is_ident_char(code[j - 1]) {
        j -= 1;
    }
    let name = std::str::from_utf8(&code[j..end]).ok()?.to_owned();
    let mut k = j;
    while k > 0 && code[k - 1].is_ascii_whitespace() {
        k -= 1;
    }
    (k >= 3 && &code[k - 3..k] == b"mod" && (k == 3 || !is_ident_char(code[k - 4])))
        .then_some(name)
        .filter(|n| !n.is_empty())
}

/// The children a file declares with `mod NAME;`.
fn declared_children(code: &str) -> BTreeSet<String> {
    let bytes = code.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while let Some(pos) = code[i..].find("mod ") {
        let at = i + pos;
        i = at + 4;
        if at > 0 && is_ident_char(bytes[at - 1]) {
            continue;
        }
        let j = skip_ws(bytes, at + 3);
        if let Some((name, k)) = ident_at(bytes, j) {
            if bytes.get(skip_ws(bytes, k)) == Some(&b';') {
                out.insert(name);
            }
        }
    }
    out
}

/// A parsed `use` tree, flattened into its paths (each a list of segments).
fn use_paths(tree: &str) -> Vec<Vec<String>> {
    fn parse(s: &[u8], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
        let mut path = prefix.to_vec();
        loop {
            *i = skip_ws(s, *i);
            if *i >= s.len() {
                out.push(path);
                return;
            }
            match s[*i] {
                b'{' => {
                    *i += 1;
                    loop {
                        *i = skip_ws(s, *i);
                        if *i < s.len() && s[*i] == b'}' {
                            *i += 1;
                            break;
                        }
                        parse(s, i, &path, out);
                        *i = skip_ws(s, *i);
                        if *i < s.len() && s[*i] == b',' {
                            *i += 1;
                        }
                    }
                    return;
                }
                b'*' => {
                    *i += 1;
                    out.push(path);
                    return;
                }
                b':' if s.get(*i + 1) == Some(&b':') => {
                    *i += 2;
                }
                b',' | b'}' => {
                    out.push(path);
                    return;
                }
                _ => match ident_at(s, *i) {
                    Some((word, j)) => {
                        *i = j;
                        if word == "as" {
                            // `as NAME`: skip the new name.
                            *i = skip_ws(s, *i);
                            if let Some((_, k)) = ident_at(s, *i) {
                                *i = k;
                            }
                        } else if word != "self" || path.is_empty() {
                            path.push(word);
                        }
                    }
                    None => {
                        *i += 1;
                    }
                },
            }
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    parse(tree.as_bytes(), &mut i, &[], &mut out);
    out
}

/// Resolves a path written in `module` (with `inline` modules open) to absolute segments
/// (without `crate`), or `None` when it is not a path into this crate.
fn absolute(
    segments: &[String],
    module: &str,
    inline: &[String],
    children: &BTreeSet<String>,
) -> Option<Vec<String>> {
    let mut current: Vec<String> = match module {
        "crate" | "main" => Vec::new(),
        m => m.split("::").map(str::to_owned).collect(),
    };
    current.extend(inline.iter().cloned());
    let first = segments.first()?;
    match first.as_str() {
        "crate" => Some(segments[1..].to_vec()),
        "pgoutbox" if module == "main" => Some(segments[1..].to_vec()),
        "self" => {
            let mut p = current;
            p.extend(segments[1..].iter().cloned());
            Some(p)
        }
        "super" => {
            let mut p = current;
            let mut rest = segments;
            while rest.first().is_some_and(|s| s == "super") {
                p.pop();
                rest = &rest[1..];
            }
            p.extend(rest.iter().cloned());
            Some(p)
        }
        // A child module named from its parent's own file (`socket::connect` in
        // `publisher/mod.rs`), outside any inline module.
        name if inline.is_empty() && children.contains(name) => {
            let mut p = current;
            p.extend(segments.iter().cloned());
            Some(p)
        }
        _ => None,
    }
}

/// The module of the crate a path names: its longest prefix that is a file's module
/// (`crate` when none is: an item of the root).
fn target_module(abs: &[String], modules: &BTreeSet<String>) -> String {
    for n in (1..=abs.len()).rev() {
        let candidate = abs[..n].join("::");
        if modules.contains(&candidate) {
            return candidate;
        }
    }
    "crate".into()
}

fn line_of(code: &str, at: usize) -> usize {
    code[..at].matches('\n').count() + 1
}

/// Every reference of every file to another module of the crate.
fn edges(files: &[SourceFile]) -> Vec<Edge> {
    let modules: BTreeSet<String> = files.iter().map(|f| f.module.clone()).collect();
    let mut out = BTreeSet::new();
    for f in files {
        let code = f.code.as_str();
        let bytes = code.as_bytes();
        let braces = Braces::new(code);
        let children = declared_children(code);
        let mut record = |segments: &[String], at: usize| {
            let inline = braces.inline_path(at);
            let Some(abs) = absolute(segments, &f.module, &inline, &children) else {
                return;
            };
            let to = target_module(&abs, &modules);
            if to == f.module {
                return;
            }
            let line = line_of(code, at);
            let text = code.lines().nth(line - 1).unwrap_or("").trim().to_owned();
            out.insert(Edge {
                from: f.module.clone(),
                to,
                path: f.path.clone(),
                line,
                text,
            });
        };
        // `use` trees, and what lies outside them.
        let mut outside = vec![true; bytes.len()];
        let mut i = 0;
        while let Some(pos) = code[i..].find("use ") {
            let at = i + pos;
            i = at + 4;
            if at > 0 && (is_ident_char(bytes[at - 1]) || bytes[at - 1] == b':') {
                continue;
            }
            let Some(end) = code[at..].find(';').map(|e| at + e) else {
                continue;
            };
            for o in outside.iter_mut().take(end).skip(at) {
                *o = false;
            }
            for path in use_paths(&code[at + 4..end]) {
                record(&path, at);
            }
            i = end;
        }
        // Inline paths: `crate::`, `super::`, `self::`, `pgoutbox::` (the binary), and a
        // parent's paths into its children.
        let mut i = 0;
        while i < bytes.len() {
            if !outside[i]
                || !is_ident_char(bytes[i])
                || (i > 0 && (is_ident_char(bytes[i - 1]) || bytes[i - 1] == b'$'))
                || (i > 1 && &bytes[i - 2..i] == b"::")
            {
                i += 1;
                continue;
            }
            let Some((first, mut j)) = ident_at(bytes, i) else {
                i += 1;
                continue;
            };
            let wanted = matches!(first.as_str(), "crate" | "super" | "self")
                || (first == "pgoutbox" && f.module == "main")
                || children.contains(&first);
            if !wanted || bytes.get(j..j + 2) != Some(b"::") {
                i = j;
                continue;
            }
            let mut segments = vec![first];
            while bytes.get(j..j + 2) == Some(b"::") {
                match ident_at(bytes, j + 2) {
                    Some((seg, k)) => {
                        segments.push(seg);
                        j = k;
                    }
                    None => break,
                }
            }
            record(&segments, i);
            i = j;
        }
    }
    out.into_iter().collect()
}

/// The table entry covering `module` (longest prefix), with its layer index.
fn entry_of(module: &str) -> Option<(usize, &'static str)> {
    let mut best: Option<(usize, &'static str)> = None;
    for (layer, (_, mods)) in LAYERS.iter().enumerate() {
        for m in *mods {
            let covers = module == *m || module.starts_with(&format!("{m}::"));
            if covers && best.is_none_or(|(_, b)| m.len() > b.len()) {
                best = Some((layer, m));
            }
        }
    }
    best
}

/// Strongly connected components with more than one node (Tarjan).
fn cycles(
    nodes: &BTreeSet<String>,
    edges: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on_stack: BTreeSet<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(s: &mut State, v: &str) {
        s.index.insert(v.into(), s.next);
        s.low.insert(v.into(), s.next);
        s.next += 1;
        s.stack.push(v.into());
        s.on_stack.insert(v.into());
        let succ: Vec<String> = s
            .edges
            .get(v)
            .map(|e| e.iter().cloned().collect())
            .unwrap_or_default();
        for w in succ {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let lw = s.low[&w];
                let lv = s.low[v];
                s.low.insert(v.into(), lv.min(lw));
            } else if s.on_stack.contains(&w) {
                let iw = s.index[&w];
                let lv = s.low[v];
                s.low.insert(v.into(), lv.min(iw));
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                let done = w == v;
                comp.push(w);
                if done {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for n in nodes {
        if !s.index.contains_key(n) {
            visit(&mut s, n);
        }
    }
    s.out
}

/// One loop through a strongly connected component: the shortest way from its first node
/// back to itself, as (from, to) steps.
fn loop_through(
    comp: &[String],
    graph: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<(String, String)> {
    let members: BTreeSet<&String> = comp.iter().collect();
    let start = &comp[0];
    let mut came_from: BTreeMap<String, String> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start.clone()]);
    while let Some(v) = queue.pop_front() {
        for w in graph.get(&v).into_iter().flatten() {
            if !members.contains(w) {
                continue;
            }
            if w == start {
                let mut steps = vec![(v.clone(), w.clone())];
                let mut cur = v.clone();
                while &cur != start {
                    let prev = came_from[&cur].clone();
                    steps.push((prev.clone(), cur));
                    cur = prev;
                }
                steps.reverse();
                return steps;
            }
            if !came_from.contains_key(w) {
                came_from.insert(w.clone(), v.clone());
                queue.push_back(w.clone());
            }
        }
    }
    Vec::new()
}

/// Whether `descendant` lies inside `ancestor` (`publisher::socket` in `publisher`;
/// everything in `crate`).
fn is_inside(descendant: &str, ancestor: &str) -> bool {
    ancestor == "crate" && descendant != "main" || descendant.starts_with(&format!("{ancestor}::"))
}

/// Everything the layering rules find wrong, one line each.
fn findings(files: &[SourceFile]) -> Vec<String> {
    let mut out = Vec::new();
    // (c) every file's module is in the table, and every entry names a module.
    for f in files {
        if entry_of(&f.module).is_none() {
            out.push(format!(
                "{}: module {} is in no layer: add it to LAYERS in tests/layers/mod.rs (and docs/architecture/layers.md)",
                f.path, f.module
            ));
        }
    }
    for (_, mods) in LAYERS {
        for m in *mods {
            if !files
                .iter()
                .any(|f| f.module == *m || is_inside(&f.module, m))
                && !PLANNED.contains(m)
            {
                out.push(format!(
                    "LAYERS names {m}, which is no module of src/: remove it"
                ));
            }
        }
    }
    let all = edges(files);
    // (a) imports from a higher layer.
    for e in &all {
        let (Some((from_layer, from_entry)), Some((to_layer, to_entry))) =
            (entry_of(&e.from), entry_of(&e.to))
        else {
            continue;
        };
        if to_layer > from_layer {
            out.push(format!(
                "{}:{}: {} ({from_entry}, {}) imports {} ({to_entry}, {}): a module may import only its own layer or a lower one; `{}`",
                e.path, e.line, e.from, LAYERS[from_layer].0, e.to, LAYERS[to_layer].0, e.text
            ));
        }
    }
    // (b) cycles between files, then between table entries, each shown as one loop of
    // imports with a line that makes each step.
    let nodes: BTreeSet<String> = files.iter().map(|f| f.module.clone()).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in &all {
        if !is_inside(&e.to, &e.from) {
            graph
                .entry(e.from.clone())
                .or_default()
                .insert(e.to.clone());
        }
    }
    let mut known_seen = BTreeSet::new();
    for comp in cycles(&nodes, &graph) {
        let known = KNOWN_CYCLES.iter().find(|(a, b)| {
            comp.len() == 2 && comp.iter().any(|m| m == a) && comp.iter().any(|m| m == b)
        });
        if let Some(pair) = known {
            known_seen.insert(*pair);
            continue;
        }
        let steps = loop_through(&comp, &graph)
            .into_iter()
            .map(|(a, b)| {
                let e = all.iter().find(|e| e.from == a && e.to == b).expect("edge");
                format!("    {a} -> {b}: {}:{} `{}`", e.path, e.line, e.text)
            })
            .collect::<Vec<_>>();
        out.push(format!(
            "import cycle between files ({}):\n{}",
            comp.join(", "),
            steps.join("\n")
        ));
    }
    for pair in KNOWN_CYCLES {
        if !known_seen.contains(pair) {
            out.push(format!(
                "the known cycle {} <-> {} is gone: remove it from KNOWN_CYCLES in tests/layers/mod.rs",
                pair.0, pair.1
            ));
        }
    }
    let entry = |m: &str| entry_of(m).map(|(_, e)| e.to_owned()).unwrap_or_default();
    let entries: BTreeSet<String> = nodes.iter().map(|n| entry(n)).collect();
    let mut entry_graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in &all {
        let (a, b) = (entry(&e.from), entry(&e.to));
        if a != b && !is_inside(&e.to, &e.from) && !is_inside(&b, &a) && !is_inside(&a, &b) {
            entry_graph.entry(a).or_default().insert(b);
        }
    }
    for comp in cycles(&entries, &entry_graph) {
        let steps = loop_through(&comp, &entry_graph)
            .into_iter()
            .map(|(a, b)| {
                let e = all
                    .iter()
                    .find(|e| entry(&e.from) == a && entry(&e.to) == b)
                    .expect("edge");
                format!("    {a} -> {b}: {}:{} `{}`", e.path, e.line, e.text)
            })
            .collect::<Vec<_>>();
        out.push(format!(
            "import cycle between modules of the table ({}):\n{}",
            comp.join(", "),
            steps.join("\n")
        ));
    }
    out
}

/// The layer table holds: no upward import, no cycle, no module outside the table.
#[test]
fn imports_point_down_the_layers_and_never_in_a_cycle() {
    let files = load();
    // For a person reading the graph: PGOUTBOX_PRINT_IMPORTS=1 cargo test --test main --
    // layers:: --nocapture prints every import edge (`from -> to path:line`).
    if std::env::var_os("PGOUTBOX_PRINT_IMPORTS").is_some() {
        for e in edges(&files) {
            println!("{} -> {} {}:{}", e.from, e.to, e.path, e.line);
        }
    }
    assert!(files.len() > 40, "found {} files under src/", files.len());
    let found = findings(&files);
    assert!(
        found.is_empty(),
        "{} layering problem(s) in src/:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// docs/architecture/layers.md names every entry of the table, in its layer's row.
#[test]
fn the_architecture_doc_shows_the_same_table() {
    let doc = std::fs::read_to_string(root().join("docs/architecture/layers.md"))
        .expect("docs/architecture/layers.md");
    for (layer, mods) in LAYERS {
        let row = doc
            .lines()
            .find(|l| l.starts_with('|') && l.contains(layer))
            .unwrap_or_else(|| panic!("no row for {layer:?} in docs/architecture/layers.md"));
        for m in *mods {
            assert!(
                row.contains(&format!("`{m}`")) || (*m == "crate" && row.contains("`lib.rs`")),
                "docs/architecture/layers.md: the row of {layer:?} does not name `{m}`"
            );
        }
    }
}

/// The scanner itself: what it counts and what it leaves out.
#[test]
fn the_scanner_finds_use_trees_inline_paths_and_super() {
    let code = code_only(
        "use crate::a::{b::{self, C}, d as e};\n\
         // crate::commented::out\n\
         let s = \"crate::in_a_string\";\n\
         let r = r#\"crate::raw\"#;\n\
         let c = '\"'; let l: &'static str = x;\n\
         fn f() { crate::inline::path(); super::up::Thing; child::f(); }\n\
         mod child;\n\
         mod tests { use super::*; use super::super::grand; }\n",
    );
    assert!(!code.contains("commented") && !code.contains("in_a_string") && !code.contains("raw"));
    let file = SourceFile {
        path: "src/x/y.rs".into(),
        module: "x::y".into(),
        code,
    };
    let files = vec![
        file,
        SourceFile {
            path: "src/a/b.rs".into(),
            module: "a::b".into(),
            code: String::new(),
        },
        SourceFile {
            path: "src/a/mod.rs".into(),
            module: "a".into(),
            code: String::new(),
        },
        SourceFile {
            path: "src/inline.rs".into(),
            module: "inline".into(),
            code: String::new(),
        },
        SourceFile {
            path: "src/x/up.rs".into(),
            module: "x::up".into(),
            code: String::new(),
        },
        SourceFile {
            path: "src/x/y/child.rs".into(),
            module: "x::y::child".into(),
            code: String::new(),
        },
        SourceFile {
            path: "src/x/grand.rs".into(),
            module: "x::grand".into(),
            code: String::new(),
        },
    ];
    let got: Vec<(String, usize)> = edges(&files).into_iter().map(|e| (e.to, e.line)).collect();
    assert_eq!(
        got,
        [
            ("a".to_owned(), 1),
            ("a::b".to_owned(), 1),
            ("inline".to_owned(), 6),
            ("x::grand".to_owned(), 8),
            ("x::up".to_owned(), 6),
            ("x::y::child".to_owned(), 6),
        ]
    );
}
