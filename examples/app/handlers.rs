//! The app's handlers, and the routes of the groups that keep their handlers beside them.

use super::*;

/// `POST /jobs/{tenant}/run`: runs for `APP_JOB_MS` holding one of the tenant's permits, then
/// answers `200` with the permit's fencing token. Beyond the limit the layer answers `429`.
pub(super) async fn run_job(
    State(state): State<AppState>,
    Path(tenant): Path<String>,
    permit: Option<Extension<Permit>>,
) -> (StatusCode, Json<Value>) {
    tokio::time::sleep(state.config.jobs.duration).await;
    let permit = permit.map(|Extension(p)| p.fencing_token());
    (
        StatusCode::OK,
        Json(json!({ "tenant": tenant, "permit": permit })),
    )
}

/// Transfers: with a database, each `Idempotency-Key` runs once across all copies, in the
/// transaction that records its response; without one, `503` saying what is missing.
pub(super) fn transfer_routes(state: &AppState) -> Router<AppState> {
    match &state.transfers {
        Some((_, layer)) => Router::new()
            .route(
                "/transfers",
                post(create_transfer)
                    .route_layer(layer.clone())
                    .route_layer(axum::middleware::from_fn(identity::require_caller)),
            )
            .route("/transfers/count", get(count_transfers)),
        None => Router::new()
            .route("/transfers", post(no_database))
            .route("/transfers/count", get(no_database)),
    }
}

/// Creates the app's own table of transfers, if it does not exist.
pub async fn prepare_transfers(database: &PgStore) -> Result<(), tollgate::store::StoreError> {
    use tollgate::store::{StoreError, StoreErrorKind::Unavailable};
    let client = database
        .pool()
        .get()
        .await
        .map_err(|e| StoreError::new(Unavailable, e))?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS app_transfers (
               id text PRIMARY KEY,
               from_account text NOT NULL,
               to_account text NOT NULL,
               amount bigint NOT NULL,
               created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .map_err(|e| StoreError::new(Unavailable, e))
}

/// The body of `POST /transfers`.
#[derive(Debug, serde::Deserialize)]
pub(super) struct TransferRequest {
    from: String,
    to: String,
    amount: i64,
}

/// `POST /transfers`: inserts the transfer in the transaction the idempotency layer opened,
/// waits `APP_TRANSFER_DELAY_MS`, and answers `201` with its id; the layer records the answer
/// in the same transaction and commits. A database error answers `503`: not recorded, rolled
/// back, and a retry runs again.
pub(super) async fn create_transfer(
    State(state): State<AppState>,
    tx: OnceTx,
    body: Bytes,
) -> (StatusCode, Json<Value>) {
    let transfer: TransferRequest = match json_body(&body, "transfer") {
        Ok(transfer) => transfer,
        Err(refused) => return refused,
    };
    let id = uuid::Uuid::new_v4().to_string();
    let insert = "INSERT INTO app_transfers (id, from_account, to_account, amount) \
                  VALUES ($1, $2, $3, $4)";
    let inserted = match tx.prepare_cached(insert).await {
        Ok(statement) => {
            let params: [&(dyn ToSql + Sync); 4] =
                [&id, &transfer.from, &transfer.to, &transfer.amount];
            tx.execute(&statement, &params).await
        }
        Err(error) => Err(error),
    };
    if let Err(error) = inserted {
        tracing::warn!(%error, "could not insert a transfer");
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                json!({ "error": "the database is unavailable; retry with the same Idempotency-Key" }),
            ),
        );
    }
    tokio::time::sleep(state.config.transfer_delay).await;
    (
        StatusCode::CREATED,
        Json(json!({
            "id": id,
            "from": transfer.from,
            "to": transfer.to,
            "amount": transfer.amount,
        })),
    )
}

/// `GET /transfers/count`: the rows of the app's table of transfers.
pub(super) async fn count_transfers(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let Some((database, _)) = &state.transfers else {
        return no_database().await;
    };
    let counted = match database.pool().get().await {
        Ok(client) => client
            .query_one("SELECT count(*) FROM app_transfers", &[])
            .await
            .and_then(|row| row.try_get::<_, i64>(0))
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match counted {
        Ok(count) => (StatusCode::OK, Json(json!({ "count": count }))),
        Err(error) => {
            tracing::warn!(%error, "could not count the transfers");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "error": "the database is unavailable" })),
            )
        }
    }
}

