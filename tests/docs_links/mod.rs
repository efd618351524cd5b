//! Every relative link and `#anchor` in `README.md` and `docs/` resolves.
//!
//! No network and no servers: the Markdown is parsed with pulldown-cmark (the parser mdBook
//! itself uses, with the extensions mdBook turns on), so what counts as a link or a heading is
//! what the book renders. The rules:
//!
//! - a link without a scheme (`http:`, `https:`, `mailto:`) must name a file or directory
//!   that exists, relative to the page (an empty path is the page itself);
//! - a `#anchor` into a Markdown file must be the id of one of its headings, made by mdBook's
//!   rule (GitHub's is the same for our headings): the heading's text lowercased, whitespace
//!   to `-`, every character that is not alphanumeric, `-` or `_` dropped, and `-1`, `-2`, ...
//!   appended to repeats; an explicit `{#id}` wins;
//! - a page of the book (`docs/src/`) links only inside `docs/src/`, because the built book
//!   contains nothing else (a link to `sql/outbox.sql` would work on a code host and break in
//!   the book: name such files in code font instead);
//! - every page under `docs/src/` is listed in `docs/src/SUMMARY.md`, so none is left out of
//!   the book.
//!
//! `docs/book/` (the build output) is skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

/// The links and heading ids of one Markdown file.
#[derive(Debug, Default)]
struct Page {
    /// Link and image destinations, as written.
    links: Vec<String>,
    /// The ids of its headings.
    ids: BTreeSet<String>,
}

/// mdBook's `normalize_id`: lowercase, whitespace to `-`, keep alphanumerics, `-` and `_`.
fn normalize_id(text: &str) -> String {
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_ascii_lowercase())
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

fn options() -> Options {
    Options::ENABLE_TABLES
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_HEADING_ATTRIBUTES
        | Options::ENABLE_DEFINITION_LIST
}

fn parse(text: &str) -> Page {
    let mut page = Page::default();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    // The heading being read: its explicit id, if any, and its text so far.
    let mut heading: Option<(Option<String>, String)> = None;
    for event in Parser::new_ext(text, options()) {
        match event {
            Event::Start(Tag::Heading { id, .. }) => {
                heading = Some((id.map(|i| i.to_string()), String::new()));
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some((_, text)) = heading.as_mut() {
                    text.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some((explicit, text)) = heading.take() {
                    let id = explicit.unwrap_or_else(|| {
                        let base = normalize_id(&text);
                        let n = seen.entry(base.clone()).or_insert(0);
                        let id = if *n == 0 {
                            base.clone()
                        } else {
                            format!("{base}-{n}")
                        };
                        *n += 1;
                        id
                    });
                    page.ids.insert(id);
                }
            }
            Event::Start(Tag::Link { dest_url, .. })
            | Event::Start(Tag::Image { dest_url, .. }) => {
                page.links.push(dest_url.to_string());
            }
            _ => {}
        }
    }
    page
}

/// `path` with `.` and `..` folded, without touching the file system.
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn has_scheme(link: &str) -> bool {
    link.split_once(':').is_some_and(|(scheme, _)| {
        !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    })
}

/// The Markdown files checked under `root`: `README.md` and every `.md` under `docs/`
/// except the build output.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if path != root.join("docs/book") {
                    dirs.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Every problem found under `root`, one line each (`file: link: why`).
fn check(root: &Path) -> Vec<String> {
    let book = lexical(&root.join("docs/src"));
    let files = markdown_files(root);
    let mut pages: BTreeMap<PathBuf, Page> = BTreeMap::new();
    let mut problems = Vec::new();
    for file in &files {
        match std::fs::read_to_string(file) {
            Ok(text) => {
                pages.insert(lexical(file), parse(&text));
            }
            Err(e) => problems.push(format!("{}: cannot read: {e}", file.display())),
        }
    }
    let show = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    for (file, page) in &pages {
        let dir = file.parent().unwrap_or(root);
        for link in &page.links {
            if has_scheme(link) {
                continue;
            }
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                lexical(&dir.join(path))
            };
            let mut why = None;
            if !target.starts_with(root) {
                why = Some("points outside the repository".to_owned());
            } else if file.starts_with(&book) && !target.starts_with(&book) {
                why = Some("a book page links outside docs/src/, which the built book does not contain; name the file in code font instead".to_owned());
            } else if !target.exists() {
                why = Some(format!("{} does not exist", show(&target)));
            } else if let Some(anchor) = anchor.filter(|a| !a.is_empty()) {
                if target.extension().is_some_and(|e| e == "md") {
                    match pages.get(&target) {
                        Some(p) if p.ids.contains(anchor) => {}
                        Some(p) => {
                            why = Some(format!(
                                "no heading of {} has the id {anchor:?} (it has: {})",
                                show(&target),
                                p.ids.iter().cloned().collect::<Vec<_>>().join(", ")
                            ))
                        }
                        None => why = Some(format!("{} is not a checked page", show(&target))),
                    }
                }
            }
            if let Some(why) = why {
                problems.push(format!("{}: ({link}): {why}", show(file)));
            }
        }
    }
    // Every book page is in the table of contents.
    let summary = book.join("SUMMARY.md");
    if let Some(toc) = pages.get(&summary) {
        let listed: BTreeSet<PathBuf> = toc
            .links
            .iter()
            .map(|l| lexical(&book.join(l.split('#').next().unwrap_or_default())))
            .collect();
        for file in pages.keys() {
            if file.starts_with(&book) && *file != summary && !listed.contains(file) {
                problems.push(format!(
                    "{}: not listed in docs/src/SUMMARY.md, so the book leaves it out",
                    show(file)
                ));
            }
        }
    } else if book.exists() {
        problems.push("docs/src/SUMMARY.md is missing".into());
    }
    problems
}

