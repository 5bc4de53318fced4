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
}

impl RateCheck {
    /// A new attempt to spend `cost` for `key`, with a fresh random id.
    pub fn new(key: Key, cost: u64) -> Self {
        Self {
            key,
            cost,
            attempt: uuid::Uuid::new_v4().as_u64_pair().0,
        }
    }

    /// The caller.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The cost to spend.
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
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 16];
        for (i, digit) in hex.iter_mut().enumerate() {
            *digit = DIGITS[((self.attempt >> (60 - 4 * i)) & 0xf) as usize];
        }
        hex
    }
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
