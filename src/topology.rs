//! `pgoutbox declare-topology`: the RabbitMQ topology for consumers that scale out with
//! per-aggregate order, declared or checked.
//!
//! ```text
//!  outbox exchange (topic) ──"#"──▶ hash exchange (x-consistent-hash,
//!                                    hash-header: x-pgoutbox-aggregate-id)
//!                                      │ "1"      │ "1"     ...  │ "1"
//!                                      ▼          ▼              ▼
//!                                  PREFIX.0    PREFIX.1  ...  PREFIX.(Q-1)
//!                                  quorum queues, x-single-active-consumer
//! ```
//!
//! Every message with an aggregate id lands in one queue, chosen by the hash of its
//! `x-pgoutbox-aggregate-id` header (RabbitMQ's `rabbitmq_consistent_hash_exchange` plugin,
//! "Routing on a header": the exchange argument `hash-header`; the binding key is the
//! queue's weight on the hash ring, `"1"` for all). Each queue is a quorum queue with
//! single active consumer (RabbitMQ docs, "Single Active Consumer"): any number of consumer
//! processes may subscribe to it, the broker delivers to one of them at a time and hands the
//! queue to another when that one's channel or connection goes away, so a queue's messages
//! are consumed in queue order and a standby consumer takes over without a coordinator.
//!
//! Idempotent: each object is looked up first (a passive declare), then declared with the
//! properties it must have. RabbitMQ refuses a declaration that differs from an existing
//! object (406 `PRECONDITION_FAILED`, "inequivalent arg", AMQP 0-9-1 `exchange.declare` and
//! `queue.declare` rules), and that refusal, which names the argument and both values, is
//! what [`Finding`] reports as a difference; nothing existing is ever changed or deleted.
//! RabbitMQ compares a queue's type and arguments and an exchange's type and durability,
//! but not an exchange's arguments (the `hash-header`): an existing hash exchange is taken
//! as it is, and [`State::Matches`] says so. AMQP 0-9-1 cannot list bindings, so they are
//! declared (a binding that exists is left as it is) but not checked; a queue of the
//! same prefix numbered past Q (left by a larger topology, still taking a share of the keys
//! if it is still bound) is reported as a difference.
//!
//! Changing Q, like changing `run --partitions`, moves keys between queues: drain the
//! queues first (docs: Consumers, The delivery guarantee).

use std::time::Duration;

use amq_protocol::protocol::{exchange, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::contract::HEADER_AGGREGATE_ID;
use crate::publisher::connection::{Answer, Session};
use crate::publisher::Error as BrokerError;
use crate::validation::ValidationError;

/// The exchange type of RabbitMQ's consistent-hash plugin.
pub const HASH_EXCHANGE_TYPE: &str = "x-consistent-hash";
/// The plugin that provides [`HASH_EXCHANGE_TYPE`], shipped with RabbitMQ and off by
/// default.
pub const HASH_PLUGIN: &str = "rabbitmq_consistent_hash_exchange";
/// The hash exchange's argument naming the header it hashes (instead of the routing key).
pub const HASH_HEADER_ARGUMENT: &str = "hash-header";
/// The binding key of each queue on the hash exchange: its weight on the hash ring (all
/// equal).
pub const QUEUE_WEIGHT: &str = "1";
/// The binding key from the outbox exchange (a topic exchange) to the hash exchange: every
/// routing key.
pub const EVERY_ROUTING_KEY: &str = "#";
/// Default number of queues (`--queues`).
pub const DEFAULT_QUEUES: u16 = 4;
/// Most queues `--queues` takes: a consumer process per queue, and more queues than
/// consumers buy nothing.
pub const MAX_QUEUES: u16 = 1024;
/// How long one method may wait for the broker's answer (a quorum queue's declaration
/// waits for its Raft group to start: well under a second on one node).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The objects to declare, with validated names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The outbox exchange `run` publishes to (`--exchange`), a durable topic exchange.
    pub exchange: String,
    /// The consistent-hash exchange (`--hash-exchange`, default `EXCHANGE.hash`).
    pub hash_exchange: String,
    /// The queue name prefix (`--queue-prefix`, default `EXCHANGE.q`): queue i is
    /// `PREFIX.i`.
    pub queue_prefix: String,
    /// The number of queues, Q (`--queues`).
    pub queue_count: u16,
}