/// The transfer routes without a database.
pub(super) async fn no_database() -> (StatusCode, Json<Value>) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "error": "transfers need a PostgreSQL database: set DATABASE_URL" })),
    )
}

/// `name` as a whole number, if it is one.
pub(super) fn header_number(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// The LLM gateway: a token budget per tenant, charged what each completion used.
pub(super) fn llm_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/llm/complete", post(complete))
        .route_layer(state.tokens.clone())
}

/// The body of `POST /llm/complete`.
#[derive(Debug, serde::Deserialize)]
pub(super) struct Completion {
    tokens: u64,
}

/// `POST /llm/complete`: "uses" the tokens the body names and reports them in `x-tokens-used`,
/// which the budget is charged after the response (it reserved `x-max-tokens`).
pub(super) async fn complete(body: Bytes) -> Response {
    match serde_json::from_slice::<Completion>(&body) {
        Ok(Completion { tokens }) => (
            StatusCode::OK,
            [(TOKENS_USED_HEADER, tokens.to_string())],
            Json(json!({ "tokens": tokens })),
        )
            .into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            [(TOKENS_USED_HEADER, "0".to_owned())],
            Json(json!({ "error": format!("invalid completion: {error}") })),
        )
            .into_response(),
    }
}

/// `POST /coupons/{code}/redeem`: exactly one `200` per coupon across every copy of the app. The
/// store unreachable or late → `503`: a redemption is never reported that was not recorded, and
/// an attempt whose answer was lost is undone once the store refuses it for good, so that the
/// coupon is not consumed by nobody. A redemption that replicas have not acknowledged yet
/// (`REDIS_WAIT_REPLICAS`) is in progress: `409` with `Retry-After`, not "already redeemed".
pub(super) async fn redeem_coupon(
    State(state): State<AppState>,
    Path(code): Path<String>,
) -> Response {
    match state
        .claims
        .claim_once(format!("coupon:{code}"), None)
        .await
    {
        Ok(claim) if claim.won() => (
            StatusCode::OK,
            Json(json!({ "coupon": code, "status": "redeemed", "redemption": claim.holder() })),
        )
            .into_response(),
        Ok(claim) if claim.pending() => (
            StatusCode::CONFLICT,
            [(axum::http::header::RETRY_AFTER, "1")],
            Json(json!({ "coupon": code, "status": "in_progress" })),
        )
            .into_response(),
        Ok(_) => (
            StatusCode::CONFLICT,
            Json(json!({ "coupon": code, "status": "already_redeemed" })),
        )
            .into_response(),
        Err(error) => {
            tracing::warn!(%error, "coupon store unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(axum::http::header::RETRY_AFTER, "1")],
                Json(json!({ "coupon": code, "status": "unavailable" })),
            )
                .into_response()
        }
    }
}

