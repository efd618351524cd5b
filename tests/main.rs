//! Integration tests for pgoutbox (one binary; servers shared per process).

mod support;

mod harness_smoke;
