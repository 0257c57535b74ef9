//! The peers' view: copy sources, placement, reports and beats.

use super::*;
use crate::wire::pods::PodTemplate;
use ractor::{Actor, ActorProcessingErr, ActorRef};

struct Nobody;
impl Actor for Nobody {
    type Msg = ();
    type State = ();
    type Arguments = ();
    async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }
}

fn report(pod: &str, started: f64, ready: bool, busy: u32, templates: &[(&str, u64)]) -> PodReport {
    PodReport {
        pod: pod.into(),
        started_unix: started,
        http: String::new(),
        ready,
        in_flight: busy,
        limit: 10,
        templates: templates
            .iter()
            .map(|&(id, disk)| PodTemplate {
                id: id.into(),
                version: 1,
                host_bytes: 1,
                disk_bytes: disk,
                tokens: 16,
                steps: 4,
            })
            .collect(),
        listed: true,
        listing: templates.len() as u64,
        workers: vec![],
        queued: vec![],
        fetching: vec![],
    }
}

fn pods_for_test() -> (Pods, tempfile::TempDir) {
    let m = crate::metrics::router::RouterMetrics::register(
        &mut Default::default(),
        &mut Default::default(),
        Default::default(),
    );
    let d = tempfile::tempdir().unwrap();
    let recipes = Recipes::new(d.path().to_path_buf());
    let pods = Pods::new(
        "me".into(),
        PodPolicy::default(),
        Duration::from_secs(1),
        recipes,
        None,
        m,
        false,
    );
    (pods, d)
}

/// A beat without its template list keeps the list this pod has; one whose list
/// fingerprint is not the list's asks for the whole report (until one comes); a
/// beat from a daemon not asked yet is not placed.
#[tokio::test]
async fn beats_keep_the_template_list_they_omit_and_ask_again_when_one_was_missed() {
    let (cell, _) = Actor::spawn(None, Nobody, ()).await.unwrap();
    let (pods, _d) = pods_for_test();
    let beat = |busy: u32, listing: u64| {
        let mut r = report("a", 1.0, true, busy, &[]);
        (r.listed, r.listing) = (false, listing);
        r
    };
    assert_eq!(pods.beat(beat(0, 1)).map(|b| b.1), None, "not asked yet");
    let heard = pods.reported(cell.get_cell(), report("a", 1.0, true, 0, &[("t", 1)]));
    assert_eq!(
        heard,
        Heard {
            came_up: true,
            stale: false
        }
    );
    // The same list: kept, with the beat's load.
    let (_, heard) = pods.beat(beat(3, 1)).unwrap();
    assert_eq!(heard, Heard::default());
    assert_eq!(pods.holder("t", &[]).as_deref(), Some("a"));
    assert_eq!(pods.status()[0].in_flight, 3);
    // Another list, not sent to this pod: the old one stays until asked.
    assert!(pods.beat(beat(2, 7)).unwrap().1.stale);
    assert!(pods.beat(beat(2, 7)).unwrap().1.stale, "still unknown");
    assert_eq!(pods.holder("t", &[]).as_deref(), Some("a"));
    let mut whole = report("a", 1.0, true, 2, &[("u", 1)]);
    whole.listing = 7;
    assert!(!pods.reported(cell.get_cell(), whole).stale);
    assert!(!pods.beat(beat(2, 7)).unwrap().1.stale);
    assert_eq!(pods.holder("t", &[]), None);
    assert_eq!(pods.holder("u", &[]).as_deref(), Some("a"));
    // A restarted daemon of a is placed only once asked.
    let mut newer = beat(0, 7);
    newer.started_unix = 2.0;
    assert!(pods.beat(newer).is_none());
    assert!(pods.knows(&cell.get_cell()));
    cell.stop(None);
}

#[tokio::test]
async fn a_copy_comes_from_the_least_busy_ready_pod_whose_disk_holds_the_template() {
    let (cell, _) = Actor::spawn(None, Nobody, ()).await.unwrap();
    let (pods, _d) = pods_for_test();
    let c = || cell.get_cell();
    // (Templates by their bytes on disk: 0 while the disk copy is being written.)
    pods.reported(c(), report("a", 1.0, true, 5, &[("t", 1)]));
    pods.reported(c(), report("b", 1.0, true, 0, &[("t", 0)]));
    pods.reported(c(), report("c", 1.0, true, 2, &[("t", 1)]));
    pods.reported(c(), report("d", 1.0, false, 0, &[("t", 1)]));
    // The least busy with a disk copy; not ready is never chosen.
    assert_eq!(pods.holder("t", &[]).as_deref(), Some("c"));
    assert_eq!(pods.holder("t", &["c".into()]).as_deref(), Some("a"));
    assert_eq!(pods.holder("t", &["c".into(), "a".into()]), None);
    assert!(pods.writing("t", &["c".into(), "a".into()]));
    assert!(!pods.writing("t", &["b".into()]));
    assert_eq!(pods.holder("u", &[]), None);
    // An older daemon of b (an orphan draining) does not displace the newer one.
    pods.reported(c(), report("b", 2.0, true, 0, &[("t", 1)]));
    assert!(!pods.reported(c(), report("b", 1.0, false, 0, &[])).came_up);
    assert_eq!(pods.holder("t", &[]).as_deref(), Some("b"));
    let (up, held) = pods.placement(Duration::ZERO);
    assert_eq!(up, ["a", "b", "c"]);
    assert_eq!(held["t"], ["a", "b", "c"]);
    // Within the grace period, d (not ready: restarting) still counts as a holder
    // (no copy is made for it), and b, draining, too; after it, neither does.
    pods.reported(c(), report("b", 2.0, false, 0, &[("t", 1)]));
    let (up, held) = pods.placement(Duration::from_secs(60));
    assert_eq!(up, ["a", "c"]);
    assert_eq!(held["t"], ["a", "b", "c", "d"]);
    let (_, held) = pods.placement(Duration::ZERO);
    assert_eq!(held["t"], ["a", "c"]);
    cell.stop(None);
}