/// Checks an exchange or queue name given as `setting`: 1 to 255 bytes (an AMQP short
/// string) and not starting with `amq.` (RabbitMQ reserves it: 403 `ACCESS_REFUSED`).
fn check_name(setting: &'static str, name: &str, room: usize) -> Result<(), ValidationError> {
    let rule = if name.is_empty() {
        "give a name"
    } else if name.len() + room > 255 {
        "names are at most 255 bytes (an AMQP short string), the queue number included: shorten it"
    } else if name.starts_with("amq.") {
        "names starting with amq. are reserved by RabbitMQ: pick another"
    } else {
        return Ok(());
    };
    Err(ValidationError {
        setting,
        value: name.to_owned(),
        rule: rule.into(),
    })
}

impl Topology {
    /// The topology for outbox exchange `exchange`, with the defaults for the names not given.
    ///
    /// # Errors
    /// [`ValidationError`] naming `--exchange`, `--hash-exchange`, `--queue-prefix` or
    /// `--queues`.
    pub fn new(
        exchange: &str,
        hash_exchange: Option<&str>,
        queue_prefix: Option<&str>,
        queue_count: u16,
    ) -> Result<Topology, ValidationError> {
        check_name("--exchange", exchange, 0)?;
        let hash_exchange = hash_exchange.map_or_else(|| format!("{exchange}.hash"), str::to_owned);
        check_name("--hash-exchange", &hash_exchange, 0)?;
        if hash_exchange == exchange {
            return Err(ValidationError {
                setting: "--hash-exchange",
                value: hash_exchange,
                rule: "it is --exchange too: the hash exchange is a second exchange, bound from the outbox exchange; give it another name".into(),
            });
        }
        let queue_prefix = queue_prefix.map_or_else(|| format!("{exchange}.q"), str::to_owned);
        // ".1023": room for the largest queue number.
        check_name("--queue-prefix", &queue_prefix, 5)?;
        if !(1..=MAX_QUEUES).contains(&queue_count) {
            return Err(ValidationError {
                setting: "--queues",
                value: queue_count.to_string(),
                rule: format!("write 1 to {MAX_QUEUES}"),
            });
        }
        Ok(Topology {
            exchange: exchange.to_owned(),
            hash_exchange,
            queue_prefix,
            queue_count,
        })
    }

    /// Queue `i`'s name: `PREFIX.i`.
    pub fn queue(&self, i: u16) -> String {
        format!("{}.{i}", self.queue_prefix)
    }

    /// The queues' names, `PREFIX.0` to `PREFIX.(Q-1)`.
    pub fn queues(&self) -> Vec<String> {
        (0..self.queue_count).map(|i| self.queue(i)).collect()
    }
}

/// Whether [`apply`] may create what is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Declare what is missing, check what exists (`declare-topology`).
    Declare,
    /// Change nothing: report what is missing or differs (`declare-topology --check`).
    Check,
}

