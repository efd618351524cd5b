//! The files in `deploy/` name only flags and `PGOUTBOX_*` variables the binary has.
//!
//! No container engine, Kubernetes or Prometheus runs here, so these files are checked, not
//! run: every YAML file must parse, and every `--flag` in an invocation of pgoutbox (a
//! container's `command`/`args` whose `image` is pgoutbox, the Dockerfile's `ENTRYPOINT` and
//! `CMD`, the unit's `ExecStart`, a `pgoutbox <subcommand> ...` or `"$BIN" <subcommand> ...`
//! on any line, comments included) must be an option of that subcommand, and every
//! `PGOUTBOX_*` word anywhere must be a variable the binary reads. What the binary has is
//! asked of the binary itself (`--help` of every subcommand), so a flag another branch adds
//! passes only once the binary has it. `PGOUTBOX_TEST_BIN` checks another binary.
//!
//! Variables of the test harness and the scripts (`PGOUTBOX_TEST_*`, `PGOUTBOX_BENCH_*`,
//! `PGOUTBOX_STACK_*`, `PGOUTBOX_FUZZ_*`) are not the binary's and are left alone.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Prefixes of variables the binary never reads: the harness's and the scripts' own.
const NOT_THE_BINARYS: [&str; 4] = [
    "PGOUTBOX_TEST_",
    "PGOUTBOX_BENCH_",
    "PGOUTBOX_STACK_",
    "PGOUTBOX_FUZZ_",
];

/// What the binary accepts: options per subcommand path (`run`, `dead-letters list`) and
/// every environment variable any of them reads.
struct Surface {
    flags: BTreeMap<String, BTreeSet<String>>,
    env: BTreeSet<String>,
}

fn binary() -> String {
    std::env::var("PGOUTBOX_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_pgoutbox").into())
}

fn help(path: &[&str]) -> String {
    let out = std::process::Command::new(binary())
        .args(path)
        .arg("--help")
        .env("NO_COLOR", "1")
        .output()
        .expect("run pgoutbox --help");
    assert!(out.status.success(), "pgoutbox {path:?} --help failed");
    String::from_utf8(out.stdout).expect("utf-8 help")
}

/// The names listed under `Commands:` in a help text (without `help`).
fn subcommands(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("Commands:") {
            inside = true;
        } else if inside {
            match line.split_whitespace().next() {
                Some(name) if line.starts_with("  ") => {
                    if name != "help" {
                        names.push(name.to_owned());
                    }
                }
                _ => inside = false,
            }
        }
    }
    names
}

fn surface() -> Surface {
    let mut s = Surface {
        flags: BTreeMap::new(),
        env: BTreeSet::new(),
    };
    let mut todo: Vec<Vec<String>> = subcommands(&help(&[]))
        .into_iter()
        .map(|n| vec![n])
        .collect();
    while let Some(path) = todo.pop() {
        let refs: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&refs);
        for child in subcommands(&text) {
            let mut p = path.clone();
            p.push(child);
            todo.push(p);
        }
        let mut flags = BTreeSet::new();
        for line in text.lines() {
            if line.trim_start().starts_with('-') {
                for word in line.split(|c: char| c.is_whitespace() || c == ',') {
                    if let Some(name) = word.strip_prefix("--") {
                        flags.insert(format!("--{}", name.split('=').next().unwrap_or("")));
                    }
                }
            }
            let mut rest = line;
            while let Some(at) = rest.find("[env: ") {
                rest = &rest[at + 6..];
                let end = rest.find(['=', ']']).unwrap_or(rest.len());
                s.env.insert(rest[..end].to_owned());
            }
        }
        s.flags.insert(path.join(" "), flags);
    }
    assert!(
        s.flags.contains_key("run"),
        "no run subcommand: {:?}",
        s.flags.keys()
    );
    assert!(s.env.contains("PGOUTBOX_DATABASE_URL"), "{:?}", s.env);
    s
}

/// One invocation of pgoutbox found in a file: its words after the program name.
struct Invocation {
    file: String,
    line: usize,
    words: Vec<String>,
}

fn clean(word: &str) -> String {
    word.trim_matches(|c: char| "`'\"[](),;".contains(c))
        .to_owned()
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .map_or(0, |i| i + 1)
}

/// Words of a YAML `command`/`args`/`entrypoint`: a list of strings, or one string.
fn yaml_words(value: &yaml_rust2::Yaml) -> Vec<String> {
    match value {
        yaml_rust2::Yaml::Array(items) => items
            .iter()
            .filter_map(|i| i.as_str().map(str::to_owned))
            .collect(),
        yaml_rust2::Yaml::String(s) => s.split_whitespace().map(clean).collect(),
        _ => Vec::new(),
    }
}

/// Walks a YAML tree; every mapping whose `image` names pgoutbox is a container of ours.
fn yaml_invocations(node: &yaml_rust2::Yaml, file: &str, text: &str, out: &mut Vec<Invocation>) {
    use yaml_rust2::Yaml;
    match node {
        Yaml::Hash(map) => {
            let image = map
                .get(&Yaml::String("image".into()))
                .and_then(Yaml::as_str)
                .unwrap_or("");
            if image.contains("pgoutbox") {
                let mut words = Vec::new();
                for key in ["entrypoint", "command", "args"] {
                    if let Some(v) = map.get(&Yaml::String(key.into())) {
                        words.extend(yaml_words(v));
                    }
                }
                let line = words
                    .first()
                    .map_or(0, |w| line_of(text, &format!("\"{w}\"")));
                out.push(Invocation {
                    file: file.to_owned(),
                    line,
                    words,
                });
            }
            for (_, v) in map {
                yaml_invocations(v, file, text, out);
            }
        }
        Yaml::Array(items) => {
            for v in items {
                yaml_invocations(v, file, text, out);
            }
        }
        _ => {}
    }
}