/// `POST /reports/{name}/rebuild`: the rebuild runs under a lock whose lease is kept alive while
/// it works; the fencing token is what the report's storage would check.
pub(super) async fn rebuild_report(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> (StatusCode, Json<Value>) {
    let work = state.config.report_work;
    let rebuilt = state
        .locks
        .with_lock(format!("report:{name}"), REPORT_LEASE, |lease| async move {
            tokio::time::sleep(work).await;
            lease.fencing_token()
        })
        .await;
    match rebuilt {
        Ok(token) => (
            StatusCode::OK,
            Json(json!({ "report": name, "status": "rebuilt", "fencing_token": token })),
        ),
        Err(LockError::Busy { lease_left }) => (
            StatusCode::CONFLICT,
            Json(json!({
                "report": name,
                "status": "busy",
                "retry_after_ms": lease_left.as_millis() as u64,
            })),
        ),
        Err(LockError::Lost) => (
            StatusCode::CONFLICT,
            Json(json!({ "report": name, "status": "lease_lost" })),
        ),
        Err(error) => {
            tracing::warn!(%error, "lock store unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "report": name, "status": "unavailable" })),
            )
        }
    }
}

/// The body of `POST /payments`.
#[derive(Debug, serde::Deserialize)]
pub(super) struct PaymentRequest {
    amount: i64,
    currency: String,
}

/// `body` as JSON of a `T`, or the `400` that says why it is not a valid `what`.
pub(super) fn json_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, (StatusCode, Json<Value>)> {
    serde_json::from_slice(body).map_err(|error| {
        (
            StatusCode::BAD_REQUEST,
            Json(json!({ "error": format!("invalid {what}: {error}") })),
        )
    })
}

/// `POST /payments`: works for `APP_PAYMENT_DELAY_MS`, then answers `201` with a fresh payment
/// id. Behind the idempotency layer: runs once per key across all copies.
pub(super) async fn create_payment(
    State(state): State<AppState>,
    body: Bytes,
) -> (StatusCode, Json<Value>) {
    let payment: PaymentRequest = match json_body(&body, "payment") {
        Ok(payment) => payment,
        Err(refused) => return refused,
    };
    tokio::time::sleep(state.config.payment_delay).await;
    (
        StatusCode::CREATED,
        Json(json!({
            "id": uuid::Uuid::new_v4().to_string(),
            "amount": payment.amount,
            "currency": payment.currency,
        })),
    )
}

/// Copies axum's `ConnectInfo<SocketAddr>` into a plain `SocketAddr` request extension, where
/// tollgate's `PeerIp` finds it without the crate's `axum` feature.
pub(super) fn peer_addr_extension(mut request: Request) -> Request {
    if let Some(ConnectInfo(addr)) = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .copied()
    {
        request.extensions_mut().insert(addr);
    }
    request
}

/// `GET /healthz`: 200 while the store answers, 503 when it does not.
pub(super) async fn healthz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let store = state.config.store_kind();
    match tokio::time::timeout(HEALTH_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => (
            StatusCode::OK,
            Json(json!({ "status": "ok", "store": store })),
        ),
        Ok(Err(error)) => {
            tracing::warn!(%error, "health check: the store does not answer");
            unavailable(store)
        }
        Err(_) => {
            tracing::warn!(timeout = ?HEALTH_TIMEOUT, "health check: the store timed out");
            unavailable(store)
        }
    }
}

/// The health answer while the store does not answer (details go to the log, not to callers).
pub(super) fn unavailable(store: &str) -> (StatusCode, Json<Value>) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "status": "unavailable", "store": store })),
    )
}

/// `GET /api/hello`: says hello and who the caller counts as. API keys are never echoed: an
/// authenticated caller is shown by its tenant, and its key as the digest tollgate stores.
pub(super) async fn hello(
    authenticated: Option<Extension<identity::Caller>>,
    peer: Option<Extension<SocketAddr>>,
    decision: Option<Extension<RateLimitDecision>>,
) -> Json<Hello> {
    let key = decision.map(|Extension(d)| d.key());
    let caller = match authenticated {
        Some(Extension(caller)) => Caller {
            by: "api-key",
            tenant: Some(caller.tenant().to_owned()),
            ip: None,
            key,
        },
        None => Caller {
            by: "peer-ip",
            tenant: None,
            ip: Some(peer.map(|Extension(addr)| addr.ip())),
            key,
        },
    };
    Json(Hello {
        message: "hello",
        caller,
    })
}

/// The body of `GET /api/hello`, serialized as it is (no intermediate JSON tree).
#[derive(Serialize)]
pub(super) struct Hello {
    message: &'static str,
    caller: Caller,
}

/// Who the caller counts as: `{"by": "api-key", "tenant": ..., "key": ...}` or `{"by":
/// "peer-ip", "ip": ..., "key": ...}`; `key` is the digest the limits are kept under.
#[derive(Serialize)]
pub(super) struct Caller {
    by: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tenant: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip: Option<Option<IpAddr>>,
    #[serde(serialize_with = "digest")]
    key: Option<Key>,
}

pub(super) fn digest<S: Serializer>(key: &Option<Key>, serializer: S) -> Result<S::Ok, S::Error> {
    match key {
        Some(key) => serializer.collect_str(key),
        None => serializer.serialize_none(),
    }
}
