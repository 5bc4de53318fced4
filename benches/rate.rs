//! Benchmarks (being written).
fn main() {}
