//! Which uploaded images become templates by themselves (`[templates] auto`;
//! docs/api.md, "Templates that make themselves"): an image is captured when it is seen
//! `admit_after` times within `window` seconds of the first of those sightings, so one
//! that is edited once never costs a capture nor takes room in the template tiers (the
//! doorkeeper of TinyLFU's admission, counting exactly). The sightings table is bounded:
//! past `capacity` images the one seen least recently is forgotten, which can only
//! delay an admission, never make one. Pure: the router holds it under a mutex and
//! gives it the time.

use std::collections::{BTreeMap, HashMap};

/// A digest of an image with what its template depends on (model, size, steps).
pub type Key = [u8; 32];

pub struct Sightings {
    admit_after: u32,
    window: f64,
    capacity: usize,
    /// Key → (sightings in its run, when its run began, its last sighting's tick).
    seen: HashMap<Key, (u32, f64, u64)>,
    /// Last sighting's tick → key: who is forgotten first.
    order: BTreeMap<u64, Key>,
    tick: u64,
}

impl Sightings {
    pub fn new(admit_after: u32, window: f64, capacity: usize) -> Self {
        Sightings {
            admit_after: admit_after.max(1),
            window,
            capacity: capacity.max(1),
            seen: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Counts a sighting of `key` at time `now` (seconds, not decreasing); whether it
    /// is admitted now (its count starts again after an admission).
    pub fn see(&mut self, key: Key, now: f64) -> bool {
        self.tick += 1;
        let (mut count, mut since) = match self.seen.remove(&key) {
            Some((c, s, t)) => {
                self.order.remove(&t);
                (c, s)
            }
            None => (0, now),
        };
        if now - since > self.window {
            (count, since) = (0, now);
        }
        count += 1;
        if count >= self.admit_after {
            return true;
        }
        while self.seen.len() >= self.capacity {
            let Some((_, old)) = self.order.pop_first() else {
                break;
            };
            self.seen.remove(&old);
        }
        self.seen.insert(key, (count, since, self.tick));
        self.order.insert(self.tick, key);
        false
    }

    /// How many images it counts now.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rule without bounds, replayed over the whole history for each sighting:
    /// a key's run begins at its first sighting after its last admission (or after its
    /// run's window passed), and the `admit_after`-th sighting of a run is admitted.
    fn brute(history: &[(u8, f64)], admit_after: u32, window: f64) -> Vec<bool> {
        let mut out = vec![];
        for (i, &(k, _)) in history.iter().enumerate() {
            let (mut count, mut since, mut admitted) = (0u32, 0.0, false);
            for &(_, t) in history[..=i].iter().filter(|(k2, _)| *k2 == k) {
                if count > 0 && t - since > window {
                    count = 0;
                }
                if count == 0 {
                    since = t;
                }
                count += 1;
                admitted = count >= admit_after;
                if admitted {
                    count = 0;
                }
            }
            out.push(admitted);
        }
        out
    }

    fn key(k: u8) -> Key {
        [k; 32]
    }

    fn histories() -> impl Strategy<Value = Vec<(u8, f64)>> {
        prop::collection::vec((0u8..6, 0.0f64..3.0), 0..60).prop_map(|v| {
            let mut now = 0.0;
            v.into_iter()
                .map(|(k, dt)| {
                    now += dt;
                    (k, now)
                })
                .collect()
        })
    }

    proptest! {
        /// With room for every key, it admits exactly as the unbounded rule does.
        #[test]
        fn admits_as_the_rule_does(h in histories(), admit_after in 1u32..4, window in 0.5f64..8.0) {
            let mut s = Sightings::new(admit_after, window, 6);
            let got: Vec<bool> = h.iter().map(|&(k, t)| s.see(key(k), t)).collect();
            prop_assert_eq!(got, brute(&h, admit_after, window));
        }

        /// Bounded below the keys it sees, it forgets, which only delays: it holds no
        /// more than its capacity, and admits an image only when that image was seen
        /// `admit_after` times since its last admission, within a window.
        #[test]
        fn a_small_table_only_delays(h in histories(), admit_after in 2u32..4, window in 0.5f64..8.0, cap in 1usize..4) {
            let mut s = Sightings::new(admit_after, window, cap);
            let mut last: HashMap<u8, usize> = HashMap::new();
            for (i, &(k, t)) in h.iter().enumerate() {
                let admitted = s.see(key(k), t);
                prop_assert!(s.len() <= cap);
                if admitted {
                    let from = last.get(&k).map_or(0, |j| j + 1);
                    let seen = h[from..=i].iter().filter(|&&(k2, t2)| k2 == k && t - t2 <= window).count();
                    prop_assert!(seen >= admit_after as usize, "admitted {i} after {seen} sightings");
                    last.insert(k, i);
                }
            }
        }
    }

    /// One-off images never get in, and a flood of them does not stop an image seen
    /// again from getting in when the table has room for it.
    #[test]
    fn one_off_images_are_never_admitted() {
        let mut s = Sightings::new(2, 60.0, 4);
        for k in 0..200u8 {
            assert!(!s.see(key(k), f64::from(k)));
        }
        assert!(s.len() <= 4);
        assert!(!s.see(key(250), 300.0));
        assert!(s.see(key(250), 301.0));
        // Its count starts again.
        assert!(!s.see(key(250), 302.0));
        // Past the window, a sighting begins a new run.
        assert!(!s.see(key(251), 400.0));
        assert!(!s.see(key(251), 461.0));
        assert!(s.see(key(251), 462.0));
    }
}