#[test]
fn every_relative_link_and_anchor_in_the_readme_and_the_book_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = markdown_files(root);
    assert!(
        files.len() > 20,
        "expected the README and the book's pages, found {files:?}"
    );
    let problems = check(root);
    assert!(
        problems.is_empty(),
        "{} broken link(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The checker itself can fail: a broken file link, a broken anchor, a book page linking out
/// of the book and a page missing from SUMMARY.md are each reported; good links are not.
#[test]
fn the_checker_reports_each_kind_of_broken_link() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    let write = |path: &str, text: &str| {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    };
    write(
        "README.md",
        "# Top\n\n[ok](docs/src/a.md#why-run-refused-to-start-gaps-and---accept-gap) \
         [ok](#top) [ok](https://example.org/x) [gone](docs/src/missing.md) \
         [bad anchor](docs/src/a.md#nope)\n\n```sh\n[not a link](nowhere.md)\n```\n",
    );
    write("sql/x.sql", "");
    write("docs/src/SUMMARY.md", "# Summary\n\n- [A](a.md)\n");
    write(
        "docs/src/a.md",
        "# Why `run` refused to start: gaps and `--accept-gap`\n\n## Again\n\n## Again\n\n\
         [ok](#again-1) [out of the book](../../sql/x.sql) [ok](#again)\n",
    );
    write("docs/src/orphan.md", "# Orphan\n");
    let problems = check(root);
    let has = |needle: &str| problems.iter().any(|p| p.contains(needle));
    assert!(
        has("(docs/src/missing.md): docs/src/missing.md does not exist"),
        "{problems:#?}"
    );
    assert!(has("(docs/src/a.md#nope): no heading"), "{problems:#?}");
    assert!(
        has("(../../sql/x.sql): a book page links outside docs/src/"),
        "{problems:#?}"
    );
    assert!(has("docs/src/orphan.md: not listed"), "{problems:#?}");
    assert_eq!(
        problems.len(),
        4,
        "only the four broken ones: {problems:#?}"
    );
}

