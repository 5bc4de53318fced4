//! [`ExpiringMap`]: a bounded map of entries that expire, shared between threads without one
//! global lock — the state that `MemoryStore` and the rate limiter's local fallback keep in
//! process.
//!
//! - **Shards**: entries are spread over [`SHARDS`] tables by a hash of a routing value the user
//!   picks (keyed at random, so that nobody can aim keys at one shard), each behind its own lock,
//!   so that operations on different keys seldom wait for each other. Keys that route alike share
//!   a table: an operation on them is one step under one lock.
//! - **Expiry index**: each table orders its entries by expiry, and locking a table first removes
//!   the entries whose time is up — exactly those, never a scan of the live ones. An entry is
//!   moved in the index when it comes due and turns out to live longer (not on every write that
//!   pushes its expiry later), so the index costs O(log n) per entry and lifetime, amortised. An
//!   expiry moved earlier is moved in the index at once, or the entry would count against the
//!   capacity after it expired.
//! - **Capacity**: at most `capacity` entries over all shards, counted together (not per shard).
//!   A new entry beyond that is refused ([`Full`]); its user then removes the expired entries of
//!   every shard ([`ExpiringMap::remove_expired_everywhere`], with no lock held) and tries once
//!   more, so that a new entry is refused only while `capacity` live ones are held. A live entry
//!   is never evicted to make room: that would hand a caller a fresh quota, or free a held lock.
//!   Each table publishes its earliest index position outside its lock, so that this skips the
//!   shards where nothing has expired.
//!
//! Time is whatever the user counts in (its store clock, in microseconds): the map only compares
//! a value's [`Expiring::expires_at`] with the `now` an operation locks a table at.

use std::borrow::Borrow;
use std::collections::BTreeSet;
use std::collections::hash_map::{self, HashMap};
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The number of shards: enough that a few cores seldom meet on one lock, few enough that an
/// empty map stays small (a few kilobytes).
pub(crate) const SHARDS: usize = 32;

/// A value that expires.
pub(crate) trait Expiring {
    /// The time after which the value is gone: at `now` or before, it is expired.
    fn expires_at(&self) -> u64;
}

/// A new entry refused: the map holds its capacity of live entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

/// At most `capacity` entries of `K` to `V`, in [`SHARDS`] tables that each keep a side value
/// `S` of their own (say, names numbered under the same lock as the entries).
#[derive(Debug)]
pub(crate) struct ExpiringMap<K, V, S = ()> {
    shards: Box<[Shard<K, V, S>]>,
    /// Picks a routing value's shard.
    hasher: RandomState,
    count: Count,
}

/// Entries held over all shards, the expired ones not removed yet included, and their bound.
#[derive(Debug)]
struct Count {
    held: AtomicUsize,
    capacity: usize,
}

// One shard per cache line: threads locking neighbouring shards do not slow each other down.
#[derive(Debug)]
#[repr(align(64))]
struct Shard<K, V, S> {
    table: Mutex<Table<K, V, S>>,
    /// The table's earliest index position (`u64::MAX` when empty), readable without the lock:
    /// nothing in the table has expired before it.
    next_due: AtomicU64,
}

#[derive(Debug)]
struct Table<K, V, S> {
    entries: HashMap<K, Indexed<V>>,
    /// Every entry once, at its `indexed_at`, earliest first.
    by_expiry: BTreeSet<(u64, K)>,
    side: S,
}

#[derive(Debug)]
struct Indexed<V> {
    value: V,
    /// Its place in the expiry index: never after the value's expiry.
    indexed_at: u64,
}

/// One shard's table, locked at `now` with its expired entries removed; unlocking publishes its
/// earliest index position.
#[derive(Debug)]
pub(crate) struct Locked<'a, K: Ord, V, S = ()> {
    map: &'a ExpiringMap<K, V, S>,
    index: usize,
    now: u64,
    table: MutexGuard<'a, Table<K, V, S>>,
}

/// Room taken from a map's capacity for entries not added yet, all at once; what is not used is
/// given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Room<'a> {
    count: &'a Count,
    entries: usize,
}

