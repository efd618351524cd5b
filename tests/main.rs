//! Integration tests for pgoutbox (one binary; servers shared per process).

mod support;

mod chaos;
mod cli;
mod cloudevents;
mod cluster;
mod config;
mod contract;
mod deploy_files;
mod docs_links;
mod end_to_end;
mod errors;
mod faults;
mod gaps;
mod hardening;
mod harness_smoke;
mod inbox;
mod journal;
mod layers;
mod lifecycle;
mod liveness;
mod lockdown;
mod observability;
mod operations;
mod outboxes;
mod partitions;
mod pg_tls;
mod proxy_smoke;
mod publisher_wire;
mod reference;
mod roles;
mod routing;
mod secrets;
mod standby;
mod status;
mod tls;
