#![doc = include_str!("../docs/guide.md")]
#![cfg_attr(
    feature = "postgres",
    doc = "",
    doc = "[`IdempotencyLayer::in_transaction`]: crate::idempotency::IdempotencyLayer::in_transaction",
    doc = "[`PgStore::once`]: crate::store::PgStore::once"
)]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "",
    doc = "[`IdempotencyLayer::in_transaction`]: https://docs.rs/tollgate/latest/tollgate/idempotency/struct.IdempotencyLayer.html#method.in_transaction",
    doc = "[`PgStore::once`]: https://docs.rs/tollgate/latest/tollgate/store/struct.PgStore.html#method.once"
)]

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
    #![cfg_attr(
        feature = "conformance",
        doc = "",
        doc = "[`conformance::model`]: crate::conformance::model"
    )]
    #![cfg_attr(
        not(feature = "conformance"),
        doc = "",
        doc = "[`conformance::model`]: https://docs.rs/tollgate/latest/tollgate/conformance/model/index.html"
    )]
}

pub mod performance {
    #![doc = include_str!("../docs/performance.md")]
}
