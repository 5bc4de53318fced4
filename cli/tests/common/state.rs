//! `tollgate inspect lock|permits|record` against a store the test fills through the library:
//! a lock taken by `Locks`, permits taken as the concurrency limit takes them, a record
//! completed by the idempotency layer and one still running — each shown exactly, as text and
//! as JSON.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tollgate::concurrency::ConcurrencyLimitLayer;
use tollgate::idempotency::{IdempotencyLayer, RequestBody};
use tollgate::key::{Header, Key, KeyExtractor};
use tollgate::lock::Locks;
use tollgate::store::{BeginRequest, Hold, IdempotencyBegin, PermitAttempt, PermitRequest};
use tollgate::store::{Store, keys};
use tower::{ServiceBuilder, ServiceExt};

use super::{Run, masked, tollgate};

/// A lease whose time left shows as `2h30m` for the first 30 s after it was set.
const LONG: Duration = Duration::from_millis(9_030_500);
/// One that shows as `1h15m` as long.
const MEDIUM: Duration = Duration::from_millis(4_530_500);

/// `tollgate inspect <what…> <store…> --prefix svc [--json]`.
async fn run_inspect(what: &[&str], store: &[String], json: bool) -> Run {
    let mut args = vec!["inspect"];
    args.extend(what);
    args.extend(store.iter().map(String::as_str));
    args.extend(["--prefix", "svc"]);
    if json {
        args.push("--json");
    }
    tollgate(&args).await
}

/// `tollgate inspect …` of something in the store: its standard output, exit 0.
async fn inspect(what: &[&str], store: &[String], json: bool) -> String {
    let run = run_inspect(what, store, json).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stderr.is_empty(), "{run:?}");
    run.stdout
}

/// `tollgate inspect …` of something the store holds nothing of: its standard output, exit 1,
/// and a line on stderr saying what it looked for, under which prefix.
async fn absent(what: &[&str], store: &[String], json: bool) -> String {
    let run = run_inspect(what, store, json).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.contains("prefix \"svc\"") && run.stderr.contains("--prefix"),
        "{run:?}"
    );
    run.stdout
}

