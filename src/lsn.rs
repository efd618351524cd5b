//! The `Lsn` newtype: a position in the PostgreSQL write-ahead log.
//!
//! An LSN is a 64-bit byte offset into the WAL. PostgreSQL prints it as two hexadecimal
//! halves, `X/Y` (high 32 bits / low 32 bits), as in `pg_current_wal_lsn()` and
//! `pg_replication_slots.confirmed_flush_lsn`. See the PostgreSQL docs, "pg_lsn Type".
//!
//! # Why not tokio-postgres' `PgLsn`
//!
//! `tokio_postgres::types::PgLsn` is the same `u64` with the same `X/Y` text, and we keep
//! our own type because it does what that one does not:
//! - **It parses as PostgreSQL does** (`pg_lsn_in`: 1 to 8 hex digits, `/`, 1 to 8 hex
//!   digits, nothing else), and the error names the text. `PgLsn` reads each half as a
//!   `u64` and ORs them: `0/100000000` becomes `1/0`, `1FFFFFFFF/0` loses its top bit,
//!   `+1/0` is accepted, and its error says nothing. An LSN read back from a header, a
//!   dead letter or an operator must be the position that was written, or be refused
//!   (`pg_lsn_reads_what_postgres_refuses` below pins the difference).
//! - **Arithmetic and the traits the watermark needs**: [`Lsn::bytes_since`] (lag in
//!   bytes), [`Lsn::ZERO`], `Default` and `Hash` (`PgLsn` has neither, and its field is
//!   private: no `const` such as `ZERO`, no pattern).
//! - **No dependency in the pure layers**: `pgoutput`, `watermark`, `lockdown`,
//!   `partition` and the replication framing hold LSNs without importing the Postgres
//!   client crate.
//!
//! What `PgLsn` has that we do not need: `ToSql`/`FromSql` for `pg_lsn`. Our SQL passes
//! LSNs as text (`$1::text::pg_lsn`, `lsn::text`), where PostgreSQL's own parser checks them.

use std::fmt;
use std::str::FromStr;

/// A WAL position in bytes from the start of the WAL (PostgreSQL's `pg_lsn`).
///
/// Ordering is WAL order. `Display` and `FromStr` use PostgreSQL's `X/Y` text form.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The zero position, `0/0`; `START_REPLICATION ... LOGICAL 0/0` means "from the slot".
    pub const ZERO: Lsn = Lsn(0);

    /// The distance in bytes from `earlier` to `self`, or 0 when `earlier` is ahead.
    pub fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// Upper-case hex digits, for [`Lsn`]'s text.
const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// Writes `v` (at most 32 bits) as upper-case hex without leading zeros (`0` for 0) at the
/// end of `buf[..end]`; returns where it starts.
fn hex_before(buf: &mut [u8; 17], end: usize, mut v: u64) -> usize {
    let mut at = end;
    loop {
        at -= 1;
        buf[at] = HEX[(v & 0xF) as usize];
        v >>= 4;
        if v == 0 {
            return at;
        }
    }
}

impl fmt::Display for Lsn {
    /// `X/Y`, each half upper-case hex without leading zeros (PostgreSQL's `pg_lsn` output).
    /// Written by hand into a stack buffer: two `{:X}` arguments through the formatting
    /// machinery cost more than the rest of a message's header encoding (callgrind, 2026-12-06).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 17];
        let lo = hex_before(&mut buf, 17, self.0 & 0xFFFF_FFFF);
        buf[lo - 1] = b'/';
        let hi = hex_before(&mut buf, lo - 1, self.0 >> 32);
        // ASCII only: the hex digits and '/'.
        f.pad(std::str::from_utf8(&buf[hi..]).unwrap_or("0/0"))
    }
}

/// The error returned when a string is not an `X/Y` LSN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {input:?}: expected two hexadecimal halves such as 16/B374D848")]
pub struct ParseLsnError {
    input: String,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    /// Parses PostgreSQL's `X/Y` form (each half 1 to 8 hex digits), as `pg_lsn_in` does.
    ///
    /// # Errors
    /// [`ParseLsnError`] when there is no `/`, a half is empty, longer than 8 digits or has
    /// anything but hex digits (no sign, space or `0x`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError {
            input: s.to_owned(),
        };
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let half = |h: &str| {
            // from_str_radix alone would take a leading `+`.
            if h.is_empty() || h.len() > 8 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            u32::from_str_radix(h, 16).map_err(|_| err())
        };
        Ok(Lsn((u64::from(half(hi)?) << 32) | u64::from(half(lo)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_matches_the_formatting_machinery_and_postgres() {
        for v in [
            0u64,
            1,
            0xF,
            0x10,
            0x1_0000_0000,
            0x16_B374_D848,
            0xFFFF_FFFF,
            0xFFFF_FFFF_FFFF_FFFF,
            0xABC_0000_0001,
        ] {
            let want = format!("{:X}/{:X}", v >> 32, v & 0xFFFF_FFFF);
            assert_eq!(Lsn(v).to_string(), want);
            assert_eq!(want.parse::<Lsn>().unwrap(), Lsn(v));
        }
        assert_eq!(format!("{:>8}", Lsn(0x10)), "    0/10");
    }

    #[test]
    fn display_and_parse_round_trip() {
        let lsn = Lsn(0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert_eq!("16/B374D848".parse::<Lsn>().unwrap(), lsn);
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        assert_eq!(Lsn(0x1_0000_0000).to_string(), "1/0");
    }

    #[test]
    fn rejects_malformed_text() {
        for bad in [
            "",
            "0",
            "/0",
            "0/",
            "g/0",
            "123456789/0",
            "0/0/0",
            "+1/0",
            "0/+1",
            "-0/0",
            " 1/0",
            "1/0 ",
            "0x1/0",
        ] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad} should not parse");
        }
    }

    /// Why this type is ours (see the module doc): tokio-postgres' `PgLsn` reads these
    /// texts, which PostgreSQL refuses, as some other position. If this test fails,
    /// `PgLsn` has become as strict as PostgreSQL: reconsider using it.
    #[test]
    fn pg_lsn_reads_what_postgres_refuses() {
        use tokio_postgres::types::PgLsn;
        for (text, as_pg_lsn) in [
            ("0/100000000", 0x1_0000_0000u64),
            ("1FFFFFFFF/0", 0xFFFF_FFFF_0000_0000),
            ("+1/0", 0x1_0000_0000),
        ] {
            let got = text.parse::<PgLsn>().map(u64::from).ok();
            assert_eq!(got, Some(as_pg_lsn), "PgLsn now reads {text:?} as {got:?}");
            let e = text.parse::<Lsn>().unwrap_err();
            assert!(e.to_string().contains(&format!("{text:?}")), "{e}");
        }
    }

    #[test]
    fn ordering_and_distance() {
        assert!(Lsn(5) > Lsn(4));
        assert_eq!(Lsn(10).bytes_since(Lsn(4)), 6);
        assert_eq!(Lsn(4).bytes_since(Lsn(10)), 0);
    }
}