impl<K, V, S> ExpiringMap<K, V, S>
where
    K: Hash + Eq + Ord + Clone,
    V: Expiring,
    S: Default,
{
    /// An empty map for at most `capacity` entries.
    pub(crate) fn new(capacity: usize) -> Self {
        let shard = || Shard {
            table: Mutex::new(Table {
                entries: HashMap::new(),
                by_expiry: BTreeSet::new(),
                side: S::default(),
            }),
            next_due: AtomicU64::new(u64::MAX),
        };
        Self {
            shards: (0..SHARDS).map(|_| shard()).collect(),
            hasher: RandomState::new(),
            count: Count {
                held: AtomicUsize::new(0),
                capacity,
            },
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.count.capacity
    }

    /// The shard of the keys routed by `route`.
    pub(crate) fn shard<R: Hash + ?Sized>(&self, route: &R) -> usize {
        self.hasher.hash_one(route) as usize % SHARDS
    }

    /// Locks `shard`'s table at `now` and removes its expired entries. Two tables are locked in
    /// ascending shard order, or two such operations could deadlock.
    pub(crate) fn lock(&self, shard: usize, now: u64) -> Locked<'_, K, V, S> {
        // Every change to a table completes its index upkeep before it returns, so a panic
        // cannot leave an entry unindexed. A panic inside `update` may leave a value's expiry
        // before its index position: the entry is then removed late, when that position comes
        // due. Either way the table is still usable.
        let table = self.shards[shard]
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut locked = Locked {
            map: self,
            index: shard,
            now,
            table,
        };
        locked.remove_expired();
        locked
    }

    /// Removes the expired entries of every shard where some may have expired: what a new
    /// entry refused as [`Full`] does before it tries once more. It takes each shard's lock in
    /// turn, so it must be called with none held, or it could deadlock.
    pub(crate) fn remove_expired_everywhere(&self, now: u64) {
        for (index, shard) in self.shards.iter().enumerate() {
            if shard.next_due.load(Ordering::Relaxed) <= now {
                drop(self.lock(index, now));
            }
        }
    }

    /// The number of live entries at `now` (the expired ones are removed on the way).
    pub(crate) fn live(&self, now: u64) -> usize {
        (0..SHARDS)
            .map(|index| self.lock(index, now).table.entries.len())
            .sum()
    }
}

impl<K, V, S> ExpiringMap<K, V, S> {
    /// No room taken yet: [`Room::take`] takes some.
    pub(crate) fn room(&self) -> Room<'_> {
        Room {
            count: &self.count,
            entries: 0,
        }
    }
}

