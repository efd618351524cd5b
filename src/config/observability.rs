//! How `run` lets itself be watched: its instance id (in `application_name` and the
//! broker's connection name), where `/metrics`, `/healthz` and `/readyz` are served, when a
//! stream counts as stalled, and the delivery journal.

use std::time::Duration;

use crate::validation::ValidationError;

/// Default `--stall-after-s`: unconfirmed messages with no settle for a minute are a stall
/// (a confirm round trip is milliseconds; a minute rules out a slow disk or a GC pause).
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);

/// Largest accepted `--stall-after-s`: one hour (a stall detected later is no alarm).
pub const MAX_STALL_AFTER: Duration = Duration::from_secs(3600);

/// Whether `run` keeps the delivery journal (`--journal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JournalMode {
    /// No journal (the default).
    #[default]
    Off,
    /// One `outbox.journal` row per confirmed message, written in batches.
    On,
}

/// Parses `--http-addr`: `HOST:PORT` (an IP address, `localhost`) or `off`.
///
/// # Errors
/// [`ValidationError`] for `--http-addr` naming the accepted forms.
pub fn parse_http_addr(text: &str) -> Result<Option<std::net::SocketAddr>, ValidationError> {
    use std::net::ToSocketAddrs;
    let text = text.trim();
    if text.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let bad = |why: String| ValidationError {
        setting: "--http-addr",
        value: text.to_owned(),
        rule: format!(
            "{why}; write HOST:PORT (e.g. 127.0.0.1:8432, 0.0.0.0:8432 in a container) or off"
        ),
    };
    let mut addrs = text
        .to_socket_addrs()
        .map_err(|e| bad(format!("not an address ({e})")))?;
    addrs
        .next()
        .map(Some)
        .ok_or_else(|| bad("resolves to no address".into()))
}

/// `--instance-id`, `--http-addr`, `--stall-after-s`, `--journal`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservabilitySettings {
    /// Identifies this process in `application_name` and the RabbitMQ connection name.
    pub instance_id: String,
    /// Where `/metrics`, `/healthz` and `/readyz` are served (`None`: off).
    pub http_addr: Option<std::net::SocketAddr>,
    /// Unconfirmed messages with no settle for this long are a stall (`/readyz` 503, the
    /// `pgoutbox_stalled` gauge, a warning a minute); 1 s to [`MAX_STALL_AFTER`], checked
    /// by [`super::RunSettings::validate`].
    pub stall_after: Duration,
    /// `--journal`: record every confirmed message in `outbox.journal`.
    pub journal: JournalMode,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_addrs_are_host_port_or_off() {
        assert_eq!(parse_http_addr("off"), Ok(None));
        assert_eq!(
            parse_http_addr("127.0.0.1:8432").unwrap().map(|a| a.port()),
            Some(8432)
        );
        let e = parse_http_addr("nonsense").unwrap_err();
        assert_eq!(e.setting, "--http-addr");
        assert!(e.to_string().contains("or off"), "{e}");
    }
}