/// Issue 32, item 7: every page of the book that the code names in a text it prints (an
/// error's "see docs/src/...md", a log line, `--help`), with its `#anchor` if any, exists,
/// so that an operator who follows it lands on the page and the heading.
#[test]
fn every_docs_page_and_anchor_named_in_the_code_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = Vec::new();
    let mut dirs = vec![root.join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                sources.push(path);
            }
        }
    }
    let mut named = 0;
    let mut problems = Vec::new();
    for file in &sources {
        let text = std::fs::read_to_string(file).expect("read source");
        for (at, _) in text.match_indices("docs/src/") {
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || "/_.-#".contains(c)))
                .unwrap_or(rest.len());
            let link = rest[..end].trim_end_matches('.');
            let (page, anchor) = link.split_once('#').unwrap_or((link, ""));
            if !page.ends_with(".md") {
                continue; // a directory named in prose, or a path built at run time
            }
            named += 1;
            let where_ = format!(
                "{}: {link}",
                file.strip_prefix(root).unwrap_or(file).display()
            );
            let Ok(markdown) = std::fs::read_to_string(root.join(page)) else {
                problems.push(format!("{where_}: no such page"));
                continue;
            };
            if !anchor.is_empty() && !parse(&markdown).ids.contains(anchor) {
                problems.push(format!("{where_}: no heading with id {anchor:?}"));
            }
        }
    }
    assert!(named > 10, "found only {named} pages named in src/");
    assert!(
        problems.is_empty(),
        "{} of {named} pages named in the code do not resolve:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The texts of the `#[error("...")]` attributes and of the `Precondition("...")` errors
/// (literal or `format!`) under `src/`, as written (escapes kept), each with the file it is
/// in. A text made only of placeholders (`{0}`, `transparent`) is a
/// wrapper whose inner error has its own text, and is skipped.
fn error_texts(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![root.join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read source");
            let file = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .display()
                .to_string();
            // `#[error("...")]` texts, and the texts of `Precondition(...)` errors (the
            // top-level error whose text is built at the call: `Precondition("...")` or
            // `Precondition(format!("...", ...))`).
            let mut starts: Vec<usize> = text
                .match_indices("#[error(\"")
                .map(|(at, m)| at + m.len())
                .collect();
            for (at, m) in text.match_indices("Precondition(") {
                let rest = text[at + m.len()..].trim_start();
                let rest = rest.strip_prefix("format!(").map_or(rest, str::trim_start);
                if let Some(body) = rest.strip_prefix('"') {
                    starts.push(text.len() - body.len());
                }
            }
            for start in starts {
                let body = &text[start..];
                let mut end = None;
                let mut escaped = false;
                for (i, c) in body.char_indices() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => {
                            end = Some(i);
                            break;
                        }
                        _ => escaped = false,
                    }
                }
                let literal = &body[..end.expect("an error text's literal ends")];
                out.push((file.clone(), literal.to_owned()));
            }
        }
    }
    out.sort();
    out
}

