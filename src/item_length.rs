//! A test that holds the size of the code where the streamer's state lives (issue 22
//! "Targets"): no function over [`MAX_FN_LINES`] lines and no type definition over
//! [`MAX_TYPE_LINES`] lines in `src/pipeline/`, `src/publisher/` and `src/sink/`.
//!
//! An item's length runs from the line of its keyword (`fn`, `struct`, `enum`, `trait`)
//! to the line of its closing brace, both included (doc comments and attributes are not
//! counted). The source is read with a small lexer that skips comments, string, raw string
//! and character literals, so braces inside them do not count.
//!
//! `PGOUTBOX_ITEM_LENGTHS=all cargo test --lib item_length -- --nocapture` prints every
//! item over half the bounds, longest first.

use std::path::{Path, PathBuf};

/// The longest function allowed, in lines.
const MAX_FN_LINES: usize = 80;
/// The longest type definition (struct, enum, trait) allowed, in lines.
const MAX_TYPE_LINES: usize = 150;
/// The folders held, relative to the crate root.
const FOLDERS: [&str; 3] = ["src/pipeline", "src/publisher", "src/sink"];

/// One item found in a source file.
#[derive(Debug)]
struct Item {
    file: String,
    keyword: &'static str,
    name: String,
    first_line: usize,
    lines: usize,
}