/// What [`apply`] found for one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// It was missing and is declared now.
    Created,
    /// It exists with the properties it must have (what RabbitMQ compares, see the module
    /// doc); the text says what was not compared, if anything.
    Matches(&'static str),
    /// The binding is declared (new, or already there).
    Bound,
    /// It is missing ([`Mode::Check`]).
    Missing,
    /// It differs: the broker's words (406 `PRECONDITION_FAILED - inequivalent arg ...`) or
    /// ours, and the fix.
    Differs(String),
    /// Not looked at, and why.
    Skipped(&'static str),
}

impl State {
    /// Whether this is a difference the operator must resolve.
    pub fn is_problem(&self) -> bool {
        matches!(self, State::Differs(_) | State::Missing)
    }
}

/// One object of the topology and what became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The object, e.g. `queue "pgoutbox.q.0" (quorum, single active consumer)`.
    pub object: String,
    /// What was found or done.
    pub state: State,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.state {
            State::Created => write!(f, "{}: created", self.object),
            State::Matches("") => write!(f, "{}: exists, as declared", self.object),
            State::Matches(note) => write!(f, "{}: exists, as declared ({note})", self.object),
            State::Bound => write!(f, "{}: bound", self.object),
            State::Missing => write!(f, "{}: MISSING", self.object),
            State::Differs(what) => write!(f, "{}: DIFFERS: {what}", self.object),
            State::Skipped(why) => write!(f, "{}: not checked ({why})", self.object),
        }
    }
}

/// Why [`apply`] stopped before the end.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Connecting or talking to the broker failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The broker does not know [`HASH_EXCHANGE_TYPE`]: [`HASH_PLUGIN`] is off on the node.
    #[error("RabbitMQ at {url} refused exchange type {HASH_EXCHANGE_TYPE} ({reply_code} {reply_text}): the plugin {HASH_PLUGIN} is not enabled on that node. Enable it there with `{command}` (the node name is from the broker's cluster_name; `rabbitmqctl status` shows the node's own. On every node of a cluster. --online fails, instead of editing another broker's enabled-plugins file, when the command cannot reach the node. On the throwaway stack: `bash deploy/stack.sh plugins DIR enable {HASH_PLUGIN}`), then run declare-topology again")]
    PluginOff {
        /// The redacted URL.
        url: String,
        /// The reply code (503 `COMMAND_INVALID`).
        reply_code: u16,
        /// The reply text.
        reply_text: String,
        /// The command that enables the plugin on the node.
        command: String,
    },
    /// The broker refused a declaration for another reason than a difference (403
    /// `ACCESS_REFUSED`: the user may not configure it), or closed the connection.
    #[error("RabbitMQ at {url} refused {object}: {reply_code} {reply_text}; {fix}")]
    Refused {
        /// The redacted URL.
        url: String,
        /// The object.
        object: String,
        /// The reply code.
        reply_code: u16,
        /// The reply text.
        reply_text: String,
        /// What to change.
        fix: &'static str,
    },
    /// The broker did not answer within [`CALL_TIMEOUT`].
    #[error("RabbitMQ at {url} did not answer {what} within {} s; check that the node is running and not blocked (rabbitmqctl status)", CALL_TIMEOUT.as_secs())]
    Timeout {
        /// The redacted URL.
        url: String,
        /// The method.
        what: String,
    },
}

/// The `rabbitmq-plugins` command that enables [`HASH_PLUGIN`] on the node whose
/// `connection.start` server properties are `server_properties` (AMQP 0-9-1 section 2.2.4;
/// RabbitMQ sends no node name there). The node name is read from the `cluster_name`
/// property: RabbitMQ's default cluster name is its first node's name with the host's fully
/// qualified name (`rabbit@mq1.example.com` for the node `rabbit@mq1`), so the host is cut to
/// its first label, as short node names (RabbitMQ's default) have it. A cluster name that is
/// no node name (renamed) gives `rabbit@` and the URL's host, RabbitMQ's default node name.
pub fn enable_command(server_properties: &FieldTable, url_host: &str) -> String {
    let node = match server_properties.inner().get("cluster_name") {
        Some(AMQPValue::LongString(s)) => node_of_cluster_name(&s.to_string()),
        _ => None,
    }
    .unwrap_or_else(|| format!("rabbit@{}", first_label(url_host)));
    format!("rabbitmq-plugins --node {node} enable --online {HASH_PLUGIN}")
}

/// `name@host` with the host cut to its first label; `None` when `cluster_name` is not of
/// that form.
fn node_of_cluster_name(cluster_name: &str) -> Option<String> {
    let (name, host) = cluster_name.split_once('@')?;
    (!name.is_empty() && !host.is_empty()).then(|| format!("{name}@{}", first_label(host)))
}

