//! When a pod tells its peers its state (docs/cluster.md, "Beats"), and what that costs
//! the mesh. Pure: the mesh paces its beats with [`Pacer`], and `denoised bench
//! simulate` counts them with the same pacer over a simulated cluster ([`pushed`]),
//! beside the scheme it replaced ([`polled`]: every pod asked every peer for its whole
//! report each second).
//!
//! A pod looks at its state every [`TICK_S`]. A beat goes to every peer when the state
//! changed (a request came, started or ended; readiness; its templates) and the last
//! beat is at least [`MIN_GAP_S`] old, and otherwise every [`HEARTBEAT_S`] (what the
//! peers' failure detection counts on: down after three heartbeats missed). Its
//! template list travels only in the beat after it changed; a peer that missed that
//! one sees another fingerprint and asks for the whole report.

/// How often a pod looks at its state.
pub const TICK_S: f64 = 0.1;
/// The fewest seconds between two beats: under load a pod's state changes at every
/// step, and its peers need a recent picture, not each change.
pub const MIN_GAP_S: f64 = 0.5;
/// The most seconds between two beats.
pub const HEARTBEAT_S: f64 = 1.0;

/// One pod's beats: whether one is due at each look.
#[derive(Clone, Debug, Default)]
pub struct Pacer {
    last: Option<f64>,
    pending: bool,
}

impl Pacer {
    /// Whether a beat goes out at `now` (seconds, increasing), `changed`: the state
    /// changed since the last look. A change while the last beat is too recent waits
    /// for the gap to pass.
    pub fn due(&mut self, now: f64, changed: bool) -> bool {
        // (Half a tick of slack: the mesh's ticks are late by a scheduler's jitter.)
        let slack = TICK_S / 2.0;
        self.pending |= changed;
        let since = self.last.map_or(f64::INFINITY, |l| now - l);
        let due = since + slack >= HEARTBEAT_S || (self.pending && since + slack >= MIN_GAP_S);
        if due {
            self.last = Some(now);
            self.pending = false;
        }
        due
    }
}

/// The mesh's control traffic, summed over the cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Traffic {
    pub messages_per_s: f64,
    pub bytes_per_s: f64,
}

/// The sizes of what a pod sends (encoded), for [`polled`] and [`pushed`].
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// A report without its template list (load and readiness).
    pub report: f64,
    /// Its template list.
    pub listing: f64,
    /// An ask (a call's envelope, no payload).
    pub ask: f64,
}

/// The scheme beats replaced: every pod asks every peer for its whole report each
/// second; each ask is a message and so is each answer.
pub fn polled(pods: usize, sizes: Sizes) -> Traffic {
    let pairs = (pods * pods.saturating_sub(1)) as f64;
    Traffic {
        messages_per_s: 2.0 * pairs,
        bytes_per_s: pairs * (sizes.ask + sizes.report + sizes.listing),
    }
}

/// Beats over `span` seconds: `load[p]`, the times pod `p`'s load or readiness changed,
/// and `listing[p]`, those its template list changed (each sorted). Each beat goes to
/// every peer; the list only in the first beat after it changed.
pub fn pushed(load: &[Vec<f64>], listing: &[Vec<f64>], span: f64, sizes: Sizes) -> Traffic {
    let pods = load.len();
    let peers = pods.saturating_sub(1) as f64;
    let (mut beats, mut listings) = (0usize, 0usize);
    for (p, changes) in load.iter().enumerate() {
        let listed = listing.get(p).map_or(&[][..], |v| &v[..]);
        let (mut c, mut l) = (0, 0);
        let mut pacer = Pacer::default();
        let mut list_due = false;
        let ticks = (span / TICK_S).ceil() as usize;
        for k in 0..=ticks {
            let now = k as f64 * TICK_S;
            let mut changed = false;
            while c < changes.len() && changes[c] <= now {
                (c, changed) = (c + 1, true);
            }
            while l < listed.len() && listed[l] <= now {
                (l, changed, list_due) = (l + 1, true, true);
            }
            if pacer.due(now, changed) {
                beats += 1;
                listings += usize::from(std::mem::take(&mut list_due));
            }
        }
    }
    let span = span.max(TICK_S);
    Traffic {
        messages_per_s: beats as f64 * peers / span,
        bytes_per_s: (beats as f64 * sizes.report + listings as f64 * sizes.listing) * peers / span,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The pacer against the rules it states, over any changes: beats at least
        /// MIN_GAP_S apart, never more than HEARTBEAT_S (and a tick) apart, and a change
        /// is told within MIN_GAP_S (and a tick).
        #[test]
        fn beats_are_spaced_and_every_change_is_told(changes in proptest::collection::vec(any::<bool>(), 1..300)) {
            let mut pacer = Pacer::default();
            let mut sent = vec![];
            let mut waiting_since: Option<f64> = None;
            for (k, &changed) in changes.iter().enumerate() {
                let now = k as f64 * TICK_S;
                if changed && waiting_since.is_none() {
                    waiting_since = Some(now);
                }
                if pacer.due(now, changed) {
                    sent.push(now);
                    waiting_since = None;
                }
                if let Some(t) = waiting_since {
                    prop_assert!(now - t <= MIN_GAP_S + 1e-9, "a change waited from {t} to {now}");
                }
            }
            prop_assert_eq!(sent.first().copied(), Some(0.0));
            for w in sent.windows(2) {
                let gap = w[1] - w[0];
                prop_assert!(gap >= MIN_GAP_S - TICK_S / 2.0, "{:?}", w);
                prop_assert!(gap <= HEARTBEAT_S + 1e-9, "{:?}", w);
            }
        }
    }

    #[test]
    fn quiet_pods_only_heartbeat_and_busy_ones_beat_at_most_every_gap() {
        let sizes = Sizes {
            report: 100.0,
            listing: 1000.0,
            ask: 10.0,
        };
        let span = 60.0;
        // Two quiet pods: a heartbeat a second each, to one peer.
        let quiet = pushed(&[vec![], vec![]], &[vec![], vec![]], span, sizes);
        assert!((quiet.messages_per_s - 2.0).abs() < 0.1, "{quiet:?}");
        // Changing every tick: a beat every MIN_GAP_S.
        let busy: Vec<f64> = (0..600).map(|k| k as f64 * TICK_S).collect();
        let t = pushed(&[busy.clone(), busy], &[vec![], vec![]], span, sizes);
        assert!((t.messages_per_s - 2.0 / MIN_GAP_S).abs() < 0.1, "{t:?}");
        // A listing changed once: sent once, not with every beat.
        let once = pushed(&[vec![], vec![]], &[vec![10.0], vec![]], span, sizes);
        let extra = once.bytes_per_s - quiet.bytes_per_s;
        assert!(
            (extra - sizes.listing / span).abs() < 1e-6,
            "{once:?} {quiet:?}"
        );
        // Polling: both directions, every report whole.
        let p = polled(64, sizes);
        assert_eq!(p.messages_per_s, 2.0 * 64.0 * 63.0);
        assert_eq!(p.bytes_per_s, 64.0 * 63.0 * 1110.0);
    }
}