/// Code characters of `source` with comments and literals blanked out (newlines kept, so
/// positions map to the same lines).
fn code_only(source: &str) -> Vec<u8> {
    let s = source.as_bytes();
    let mut out = s.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for b in &mut out[from..to] {
            if *b != b'\n' {
                *b = b' ';
            }
        }
    };
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        let start = i;
        if rest.starts_with(b"//") {
            while i < s.len() && s[i] != b'\n' {
                i += 1;
            }
            blank(&mut out, start, i);
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < s.len() {
                if s[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if s[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            blank(&mut out, start, i);
        } else if let Some(hashes) = raw_string_start(rest) {
            // r"..." / r#"..."# / br#"..."#
            i += rest.iter().position(|&b| b == b'"').unwrap_or(0) + 1;
            let end: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            while i < s.len() && !s[i..].starts_with(&end) {
                i += 1;
            }
            i = (i + end.len()).min(s.len());
            blank(&mut out, start, i);
        } else if s[i] == b'"' {
            i += 1;
            while i < s.len() && s[i] != b'"' {
                i += if s[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(s.len());
            blank(&mut out, start, i);
        } else if s[i] == b'\'' {
            // A character literal ('x', '\n', '\u{7f}') or a lifetime ('a): a literal closes
            // within a few bytes.
            let close = if rest.get(1) == Some(&b'\\') {
                rest.iter().skip(3).position(|&b| b == b'\'').map(|p| p + 3)
            } else {
                rest.iter()
                    .skip(1)
                    .take(5)
                    .position(|&b| b == b'\'')
                    .map(|p| p + 1)
            };
            match close {
                Some(p) if p <= 12 => {
                    i += p + 1;
                    blank(&mut out, start, i);
                }
                _ => i += 1,
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The number of `#` of a raw string starting at `rest` (`r"`, `r#"`, `br##"`), if it is one.
fn raw_string_start(rest: &[u8]) -> Option<usize> {
    let rest = rest.strip_prefix(b"b").unwrap_or(rest);
    let rest = rest.strip_prefix(b"r")?;
    let hashes = rest.iter().take_while(|&&b| b == b'#').count();
    (rest.get(hashes) == Some(&b'"')).then_some(hashes)
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The items of one file: each `fn`, `struct`, `enum` or `trait` keyword followed by a body
/// in braces (declarations ending in `;` are skipped).
fn items(file: &str, source: &str) -> Vec<Item> {
    let code = code_only(source);
    let line_of = |pos: usize| code[..pos].iter().filter(|&&b| b == b'\n').count() + 1;
    let mut found = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let at_word = i == 0 || !is_ident(code[i - 1]);
        let keyword = ["fn", "struct", "enum", "trait"]
            .into_iter()
            .find(|k| code[i..].starts_with(k.as_bytes()));
        let Some(keyword) = keyword.filter(|k| {
            at_word
                && code
                    .get(i + k.len())
                    .is_some_and(|b| b.is_ascii_whitespace())
        }) else {
            i += 1;
            continue;
        };
        let name_start = i + keyword.len();
        let name: String = code[name_start..]
            .iter()
            .skip_while(|b| b.is_ascii_whitespace())
            .take_while(|&&b| is_ident(b))
            .map(|&b| b as char)
            .collect();
        // The body opens at the first `{` outside parentheses, brackets and angle brackets
        // of the signature; a `;` first means no body.
        let mut j = name_start;
        let mut nesting = 0i32;
        let mut open = None;
        while j < code.len() {
            match code[j] {
                b'(' | b'[' => nesting += 1,
                b')' | b']' => nesting -= 1,
                b';' if nesting == 0 => break,
                b'{' if nesting == 0 => {
                    open = Some(j);
                    break;
                }
                _ => {}
            }
            j += 1;
        }
        if let Some(open) = open {
            let mut depth = 0;
            let mut k = open;
            while k < code.len() {
                match code[k] {
                    b'{' => depth += 1,
                    b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                k += 1;
            }
            let first_line = line_of(i);
            found.push(Item {
                file: file.to_owned(),
                keyword,
                name,
                first_line,
                lines: line_of(k.min(code.len() - 1)) - first_line + 1,
            });
        }
        i = name_start;
    }
    found
}

fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, into);
        } else if path.extension().is_some_and(|e| e == "rs") {
            into.push(path);
        }
    }
}

fn all_items() -> Vec<Item> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for folder in FOLDERS {
        rust_files(&root.join(folder), &mut files);
    }
    files.sort();
    let mut all = Vec::new();
    for path in files {
        let source = std::fs::read_to_string(&path).expect("read a source file");
        let name = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .display()
            .to_string();
        all.extend(items(&name, &source));
    }
    all.sort_by_key(|i| std::cmp::Reverse(i.lines));
    all
}

fn limit(item: &Item) -> usize {
    if item.keyword == "fn" {
        MAX_FN_LINES
    } else {
        MAX_TYPE_LINES
    }
}

#[test]
fn no_long_functions_or_types_in_the_pipeline_and_publishers() {
    let all = all_items();
    assert!(all.len() > 100, "the scan found only {} items", all.len());
    let show_all = std::env::var("PGOUTBOX_ITEM_LENGTHS").is_ok_and(|v| v == "all");
    for item in all.iter().filter(|i| show_all && i.lines * 2 > limit(i)) {
        println!(
            "{:>4} lines  {} {}  {}:{}",
            item.lines, item.keyword, item.name, item.file, item.first_line
        );
    }
    let long: Vec<String> = all
        .iter()
        .filter(|i| i.lines > limit(i))
        .map(|i| {
            format!(
                "{}:{} {} {} is {} lines (at most {})",
                i.file,
                i.first_line,
                i.keyword,
                i.name,
                i.lines,
                limit(i)
            )
        })
        .collect();
    assert!(
        long.is_empty(),
        "split these along their concepts (issue 22):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_scan_skips_literals_and_comments_and_measures_bodies() {
    let source = r##"
/// fn not_this() {
fn one() {
    let s = "} {";
    let c = '}';
    let r = r#"}"#;
    // }
}

trait T {
    fn declared(&self);
}

fn two<'a>(x: &'a str) -> &'a str {
    /* { */
    x
}
"##;
    let found = items("x.rs", source);
    let summary: Vec<(&str, &str, usize, usize)> = found
        .iter()
        .map(|i| (i.keyword, i.name.as_str(), i.first_line, i.lines))
        .collect();
    assert_eq!(
        summary,
        [
            ("fn", "one", 3, 6),
            ("trait", "T", 10, 3),
            ("fn", "two", 14, 4)
        ]
    );
}
