//! Integration tests for pgoutbox (one binary; servers shared per process).

mod support;

mod chaos;
mod end_to_end;
mod faults;
mod hardening;
mod harness_smoke;
mod observability;
mod operations;
mod proxy_smoke;