/// The first DNS label of `host` (an IP address as it is).
fn first_label(host: &str) -> &str {
    if host.parse::<std::net::IpAddr>().is_ok() || host.starts_with('[') {
        return host;
    }
    host.split('.').next().unwrap_or(host)
}

/// Declares (or, under [`Mode::Check`], checks) `topology` over `session`, object by object
/// in this order: the outbox exchange, the hash exchange, the queues, a queue numbered Q
/// (should not exist), then the bindings (only when nothing differs).
///
/// # Errors
/// [`Error::PluginOff`] with the command that enables the plugin on the node;
/// [`Error::Refused`] for a refusal that is not a difference (403); [`Error::Timeout`];
/// [`Error::Broker`] for a lost connection.
pub async fn apply(
    session: &mut Session,
    topology: &Topology,
    mode: Mode,
    url: &str,
    url_host: &str,
) -> Result<Vec<Finding>, Error> {
    let mut calls = Calls {
        session,
        url,
        url_host,
    };
    let mut out = Vec::new();
    let topic = Object::Exchange {
        name: &topology.exchange,
        kind: "topic",
        arguments: FieldTable::default(),
    };
    out.push(calls.object(&topic, mode).await?);
    let mut hash_arguments = FieldTable::default();
    hash_arguments.insert(
        ShortString::from(HASH_HEADER_ARGUMENT),
        AMQPValue::LongString(LongString::from(HEADER_AGGREGATE_ID)),
    );
    let hash = Object::Exchange {
        name: &topology.hash_exchange,
        kind: HASH_EXCHANGE_TYPE,
        arguments: hash_arguments,
    };
    out.push(calls.object(&hash, mode).await?);
    let queues = topology.queues();
    for name in &queues {
        out.push(calls.object(&Object::Queue { name }, mode).await?);
    }
    let beyond = topology.queue(topology.queue_count);
    if calls.exists(&Object::Queue { name: &beyond }).await? {
        out.push(Finding {
            object: format!("queue {beyond:?}"),
            state: State::Differs(format!(
                "it exists, past the {} queues asked for: a larger topology was declared before, and while it is bound to {:?} it takes a share of the keys. Changing the number of queues remaps keys: drain the queues, then delete it (rabbitmqctl delete_queue {beyond}) or give --queues its old number",
                topology.queue_count, topology.hash_exchange
            )),
        });
    }
    let differs = out.iter().any(|f| f.state.is_problem());
    let bind = |object: String| {
        let state = match (mode, differs) {
            (Mode::Check, _) => State::Skipped(
                "AMQP 0-9-1 cannot list bindings: rabbitmqctl list_bindings shows them",
            ),
            (Mode::Declare, true) => State::Skipped("not declared while something above differs"),
            (Mode::Declare, false) => State::Bound,
        };
        (object, state)
    };
    let mut bindings = vec![(
        bind(format!(
            "binding {:?} -> {:?} (routing key {EVERY_ROUTING_KEY:?})",
            topology.exchange, topology.hash_exchange
        )),
        None,
    )];
    for name in &queues {
        bindings.push((
            bind(format!(
                "binding {:?} -> {name:?} (weight {QUEUE_WEIGHT:?})",
                topology.hash_exchange
            )),
            Some(name),
        ));
    }
    for ((object, state), queue_name) in bindings {
        if state == State::Bound {
            let method = match queue_name {
                None => AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
                    destination: ShortString::from(topology.hash_exchange.as_str()),
                    source: ShortString::from(topology.exchange.as_str()),
                    routing_key: ShortString::from(EVERY_ROUTING_KEY),
                    nowait: false,
                    arguments: FieldTable::default(),
                })),
                Some(q) => AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                    queue: ShortString::from(q.as_str()),
                    exchange: ShortString::from(topology.hash_exchange.as_str()),
                    routing_key: ShortString::from(QUEUE_WEIGHT),
                    nowait: false,
                    arguments: FieldTable::default(),
                })),
            };
            match calls.call(method, &object).await? {
                Answer::Ok(_) => {}
                refused => return Err(calls.refused(&object, refused)),
            }
        }
        out.push(Finding { object, state });
    }
    Ok(out)
}