impl<K, V, S> Locked<'_, K, V, S>
where
    K: Hash + Eq + Ord + Clone,
    V: Expiring,
{
    /// Which shard this is.
    pub(crate) fn shard(&self) -> usize {
        self.index
    }

    /// The table's side value.
    pub(crate) fn side(&mut self) -> &mut S {
        &mut self.table.side
    }

    pub(crate) fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.table.entries.get(key).map(|entry| &entry.value)
    }

    pub(crate) fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.table.entries.contains_key(key)
    }

    /// Runs `f` on `key`'s value, if held, and keeps the index in step: a value that `f` left
    /// expired is removed, one whose expiry `f` moved earlier is moved in the index.
    pub(crate) fn update<Q, R>(&mut self, key: &Q, f: impl FnOnce(&mut V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let entry = self.table.entries.get_mut(key)?;
        let out = f(&mut entry.value);
        let (expires_at, indexed_at) = (entry.value.expires_at(), entry.indexed_at);
        self.settle(key, expires_at, indexed_at);
        Some(out)
    }

    /// Runs `f` on `key`'s value, as [`update`](Self::update) does; if the key is not held, on
    /// `new()` instead, which is kept if `f` leaves it unexpired and there is room for it
    /// ([`Full`] when there is none: `f`'s result is then thrown away with the value). One hash
    /// of `key` either way.
    pub(crate) fn upsert<R>(
        &mut self,
        key: K,
        new: impl FnOnce() -> V,
        f: impl FnOnce(&mut V) -> R,
    ) -> Result<R, Full> {
        let now = self.now;
        let table = &mut *self.table;
        match table.entries.entry(key) {
            hash_map::Entry::Occupied(mut held) => {
                let out = f(&mut held.get_mut().value);
                let (expires_at, indexed_at) =
                    (held.get().value.expires_at(), held.get().indexed_at);
                if expires_at <= now {
                    let (key, _) = held.remove_entry();
                    table.by_expiry.remove(&(indexed_at, key));
                    self.map.count.give_back(1);
                } else if expires_at < indexed_at {
                    held.get_mut().indexed_at = expires_at;
                    table.by_expiry.remove(&(indexed_at, held.key().clone()));
                    table.by_expiry.insert((expires_at, held.key().clone()));
                }
                Ok(out)
            }
            hash_map::Entry::Vacant(vacant) => {
                let mut value = new();
                let out = f(&mut value);
                let expires_at = value.expires_at();
                if expires_at > now {
                    self.map.count.take(1)?;
                    table.by_expiry.insert((expires_at, vacant.key().clone()));
                    let indexed_at = expires_at;
                    vacant.insert(Indexed { value, indexed_at });
                }
                Ok(out)
            }
        }
    }

    /// Sets `key` to `value`; a key not held yet takes room from `room` (taken from this map) if
    /// it has some left, else from the map's capacity. A value expired already is not kept.
    pub(crate) fn insert<Q>(&mut self, key: &Q, value: V, room: &mut Room<'_>) -> Result<(), Full>
    where
        K: Borrow<Q> + for<'q> From<&'q Q>,
        Q: Hash + Eq + ?Sized,
    {
        debug_assert!(
            std::ptr::eq(room.count, &self.map.count),
            "another map's room"
        );
        let expires_at = value.expires_at();
        if let Some(entry) = self.table.entries.get_mut(key) {
            entry.value = value;
            let indexed_at = entry.indexed_at;
            self.settle(key, expires_at, indexed_at);
            return Ok(());
        }
        if expires_at <= self.now {
            return Ok(());
        }
        room.use_one()?;
        let key = K::from(key);
        self.table.by_expiry.insert((expires_at, key.clone()));
        let indexed = Indexed {
            value,
            indexed_at: expires_at,
        };
        self.table.entries.insert(key, indexed);
        Ok(())
    }

    /// Deletes `key`; its value, if it was held.
    pub(crate) fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (key, entry) = self.table.entries.remove_entry(key)?;
        self.table.by_expiry.remove(&(entry.indexed_at, key));
        self.map.count.give_back(1);
        Some(entry.value)
    }

    /// Keeps the index in step with `key`'s expiry after a change. A later expiry is left to
    /// [`remove_expired`](Self::remove_expired), which finds it when the index entry comes due:
    /// one index move per lifetime, not per write.
    fn settle<Q>(&mut self, key: &Q, expires_at: u64, indexed_at: u64)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if expires_at <= self.now {
            self.remove(key);
        } else if expires_at < indexed_at {
            let table = &mut *self.table;
            if let Some((key, mut entry)) = table.entries.remove_entry(key) {
                table.by_expiry.remove(&(indexed_at, key.clone()));
                table.by_expiry.insert((expires_at, key.clone()));
                entry.indexed_at = expires_at;
                table.entries.insert(key, entry);
            }
        }
    }

    /// Removes the entries expired at `now`. An entry whose expiry moved later since it was
    /// indexed is indexed again at its expiry instead.
    fn remove_expired(&mut self) {
        let now = self.now;
        let table = &mut *self.table;
        let mut removed = 0;
        while let Some(&(at, _)) = table.by_expiry.first()
            && at <= now
        {
            let Some((_, key)) = table.by_expiry.pop_first() else {
                break;
            };
            match table.entries.entry(key) {
                hash_map::Entry::Occupied(mut held) if held.get().value.expires_at() > now => {
                    let expires_at = held.get().value.expires_at();
                    held.get_mut().indexed_at = expires_at;
                    table.by_expiry.insert((expires_at, held.key().clone()));
                }
                hash_map::Entry::Occupied(expired) => {
                    expired.remove();
                    removed += 1;
                }
                hash_map::Entry::Vacant(_) => {}
            }
        }
        self.map.count.give_back(removed);
    }
}

