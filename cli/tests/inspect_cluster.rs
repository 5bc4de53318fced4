//! `tollgate inspect` and `tollgate reset` on a three-master Redis Cluster of the test's own,
//! its nodes named by repeated `--store`, or one seed with `--cluster`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::cluster::RedisCluster;
use common::*;
use http::StatusCode;
use tollgate::store::RedisStore;

#[tokio::test]
async fn inspect_and_reset_on_a_cluster() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap();
    let urls = cluster.urls();
    let store = RedisStore::cluster_builder(urls.clone())
        .timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let (_dir, config) = write_config(TOLLGATE_TOML);
    let layer = by_api_key(Arc::new(store), &config);
    // callers in hash slots of their own, on every master (checked below)
    let callers: Vec<String> = (0..24).map(|i| format!("caller-{i}")).collect();
    for (spent, who) in callers.iter().enumerate() {
        for _ in 0..spent % 5 + 1 {
            let status = call(&layer, &[("x-api-key", who)], None).await;
            assert_eq!(status, StatusCode::OK);
        }
    }

    let counts = cluster.key_counts();
    assert!(
        counts.iter().all(|&n| n > 0),
        "keys on every node: {counts:?}"
    );
    let config = config.to_str().unwrap();
    let every_node: Vec<String> = urls
        .iter()
        .flat_map(|url| ["--store".to_owned(), url.clone()])
        .collect();
    let one_seed: Vec<String> = vec!["--cluster".into(), "--store".into(), urls[2].clone()];
    for (spent, who) in callers.iter().enumerate() {
        let spent = (spent % 5 + 1) as u64;
        let expected = rows(&[("minute", 5, 5 - spent), ("hour", 100, 100 - spent)]);
        let json = inspect(config, &every_node, who).await.json();
        assert_eq!(remaining(&json), expected, "{who}");
        let json = inspect(config, &one_seed, who).await.json();
        assert_eq!(remaining(&json), expected, "{who}");
    }
    // a caller that never came: exit 1, saying so
    let described = inspect(config, &one_seed, "alice").await.json_of_nothing();
    assert_eq!(described["store"], format!("Redis Cluster {}", urls[2]));

    let mut reset = vec!["reset", "--config", config];
    reset.extend(every_node.iter().map(String::as_str));
    reset.extend(["--header", "x-api-key=caller-4"]);
    let reset = tollgate(&reset).await;
    assert_eq!(reset.code, 0, "{reset:?}");
    assert!(
        reset
            .stdout
            .starts_with("reset header x-api-key=ca… on Redis Cluster "),
        "{reset:?}"
    );
    assert_eq!(
        remaining(
            &inspect(config, &one_seed, "caller-4")
                .await
                .json_of_nothing()
        ),
        rows(&[("minute", 5, 5), ("hour", 100, 100)])
    );
    assert_eq!(
        remaining(&inspect(config, &one_seed, "caller-3").await.json()),
        rows(&[("minute", 5, 1), ("hour", 100, 96)])
    );
}

/// `inspect --json` of caller `who` through the store arguments `seeds`.
async fn inspect(config: &str, seeds: &[String], who: &str) -> Run {
    let header = format!("x-api-key={who}");
    let mut args = vec!["inspect", "--json", "--config", config];
    args.extend(seeds.iter().map(String::as_str));
    args.extend(["--header", &header]);
    tollgate(&args).await
}

#[tokio::test]
async fn inspect_shows_a_lock_permits_and_records_on_a_cluster() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap();
    let urls = cluster.urls();
    let store = RedisStore::cluster_builder(urls.clone())
        .timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let every_node: Vec<String> = urls
        .iter()
        .flat_map(|url| ["--store".to_owned(), url.clone()])
        .collect();
    let described = format!("Redis Cluster {}", urls.join(", "));
    common::state::locks_permits_and_records(Arc::new(store), &every_node, &described).await;
}