fn deploy_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read deploy/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Everything the deploy files say to the binary, each with where it is said.
fn invocations_and_variables(files: &[PathBuf]) -> (Vec<Invocation>, Vec<(String, usize, String)>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut calls = Vec::new();
    let mut vars = Vec::new();
    for path in files {
        let name = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let base = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if base.ends_with(".yml") || base.ends_with(".yaml") {
            let docs = yaml_rust2::YamlLoader::load_from_str(&text)
                .unwrap_or_else(|e| panic!("{name} is not valid YAML: {e}"));
            assert!(!docs.is_empty(), "{name} holds no YAML document");
            for doc in &docs {
                yaml_invocations(doc, &name, &text, &mut calls);
            }
        }
        if base == "Dockerfile" {
            // Exec form: ENTRYPOINT ["/usr/local/bin/pgoutbox"] then CMD ["run", ...].
            let mut words = Vec::new();
            let mut line = 0;
            for (i, l) in text.lines().enumerate() {
                for keyword in ["ENTRYPOINT ", "CMD "] {
                    if let Some(json) = l.strip_prefix(keyword) {
                        let list: Vec<String> = serde_json::from_str(json).unwrap_or_else(|e| {
                            panic!("{name}:{}: {keyword}is not exec form: {e}", i + 1)
                        });
                        words.extend(list.into_iter().filter(|w| !w.ends_with("/pgoutbox")));
                        line = i + 1;
                    }
                }
            }
            assert!(!words.is_empty(), "{name}: no CMD for pgoutbox");
            calls.push(Invocation {
                file: name.clone(),
                line,
                words,
            });
        }
        for (i, l) in text.lines().enumerate() {
            // ExecStart=/usr/local/bin/pgoutbox run, `pgoutbox status`, "$BIN" run ...
            // An invocation ends at the end of its backtick quote or at a `;`.
            let raw: Vec<&str> = l.split_whitespace().collect();
            let is_program = |at: usize| {
                let w = clean(raw[at]);
                let program = w.strip_prefix("ExecStart=").unwrap_or(&w);
                let after_cargo_flag =
                    at > 0 && ["--bin", "-p", "--package"].contains(&raw[at - 1]);
                !after_cargo_flag
                    && (program == "pgoutbox"
                        || program.ends_with("/pgoutbox")
                        || program == "$BIN")
            };
            for at in 0..raw.len() {
                if !is_program(at) || raw[at].ends_with('`') {
                    continue;
                }
                let mut words = Vec::new();
                for (next, w) in raw.iter().enumerate().skip(at + 1) {
                    if is_program(next) {
                        break;
                    }
                    words.push(clean(w));
                    if w.ends_with('`') || w.ends_with(';') || w.ends_with("`;") {
                        break;
                    }
                }
                calls.push(Invocation {
                    file: name.clone(),
                    line: i + 1,
                    words,
                });
            }
            let mut rest = l;
            while let Some(at) = rest.find("PGOUTBOX_") {
                let tail = &rest[at..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                    .unwrap_or(tail.len());
                // `PGOUTBOX_*` in prose names the family, not a variable.
                if end > "PGOUTBOX_".len() {
                    vars.push((name.clone(), i + 1, tail[..end].to_owned()));
                }
                rest = &tail[end..];
            }
        }
    }
    (calls, vars)
}

/// `deploy/` names no flag and no variable the binary lacks.
#[test]
fn deploy_files_name_only_flags_and_variables_the_binary_has() {
    let surface = surface();
    let files = deploy_files();
    let (calls, vars) = invocations_and_variables(&files);
    let mut wrong = Vec::new();
    let mut checked_flags = 0;
    for call in &calls {
        // The subcommand path: the longest prefix of words the binary knows.
        let mut path = String::new();
        for w in &call.words {
            let longer = if path.is_empty() {
                w.clone()
            } else {
                format!("{path} {w}")
            };
            if surface.flags.contains_key(&longer) {
                path = longer;
            } else {
                break;
            }
        }
        let known: BTreeSet<String> = if path.is_empty() {
            // No subcommand named (e.g. "pgoutbox run" split over lines): any of them.
            surface.flags.values().flatten().cloned().collect()
        } else {
            surface.flags[&path].clone()
        };
        for w in &call.words {
            if let Some(flag) = w
                .strip_prefix("--")
                .filter(|f| f.starts_with(|c: char| c.is_ascii_lowercase()))
            {
                let flag = format!("--{}", flag.split('=').next().unwrap_or(""));
                checked_flags += 1;
                if !known.contains(&flag) {
                    wrong.push(format!(
                        "{}:{}: `pgoutbox {path}` has no {flag}",
                        call.file, call.line
                    ));
                }
            }
        }
    }
    let mut checked_vars = 0;
    for (file, line, var) in &vars {
        if NOT_THE_BINARYS.iter().any(|p| var.starts_with(p)) {
            continue;
        }
        checked_vars += 1;
        if !surface.env.contains(var) {
            wrong.push(format!("{file}:{line}: the binary reads no {var}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "deploy/ names what the binary ({}) does not have:\n{}",
        binary(),
        wrong.join("\n")
    );
    assert!(calls.len() >= 5, "found {} invocations", calls.len());
    eprintln!(
        "deploy files: {} files, {} invocations, {checked_flags} flags and {checked_vars} variables checked against {} subcommands",
        files.len(),
        calls.len(),
        surface.flags.len()
    );
}
