//! Integration tests for pgoutbox (one binary; servers shared per process).

mod support;

mod end_to_end;
mod harness_smoke;
mod operations;
