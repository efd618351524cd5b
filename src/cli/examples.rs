//! The examples at the end of each command's long help (`pgoutbox COMMAND --help`; `-h`
//! stays short). One or two invocations each, as an operator would type them; the
//! generated reference (`docs/src/reference/cli.md`) and the man pages show the same text.

/// `setup`.
pub const SETUP: &str = "\
Examples:
  # Install the helpers, the publication and the slot (idempotent)
  PGOUTBOX_DATABASE_URL=postgres://postgres@localhost/app pgoutbox setup

  # Also create the least-privilege roles and lock the outbox down (needs a superuser)
  pgoutbox setup --create-roles --lockdown --database-url-file /run/secrets/pg-admin";

/// `run`.
pub const RUN: &str = "\
Examples:
  # Stream with the URLs from the environment
  export PGOUTBOX_DATABASE_URL=postgres://pgoutbox_streamer@db/app
  export PGOUTBOX_AMQP_URL=amqp://pgoutbox@rabbit/%2f
  pgoutbox run

  # Settings from a file, metrics on every interface, the delivery journal on
  pgoutbox run --config /etc/pgoutbox.toml --http-addr 0.0.0.0:8432 --journal";

/// `check`.
pub const CHECK: &str = "\
Examples:
  # What would stop `run`, with run's own settings (changes nothing)
  pgoutbox check --config /etc/pgoutbox.toml

  # Exit 1 and print the fix when a server, the slot or the exchange is not ready
  pgoutbox check --database-url postgres://pgoutbox_streamer@db/app --amqp-url amqp://rabbit";

/// `declare-topology`.
pub const DECLARE_TOPOLOGY: &str = "\
Examples:
  # Four quorum queues behind a consistent-hash exchange on the outbox exchange (idempotent)
  PGOUTBOX_AMQP_URL=amqp://admin@rabbit/%2f pgoutbox declare-topology --queues 4

  # Change nothing: exit 1 and say what is missing or differs
  pgoutbox declare-topology --queues 4 --check";

/// `status`.
pub const STATUS: &str = "\
Examples:
  # The slot's health for a person (exit 0 healthy, 1 warning, 2 critical)
  pgoutbox status

  # For a monitoring check, with a tighter lag budget
  pgoutbox status --json --warn-lag-bytes 104857600 --crit-lag-bytes 1073741824";

/// `peek`.
pub const PEEK: &str = "\
Examples:
  # The first 10 messages waiting in the slot (while no streamer holds it)
  pgoutbox peek --limit 10

  # With their payloads, as JSON
  pgoutbox peek --payload --json";

/// `teardown`.
pub const TEARDOWN: &str = "\
Examples:
  # Drop the slot and the publication (refused while messages are waiting)
  pgoutbox teardown

  # Drop them even though waiting messages are then lost
  pgoutbox teardown --force";

/// `maintenance`.
pub const MAINTENANCE: &str = "\
Examples:
  # One retention pass with the defaults (7 days each), e.g. from cron
  pgoutbox maintenance

  # Keep the journal 30 days and the inbox records forever
  pgoutbox maintenance --journal-retention 30d --inbox-retention 0";

/// `journal`.
pub const JOURNAL: &str = "\
Examples:
  # When and where a message was confirmed (run --journal must have been on)
  pgoutbox journal 6f1c9a52-3b1e-4c55-9d0e-2a7f4f1b8c11

  # As JSON
  pgoutbox journal 6f1c9a52-3b1e-4c55-9d0e-2a7f4f1b8c11 --json";

/// `dead-letters list`.
pub const DEAD_LETTERS_LIST: &str = "\
Examples:
  # The dead letters not yet requeued, oldest first
  pgoutbox dead-letters list

  # Every row, requeued ones too, as JSON
  pgoutbox dead-letters list --all --json --limit 1000";

/// `dead-letters requeue`.
pub const DEAD_LETTERS_REQUEUE: &str = "\
Examples:
  # Send two dead letters again, with their original message_id
  pgoutbox dead-letters requeue --id 41 --id 42

  # Every dead letter not yet requeued (after fixing the cause)
  pgoutbox dead-letters requeue --all";

/// `dead-letters purge`.
pub const DEAD_LETTERS_PURGE: &str = "\
Examples:
  # Delete the dead letters older than 30 days
  pgoutbox dead-letters purge --older-than 30d

  # Delete one row
  pgoutbox dead-letters purge --id 41";

/// `completions`.
pub const COMPLETIONS: &str = "\
Examples:
  # bash, for the current user
  pgoutbox completions bash > ~/.local/share/bash-completion/completions/pgoutbox

  # zsh (a directory on $fpath) and fish
  pgoutbox completions zsh > ~/.zfunc/_pgoutbox
  pgoutbox completions fish > ~/.config/fish/completions/pgoutbox.fish";

/// `docs reference`.
pub const DOCS_REFERENCE: &str = "\
Examples:
  # Regenerate the book's reference pages after changing a flag, a metric or a reason
  pgoutbox docs reference --out docs/src/reference";

/// `docs man`.
pub const DOCS_MAN: &str = "\
Examples:
  # One man page per command, then read one
  pgoutbox docs man --out /usr/local/share/man/man1
  man pgoutbox-run";
