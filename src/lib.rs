//! pgoutbox (skeleton)
pub mod lsn;