async fn inspect_json(what: &[&str], store: &[String]) -> Value {
    let out = inspect(what, store, true).await;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// `json[field]` as milliseconds, checked to be within 30 s below `lease`.
fn fresh_ms(json: &Value, field: &str, lease: Duration) -> u64 {
    let ms = json[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field}: {json}"));
    let lease = lease.as_millis() as u64;
    assert!(
        ms <= lease && ms > lease - 30_000,
        "{field} {ms} of {lease}"
    );
    ms
}

/// `text` without its `age` line, which must be there, and the age it shows (under 30 s:
/// `12ms`, `1.4s`).
fn without_age(text: &str) -> (String, String) {
    let mut age = None;
    let mut rest = String::new();
    for line in text.lines() {
        match line.strip_prefix("age         ") {
            Some(shown) => age = Some(shown.to_owned()),
            None => {
                rest.push_str(line);
                rest.push('\n');
            }
        }
    }
    let age = age.unwrap_or_else(|| panic!("no age in {text}"));
    let number = age.trim_end_matches("ms").trim_end_matches('s');
    assert!(
        number.parse::<f64>().is_ok_and(|n| n < 30_000.0),
        "age {age}"
    );
    (rest, age)
}

/// `json["age_ms"]`, checked to be a young record's.
fn young_ms(json: &Value) -> u64 {
    let ms = json["age_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("age_ms: {json}"));
    assert!(ms < 30_000, "{json}");
    ms
}

/// The key of tenant `value` under a layer keyed by `x-tenant`, as the layer's extractor finds it.
fn tenant(value: &str) -> Key {
    let parts = Request::get("/")
        .header("x-tenant", value)
        .body(())
        .unwrap()
        .into_parts()
        .0;
    Header::from_static("x-tenant").extract(&parts).unwrap()
}

/// Runs every check on `store`, named on the command line by `args` (`--store …`) and in the
/// output as `described`.
pub(crate) async fn locks_permits_and_records(
    store: Arc<dyn Store>,
    args: &[String],
    described: &str,
) {
    lock(&store, args, described).await;
    permits(&store, args, described).await;
    records(&store, args, described).await;
}

async fn lock(store: &Arc<dyn Store>, args: &[String], described: &str) {
    let name = format!("nightly-report-{}", std::process::id());
    let (key, _) = keys::lock("svc", &name).unwrap();
    let locks = Locks::new(Arc::clone(store)).with_prefix("svc").unwrap();

    let never = absent(&["lock", &name], args, false).await;
    assert_eq!(
        never,
        format!(
            "store          {described}\nlock           {name}\nkey            {key}\n\n\
             state          free\nfencing token  none drawn\n"
        )
    );

    let guard = locks.try_acquire(&name, LONG).await.unwrap();
    let fence = guard.fencing_token();
    let held = inspect_json(&["lock", &name], args).await;
    let holder = held["holder"].as_str().unwrap().to_owned();
    assert_eq!(holder.len(), 36, "a uuid: {holder}");
    let left = fresh_ms(&held, "lease_left_ms", LONG);
    assert_eq!(
        held,
        json!({
            "store": described,
            "lock": name,
            "key": key,
            "held": true,
            "holder": holder,
            "fencing_token": fence,
            "lease_left_ms": left,
        })
    );
    let text = inspect(&["lock", &name], args, false).await;
    assert_eq!(
        text,
        format!(
            "store          {described}\nlock           {name}\nkey            {key}\n\n\
             state          held\nholder         {holder}\nfencing token  {fence}\n\
             lease left     2h30m\n"
        )
    );
    // reading changed nothing: the lock is still held
    assert!(locks.try_acquire(&name, LONG).await.is_err());

    guard.release().await.unwrap();
    let free = inspect(&["lock", &name], args, false).await;
    assert_eq!(
        free,
        format!(
            "store          {described}\nlock           {name}\nkey            {key}\n\n\
             state          free\nfencing token  {fence} (last drawn)\n"
        )
    );
    assert_eq!(
        inspect_json(&["lock", &name], args).await,
        json!({
            "store": described,
            "lock": name,
            "key": key,
            "held": false,
            "holder": null,
            "fencing_token": fence,
            "lease_left_ms": 0,
        })
    );
}

async fn permits(store: &Arc<dyn Store>, args: &[String], described: &str) {
    let value = format!("42-{}", std::process::id());
    let key = keys::permits("svc", &tenant(&value)).unwrap();
    let fence = format!("{key}:fence");
    let header = format!("x-tenant={value}");
    let what = ["permits", "--header", &header];
    let take = |token: &str, lease: Duration, wait: Option<Duration>| {
        let request = PermitRequest::new(Hold::new(&key, token), fence.clone(), 2, lease, wait);
        store.permit_acquire(
            request,
            tokio::time::Instant::now() + Duration::from_secs(2),
        )
    };
    let head = format!(
        "store    {described}\ncaller   header x-tenant={}\nkey      {key}\n\n",
        masked(&value)
    );

    let empty = absent(&what, args, false).await;
    assert_eq!(empty, format!("{head}in use   0\nwaiting  0\nleases   -\n"));

    assert!(matches!(
        take("a", LONG, None).await.unwrap(),
        PermitAttempt::Acquired { .. }
    ));
    assert!(matches!(
        take("b", MEDIUM, None).await.unwrap(),
        PermitAttempt::Acquired { .. }
    ));
    let queued = take("c", LONG, Some(LONG)).await.unwrap();
    assert!(
        matches!(queued, PermitAttempt::Full { ahead: 0, .. }),
        "{queued:?}"
    );

    let text = inspect(&what, args, false).await;
    assert_eq!(
        text,
        format!("{head}in use   2\nwaiting  1\nleases   1h15m, 2h30m\n")
    );
    let json = inspect_json(&what, args).await;
    let leases = json["leases_left_ms"].as_array().unwrap();
    assert_eq!(leases.len(), 2, "{json}");
    let (first, second) = (leases[0].as_u64().unwrap(), leases[1].as_u64().unwrap());
    assert!(first <= MEDIUM.as_millis() as u64 && first > MEDIUM.as_millis() as u64 - 30_000);
    assert!(second <= LONG.as_millis() as u64 && second > LONG.as_millis() as u64 - 30_000);
    assert_eq!(
        json,
        json!({
            "store": described,
            "caller": format!("header x-tenant={}", masked(&value)),
            "key": key,
            "in_use": 2,
            "waiting": 1,
            "leases_left_ms": [first, second],
        })
    );

    for token in ["a", "b", "c"] {
        store.permit_release(Hold::new(&key, token)).await.unwrap();
    }
    let released = absent(&what, args, false).await;
    assert_eq!(
        released,
        format!("{head}in use   0\nwaiting  0\nleases   -\n")
    );
    // a permit the concurrency limit itself holds, named as the layer names it
    let layer = ConcurrencyLimitLayer::builder(Arc::clone(store))
        .limit(3)
        .key(Header::from_static("x-tenant"))
        .prefix("svc")
        .lease(LONG)
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::from("running")))
        }));
    let request = Request::get("/jobs")
        .header("x-tenant", &value)
        .body(String::new())
        .unwrap();
    // the permit is held until the response's body ends
    let running = service.oneshot(request).await.unwrap();
    assert_eq!(running.status(), StatusCode::OK);
    let text = inspect(&what, args, false).await;
    assert_eq!(
        text,
        format!("{head}in use   1\nwaiting  0\nleases   2h30m\n")
    );
    running.into_body().collect().await.unwrap();
    let mut ended = String::new();
    for _ in 0..50 {
        let run = run_inspect(&what, args, false).await;
        ended = run.stdout;
        if run.code == 1 && ended.contains("in use   0") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(ended, format!("{head}in use   0\nwaiting  0\nleases   -\n"));

    let global = absent(&["permits", "--global"], args, true).await;
    let global: Value = serde_json::from_str(&global).unwrap();
    assert_eq!(global["caller"], "global (one key for every request)");
    assert_eq!(global["in_use"], 0);
}

