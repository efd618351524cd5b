//! What `run` makes of each message: its AMQP properties (`--publish-properties`), the
//! CloudEvents binding (`--cloudevents`), and what happens to a message the broker returns
//! as unroutable (`--on-unroutable`).

use crate::validation::ValidationError;

/// What happens to a message the broker returns as unroutable (312 NO_ROUTE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnroutablePolicy {
    /// Dead-letter it and go on.
    DeadLetter,
    /// Retry forever, holding the watermark, logging each attempt.
    Block,
}

/// What each published message carries besides its body and routing key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishProperties {
    /// `message_id`, `content_type`, `delivery_mode` 2, `timestamp` (s), the producer's
    /// headers, and ours: `x-pgoutbox-lsn` and `x-pgoutbox-commit-lsn` (`X/Y` text),
    /// `x-pgoutbox-commit-time-us` (integer).
    Full,
    /// `delivery_mode` 2, `message_id` and the producer's own headers only; returns are
    /// matched by `message_id`.
    Minimal,
}

/// `--publish-properties`, `--cloudevents` (with its source and prefix), `--on-unroutable`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishingSettings {
    /// What each message carries (`--publish-properties`).
    pub publish_properties: PublishProperties,
    /// Publish in the CloudEvents AMQP binding's binary content mode (`--cloudevents`), with
    /// this source and prefix; `None`: plain messages.
    pub cloudevents: Option<crate::cloudevents::Binding>,
    /// What to do with returned (unroutable) messages.
    pub on_unroutable: UnroutablePolicy,
}

impl PublishingSettings {
    /// Checks the CloudEvents source.
    ///
    /// # Errors
    /// [`ValidationError`] for `--cloudevents-source` that is not a URI-reference of at
    /// most 255 bytes.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if let Some(binding) = &self.cloudevents {
            binding.validate().map_err(|rule| ValidationError {
                setting: "--cloudevents-source",
                value: binding.source.clone(),
                rule: format!(
                    "{rule} (when not given, it is {}:///DATABASE/SLOT)",
                    crate::cloudevents::DEFAULT_SOURCE_SCHEME
                ),
            })?;
        }
        Ok(())
    }
}
