//! [`RateCheck`]: one attempt to spend a caller's quota.

use crate::key::Key;

/// One attempt to spend `cost` of caller `key`'s quota, named by a random attempt id.
///
/// The id makes a check safe to run twice: a store that receives the same attempt again (a
/// command re-sent after a dropped connection, a retry after a lost reply) charges it once and
/// answers as the first run did. Make a new `RateCheck` for every request; reuse one only to
/// retry the same request.
///
/// ```
/// use tollgate::key::Key;
/// use tollgate::rate::RateCheck;
///
/// let check = RateCheck::new(Key::new("user", b"alice"), 1);
/// let retry = check; // the same attempt
/// assert_eq!(retry.attempt(), check.attempt());
/// assert_ne!(RateCheck::new(check.key(), 1).attempt(), check.attempt());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateCheck {
    key: Key,
    cost: u64,
    attempt: u64,
    reservation: bool,
    settles: Option<Settlement>,
    quiet: bool,
    held_us: u64,
}

/// What a settlement corrects: the check it settles, and what that check charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// The attempt id of the settled check.
    pub of: u64,
    /// What the settled check charged (its cost, as admitted).
    pub reserved: u64,
    /// Whether the settled check was a [reservation](RateCheck::reservation): only a
    /// reservation's unused part is refunded (the store kept where its charge went).
    pub refundable: bool,
}

/// Mixed into a check's attempt id to name its settlement: a settlement is an attempt of its own
/// (sent, re-sent and remembered as one), derived from the check's so that the same
/// settlement made twice is applied once.
const SETTLEMENT_ID: u64 = 0x9e37_79b9_7f4a_7c15;

/// The longest [hold](RateCheck::held) a store is sent, about twelve days: no arithmetic of a
/// store overflows on it.
const MOST_HELD_US: u64 = 1 << 40;

impl RateCheck {
    /// A new attempt to spend `cost` for `key`, with a fresh random id.
    pub fn new(key: Key, cost: u64) -> Self {
        Self {
            key,
            cost,
            attempt: uuid::Uuid::new_v4().as_u64_pair().0,
            reservation: false,
            settles: None,
            quiet: false,
            held_us: 0,
        }
    }

    /// A new attempt to spend `cost` for `key` that will be [settled](Self::settle) once its
    /// actual cost is known: decided and charged as [`new`](Self::new) is, and the store also
    /// keeps where the charge went (a sliding counter's window, a GCRA span, a log's entries) for
    /// as long as the limit counts it, so that the settlement refunds only what the limit still
    /// counts — never quota that others spent after the charge left the window. See the
    /// [attempt ledger](crate::store#the-attempt-ledger).
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::rate::RateCheck;
    ///
    /// let reserved = RateCheck::reservation(Key::new("user", b"alice"), 4_000);
    /// assert!(reserved.is_reservation());
    /// assert!(reserved.settle(1_200).settles().is_some_and(|s| s.refundable));
    /// assert!(!RateCheck::new(reserved.key(), 1).is_reservation());
    /// ```
    pub fn reservation(key: Key, cost: u64) -> Self {
        Self {
            reservation: true,
            ..Self::new(key, cost)
        }
    }

    /// The same check, its settlements [quiet](Self::is_quiet): a refund they make is not
    /// broadcast as an invalidation. For a reservation that a copy makes for itself — a
    /// [leased](crate::rate::Limit::leased) slice — whose unspent part going back frees no
    /// caller that another copy would have denied; a broadcast that follows a reset must not be
    /// mistaken for it.
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::rate::RateCheck;
    ///
    /// let slice = RateCheck::reservation(Key::new("user", b"alice"), 64).quiet();
    /// assert!(slice.settle(10).is_quiet());
    /// assert!(!RateCheck::reservation(slice.key(), 64).settle(10).is_quiet());
    /// ```
    pub fn quiet(self) -> Self {
        Self {
            quiet: true,
            ..self
        }
    }

