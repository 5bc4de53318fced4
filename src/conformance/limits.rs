//! The rules of [`LimitsStore`]: a table read back as saved, saves conditional on the version
//! read (exactly one of concurrent writers wins), a history of the newest changes, namespaces
//! apart.

use std::time::{Duration, SystemTime};

use super::unique;
use crate::key::Key;
use crate::rate::{Limit, LimitTable};
use crate::store::{HISTORY_KEPT, LimitsStore, Saved};

/// A table of every kind of entry, its own limit's quota `quota`.
fn table(quota: u64) -> LimitTable {
    let mut table = LimitTable::with_defaults(
        2,
        [
            (
                None,
                vec![
                    Limit::per_second("burst", quota),
                    Limit::per_hour("h", 10_000),
                ],
            ),
            (
                Some("pro".to_owned()),
                vec![Limit::per_minute("m", 600).leased()],
            ),
        ],
    );
    table.set_tier(
        Some("pro"),
        vec![Limit::per_minute("m", 900).block_for(Duration::from_millis(2500))],
    );
    table.set_caller(
        Key::new("tenant", b"acme"),
        vec![Limit::per_second("burst", 99)],
    );
    table
}

/// No table until one is saved; then it reads back as saved, at version 1.
pub async fn a_table_reads_back_as_saved(store: &impl LimitsStore) {
    let ns = unique("t:rl");
    assert_eq!(store.load_limits(&ns).await.unwrap(), None);
    assert!(store.limits_history(&ns).await.unwrap().is_empty());
    assert_eq!(
        store.save_limits(&ns, 0, &table(5), "first").await.unwrap(),
        Saved::Saved(1)
    );
    let stored = store.load_limits(&ns).await.unwrap().expect("a table");
    assert_eq!((stored.version, stored.table), (1, table(5)));
}

/// A save names the version it read: another one saves nothing and says which the store holds.
pub async fn a_save_needs_the_version_it_read(store: &impl LimitsStore) {
    let ns = unique("t:rl");
    store.save_limits(&ns, 0, &table(1), "").await.unwrap();
    assert_eq!(
        store.save_limits(&ns, 0, &table(2), "").await.unwrap(),
        Saved::Conflict(1)
    );
    assert_eq!(
        store.save_limits(&ns, 2, &table(2), "").await.unwrap(),
        Saved::Conflict(1)
    );
    assert_eq!(
        store.save_limits(&ns, 1, &table(3), "").await.unwrap(),
        Saved::Saved(2)
    );
    // a re-sent save names the version its first run raised
    assert_eq!(
        store.save_limits(&ns, 1, &table(3), "").await.unwrap(),
        Saved::Conflict(2)
    );
    let stored = store.load_limits(&ns).await.unwrap().expect("a table");
    assert_eq!((stored.version, stored.table), (2, table(3)));
    assert_eq!(store.limits_history(&ns).await.unwrap().len(), 2);
}

/// Of writers that read one version, exactly one saves — for the first table and for a later
/// one.
pub async fn exactly_one_of_concurrent_saves_wins(store: &(impl LimitsStore + Clone)) {
    let ns = unique("t:rl");
    for expected in [0, 1] {
        let saves = (0..16u64).map(|i| {
            let (store, ns) = (store.clone(), ns.clone());
            async move {
                store
                    .save_limits(&ns, expected, &table(i + 1), "")
                    .await
                    .unwrap()
            }
        });
        let saved = futures_util::future::join_all(saves).await;
        let won: Vec<usize> = (0..saved.len())
            .filter(|&i| saved[i] == Saved::Saved(expected + 1))
            .collect();
        assert_eq!(won.len(), 1, "{saved:?}");
        let lost = saved
            .iter()
            .filter(|s| **s == Saved::Conflict(expected + 1));
        assert_eq!(lost.count(), 15, "{saved:?}");
        let stored = store.load_limits(&ns).await.unwrap().expect("a table");
        assert_eq!(stored.table, table(won[0] as u64 + 1));
    }
}

/// The history keeps the newest [`HISTORY_KEPT`] changes, newest first, each with its version,
/// note (one line) and the store's time.
pub async fn history_keeps_the_newest_changes(store: &impl LimitsStore) {
    let ns = unique("t:rl");
    let before = SystemTime::now() - Duration::from_secs(60);
    let saves = HISTORY_KEPT as u64 + 2;
    for version in 1..=saves {
        let note = format!("change\n{version}");
        let saved = store
            .save_limits(&ns, version - 1, &table(version), &note)
            .await;
        assert_eq!(saved.unwrap(), Saved::Saved(version));
    }
    let history = store.limits_history(&ns).await.unwrap();
    assert_eq!(history.len(), HISTORY_KEPT);
    for (change, version) in history.iter().zip((3..=saves).rev()) {
        assert_eq!(change.version, version);
        assert_eq!(change.note, format!("change {version}"));
        assert_eq!(change.table, table(version));
        let after = SystemTime::now() + Duration::from_secs(60);
        assert!(change.at > before && change.at < after, "{:?}", change.at);
    }
}

/// The tables of two namespaces are apart.
pub async fn namespaces_are_apart(store: &impl LimitsStore) {
    let (a, b) = (unique("t:rl"), unique("t:rl"));
    store.save_limits(&a, 0, &table(1), "a").await.unwrap();
    assert_eq!(store.load_limits(&b).await.unwrap(), None);
    assert_eq!(
        store.save_limits(&b, 0, &table(2), "b").await.unwrap(),
        Saved::Saved(1)
    );
    assert_eq!(
        store.load_limits(&a).await.unwrap().unwrap().table,
        table(1)
    );
    assert_eq!(store.limits_history(&b).await.unwrap()[0].note, "b");
}

/// Copies register with what they were built with, each for its own time; registered again, a
/// copy says what it says now; one not seen within its time is gone; namespaces are apart.
pub async fn copies_register_and_lapse(store: &impl LimitsStore) {
    let ns = unique("t:rl");
    assert!(store.copies(&ns).await.unwrap().is_empty());
    let minute = Duration::from_secs(60);
    store
        .register_copy(&ns, "a", "r0-abc", minute)
        .await
        .unwrap();
    let short = Duration::from_millis(300);
    store
        .register_copy(&ns, "b", "r1-def", short)
        .await
        .unwrap();
    let seen = store.copies(&ns).await.unwrap();
    let named: Vec<(&str, &str)> = seen.iter().map(|c| (&*c.copy, &*c.built)).collect();
    assert_eq!(named, [("a", "r0-abc"), ("b", "r1-def")]);
    assert!(seen[0].left > minute - Duration::from_secs(5) && seen[0].left <= minute);
    assert!(seen[1].left <= short, "{seen:?}");
    store
        .register_copy(&ns, "a", "r2-xyz", minute)
        .await
        .unwrap();
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    let seen = store.copies(&ns).await.unwrap();
    let named: Vec<(&str, &str)> = seen.iter().map(|c| (&*c.copy, &*c.built)).collect();
    assert_eq!(named, [("a", "r2-xyz")]);
    assert!(store.copies(&unique("t:rl")).await.unwrap().is_empty());
}