/// Lowercase, Markdown emphasis and code marks, string escapes and `:;,` dropped, whitespace folded,
/// so that an error text and the page's quotation of it compare equal.
fn folded(text: &str) -> String {
    text.replace("\\\"", "\"")
        .chars()
        .filter(|c| !"`*\\:;,".contains(*c))
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// What of an error text the troubleshooting page may quote: the start (up to six words) of
/// each run of literal text between placeholders that has three words or more (the page
/// quotes a long text by a part of it, with `...` and `<placeholders>` for the rest). Empty
/// when no run has three words: a wrapper such as `"postgres: {context}"`, whose inner text
/// is the message.
fn quotable(literal: &str) -> Vec<String> {
    let mut runs = Vec::new();
    let mut run = String::new();
    let mut depth = 0;
    for c in literal.chars() {
        match c {
            '{' => {
                depth += 1;
                runs.push(std::mem::take(&mut run));
            }
            '}' if depth > 0 => depth -= 1,
            _ if depth == 0 => run.push(c),
            _ => {}
        }
    }
    runs.push(run);
    runs.iter()
        .map(|r| folded(r.trim_matches(|c: char| !c.is_alphanumeric())))
        .filter_map(|r| {
            let words: Vec<&str> = r.split(' ').collect();
            (words.len() >= 3).then(|| words[..words.len().min(6)].join(" "))
        })
        .collect()
}

/// Error texts that have no entry of their own on the troubleshooting page, each with why: an
/// operator never reads them alone, because another text that has an entry carries them
/// (its `{reason}` or `{source}`), or they are not operator-facing at all. An entry here
/// that matches no error text any more fails the test, so the list cannot go stale.
const NO_ENTRY_OF_THEIR_OWN: &[(&str, &str)] = &[
    (
        "empty envelope",
        "a decode error: the dead letter's reason `poison` carries it",
    ),
    (
        "envelope header",
        "a decode error: the dead letter's reason `poison` carries it",
    ),
    (
        "envelope traceparent",
        "a decode error: the dead letter's reason `poison` carries it",
    ),
    (
        "envelope tracestate",
        "a decode error: the dead letter's reason `poison` carries it",
    ),
    (
        "empty pgoutput message",
        "the {reason} of 'could not decode the pgoutput message at LSN'",
    ),
    (
        "empty copydata body",
        "the {reason} of 'could not decode the pgoutput message at LSN'",
    ),
    (
        "primary keepalive must be exactly",
        "the {reason} of 'replication protocol violation'",
    ),
    (
        "a transaction began while another",
        "the {source} of 'broke pgoutput's transaction order'",
    ),
    (
        "a transactional message or commit arrived",
        "the {source} of 'broke pgoutput's transaction order'",
    ),
    (
        "invalid lsn",
        "not printed: the code parses only LSNs PostgreSQL wrote, and drops what fails",
    ),
    (
        "bytes long the limit is 255 bytes",
        "a decode error: the dead letter's reason `poison` carries it",
    ),
    (
        "a confirm arrived for a message",
        "the text of 'internal error, please report it'",
    ),
    (
        "returned a message",
        "the {what} of 'RabbitMQ broke the publisher-confirm protocol'",
    ),
    (
        "sent basic.",
        "the {what} of 'RabbitMQ broke the publisher-confirm protocol'",
    ),
    (
        "but pgoutbox publishes only on channel",
        "the {what} of 'RabbitMQ broke the publisher-confirm protocol'",
    ),
];

/// Issue 32, item 7: every error text the code defines (`#[error("...")]` and
/// `Precondition("...")` under `src/`) has
/// an entry on the troubleshooting page, found by the start of one of its literal runs, or is
/// in [`NO_ENTRY_OF_THEIR_OWN`] with the reason. Texts built with `format!` inside other
/// `{0}` wrappers (`Config`, a layer's own) are not seen by this test.
#[test]
fn every_error_text_has_a_troubleshooting_entry() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = folded(
        &std::fs::read_to_string(root.join("docs/src/operators/troubleshooting.md"))
            .expect("read troubleshooting page"),
    );
    let texts = error_texts(root);
    assert!(texts.len() > 50, "found only {} error texts", texts.len());
    let mut used = BTreeSet::new();
    let mut checked = 0;
    let mut missing = Vec::new();
    for (file, literal) in &texts {
        let quotes = quotable(literal);
        if quotes.is_empty() {
            continue;
        }
        checked += 1;
        let all = folded(literal);
        if let Some((prefix, _)) = NO_ENTRY_OF_THEIR_OWN
            .iter()
            .find(|(prefix, _)| all.contains(prefix))
        {
            used.insert(*prefix);
            continue;
        }
        if !quotes.iter().any(|q| page.contains(q)) {
            missing.push(format!("{file}: {literal:?}"));
        }
    }
    let stale: Vec<_> = NO_ENTRY_OF_THEIR_OWN
        .iter()
        .filter(|(prefix, _)| !used.contains(prefix))
        .map(|(prefix, _)| *prefix)
        .collect();
    assert!(
        stale.is_empty(),
        "NO_ENTRY_OF_THEIR_OWN names texts the code no longer has: {stale:?}"
    );
    assert!(
        missing.is_empty(),
        "{} of {checked} error texts have no entry on docs/src/operators/troubleshooting.md:\n{}",
        missing.len(),
        missing.join("\n")
    );
}
