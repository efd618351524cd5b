//! The catalogue of every metric `run` serves, read from the registry itself: name, type,
//! help and labels (with the values each label can take), for the generated reference
//! (`docs/src/reference/metrics.md`) and for the check that every metric name a help text
//! or a book page mentions exists.
//!
//! The registry is the one source: [`catalog`] encodes a fresh [`Telemetry`] (every
//! labelled family has its label values registered at 0 from the start) and reads the
//! OpenMetrics text back, so a metric added, renamed or relabelled shows here without a
//! second list to keep in step. Pure: no I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use super::Telemetry;

/// One metric family, as the reference shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricDoc {
    /// The name a scrape shows and a query uses (`pgoutbox_messages_published_total`;
    /// for the histogram its base name, whose samples add `_bucket`, `_sum`, `_count`).
    pub name: String,
    /// `counter`, `gauge`, `histogram` or `info`.
    pub kind: String,
    /// The registry's help text.
    pub help: String,
    /// Each label and its values (sorted); a label whose value is
    /// not fixed (the build's `version`) has none listed. The histogram's `le` is left out.
    pub labels: Vec<(String, Vec<String>)>,
    /// The histogram's bucket bounds (`le`), in seconds; empty for the others.
    pub buckets: Vec<String>,
}

/// Labels whose values are not a fixed set (shown by name only): the build's `version`, and
/// `partition` (`0` to `--partitions` - 1).
const OPEN_LABELS: &[&str] = &["version", "partition"];

/// Every metric family of a fresh `run`, in registry order.
pub fn catalog() -> Vec<MetricDoc> {
    let text = Telemetry::new(Duration::from_secs(60)).encode();
    parse_exposition(&text)
}

/// Reads `# HELP`, `# TYPE` and the samples of an OpenMetrics text into families.
fn parse_exposition(text: &str) -> Vec<MetricDoc> {
    let mut families: Vec<MetricDoc> = Vec::new();
    let mut help: BTreeMap<String, String> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (base, h) = rest.split_once(' ').unwrap_or((rest, ""));
            help.insert(base.to_owned(), h.to_owned());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (base, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let name = match kind {
                "counter" => format!("{base}_total"),
                "info" => format!("{base}_info"),
                _ => base.to_owned(),
            };
            families.push(MetricDoc {
                name,
                kind: kind.to_owned(),
                help: help.get(base).cloned().unwrap_or_default(),
                labels: Vec::new(),
                buckets: Vec::new(),
            });
        } else if !line.starts_with('#') && !line.is_empty() {
            let Some(family) = families.last_mut() else {
                continue;
            };
            for (label, value) in sample_labels(line) {
                if label == "le" {
                    // The encoder writes the last bucket's bound as f64::MAX.
                    let value =
                        if value == f64::MAX.to_string() || value == format!("{:e}", f64::MAX) {
                            "+Inf".to_owned()
                        } else {
                            value
                        };
                    if !family.buckets.contains(&value) {
                        family.buckets.push(value);
                    }
                    continue;
                }
                let slot = match family.labels.iter_mut().find(|(l, _)| *l == label) {
                    Some(slot) => slot,
                    None => {
                        family.labels.push((label.clone(), Vec::new()));
                        family.labels.last_mut().expect("just pushed")
                    }
                };
                if !OPEN_LABELS.contains(&label.as_str()) && !slot.1.contains(&value) {
                    slot.1.push(value);
                }
            }
        }
    }
    // A family's series come out of a hash map: sort the values, so the catalogue (and the
    // page written from it) is the same on every run.
    for family in &mut families {
        for (_, values) in &mut family.labels {
            values.sort();
        }
    }
    families
}

/// The `label="value"` pairs of one sample line (values of ours never hold `"` or `,`).
fn sample_labels(line: &str) -> Vec<(String, String)> {
    let Some((_, rest)) = line.split_once('{') else {
        return Vec::new();
    };
    let Some((inside, _)) = rest.split_once('}') else {
        return Vec::new();
    };
    inside
        .split(',')
        .filter_map(|pair| {
            let (label, value) = pair.split_once('=')?;
            Some((label.to_owned(), value.trim_matches('"').to_owned()))
        })
        .collect()
}

