//! `tollgate inspect` and `tollgate reset` on PostgreSQL: a server of the test's own
//! (`tollgate::testing::PgServer`), the service's store in a schema of its own, migrated by the service.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use http::StatusCode;
use tollgate::store::PgStore;
use tollgate::testing::PgServer;

#[tokio::test]
async fn inspect_and_reset_on_postgres() {
    let server = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let store = PgStore::builder(url.clone())
        .schema("svc_limits")
        .timeout(Duration::from_secs(2))
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let layer = by_api_key(Arc::new(store), &config);
    for _ in 0..3 {
        assert_eq!(
            call(&layer, &[("x-api-key", "alice")], None).await,
            StatusCode::OK
        );
    }
    assert_eq!(
        call(&layer, &[("x-api-key", "bob")], None).await,
        StatusCode::OK
    );

    let config = config.to_str().unwrap();
    let base = [
        "--store",
        &url,
        "--config",
        config,
        "--pg-schema",
        "svc_limits",
    ];
    let inspect = |who: &'static str| {
        let header = format!("x-api-key={who}");
        let mut args = vec!["inspect", "--json"];
        args.extend(base);
        async move {
            let mut args = args;
            args.extend(["--header", &header]);
            tollgate(&args).await
        }
    };
    assert_eq!(
        remaining(&inspect("alice").await.json()),
        rows(&[("minute", 5, 2), ("hour", 100, 97)])
    );
    assert_eq!(
        remaining(&inspect("bob").await.json()),
        rows(&[("minute", 5, 4), ("hour", 100, 99)])
    );

    let mut reset = vec!["reset"];
    reset.extend(base);
    reset.extend(["--header", "x-api-key=alice"]);
    let reset = tollgate(&reset).await;
    assert_eq!(reset.code, 0, "{reset:?}");
    assert_eq!(
        reset.stdout,
        format!(
            "reset header x-api-key=a… on {url}\n  svc:rl        minute, hour\n  svc:rl:paid   minute\n"
        )
    );
    // nothing left of alice: inspect says so, and so does a second reset (exit 1 both)
    assert_eq!(
        remaining(&inspect("alice").await.json_of_nothing()),
        rows(&[("minute", 5, 5), ("hour", 100, 100)])
    );
    let mut again = vec!["reset"];
    again.extend(base);
    again.extend(["--header", "x-api-key=alice"]);
    let again = tollgate(&again).await;
    assert_eq!(again.code, 1, "{again:?}");
    assert_eq!(again.stdout, reset.stdout);
    assert_eq!(
        again.stderr,
        "nothing to reset: the store holds no state of header x-api-key=a… under svc:rl, \
         svc:rl:paid; a caller that never came, or one named otherwise (check the caller, the \
         prefix and the tiers)\n"
    );
    // a mistyped prefix in the limits file finds nothing of bob, who has spent: exit 1, naming
    // the prefix it looked under, and bob's quota untouched
    let (_mistyped_dir, mistyped) =
        write_config(&TOLLGATE_TOML.replace("prefix = \"svc\"", "prefix = \"svx\""));
    let mistyped = mistyped.to_str().unwrap();
    for command in ["inspect", "reset"] {
        let run = tollgate(&[
            command,
            "--store",
            &url,
            "--config",
            mistyped,
            "--pg-schema",
            "svc_limits",
            "--header",
            "x-api-key=bob",
        ])
        .await;
        assert_eq!(run.code, 1, "{run:?}");
        assert!(
            run.stderr.starts_with("nothing ")
                && run.stderr.contains("header x-api-key=b… under svx:rl"),
            "{run:?}"
        );
    }
    assert_eq!(
        remaining(&inspect("bob").await.json()),
        rows(&[("minute", 5, 4), ("hour", 100, 99)])
    );

    // the CLI never migrates: a schema the service never made is an error
    let wrong = tollgate(&[
        "inspect",
        "--store",
        &url,
        "--config",
        config,
        "--header",
        "x-api-key=alice",
    ])
    .await;
    assert_eq!(wrong.code, 2, "{wrong:?}");
    assert!(
        wrong.stderr.starts_with(&format!("error: {url}: ")),
        "{wrong:?}"
    );
    assert!(
        wrong.stderr.contains("schema \"tollgate\" does not exist"),
        "{wrong:?}"
    );
    assert!(wrong.stderr.contains("--pg-schema"), "{wrong:?}");
}

#[tokio::test]
async fn inspect_shows_a_lock_permits_and_records_on_postgres() {
    let server = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url();
    let store = PgStore::builder(url.clone())
        .schema("svc_state")
        .timeout(Duration::from_secs(2))
        .purge_interval(None)
        .connect()
        .await
        .unwrap();
    let args = vec![
        "--store".to_owned(),
        url.clone(),
        "--pg-schema".to_owned(),
        "svc_state".to_owned(),
    ];
    common::state::locks_permits_and_records(Arc::new(store), &args, &url).await;

    // read-only: a schema the service never made is an error, not created
    for what in [
        vec!["lock", "nightly"],
        vec!["permits", "--global"],
        vec!["record", "order-1"],
    ] {
        let mut args = vec!["inspect"];
        args.extend(what);
        args.extend(["--store", &url]);
        let wrong = tollgate(&args).await;
        assert_eq!(wrong.code, 2, "{wrong:?}");
        assert!(wrong.stdout.is_empty(), "{wrong:?}");
        assert!(
            wrong.stderr.starts_with(&format!("error: {url}: ")),
            "{wrong:?}"
        );
        assert!(
            wrong.stderr.contains("schema \"tollgate\" does not exist"),
            "{wrong:?}"
        );
        assert!(wrong.stderr.contains("--pg-schema"), "{wrong:?}");
    }
}