impl<K: Ord, V, S> Drop for Locked<'_, K, V, S> {
    fn drop(&mut self) {
        let earliest = self.table.by_expiry.first().map_or(u64::MAX, |(at, _)| *at);
        self.map.shards[self.index]
            .next_due
            .store(earliest, Ordering::Relaxed);
    }
}

impl Room<'_> {
    /// Takes room for `entries` more, all or none.
    pub(crate) fn take(&mut self, entries: usize) -> Result<(), Full> {
        self.count.take(entries)?;
        self.entries += entries;
        Ok(())
    }

    /// Room for one new entry: taken already, or taken now.
    fn use_one(&mut self) -> Result<(), Full> {
        if self.entries > 0 {
            self.entries -= 1;
            Ok(())
        } else {
            self.count.take(1)
        }
    }
}

impl Drop for Room<'_> {
    fn drop(&mut self) {
        self.count.give_back(self.entries);
    }
}

impl Count {
    /// Counts `entries` more held, if there is room for all of them.
    fn take(&self, entries: usize) -> Result<(), Full> {
        if entries == 0 {
            return Ok(());
        }
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(entries)
                    .filter(|&total| total <= self.capacity)
            })
            .map(drop)
            .map_err(|_| Full)
    }

    fn give_back(&self, entries: usize) {
        if entries > 0 {
            self.held.fetch_sub(entries, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
impl<K, V, S> ExpiringMap<K, V, S>
where
    K: Hash + Eq + Ord + Clone,
    V: Expiring,
{
    /// Entries counted against the capacity, the expired ones not removed yet included.
    pub(crate) fn held(&self) -> usize {
        self.count.held.load(Ordering::Relaxed)
    }

    /// Asserts that the index, the tables and the count agree — every entry is indexed once, not
    /// after its expiry, and counted once — and calls `each` with every entry's shard, key and
    /// value. Removes nothing.
    pub(crate) fn assert_consistent(&self, mut each: impl FnMut(usize, &K, &V)) {
        let mut total = 0;
        for (index, shard) in self.shards.iter().enumerate() {
            let table = shard.table.lock().unwrap_or_else(PoisonError::into_inner);
            assert_eq!(table.entries.len(), table.by_expiry.len());
            for (key, entry) in &table.entries {
                assert!(table.by_expiry.contains(&(entry.indexed_at, key.clone())));
                assert!(entry.indexed_at <= entry.value.expires_at());
                each(index, key, &entry.value);
            }
            total += table.entries.len();
        }
        assert_eq!(self.held(), total);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Item {
        expires_at: u64,
        tag: u32,
    }

    impl Expiring for Item {
        fn expires_at(&self) -> u64 {
            self.expires_at
        }
    }

    fn item(expires_at: u64, tag: u32) -> Item {
        Item { expires_at, tag }
    }

    type Map = ExpiringMap<Arc<str>, Item>;

    /// `n` keys of `map`'s shard `shard`.
    fn keys_in(map: &Map, shard: usize, n: usize) -> Vec<String> {
        (0..)
            .map(|i| format!("k{i}"))
            .filter(|k| map.shard(k.as_str()) == shard)
            .take(n)
            .collect()
    }

    /// Two keys of different shards, the lower shard's first.
    fn two_shards(map: &Map) -> (String, String) {
        let a = keys_in(map, 0, 1).remove(0);
        let b = keys_in(map, SHARDS - 1, 1).remove(0);
        (a, b)
    }

    fn put(map: &Map, key: &str, now: u64, value: Item) -> Result<(), Full> {
        map.lock(map.shard(key), now)
            .insert(key, value, &mut map.room())
    }

    fn get(map: &Map, key: &str, now: u64) -> Option<Item> {
        map.lock(map.shard(key), now).get(key).cloned()
    }

    /// The index position of `key`.
    fn indexed_at(map: &Map, key: &str) -> Option<u64> {
        let table = map.shards[map.shard(key)].table.lock().unwrap();
        table.entries.get(key).map(|e| e.indexed_at)
    }

    fn next_due(map: &Map, key: &str) -> u64 {
        map.shards[map.shard(key)].next_due.load(Ordering::Relaxed)
    }

    #[test]
    fn a_new_key_is_refused_exactly_at_capacity() {
        let map = Map::new(3);
        for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
            assert_eq!(put(&map, key, 0, item(100, i as u32)), Ok(()));
        }
        assert_eq!(put(&map, "d", 0, item(100, 3)), Err(Full));
        assert_eq!(
            {
                map.remove_expired_everywhere(0);
                put(&map, "d", 0, item(100, 3))
            },
            Err(Full)
        );
        assert_eq!(
            get(&map, "d", 0),
            None,
            "nothing of a refused entry is kept"
        );
        // a held key needs no room: it is replaced, with its new expiry
        assert_eq!(put(&map, "b", 0, item(200, 9)), Ok(()));
        assert_eq!(get(&map, "b", 0), Some(item(200, 9)));
        assert_eq!((map.held(), map.live(0)), (3, 3));
        assert_eq!(map.capacity(), 3);
        map.assert_consistent(|_, _, _| {});
    }

    #[test]
    fn a_capacity_of_0_holds_nothing() {
        let map = Map::new(0);
        assert_eq!(put(&map, "a", 0, item(100, 0)), Err(Full));
        // an entry expired already needs no room: it is not kept
        assert_eq!(put(&map, "a", 100, item(100, 0)), Ok(()));
        assert_eq!((map.held(), map.live(0)), (0, 0));
    }

    /// Locking a shard removes its expired entries, exactly those, and gives their room back.
    #[test]
    fn expired_entries_make_room() {
        let map = Map::new(2);
        let keys = keys_in(&map, 5, 3);
        assert_eq!(put(&map, &keys[0], 0, item(10, 0)), Ok(()));
        assert_eq!(put(&map, &keys[1], 0, item(11, 1)), Ok(()));
        assert_eq!(put(&map, &keys[2], 9, item(20, 2)), Err(Full));
        // at 10 the first has expired (an expiry is the first instant without the entry)
        assert_eq!(get(&map, &keys[0], 9), Some(item(10, 0)));
        assert_eq!(put(&map, &keys[2], 10, item(20, 2)), Ok(()));
        assert_eq!(get(&map, &keys[0], 10), None);
        assert_eq!(get(&map, &keys[1], 10), Some(item(11, 1)));
        assert_eq!((map.held(), map.live(10)), (2, 2));
        assert_eq!(map.live(11), 1);
        assert_eq!(map.held(), 1);
        map.assert_consistent(|_, _, _| {});
    }

    /// A full map finds room in the expired entries of other shards only once it looks there.
    #[test]
    fn a_full_map_removes_the_expired_entries_of_every_shard() {
        let map = Map::new(1);
        let (a, b) = two_shards(&map);
        assert_eq!(put(&map, &a, 0, item(10, 0)), Ok(()));
        assert_eq!(next_due(&map, &a), 10);
        // locking b's shard alone leaves a's expired entry counted
        assert_eq!(put(&map, &b, 10, item(20, 1)), Err(Full));
        assert_eq!(map.held(), 1);
        assert_eq!(
            {
                map.remove_expired_everywhere(10);
                put(&map, &b, 10, item(20, 1))
            },
            Ok(())
        );
        assert_eq!(map.held(), 1);
        assert_eq!(next_due(&map, &a), u64::MAX, "a's shard is empty");
        assert_eq!(get(&map, &b, 10), Some(item(20, 1)));
        map.assert_consistent(|_, _, _| {});
    }

    /// An expiry pushed later leaves the index alone until the earlier position comes due; then
    /// the entry is indexed again at its expiry, not removed.
    #[test]
    fn an_entry_whose_expiry_moved_later_survives_its_earlier_due_time() {
        let map = Map::new(10);
        assert_eq!(put(&map, "a", 0, item(10, 0)), Ok(()));
        let pushed = map.lock(map.shard("a"), 5).update("a", |v| {
            v.expires_at = 30;
            v.tag = 1;
            v.tag
        });
        assert_eq!(pushed, Some(1));
        assert_eq!(indexed_at(&map, "a"), Some(10), "not moved on the write");
        assert_eq!(next_due(&map, "a"), 10);
        assert_eq!(get(&map, "a", 10), Some(item(30, 1)));
        assert_eq!(indexed_at(&map, "a"), Some(30), "moved when it came due");
        assert_eq!(next_due(&map, "a"), 30);
        assert_eq!(get(&map, "a", 29), Some(item(30, 1)));
        assert_eq!(get(&map, "a", 30), None);
        assert_eq!(map.held(), 0);
        map.assert_consistent(|_, _, _| {});
    }

    /// A replacement with a later expiry is not re-indexed either; one with an earlier expiry
    /// is, at once.
    #[test]
    fn an_expiry_moved_earlier_is_reindexed_at_once() {
        let map = Map::new(10);
        assert_eq!(put(&map, "a", 0, item(30, 0)), Ok(()));
        assert_eq!(put(&map, "a", 1, item(40, 1)), Ok(()));
        assert_eq!(indexed_at(&map, "a"), Some(30));
        let moved = map
            .lock(map.shard("a"), 2)
            .update("a", |v| v.expires_at = 12);
        assert_eq!(moved, Some(()));
        assert_eq!(indexed_at(&map, "a"), Some(12));
        assert_eq!(next_due(&map, "a"), 12);
        assert_eq!(put(&map, "a", 3, item(11, 2)), Ok(()));
        assert_eq!(indexed_at(&map, "a"), Some(11));
        assert_eq!(get(&map, "a", 10), Some(item(11, 2)));
        assert_eq!(get(&map, "a", 11), None);
        assert_eq!(map.held(), 0);
        map.assert_consistent(|_, _, _| {});
    }

    /// A value left expired by `update` (or replaced by an expired one) is removed at once and
    /// gives its room back; `update` of a key not held does not run `f`.
    #[test]
    fn a_value_left_expired_is_removed_at_once() {
        let map = Map::new(1);
        assert_eq!(put(&map, "a", 0, item(30, 0)), Ok(()));
        let mut locked = map.lock(map.shard("a"), 5);
        assert_eq!(locked.update("a", |v| v.expires_at = 5), Some(()));
        assert!(!locked.contains_key("a"));
        assert_eq!(locked.update("a", |_| unreachable!()), None::<()>);
        drop(locked);
        assert_eq!(map.held(), 0);
        assert_eq!(put(&map, "b", 5, item(30, 1)), Ok(()));
        assert_eq!(put(&map, "b", 6, item(6, 2)), Ok(()));
        assert_eq!((map.held(), get(&map, "b", 6)), (0, None));
        map.assert_consistent(|_, _, _| {});
    }

    #[test]
    fn remove_returns_the_value_and_gives_its_room_back() {
        let map = Map::new(1);
        assert_eq!(put(&map, "a", 0, item(30, 7)), Ok(()));
        let mut locked = map.lock(map.shard("a"), 1);
        assert_eq!(locked.remove("a"), Some(item(30, 7)));
        assert_eq!(locked.remove("a"), None);
        drop(locked);
        assert_eq!(map.held(), 0);
        assert_eq!(next_due(&map, "a"), u64::MAX);
        assert_eq!(put(&map, "b", 1, item(30, 8)), Ok(()));
        map.assert_consistent(|_, _, _| {});
    }

    /// Room is taken all or none; new keys use it, held keys do not, and the rest goes back.
    #[test]
    fn room_is_taken_all_or_none_and_the_unused_rest_given_back() {
        let map = Map::new(3);
        assert_eq!(put(&map, "a", 0, item(30, 0)), Ok(()));
        let mut room = map.room();
        assert_eq!(room.take(3), Err(Full));
        assert_eq!(map.held(), 1, "nothing taken");
        assert_eq!(room.take(2), Ok(()));
        assert_eq!(map.held(), 3);
        assert_eq!(put(&map, "z", 0, item(30, 0)), Err(Full), "taken is taken");
        let mut locked = map.lock(map.shard("b"), 0);
        assert_eq!(locked.insert("b", item(30, 1), &mut room), Ok(()));
        drop(locked);
        let mut locked = map.lock(map.shard("a"), 0);
        assert_eq!(locked.insert("a", item(30, 2), &mut room), Ok(()));
        drop(locked);
        assert_eq!(map.held(), 3);
        drop(room);
        assert_eq!((map.held(), map.live(0)), (2, 2));
        // room exhausted falls back on the map's capacity
        let keys = keys_in(&map, 9, 2);
        let mut room = map.room();
        let mut locked = map.lock(9, 0);
        assert_eq!(locked.insert(&keys[0], item(30, 3), &mut room), Ok(()));
        assert_eq!(locked.insert(&keys[1], item(30, 4), &mut room), Err(Full));
        drop((locked, room));
        assert_eq!(map.held(), 3);
        map.assert_consistent(|_, _, _| {});
    }

    /// `upsert` updates a held key as `update` does, and keeps a new value only if it is live
    /// and there is room for it.
    #[test]
    fn upsert_keeps_a_new_value_only_when_live_and_with_room() {
        let map = Map::new(1);
        let mut locked = map.lock(map.shard("a"), 5);
        let new = |expires_at| move || item(expires_at, 0);
        // left expired: not kept, no room taken
        assert_eq!(locked.upsert("a".into(), new(5), |v| v.tag), Ok(0));
        assert!(!locked.contains_key("a"));
        assert_eq!(locked.upsert("a".into(), new(30), |v| v.tag += 1), Ok(()));
        assert_eq!(locked.get("a"), Some(&item(30, 1)));
        // held: updated, its later expiry left to the index
        assert_eq!(
            locked.upsert("a".into(), new(99), |v| v.expires_at = 40),
            Ok(())
        );
        assert_eq!(locked.get("a"), Some(&item(40, 1)));
        drop(locked);
        assert_eq!(indexed_at(&map, "a"), Some(30));
        assert_eq!(map.held(), 1);
        let mut locked = map.lock(map.shard("b"), 5);
        assert_eq!(locked.upsert("b".into(), new(30), |v| v.tag), Err(Full));
        assert_eq!(
            locked.upsert("b".into(), new(30), |v| v.expires_at = 5),
            Ok(())
        );
        drop(locked);
        // held, moved earlier, then left expired
        let mut locked = map.lock(map.shard("a"), 6);
        assert_eq!(
            locked.upsert("a".into(), new(99), |v| v.expires_at = 20),
            Ok(())
        );
        drop(locked);
        assert_eq!(indexed_at(&map, "a"), Some(20));
        map.assert_consistent(|_, _, _| {});
        let mut locked = map.lock(map.shard("a"), 7);
        assert_eq!(
            locked.upsert("a".into(), new(99), |v| v.expires_at = 7),
            Ok(())
        );
        assert_eq!(locked.get("a"), None);
        drop(locked);
        assert_eq!((map.held(), map.live(7)), (0, 0));
        map.assert_consistent(|_, _, _| {});
    }

    /// Each shard keeps its own side value, for as long as the map.
    #[test]
    fn each_shard_keeps_its_side_value() {
        let map: ExpiringMap<Arc<str>, Item, Vec<u32>> = ExpiringMap::new(1);
        map.lock(3, 0).side().push(7);
        map.lock(4, 0).side().push(8);
        assert_eq!(*map.lock(3, 100).side(), [7]);
        assert_eq!(*map.lock(4, 100).side(), [8]);
        assert!(map.lock(5, 0).side().is_empty());
    }

    #[test]
    fn entries_live_in_their_routed_shard() {
        let map = Map::new(100);
        for i in 0..50u32 {
            let key = format!("k{i}");
            assert_eq!(put(&map, &key, 0, item(u64::MAX, i)), Ok(()));
        }
        let mut seen = 0;
        map.assert_consistent(|shard, key, value| {
            assert_eq!(map.shard(&**key), shard);
            assert_eq!(**key, *format!("k{}", value.tag));
            seen += 1;
        });
        assert_eq!((seen, map.live(u64::MAX - 1)), (50, 50));
    }
}
