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
    settles: Option<Settlement>,
}

/// What a settlement corrects: the check it settles, and what that check charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// The attempt id of the settled check.
    pub of: u64,
    /// What the settled check charged (its cost, as admitted).
    pub reserved: u64,
}

/// Mixed into a check's attempt id to name its settlement: a settlement is an attempt of its own
/// (sent, re-sent and remembered as one), derived from the check's so that the same
/// settlement made twice is applied once.
const SETTLEMENT_ID: u64 = 0x9e37_79b9_7f4a_7c15;

impl RateCheck {
    /// A new attempt to spend `cost` for `key`, with a fresh random id.
    pub fn new(key: Key, cost: u64) -> Self {
        Self {
            key,
            cost,
            attempt: uuid::Uuid::new_v4().as_u64_pair().0,
            settles: None,
        }
    }

    /// The settlement of this check, once it was admitted and its actual cost is known: it
    /// charges `actual` in place of [`cost`](Self::cost) — the difference refunded or added, in
    /// one atomic step, whatever the balance. An overrun takes the balance past the quota (by at
    /// most one more quota per limit), and the caller is denied until the debt has left the
    /// window.
    ///
    /// A settlement is a check of its own, always admitted, whose id is derived from this one's:
    /// made twice, or re-sent, it is applied once.
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::rate::RateCheck;
    ///
    /// let reserved = RateCheck::new(Key::new("user", b"alice"), 300);
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
            settles: Some(Settlement {
                of: self.attempt,
                reserved: self.cost,
            }),
        }
    }

    /// What this check settles, when it is a [settlement](Self::settle).
    pub fn settles(&self) -> Option<Settlement> {
        self.settles
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
    fn the_attempt_id_is_sixteen_hex_digits() {
        let mut check = RateCheck::new(Key::new("t", b"k"), 1);
        check.attempt = 0x0123_4567_89ab_cdef;
        assert_eq!(&check.attempt_hex(), b"0123456789abcdef");
        check.attempt = 0xa1;
        assert_eq!(&check.attempt_hex(), b"00000000000000a1");
    }
}
