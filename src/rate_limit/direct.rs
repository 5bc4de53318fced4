//! A layer's decision for a call made outside a tower service — the outbound limit's adapter for
//! `reqwest-middleware` — and its settlement on the answer's head.

use http::request::Parts;
use tokio::time::Instant;

use super::decision::RateLimitDecision;
use super::layer::RateLimitLayer;
use super::rejection::Refused;
use super::settings::Settle;
use crate::key::KeyExtractor;
use crate::rate::RateCheck;
use crate::rate_client::DecisionSource;

/// A call the layer let through: its decision (none when it was not checked), and what its
/// answer settles.
#[derive(Debug)]
pub(crate) struct Direct {
    pub(crate) decision: Option<RateLimitDecision>,
    settle: Option<RateCheck>,
}

impl<K: KeyExtractor> RateLimitLayer<K> {
    /// Decides a call with head `parts` as the layer's service would (waiting in its queue, when
    /// it has one, with its patience counted from `arrived`): let through, or refused and why.
    pub(crate) async fn decide_direct(
        &self,
        parts: &Parts,
        arrived: Instant,
    ) -> Result<Direct, (Refused, Option<RateLimitDecision>)> {
        let settings = &self.settings;
        let unchecked = Direct {
            decision: None,
            settle: None,
        };
        let Some(key) = self.extractor.extract(parts) else {
            return match settings.missing_key.refusal() {
                Some(_) if !settings.shadow => Err((Refused::MissingKey, None)),
                _ => Ok(unchecked),
            };
        };
        let cost = settings.cost_of(parts);
        if cost == 0 {
            return Ok(unchecked);
        }
        let tier = settings.client.tiers().for_request(parts, Some(key));
        let verdict = settings
            .client
            .decide(&tier, settings.check(key, cost), Some(arrived))
            .resolve()
            .await;
        let check = verdict.check;
        let decision = RateLimitDecision::new(verdict, settings.shadow);
        decision.report();
        if !decision.admitted() && !settings.shadow {
            return Err((Refused::Denied, Some(decision)));
        }
        let charged = decision.admitted() && decision.source == DecisionSource::Store;
        let settles = matches!(settings.settle, Some(Settle::Head(_)));
        Ok(Direct {
            settle: (charged && settles).then_some(check),
            decision: Some(decision),
        })
    }

    /// Settles `direct` on the answer's head `response`, when the layer settles on heads and
    /// the answer names another amount than was reserved (logged when the store fails: the call
    /// stays charged what it reserved).
    pub(crate) async fn settle_direct(&self, direct: Direct, response: &http::response::Parts) {
        let (Some(check), Some(decision), Some(Settle::Head(read))) =
            (direct.settle, direct.decision, &self.settings.settle)
        else {
            return;
        };
        let Some(actual) = read(response).filter(|actual| *actual != check.cost()) else {
            return;
        };
        let store = &self.settings.client.store;
        if let Err(error) = store
            .settle(&decision.tier.policy, check.settle(actual))
            .await
        {
            tracing::warn!(
                target: "tollgate::rate_limit",
                %error, actual,
                "could not settle a call's actual cost: it stays charged what it reserved"
            );
        }
    }
}