async fn records(store: &Arc<dyn Store>, args: &[String], described: &str) {
    let id = std::process::id();
    let done = format!("order-{id}-17");
    let layer = IdempotencyLayer::builder(Arc::clone(store))
        .scope(Header::from_static("x-api-key"))
        .prefix("svc")
        .retention(Duration::from_millis(86_430_500))
        .build()
        .unwrap();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<RequestBody<String>>| async {
            let mut response = Response::new(String::from("made"));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(response)
        }));
    let request = Request::post("/orders")
        .header("idempotency-key", &done)
        .header("x-api-key", "alice")
        .body(String::new())
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    response.into_body().collect().await.unwrap();

    let scope = ["--scope-header", "x-api-key=alice"];
    let mut what = vec!["record", done.as_str()];
    what.extend(scope);
    let key = keys::idempotency_record(
        "svc",
        Some(
            Header::from_static("x-api-key")
                .extract(
                    &Request::get("/")
                        .header("x-api-key", "alice")
                        .body(())
                        .unwrap()
                        .into_parts()
                        .0,
                )
                .unwrap(),
        ),
        &done,
    )
    .unwrap();
    // the layer may store the response just after the body ends
    let mut completed = String::new();
    for _ in 0..50 {
        completed = inspect(&what, args, false).await;
        if completed.contains("completed") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (completed, _) = without_age(&completed);
    assert_eq!(
        completed,
        format!(
            "store       {described}\nrecord      {done}\nscope       header x-api-key=a…\n\
             key         {key}\n\nstate       completed\nstatus      201 Created\n\
             kept for    24h00m\n"
        )
    );
    let json = inspect_json(&what, args).await;
    let left = fresh_ms(
        &json,
        "retention_left_ms",
        Duration::from_millis(86_430_500),
    );
    let age = young_ms(&json);
    assert_eq!(
        json,
        json!({
            "store": described,
            "idempotency_key": done,
            "scope": "header x-api-key=a…",
            "key": key,
            "state": "completed",
            "status": 201,
            "lease_left_ms": null,
            "retention_left_ms": left,
            "age_ms": age,
        })
    );
    // the quoted form names the same key
    let quoted = format!("\"{done}\"");
    let mut again = vec!["record", quoted.as_str()];
    again.extend(scope);
    assert_eq!(inspect_json(&again, args).await["state"], "completed");

    // the same key unscoped is another record: absent
    let unscoped_key = keys::idempotency_record("svc", None, &done).unwrap();
    assert_eq!(
        absent(&["record", &done], args, false).await,
        format!(
            "store       {described}\nrecord      {done}\nscope       none (unscoped)\n\
             key         {unscoped_key}\n\nstate       absent\n"
        )
    );

    let running = format!("order-{id}-18");
    let running_key = keys::idempotency_record("svc", None, &running).unwrap();
    let begin = BeginRequest::new(Hold::new(running_key.clone(), "t"), "fp", LONG);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    assert_eq!(
        store.idempotency_begin(begin, deadline).await.unwrap(),
        IdempotencyBegin::Claimed
    );
    assert_eq!(
        without_age(&inspect(&["record", &running], args, false).await).0,
        format!(
            "store       {described}\nrecord      {running}\nscope       none (unscoped)\n\
             key         {running_key}\n\nstate       in flight\nlease left  2h30m\n"
        )
    );
    let json = inspect_json(&["record", &running], args).await;
    let left = fresh_ms(&json, "lease_left_ms", LONG);
    let age = young_ms(&json);
    assert_eq!(
        json,
        json!({
            "store": described,
            "idempotency_key": running,
            "scope": null,
            "key": running_key,
            "state": "in_flight",
            "status": null,
            "lease_left_ms": left,
            "retention_left_ms": null,
            "age_ms": age,
        })
    );
}