/// An exchange or a queue of the topology.
#[derive(Debug)]
enum Object<'a> {
    Exchange {
        name: &'a str,
        kind: &'static str,
        arguments: FieldTable,
    },
    Queue {
        name: &'a str,
    },
}

impl Object<'_> {
    fn describe(&self) -> String {
        match self {
            Object::Exchange {
                name,
                kind: HASH_EXCHANGE_TYPE,
                ..
            } => format!(
                "exchange {name:?} ({HASH_EXCHANGE_TYPE}, durable, {HASH_HEADER_ARGUMENT} {HEADER_AGGREGATE_ID})"
            ),
            Object::Exchange { name, kind, .. } => format!("exchange {name:?} ({kind}, durable)"),
            Object::Queue { name } => {
                format!("queue {name:?} (quorum, durable, x-single-active-consumer)")
            }
        }
    }

    /// Its declaration: `passive` only looks it up.
    fn declare(&self, passive: bool) -> AMQPClass {
        match self {
            Object::Exchange {
                name,
                kind,
                arguments,
            } => AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: ShortString::from(*name),
                kind: ShortString::from(*kind),
                passive,
                durable: true,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: arguments.clone(),
            })),
            Object::Queue { name } => {
                let mut arguments = FieldTable::default();
                arguments.insert(
                    ShortString::from("x-queue-type"),
                    AMQPValue::LongString(LongString::from("quorum")),
                );
                arguments.insert(
                    ShortString::from("x-single-active-consumer"),
                    AMQPValue::Boolean(true),
                );
                AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                    queue: ShortString::from(*name),
                    passive,
                    durable: true,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments,
                }))
            }
        }
    }
}

/// The session and what error messages need.
struct Calls<'a> {
    session: &'a mut Session,
    url: &'a str,
    url_host: &'a str,
}

