//! Integration tests for pgoutbox (one binary; servers shared per process).

mod support;

mod chaos;
mod cli;
mod cluster;
mod config;
mod deploy_files;
mod end_to_end;
mod errors;
mod faults;
mod gaps;
mod hardening;
mod harness_smoke;
mod journal;
mod lifecycle;
mod lockdown;
mod observability;
mod operations;
mod pg_tls;
mod proxy_smoke;
mod publisher_wire;
mod roles;
mod secrets;
mod standby;
mod status;
mod tls;
