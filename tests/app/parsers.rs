//! Property tests of the parsers that configuration and requests reach, beyond those of
//! `tests/layers/hostile_input.rs` (Idempotency-Key, Forwarded / X-Forwarded-For): CIDRs, limits
//! and failure policies read from the environment. Arbitrary input never panics; well-formed
//! input reads back what was written.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::{env, router as app};

use std::net::IpAddr;

use common::check;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use tollgate::key::Cidr;
use tollgate::rate_limit::OnStoreError;

#[test]
fn any_text_as_a_cidr_parses_or_is_refused_without_panicking() {
    check(2048, ".{0,64}", |text| {
        let _ = text.parse::<Cidr>();
        Ok(())
    });
}

#[test]
fn a_written_cidr_contains_exactly_its_network() {
    check(
        1024,
        (any::<IpAddr>(), any::<u8>(), any::<IpAddr>()),
        |(net, prefix, probe)| {
            let mapped = |ip: IpAddr| matches!(ip, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some());
            // IPv4-mapped addresses count as IPv4: left to the unit tests
            if mapped(net) || mapped(probe) {
                return Ok(());
            }
            let max = if net.is_ipv4() { 32 } else { 128 };
            let prefix = prefix % (max + 1);
            let cidr: Cidr = format!("{net}/{prefix}").parse().unwrap();
            prop_assert!(cidr.contains(net), "{net}/{prefix} lacks its own address");
            let (width, a, b) = match (net, probe) {
                (IpAddr::V4(n), IpAddr::V4(p)) => {
                    (32, u128::from(u32::from(n)), u128::from(u32::from(p)))
                }
                (IpAddr::V6(n), IpAddr::V6(p)) => (128, u128::from(n), u128::from(p)),
                _ => {
                    prop_assert!(
                        !cidr.contains(probe),
                        "{probe} in {net}/{prefix}: another family"
                    );
                    return Ok(());
                }
            };
            let shared = prefix == 0
                || (a >> (width - u32::from(prefix))) == (b >> (width - u32::from(prefix)));
            prop_assert_eq!(
                cidr.contains(probe),
                shared,
                "{} in {}/{}",
                probe,
                net,
                prefix
            );
            Ok(())
        },
    );
}

#[test]
fn any_text_as_limits_parses_or_names_the_problem() {
    check(2048, ".{0,80}", |text| {
        if let Err(problem) = env::parse_limits(&text) {
            prop_assert!(!problem.is_empty());
        }
        Ok(())
    });
}

#[test]
fn written_limits_read_back() {
    let limit = ("[a-z][a-z0-9_.-]{0,10}", 1u64..=100_000, 1u64..100_000);
    check(512, prop::collection::vec(limit, 1..5), |limits| {
        let mut names: Vec<&String> = limits.iter().map(|(n, _, _)| n).collect();
        names.sort();
        names.dedup();
        prop_assume!(names.len() == limits.len());
        let text = limits
            .iter()
            .map(|(name, count, secs)| format!("{name}:{count}/{secs}s"))
            .collect::<Vec<_>>()
            .join(",");
        let parsed = env::parse_limits(&text).map_err(TestCaseError::fail)?;
        prop_assert_eq!(parsed.len(), limits.len());
        for (limit, (name, count, secs)) in parsed.iter().zip(&limits) {
            prop_assert_eq!(limit.name(), name.as_str());
            prop_assert_eq!(limit.quota(), *count);
            prop_assert_eq!(limit.window().as_secs(), *secs);
        }
        Ok(())
    });
}

#[test]
fn failure_policies_parse_exactly_their_spellings() {
    check(2048, ".{0,24}", |text| {
        let parsed = app::parse_on_store_error(&text);
        let spelled = match text.trim() {
            "allow" => Some(OnStoreError::Allow),
            "deny" => Some(OnStoreError::Deny),
            other => other
                .strip_prefix("fallback:")
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|&copies| copies >= 1)
                .map(|copies| OnStoreError::LocalFallback { copies }),
        };
        prop_assert_eq!(parsed.ok(), spelled);
        Ok(())
    });
    check(256, 1u32..10_000, |copies| {
        prop_assert_eq!(
            app::parse_on_store_error(&format!("fallback:{copies}")),
            Ok(OnStoreError::LocalFallback { copies })
        );
        Ok(())
    });
}
