//! How an error and its causes are written for people: one line for a log field
//! ([`one_line`]), one cause per line for the report a command ends with
//! ([`render_report`]). Pure text over [`std::error::Error::source`] chains, so every layer
//! may use it (the replication and publisher sessions log with it, the binary prints with
//! it).

/// The error and its causes on one line, joined by `: ` (for a log field; see
/// [`render_report`] for the multi-line form).
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    render_report(error)
        .trim_start_matches("error: ")
        .replace("\n  caused by: ", ": ")
}

/// The error and its causes, one per line (`error: ...`, then `  caused by: ...`), each
/// cause printed once.
pub fn render_report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = format!("error: {error}");
    let mut last = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // Some libraries repeat their source in their own message: print it once.
        if !last.contains(&text) {
            out.push_str(&format!("\n  caused by: {text}"));
        }
        last = text;
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("session failed")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn one_line_joins_the_causes_a_report_prints_on_separate_lines() {
        let e = Outer(std::io::Error::other("connection refused"));
        assert_eq!(
            render_report(&e),
            "error: session failed\n  caused by: connection refused"
        );
        assert_eq!(one_line(&e), "session failed: connection refused");
    }
}