    /// The same check, its units admitted over up to `lease` after the charge rather than at
    /// once — a [leased](crate::rate::Limit::leased) slice, spent by a copy until its lease
    /// ends. The store counts them for as long as they may be admitted: a sliding log's entries
    /// are dated at the lease's end, and GCRA charges from the lease's end (so the slice also
    /// fits when admitted all at once at its start); a sliding counter charges the window the
    /// check falls in, and a copy spends such a slice only within that window. A unit admitted
    /// late is then counted, on every limit, for at least a window after it was admitted.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::key::Key;
    /// use tollgate::rate::RateCheck;
    ///
    /// let slice = RateCheck::reservation(Key::new("user", b"alice"), 64).held(Duration::from_millis(400));
    /// assert_eq!(slice.hold(), Duration::from_millis(400));
    /// assert_eq!(RateCheck::new(slice.key(), 1).hold(), Duration::ZERO);
    /// assert_eq!(slice.settle(10).hold(), Duration::ZERO, "a settlement admits nothing later");
    /// ```
    pub fn held(self, lease: std::time::Duration) -> Self {
        Self {
            held_us: u64::try_from(lease.as_micros())
                .unwrap_or(u64::MAX)
                .min(MOST_HELD_US),
            ..self
        }
    }

    /// How long after the charge this check's units may still be admitted (see
    /// [`held`](Self::held)); zero for a check admitted at once.
    pub fn hold(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.held_us)
    }

    /// [`hold`](Self::hold) in microseconds, as a store takes it.
    pub(crate) fn hold_us(&self) -> u64 {
        self.held_us
    }

    /// Whether a refund this check makes goes unannounced: a store broadcasts the
    /// [invalidation](crate::store::Invalidation) of a refunding settlement only when this is
    /// `false`.
    pub fn is_quiet(&self) -> bool {
        self.quiet
    }

    /// Whether this check is a [reservation](Self::reservation).
    pub fn is_reservation(&self) -> bool {
        self.reservation
    }

    /// The settlement of this check, once it was admitted and its actual cost is known: it
    /// charges `actual` in place of [`cost`](Self::cost), in one atomic step on every limit. An
    /// overrun adds its debt now, whatever the balance (past the quota by at most one more quota
    /// per limit), and the caller is denied until the debt has left the window. A refund returns
    /// only what of a [reservation](Self::reservation)'s charge the limit still counts: nothing
    /// once the charge has left the window, and nothing for a plain check, whose place the store
    /// did not keep.
    ///
    /// A settlement is a check of its own, always admitted, whose id is derived from this one's:
    /// made twice, or re-sent, it is applied once.
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::rate::RateCheck;
    ///
    /// let reserved = RateCheck::reservation(Key::new("user", b"alice"), 300);
    /// let settled = reserved.settle(120);
    /// assert_eq!(settled.cost(), 120);
    /// assert_eq!(settled.settles().map(|s| (s.of, s.reserved)), Some((reserved.attempt(), 300)));
    /// assert_eq!(reserved.settle(120), settled, "the same settlement");
    /// ```
    pub fn settle(&self, actual: u64) -> Self {
        Self {
            key: self.key,
            cost: actual,
            attempt: self.attempt ^ SETTLEMENT_ID,
            reservation: false,
            settles: Some(Settlement {
                of: self.attempt,
                reserved: self.cost,
                refundable: self.reservation,
            }),
            quiet: self.quiet,
            held_us: 0,
        }
    }

    /// The same check as a new attempt, with a fresh id: what a request that waited for room
    /// sends again (a denied attempt is charged nothing, and a new id can never be mistaken
    /// for a re-send of one the store may still be deciding).
    pub(crate) fn again(&self) -> Self {
        Self {
            attempt: uuid::Uuid::new_v4().as_u64_pair().0,
            ..*self
        }
    }

    /// What this check settles, when it is a [settlement](Self::settle).
    pub fn settles(&self) -> Option<Settlement> {
        self.settles
    }

    /// This check as a store receives it, its costs clamped to what changes no answer under
    /// `policy`: a cost to one more than the policy's largest quota (denied alike, for a window);
    /// a settlement's reserved cost likewise (such a check was never admitted, so nothing of it
    /// is refunded), and an overrun to twice that quota (a larger one moves nothing further). No
    /// cost a request can name then overflows a store's arithmetic.
    pub(crate) fn bounded(self, policy: &crate::rate::RatePolicy) -> Self {
        let quota = policy.limits().iter().map(|l| l.quota()).max().unwrap_or(0);
        let most = quota.saturating_add(1);
        let Some(settled) = self.settles else {
            return Self {
                cost: self.cost.min(most),
                ..self
            };
        };
        let (reserved, actual) = (settled.reserved, self.cost);
        let bounded = reserved.min(most);
        let cost = if actual >= reserved {
            bounded + (actual - reserved).min(quota.saturating_mul(2))
        } else {
            bounded.saturating_sub(reserved - actual)
        };
        Self {
            cost,
            settles: Some(Settlement {
                reserved: bounded,
                ..settled
            }),
            ..self
        }
    }

    /// The caller.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The cost to spend (of a settlement: the actual cost it charges in place of the reserved).
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// The attempt's id.
    pub fn attempt(&self) -> u64 {
        self.attempt
    }

    #[cfg(feature = "redis")]
    /// The id as the Redis scripts store it: 16 hexadecimal digits, written without an
    /// allocation (a check is on every request's path).
    pub(crate) fn attempt_hex(&self) -> [u8; 16] {
        hex(self.attempt)
    }
}

