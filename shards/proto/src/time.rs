//! Caller-supplied time.
//!
//! The protocol core never reads a clock. Every input that depends on time takes a
//! [`Timestamp`], which is a count of nanoseconds since an epoch the caller picks (process start,
//! the simulation's zero, anything monotonic). Timestamps from different processes are not
//! comparable, which is why deadlines travel on the wire as a remaining time-to-live (see
//! [`crate::wire`]).
//!
//! All arithmetic saturates: adding [`Duration::MAX`] to any timestamp gives [`Timestamp::MAX`],
//! which every state machine in this crate reads as "no deadline".

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time: nanoseconds since an epoch chosen by the caller.
///
/// [`Timestamp::MAX`] is "never" and is what a deadline of [`Duration::MAX`] saturates to.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The epoch.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The far future; used as "no deadline".
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// A timestamp `nanos` nanoseconds after the epoch.
    pub const fn from_nanos(nanos: u64) -> Timestamp {
        Timestamp(nanos)
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whether this is [`Timestamp::MAX`], i.e. "never".
    pub const fn is_never(self) -> bool {
        self.0 == u64::MAX
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    pub fn saturating_add(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(duration_to_nanos(d)))
    }

    /// `self - d`, saturating at [`Timestamp::ZERO`].
    pub fn saturating_sub(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(duration_to_nanos(d)))
    }

    /// Time elapsed from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// Converts a duration to nanoseconds, saturating at `u64::MAX` (about 584 years).
pub fn duration_to_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturating; see [`Timestamp::saturating_add`].
    fn add(self, rhs: Duration) -> Timestamp {
        self.saturating_add(rhs)
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturating; see [`Timestamp::saturating_sub`].
    fn sub(self, rhs: Duration) -> Timestamp {
        self.saturating_sub(rhs)
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_never() {
            f.write_str("Timestamp(never)")
        } else {
            write!(f, "Timestamp({:?})", Duration::from_nanos(self.0))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn saturates() {
        let t = Timestamp::from_nanos(5);
        assert_eq!(t + Duration::MAX, Timestamp::MAX);
        assert_eq!(Timestamp::MAX + Duration::from_nanos(1), Timestamp::MAX);
        assert_eq!(t.saturating_sub(Duration::from_secs(1)), Timestamp::ZERO);
        assert_eq!(
            t.saturating_duration_since(Timestamp::from_nanos(9)),
            Duration::ZERO
        );
        assert_eq!(
            Timestamp::from_nanos(9).saturating_duration_since(t),
            Duration::from_nanos(4)
        );
        assert_eq!(duration_to_nanos(Duration::MAX), u64::MAX);
        assert!(Timestamp::MAX.is_never());
        assert!(!t.is_never());
    }

    #[test]
    fn debug_is_readable() {
        assert_eq!(format!("{:?}", Timestamp::MAX), "Timestamp(never)");
        assert_eq!(
            format!("{:?}", Timestamp::from_nanos(1_500)),
            "Timestamp(1.5µs)"
        );
    }
}
