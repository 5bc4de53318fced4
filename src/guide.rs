#![doc = include_str!("../docs/guide.md")]

pub mod operations {
    #![doc = include_str!("../docs/operations.md")]
}

pub mod customizing {
    #![doc = include_str!("../docs/customizing.md")]
}

pub mod frameworks {
    #![doc = include_str!("../docs/frameworks.md")]
}

pub mod ledger {
    #![doc = include_str!("../docs/ledger.md")]
}

pub mod performance {
    #![doc = include_str!("../docs/performance.md")]
}
