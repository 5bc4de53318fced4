#![doc = include_str!("../docs/guide.md")]
//!
//! [`IdempotencyLayer::in_transaction`]: crate::idempotency::IdempotencyLayer::in_transaction
//! [`PgStore::once`]: https://docs.rs/tollgate/latest/tollgate/store/struct.PgStore.html#method.once

pub mod operations {
    #![doc = include_str!("../docs/operations.md")]
}

pub mod customizing {
    #![doc = include_str!("../docs/customizing.md")]
}

pub mod frameworks {
    #![doc = include_str!("../docs/frameworks.md")]
}

pub mod architecture {
    #![doc = include_str!("../docs/architecture.md")]
}

pub mod ledger {
    #![doc = include_str!("../docs/ledger.md")]
    //!
    //! [`conformance::model`]: https://docs.rs/tollgate/latest/tollgate/conformance/model/index.html
}

pub mod performance {
    #![doc = include_str!("../docs/performance.md")]
}

pub mod security {
    #![doc = include_str!("../docs/security.md")]
}

pub mod metering {
    #![doc = include_str!("../docs/metering.md")]
}

pub mod outbound {
    #![doc = include_str!("../docs/outbound.md")]
}
