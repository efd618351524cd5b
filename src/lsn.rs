//! The `Lsn` newtype: a position in the PostgreSQL write-ahead log.
//!
//! An LSN is a 64-bit byte offset into the WAL. PostgreSQL prints it as two hexadecimal
//! halves, `X/Y` (high 32 bits / low 32 bits), as in `pg_current_wal_lsn()` and
//! `pg_replication_slots.confirmed_flush_lsn`. See the PostgreSQL docs, "pg_lsn Type".

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

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
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

    /// Parses PostgreSQL's `X/Y` form (each half 1 to 8 hex digits).
    ///
    /// # Errors
    /// [`ParseLsnError`] when there is no `/`, a half is empty, longer than 8 digits or not hex.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError {
            input: s.to_owned(),
        };
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let half = |h: &str| {
            if h.is_empty() || h.len() > 8 {
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
    fn display_and_parse_round_trip() {
        let lsn = Lsn(0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert_eq!("16/B374D848".parse::<Lsn>().unwrap(), lsn);
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        assert_eq!(Lsn(0x1_0000_0000).to_string(), "1/0");
    }

    #[test]
    fn rejects_malformed_text() {
        for bad in ["", "0", "/0", "0/", "g/0", "123456789/0", "0/0/0"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn ordering_and_distance() {
        assert!(Lsn(5) > Lsn(4));
        assert_eq!(Lsn(10).bytes_since(Lsn(4)), 6);
        assert_eq!(Lsn(4).bytes_since(Lsn(10)), 0);
    }
}
