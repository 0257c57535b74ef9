//! A template's identity as the registry keeps it, and the pure rules over it: which
//! version a create or replace takes, whether a delete applies, and what a pod may do
//! with the version it holds. The registry's I/O (`super`) only applies them.

use serde::{Deserialize, Serialize};

/// A template's record in the registry (one key per id). A delete leaves a tombstone
/// (`deleted`, with the version it deleted), so that no copy, replication or recipe
/// brings that version back, and a later create takes a newer one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The template's current version (the deleted one, for a tombstone). Every
    /// change of the id takes a larger one.
    pub version: u64,
    /// Its content digest (`TemplateInfo::digest`).
    pub digest: String,
    #[serde(default)]
    pub deleted: bool,
    /// The pod that made the change, and when (Unix seconds): for operators.
    pub pod: String,
    pub unix: f64,
}

/// Why an identity change is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A create of an id the cluster holds (without `replace`).
    Exists,
    /// A delete of an id the cluster does not hold (never, or deleted).
    Unknown,
}

/// The version a create (or a replace, `replace`) of an id takes, given its record now
/// and the creating pod's clock (microseconds): larger than any the id had, so that a
/// copy's version tells which is newer whatever the pods' clocks.
pub fn new_version(now: Option<&Record>, replace: bool, clock_us: u64) -> Result<u64, Refused> {
    match now {
        Some(r) if !r.deleted && !replace => Err(Refused::Exists),
        Some(r) => Ok(clock_us.max(r.version + 1)),
        None => Ok(clock_us.max(1)),
    }
}

/// The tombstone a delete leaves, given the record now.
pub fn tombstone(now: Option<&Record>, pod: &str, unix: f64) -> Result<Record, Refused> {
    match now {
        Some(r) if !r.deleted => Ok(Record {
            deleted: true,
            pod: pod.to_string(),
            unix,
            ..r.clone()
        }),
        _ => Err(Refused::Unknown),
    }
}

/// Whether the answer to a change must wait out the pods' leases: when it replaces a
/// record, live or a tombstone. Pods serve a live record's version until their leases
/// on it run out; a tombstone's delete may still be waiting out its own, and until it
/// has, pods may still serve the version it deleted. (A create of an id deleted long
/// ago waits too: telling a recent tombstone from an old one would need the pods'
/// clocks to agree, which nothing here assumes.)
pub fn supersedes(before: Option<&Record>) -> bool {
    before.is_some()
}

/// What a pod may do with version `local` of a template, by the template's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// It is the current version: serve it.
    Current,
    /// A newer version exists: this one goes, and an edit needs the newer one.
    Superseded,
    /// The template (this version of it) was deleted: this one goes.
    Deleted,
    /// Newer than the registry's, or unknown to it: a registration that was not
    /// committed (in flight, or cut short by a crash). Not served.
    Uncommitted,
}

pub fn judge(record: Option<&Record>, local: u64) -> Held {
    match record {
        None => Held::Uncommitted,
        Some(r) if r.deleted && local <= r.version => Held::Deleted,
        Some(r) if local < r.version => Held::Superseded,
        Some(r) if local == r.version && !r.deleted => Held::Current,
        Some(_) => Held::Uncommitted,
    }
}

/// The oldest version of the id a pod may keep by `record` (older ones go).
pub fn keep_from(record: &Record) -> u64 {
    match record.deleted {
        true => record.version + 1,
        false => record.version,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rec(version: u64, deleted: bool) -> Record {
        Record {
            version,
            digest: String::new(),
            deleted,
            pod: "a".into(),
            unix: 0.0,
        }
    }

    proptest! {
        /// Brute force over short histories: applying random creates, replaces and
        /// deletes by these rules, the versions of an id only grow, a create of a held
        /// id is refused, and a pod serves exactly the current version.
        #[test]
        fn versions_only_grow_and_only_the_current_one_is_served(
            ops in proptest::collection::vec((0u8..3, 0u64..40), 1..30),
            held in 0u64..60,
        ) {
            let mut now: Option<Record> = None;
            let mut seen: Vec<u64> = vec![];
            for (op, clock) in ops {
                let before = now.clone();
                match op {
                    0 | 1 => match new_version(now.as_ref(), op == 1, clock) {
                        Ok(v) => {
                            prop_assert!(now.as_ref().is_none_or(|r| v > r.version));
                            prop_assert!(op == 1 || now.as_ref().is_none_or(|r| r.deleted));
                            now = Some(rec(v, false));
                        }
                        Err(e) => {
                            prop_assert_eq!(e, Refused::Exists);
                            prop_assert!(op == 0 && now.as_ref().is_some_and(|r| !r.deleted));
                        }
                    },
                    _ => match tombstone(now.as_ref(), "b", 1.0) {
                        Ok(t) => {
                            prop_assert!(supersedes(before.as_ref()));
                            prop_assert_eq!(t.version, before.as_ref().unwrap().version);
                            now = Some(t);
                        }
                        // Nothing live to delete; a change over its tombstone (if
                        // any) still waits.
                        Err(_) => prop_assert_eq!(supersedes(before.as_ref()), before.is_some()),
                    },
                }
                if let Some(r) = &now {
                    if seen.last() != Some(&r.version) {
                        prop_assert!(seen.iter().all(|&s| s < r.version));
                        seen.push(r.version);
                    }
                }
            }
            let verdict = judge(now.as_ref(), held);
            let current = now.as_ref().is_some_and(|r| !r.deleted && r.version == held);
            prop_assert_eq!(verdict == Held::Current, current);
            if let Some(r) = &now {
                // What a pod keeps: the current version and newer (uncommitted) ones.
                prop_assert_eq!(held >= keep_from(r), matches!(verdict, Held::Current | Held::Uncommitted));
            }
        }
    }

    /// The nemesis found it (tests/cluster_nemesis.rs): a replace that followed a delete
    /// still waiting out its lease answered at once, while a pod still served the
    /// deleted version.
    #[test]
    fn a_change_over_a_tombstone_waits_out_the_lease() {
        let t = tombstone(Some(&rec(5, false)), "b", 100.0).unwrap();
        assert!(supersedes(Some(&t)), "the delete may not be answered yet");
        assert!(supersedes(Some(&rec(5, false))));
        assert!(!supersedes(None), "a first create serves nothing older");
    }

    #[test]
    fn a_tombstone_deletes_its_version_and_older_and_a_recreate_is_newer() {
        let t = tombstone(Some(&rec(5, false)), "b", 1.0).unwrap();
        assert_eq!(judge(Some(&t), 5), Held::Deleted);
        assert_eq!(judge(Some(&t), 3), Held::Deleted);
        assert_eq!(tombstone(Some(&t), "b", 2.0), Err(Refused::Unknown));
        assert_eq!(new_version(Some(&t), false, 2), Ok(6));
        assert_eq!(judge(Some(&rec(6, false)), 5), Held::Superseded);
        assert_eq!(judge(None, 5), Held::Uncommitted);
    }
}