impl Calls<'_> {
    async fn call(&mut self, method: AMQPClass, what: &str) -> Result<Answer, Error> {
        match tokio::time::timeout(CALL_TIMEOUT, self.session.call(method)).await {
            Ok(answer) => Ok(answer?),
            Err(_) => Err(Error::Timeout {
                url: self.url.to_owned(),
                what: what.to_owned(),
            }),
        }
    }

    /// The error for an answer that is neither the reply nor a difference.
    fn refused(&self, object: &str, answer: Answer) -> Error {
        let (reply_code, reply_text) = match answer {
            Answer::ChannelClosed {
                reply_code,
                reply_text,
            }
            | Answer::ConnectionClosed {
                reply_code,
                reply_text,
            } => (reply_code, reply_text),
            Answer::Ok(other) => (0, format!("unexpected answer {other:?}")),
        };
        Error::Refused {
            url: self.url.to_owned(),
            object: object.to_owned(),
            reply_code,
            reply_text,
            fix: match reply_code {
                403 => "grant the --amqp-url user configure permission on the exchanges and queues of the topology (rabbitmqctl set_permissions), or declare it as a user who has it",
                _ => "see the broker's log for the reason",
            },
        }
    }

    /// Whether `object` exists (a passive declare).
    async fn exists(&mut self, object: &Object<'_>) -> Result<bool, Error> {
        let what = object.describe();
        match self.call(object.declare(true), &what).await? {
            Answer::Ok(_) => Ok(true),
            Answer::ChannelClosed {
                reply_code: 404, ..
            } => Ok(false),
            refused => Err(self.refused(&what, refused)),
        }
    }

    /// Looks `object` up, then declares it as it must be (creating it under
    /// [`Mode::Declare`] when missing).
    async fn object(&mut self, object: &Object<'_>, mode: Mode) -> Result<Finding, Error> {
        let what = object.describe();
        let existed = self.exists(object).await?;
        if !existed && mode == Mode::Check {
            return Ok(Finding {
                object: what,
                state: State::Missing,
            });
        }
        let state = match self.call(object.declare(false), &what).await? {
            Answer::Ok(_) if !existed => State::Created,
            Answer::Ok(_) => State::Matches(match object {
                Object::Exchange {
                    kind: HASH_EXCHANGE_TYPE,
                    ..
                } => "type and durability; RabbitMQ does not compare its hash-header: rabbitmqctl list_exchanges name type arguments shows it",
                _ => "",
            }),
            Answer::ChannelClosed {
                reply_code: 406,
                reply_text,
            } => State::Differs(format!(
                "{reply_text}; this command changes nothing that exists: delete it (after draining, for a queue) or pick other names (--exchange, --hash-exchange, --queue-prefix)"
            )),
            Answer::ConnectionClosed {
                reply_code,
                reply_text,
            } if matches!(object, Object::Exchange { kind: HASH_EXCHANGE_TYPE, .. })
                && reply_text.contains(HASH_EXCHANGE_TYPE) =>
            {
                return Err(Error::PluginOff {
                    url: self.url.to_owned(),
                    reply_code,
                    reply_text,
                    command: enable_command(self.session.server_properties(), self.url_host),
                })
            }
            refused => return Err(self.refused(&what, refused)),
        };
        Ok(Finding {
            object: what,
            state,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_default_from_the_exchange_and_are_checked() {
        let t = Topology::new("pgoutbox", None, None, 3).unwrap();
        assert_eq!(t.hash_exchange, "pgoutbox.hash");
        assert_eq!(t.queues(), ["pgoutbox.q.0", "pgoutbox.q.1", "pgoutbox.q.2"]);
        let t = Topology::new("x", Some("h"), Some("orders"), 1).unwrap();
        assert_eq!(
            (t.hash_exchange.as_str(), t.queue(0)),
            ("h", "orders.0".into())
        );
        for (exchange, hash, prefix, n, setting) in [
            ("", None, None, 1, "--exchange"),
            ("amq.topic", None, None, 1, "--exchange"),
            ("x", Some("x"), None, 1, "--hash-exchange"),
            ("x", Some("amq.h"), None, 1, "--hash-exchange"),
            ("x", None, Some(""), 1, "--queue-prefix"),
            ("x", None, Some(&*"q".repeat(251)), 1, "--queue-prefix"),
            ("x", None, None, 0, "--queues"),
            ("x", None, None, MAX_QUEUES + 1, "--queues"),
        ] {
            let e = Topology::new(exchange, hash, prefix, n).unwrap_err();
            assert_eq!(e.setting, setting, "{e}");
        }
        assert!(Topology::new("x", None, Some(&*"q".repeat(250)), MAX_QUEUES).is_ok());
    }

    #[test]
    fn the_enable_command_names_the_node() {
        let mut props = FieldTable::default();
        assert_eq!(
            enable_command(&props, "mq.example"),
            "rabbitmq-plugins --node rabbit@mq enable --online rabbitmq_consistent_hash_exchange"
        );
        assert!(enable_command(&props, "127.0.0.1").contains("--node rabbit@127.0.0.1 "));
        for (cluster_name, node) in [
            ("pgoutbox-stack-1@localhost", "pgoutbox-stack-1@localhost"),
            ("rabbit@mq1.example.com", "rabbit@mq1"),
            ("rabbit@mq1", "rabbit@mq1"),
            ("prod-cluster", "rabbit@mq"),
        ] {
            props.insert(
                ShortString::from("cluster_name"),
                AMQPValue::LongString(LongString::from(cluster_name)),
            );
            assert_eq!(
                enable_command(&props, "mq.example"),
                format!("rabbitmq-plugins --node {node} enable --online {HASH_PLUGIN}"),
                "{cluster_name}"
            );
        }
    }
}
