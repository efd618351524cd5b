//! The exit statuses of the binary, and what each means: the constants `main` exits with,
//! and the table the reference (`docs/src/reference/exit-codes.md`) is generated from, so
//! the page and the code cannot tell two stories.

/// Success, or a clean shutdown of `run` (SIGINT/SIGTERM, everything confirmed drained).
pub const SUCCESS: u8 = 0;

/// Any other error (the message says what and how to fix it).
pub const FAILURE: u8 = 1;

/// A usage error: a bad flag or value on the command line, in a `PGOUTBOX_*` variable or
/// in the `--config` file, whether clap or our validation finds it (clap exits 2 itself).
pub const USAGE: u8 = 2;

/// `status` when it cannot judge the slot's health at all (no connection, a catalog it
/// cannot read): critical, like the worst it could have found.
pub const STATUS_UNKNOWN: u8 = 2;

/// The statuses every command shares: (status, meaning).
pub const GENERAL: &[(u8, &str)] = &[
    (
        SUCCESS,
        "success, or a clean shutdown of `run` (SIGINT/SIGTERM, everything confirmed drained)",
    ),
    (
        FAILURE,
        "any other error: the servers' state (a missing slot or publication, a lost slot, a gap, missing privileges), a refused login, a refused `dead-letters requeue`, a `check` that found a problem, a `run` whose shutdown drain timed out or lost a server with messages unconfirmed; the message says what and how to fix it",
    ),
    (
        USAGE,
        "a usage error: anything wrong with the command line, a `PGOUTBOX_*` variable or the `--config` file (an unknown flag or key, a missing or malformed value, a setting out of range, a bad slot name, a bad or unsupported `ssl*` setting in the PostgreSQL URL, a TLS setting on `amqp://`), found before pgoutbox connects anywhere",
    ),
];

/// The commands that exit by other rules: (command, its statuses).
pub const BY_COMMAND: &[(&str, &str)] = &[
    (
        "status",
        "0 healthy, 1 warning, 2 critical; 2 also when it cannot tell (a server it cannot reach, a usage error)",
    ),
    (
        "maintenance",
        "0 when every step ran, was off or was skipped; 1 when a step failed (the others still run); 2 for bad arguments",
    ),
    (
        "journal",
        "0 with at least one entry; 1 with none, or a failed connection; 2 for bad arguments",
    ),
    ("peek", "1 when a streamer holds the slot (as any error)"),
];