/// Identifiers that start `pgoutbox_` and are no metric: the roles of `sql/roles.sql` and
/// `sql/lockdown.sql`, and a function of `sql/roles.sql`.
pub const NOT_METRICS: &[&str] = &[
    "pgoutbox_emitter",
    "pgoutbox_streamer",
    "pgoutbox_producer",
    "pgoutbox_create_roles",
];

/// The names in `text` that look like one of our metrics (`pgoutbox_` and a lowercase
/// name, not a digit: `pgoutbox_1` is a slot) and are not in the catalogue `known`
/// (a family's name, or a histogram's sample name), nor one of [`NOT_METRICS`].
pub fn unknown_metric_names(text: &str, known: &[MetricDoc]) -> Vec<String> {
    let mut unknown = Vec::new();
    let bytes = text.as_bytes();
    let mut from = 0;
    while let Some(at) = text[from..].find("pgoutbox_") {
        let start = from + at;
        let mut end = start + "pgoutbox_".len();
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        from = end;
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let name = text[start..end].trim_end_matches('_');
        let first = name.as_bytes().get("pgoutbox_".len());
        if preceded || !first.is_some_and(u8::is_ascii_lowercase) || NOT_METRICS.contains(&name) {
            continue;
        }
        let is_known = known.iter().any(|m| {
            m.name == name
                || (m.kind == "histogram"
                    && ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(m.name.as_str())))
        });
        if !is_known && !unknown.iter().any(|u| u == name) {
            unknown.push(name.to_owned());
        }
    }
    unknown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_has_every_metric_with_its_type_labels_and_help() {
        let all = catalog();
        let get = |name: &str| {
            all.iter()
                .find(|m| m.name == name)
                .unwrap_or_else(|| panic!("{name} missing: {all:#?}"))
        };
        for name in super::super::NAMES {
            let m = get(name);
            assert!(!m.help.is_empty(), "{name} has no help");
        }
        assert_eq!(all.len(), super::super::NAMES.len(), "{all:#?}");
        let dl = get(super::super::MESSAGES_DEAD_LETTERED_TOTAL);
        assert_eq!(dl.kind, "counter");
        let mut reasons: Vec<String> = crate::contract::dead_letter_reason::ALL
            .iter()
            .map(|(r, _)| r.to_string())
            .collect();
        reasons.sort();
        assert_eq!(dl.labels, vec![("reason".to_owned(), reasons)]);
        let hist = get(super::super::CONFIRM_LATENCY_SECONDS);
        assert_eq!(hist.kind, "histogram");
        assert!(hist.labels.is_empty());
        assert!(
            hist.buckets.contains(&"+Inf".to_owned()),
            "{:?}",
            hist.buckets
        );
        let info = get(super::super::BUILD_INFO);
        assert_eq!(info.labels, vec![("version".to_owned(), vec![])]);
        assert_eq!(get(super::super::STALLED).kind, "gauge");
        // One series per partition connection: the label is shown, its values are not fixed.
        for name in [
            super::super::PARTITION_PUBLISHED_TOTAL,
            super::super::PARTITION_UNSETTLED_MESSAGES,
            super::super::PARTITION_CONNECTED,
            super::super::PARTITION_BLOCKED,
        ] {
            assert_eq!(
                get(name).labels,
                vec![("partition".to_owned(), vec![])],
                "{name}"
            );
        }
    }

    #[test]
    fn unknown_names_are_found_and_known_ones_and_roles_pass() {
        let all = catalog();
        let text = "see pgoutbox_journal_dropped_total and pgoutbox_stalled, \
                    pgoutbox_confirm_latency_seconds_bucket, role pgoutbox_emitter, slot pgoutbox_1, \
                    my_pgoutbox_thing, `pgoutbox_reconnects_total{cause=\"broker\"}`";
        assert_eq!(
            unknown_metric_names(text, &all),
            vec!["pgoutbox_journal_dropped_total".to_owned()]
        );
    }
}