#[cfg(feature = "redis")]
/// `id` as 16 hexadecimal digits.
pub(crate) fn hex(id: u64) -> [u8; 16] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = [0u8; 16];
    for (i, digit) in hex.iter_mut().enumerate() {
        *digit = DIGITS[((id >> (60 - 4 * i)) & 0xf) as usize];
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_are_bounded_by_what_changes_no_answer() {
        use crate::rate::{Algorithm, Limit, RatePolicy};
        let policy = RatePolicy::new(
            "t:rl",
            Algorithm::Gcra,
            vec![Limit::per_second("s", 10), Limit::per_minute("m", 100)],
        )
        .unwrap();
        let key = Key::new("t", b"k");
        let bounded = |check: RateCheck| {
            let b = check.bounded(&policy);
            (b.cost(), b.settles().map(|s| s.reserved))
        };
        assert_eq!(bounded(RateCheck::new(key, 7)), (7, None));
        assert_eq!(bounded(RateCheck::new(key, u64::MAX)), (101, None));
        let r = RateCheck::reservation(key, 60);
        assert_eq!(bounded(r.settle(20)), (20, Some(60)));
        assert_eq!(bounded(r.settle(u64::MAX)), (260, Some(60)));
        let huge = RateCheck::reservation(key, 1 << 50);
        assert_eq!(bounded(huge.settle(0)), (0, Some(101)));
        assert_eq!(bounded(huge.settle((1 << 50) - 1)), (100, Some(101)));
        assert_eq!(bounded(huge.settle(u64::MAX)), (301, Some(101)));
        let b = huge.settle(3).bounded(&policy);
        assert_eq!(
            (b.attempt(), b.settles().map(|s| s.of)),
            (huge.settle(3).attempt(), Some(huge.attempt()))
        );
    }

    #[test]
    fn the_attempt_id_is_sixteen_hex_digits() {
        let mut check = RateCheck::new(Key::new("t", b"k"), 1);
        check.attempt = 0x0123_4567_89ab_cdef;
        assert_eq!(&check.attempt_hex(), b"0123456789abcdef");
        check.attempt = 0xa1;
        assert_eq!(&check.attempt_hex(), b"00000000000000a1");
    }
}
