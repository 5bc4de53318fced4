//! Units on their way between the store and this copy's slices: a slice being fetched (charged
//! once the store decides, held once it lands), given back (still charged until its settlement
//! lands) or resolved after its answer was lost (charged, perhaps). No slice holds them, but the
//! store may count them: [`Leases::unspent`](super::Leases::unspent) counts them as held, so
//! that what it says bounds the shortfall at every moment.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The units in transit of one tier's leases.
#[derive(Debug, Default)]
pub(super) struct InTransit(AtomicU64);

/// Units counted in transit until dropped.
#[derive(Debug)]
pub(super) struct Carried {
    transit: Arc<InTransit>,
    units: u64,
}

impl InTransit {
    /// Counts `units` in transit until the guard returned is dropped.
    pub(super) fn carry(self: &Arc<Self>, units: u64) -> Carried {
        self.0.fetch_add(units, Ordering::Relaxed);
        Carried {
            transit: Arc::clone(self),
            units,
        }
    }

    /// The units in transit now.
    pub(super) fn units(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Drop for Carried {
    fn drop(&mut self) {
        self.transit.0.fetch_sub(self.units, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_in_transit_while_carried() {
        let transit = Arc::new(InTransit::default());
        let a = transit.carry(10);
        let b = transit.carry(5);
        assert_eq!(transit.units(), 15);
        drop(a);
        assert_eq!(transit.units(), 5);
        drop(b);
        assert_eq!(transit.units(), 0);
    }
}
