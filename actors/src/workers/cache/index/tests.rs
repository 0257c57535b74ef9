//! The index's eviction choices against a brute-force reference that keeps every
//! version in a list with its last use and scans it.

use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
enum Op {
    Insert { id: u8, host: u64 },
    Touch(u8),
    Pin(u8),
    Unpin(u8),
    Written(u8, u64),
    Evicted(u8),
    Loading(u8, bool),
    Retire(u8),
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u8..6;
    prop_oneof![
        (id.clone(), 1u64..100).prop_map(|(id, host)| Op::Insert { id, host }),
        id.clone().prop_map(Op::Touch),
        id.clone().prop_map(Op::Pin),
        id.clone().prop_map(Op::Unpin),
        (id.clone(), 1u64..100).prop_map(|(v, b)| Op::Written(v, b)),
        id.clone().prop_map(Op::Evicted),
        (id.clone(), any::<bool>()).prop_map(|(v, b)| Op::Loading(v, b)),
        id.clone().prop_map(Op::Retire),
        id.prop_map(Op::Remove),
    ]
}

/// The reference: versions in a list, each with its last use.
#[derive(Clone, Debug)]
struct Ref {
    version: u64,
    id: String,
    host: u64,
    disk: Disk,
    pins: u32,
    loading: bool,
    current: bool,
    used: u64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn evictions_equal_the_reference(ops in prop::collection::vec(op(), 1..60), cap in 0u64..300) {
        let mut idx = Index::default();
        let mut r: Vec<Ref> = Vec::new();
        let mut clock = 0u64;
        let mut next_version = 1u64;
        // Ops name a version by its position among the live ones.
        let pick = |r: &Vec<Ref>, i: u8| -> Option<u64> {
            (!r.is_empty()).then(|| r[i as usize % r.len()].version)
        };
        for op in ops {
            match op {
                Op::Insert { id, host } => {
                    let (v, id) = (next_version, format!("t{id}"));
                    next_version += 1;
                    idx.insert(v, &id, host, Disk::Writing);
                    for x in r.iter_mut().filter(|x| x.id == id) {
                        x.current = false;
                    }
                    clock += 1;
                    r.push(Ref { version: v, id, host, disk: Disk::Writing, pins: 0, loading: false, current: true, used: clock });
                }
                Op::Touch(i) => if let Some(v) = pick(&r, i) {
                    idx.touch(v);
                    clock += 1;
                    r.iter_mut().find(|x| x.version == v).unwrap().used = clock;
                },
                Op::Pin(i) => if let Some(v) = pick(&r, i) {
                    idx.get_mut(v).unwrap().pins += 1;
                    r.iter_mut().find(|x| x.version == v).unwrap().pins += 1;
                },
                Op::Unpin(i) => if let Some(v) = pick(&r, i) {
                    let s = idx.get_mut(v).unwrap();
                    s.pins = s.pins.saturating_sub(1);
                    let x = r.iter_mut().find(|x| x.version == v).unwrap();
                    x.pins = x.pins.saturating_sub(1);
                },
                Op::Written(i, b) => if let Some(v) = pick(&r, i) {
                    idx.get_mut(v).unwrap().disk = Disk::Stored(b);
                    r.iter_mut().find(|x| x.version == v).unwrap().disk = Disk::Stored(b);
                },
                Op::Evicted(i) => if let Some(v) = pick(&r, i) {
                    idx.get_mut(v).unwrap().host = 0;
                    r.iter_mut().find(|x| x.version == v).unwrap().host = 0;
                },
                Op::Loading(i, on) => if let Some(v) = pick(&r, i) {
                    idx.get_mut(v).unwrap().loading = on;
                    r.iter_mut().find(|x| x.version == v).unwrap().loading = on;
                },
                Op::Retire(i) => if let Some(v) = pick(&r, i) {
                    let id = r.iter().find(|x| x.version == v).unwrap().id.clone();
                    let cur = r.iter().find(|x| x.id == id && x.current).map(|x| x.version);
                    prop_assert_eq!(idx.retire(&id), cur);
                    for x in r.iter_mut().filter(|x| x.id == id) {
                        x.current = false;
                    }
                },
                Op::Remove(i) => if let Some(v) = pick(&r, i) {
                    prop_assert!(idx.remove(v).is_some());
                    r.retain(|x| x.version != v);
                },
            }
            // Host victims: on disk, unpinned, not loading, with a host copy; LRU first.
            let mut want: Vec<&Ref> = r.iter()
                .filter(|x| x.host > 0 && matches!(x.disk, Disk::Stored(_)) && x.pins == 0 && !x.loading)
                .collect();
            want.sort_by_key(|x| x.used);
            let want: Vec<u64> = want.iter().map(|x| x.version).collect();
            prop_assert_eq!(idx.host_victims(), want);
            // Disk victims: LRU-first unpinned, not loading, until under capacity.
            let stored = |x: &Ref| match x.disk { Disk::Stored(b) => b, _ => 0 };
            let total: u64 = r.iter().map(stored).sum();
            prop_assert_eq!(idx.disk_bytes(), total);
            prop_assert_eq!(idx.host_bytes(), r.iter().map(|x| x.host).sum::<u64>());
            let mut by_use: Vec<&Ref> = r.iter().collect();
            by_use.sort_by_key(|x| x.used);
            let mut over = total.saturating_sub(cap);
            let mut dropped = Vec::new();
            for x in by_use {
                if over == 0 { break; }
                if let (Disk::Stored(b), 0, false) = (x.disk, x.pins, x.loading) {
                    dropped.push(x.version);
                    over = over.saturating_sub(b);
                }
            }
            prop_assert_eq!(idx.disk_victims(cap), dropped);
            // Unreachable: not current, unpinned, not loading.
            let mut gone: Vec<u64> = r.iter().filter(|x| !x.current && x.pins == 0 && !x.loading).map(|x| x.version).collect();
            gone.sort();
            prop_assert_eq!(idx.unreachable(), gone);
            // The current version of every id.
            for x in &r {
                if x.current {
                    prop_assert_eq!(idx.version_of(&x.id), Some(x.version));
                }
            }
        }
    }
}

#[test]
fn pinned_and_unwritten_templates_stay() {
    let mut idx = Index::default();
    idx.insert(1, "a", 10, Disk::Stored(10));
    idx.insert(2, "b", 10, Disk::Writing);
    idx.insert(3, "c", 10, Disk::Stored(10));
    idx.get_mut(3).unwrap().pins = 1;
    // Only `a` may leave memory: `b` is not on disk yet, `c` is read by an edit.
    assert_eq!(idx.host_victims(), [1]);
    // Using `a` does not change that it is the only candidate; disk pressure drops
    // the least recently used unpinned template first.
    idx.insert(4, "d", 0, Disk::Stored(30));
    idx.touch(1);
    assert_eq!(idx.disk_victims(45), [4]);
    assert_eq!(idx.disk_victims(0), [4, 1]);
}
