//! The pod's edge toward its peers (docs/cluster.md), beside the HTTP API and the
//! workers' bus: a second ractor_cluster node on `[cluster] listen` (its cookie shared
//! by the cluster; TLS with the cluster's CA when `tls_*` are set, on this pod's own
//! listener and dialer: [`tls`]), the pod actor its peers call (beats, forwarded edits,
//! copies: each message checked for the pod it comes from, [`admitted`]), a loop that
//! dials the peers (`[cluster] peers`, DNS names re-resolved), one that pushes this
//! pod's beats to them
//! ([`crate::routing::beats`]) and one that marks down those whose beats stop
//! ([`crate::router::state::pods`]).
//!
//! The pod actors are in a process-group scope of their own ([`SCOPE`]). A router's
//! workers stay its own: ractor_cluster tells a node's peers of that node's own actors
//! only, never of the remote ones it knows (tests/serve_cluster.rs checks each pod
//! counts its own workers).

mod tls;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use denoised_runtime::config::ClusterConfig;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use ractor_cluster::node::NodeConnectionMode;
use ractor_cluster::{IncomingEncryptionMode, NodeServer, NodeServerMessage};

use crate::router::flow::edit::{edit_obtained, EditInput};
use crate::router::flow::generate::{generate_here, GenerateInput};
use crate::router::flow::{identity, transfer};
use crate::router::service::{cancel, submit_peer, submit_peer_edit, GenerationReply};
use crate::router::state::jobs::{JobEvent, Previews};
use crate::router::state::sessions::Sessions;
use crate::router::state::{Ctx, Listed};
use crate::routing::beats;
use crate::wire::pods::{Exported, FromPeer, PodJobEvent, PodMsg, PodOrigin, GROUP, SCOPE};
use crate::wire::{JobId, Wire, WireError};

/// How often peers not heard from are asked for their report, peers not connected are
/// dialled, and silent ones are marked down.
const TICK: Duration = Duration::from_secs(1);

/// Joins this pod to its cluster: starts its peer node, its pod actor and the loops.
/// `http` is the address of this pod's HTTP API (in its reports).
pub async fn join(ctx: Arc<Ctx>, http: String) -> Result<(), String> {
    let c = &ctx.config.cluster;
    let listen: SocketAddr = c
        .listen
        .parse()
        .map_err(|e| format!("[cluster] listen: {e}"))?;
    let sessions = match &ctx.pods {
        Some(p) => p.sessions.clone(),
        None => return Err("a pod without its peers' state".into()),
    };
    let tls = match c.tls() {
        true => Some(tls::config(c, &sessions.me)?),
        false => None,
    };
    let advertised = advertised(listen).await;
    let (port, encryption, bind) = match &tls {
        None => (listen.port(), None, listen.ip()),
        // ractor_cluster's own listener cannot be turned off: with TLS it listens on a
        // loopback port no peer dials, behind the same CA check; this pod's own TLS
        // listener ([`tls::serve`]) takes `listen`.
        Some(t) => (
            0,
            Some(IncomingEncryptionMode::Tls(t.acceptor.clone())),
            std::net::Ipv4Addr::LOCALHOST.into(),
        ),
    };
    let server = NodeServer::new(
        port,
        c.cookie.clone(),
        c.pod.clone(),
        // What a peer's session says this pod is: the address its peers dial.
        advertised.ip().to_string(),
        encryption,
        // Pods dial the peers they are given, not their peers' peers.
        Some(NodeConnectionMode::Isolated),
    )
    .with_listen_addr(bind)
    .with_max_inbound_frame_size(crate::wire::pods::MAX_FRAME_BYTES);
    let (node, _) = Actor::spawn(None, server, ())
        .await
        .map_err(|e| format!("cannot start the cluster listener on {listen}: {e}"))?;
    node.cast(NodeServerMessage::SubscribeToEvents {
        id: "refusals".into(),
        subscription: Box::new(Refusals::new(sessions.clone())),
    })
    .map_err(|e| e.to_string())?;
    if let Some(t) = &tls {
        // The name its sessions give: the port its peers dial (after the loopback
        // listener's own change, which its start sent first).
        node.cast(NodeServerMessage::PortChanged {
            port: listen.port(),
        })
        .map_err(|e| e.to_string())?;
        let l = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot start the cluster listener on {listen}: {e}"))?;
        tokio::spawn(tls::serve(
            l,
            t.acceptor.clone(),
            node.clone(),
            sessions.clone(),
        ));
    }
    if let Some(p) = &ctx.pods {
        let _ = p.http.set(http);
    }
    let (pod, _) = Actor::spawn(None, PodActor, ctx.clone())
        .await
        .map_err(|e| e.to_string())?;
    ractor::pg::join_scoped(SCOPE.into(), GROUP.into(), vec![pod.get_cell()]);
    tracing::info!(
        "pod {} listens for its peers on {listen}{}",
        c.pod,
        if tls.is_some() { " (TLS)" } else { "" }
    );
    tokio::spawn(dial(
        node,
        advertised,
        c.peers.clone(),
        tls.map(|t| (t.connector, sessions)),
    ));
    transfer::sweep_staging(&ctx);
    tokio::spawn(identity::tend(ctx.clone()));
    tokio::spawn(beat(ctx.clone()));
    tokio::spawn(watch(ctx));
    Ok(())
}

/// Whether `[cluster] tls_*` (when set) load and the certificate names the pod: checked
/// before the daemon starts any process.
pub fn check_tls(c: &ClusterConfig) -> Result<(), String> {
    match c.tls() {
        true => tls::config(c, &c.pod).map(drop),
        false => Ok(()),
    }
}

/// Tells the sessions' state of each session's node id and end, and logs the sessions
/// with peers that ended before they authenticated: a peer with another cookie (a TLS
/// handshake that fails never becomes a session; the certificate check logs those).
/// Once per address until it authenticates: a refused peer dials again every second.
struct Refusals {
    sessions: Arc<Sessions>,
    authenticated: std::sync::Mutex<HashSet<u64>>,
    said: std::sync::Mutex<HashSet<std::net::IpAddr>>,
}

impl Refusals {
    fn new(sessions: Arc<Sessions>) -> Self {
        Refusals {
            sessions,
            authenticated: Default::default(),
            said: Default::default(),
        }
    }
}

impl ractor_cluster::NodeEventSubscription for Refusals {
    fn node_session_opened(&self, s: ractor_cluster::node::NodeServerSessionInformation) {
        self.sessions.attached(s.node_id, &s.peer_addr);
    }

    fn node_session_authenticated(&self, s: ractor_cluster::node::NodeServerSessionInformation) {
        self.authenticated.lock().unwrap().insert(s.node_id);
        if let Some(a) = tls::peer_addr(&s.peer_addr) {
            self.said.lock().unwrap().remove(&a.ip());
        }
    }

    fn node_session_disconnected(&self, s: ractor_cluster::node::NodeServerSessionInformation) {
        self.sessions.closed(s.node_id);
        if self.authenticated.lock().unwrap().remove(&s.node_id) {
            return;
        }
        let ip = tls::peer_addr(&s.peer_addr).map(|a| a.ip());
        if ip.is_some_and(|ip| !self.said.lock().unwrap().insert(ip)) {
            return;
        }
        match s.is_server {
            true => tracing::warn!(
                "refused the peer at {}: it did not authenticate (another cluster cookie)",
                s.peer_addr
            ),
            false => tracing::warn!(
                "the peer at {} refused this pod (another cluster cookie, or a certificate its CA did not sign)",
                s.peer_addr
            ),
        }
    }
}

/// A peer as configured: where to dial, and the name its certificate carries.
async fn resolve(peers: &[String]) -> Vec<(SocketAddr, String)> {
    let mut out = vec![];
    for p in peers {
        // The configuration was checked at start.
        let Some((hostport, host)) = ClusterConfig::peer(p) else {
            continue;
        };
        match tokio::net::lookup_host(hostport).await {
            Ok(addrs) => out.extend(addrs.map(|a| (a, host.to_string()))),
            Err(e) => tracing::debug!("peer {p}: {e}"),
        }
    }
    out
}

/// The address this pod's peers reach it at: its listen address, or, listening on
/// every interface (a Kubernetes pod), the first address its host name resolves to.
async fn advertised(listen: SocketAddr) -> SocketAddr {
    if !listen.ip().is_unspecified() {
        return listen;
    }
    let host = format!("{}:{}", crate::node::host_name(), listen.port());
    let found = match tokio::net::lookup_host(host).await {
        Ok(mut a) => a.find(|a| !a.ip().is_loopback()),
        Err(_) => None,
    };
    found.unwrap_or(listen)
}

/// Dials every peer this pod has no session with, forever (a peer that restarts is
/// dialled again). A session in either direction counts: ractor_cluster keeps one
/// between two nodes, and it names the address its peer advertises. This pod's own
/// address (a headless service lists every pod, this one too) is not dialled.
async fn dial(
    node: ActorRef<NodeServerMessage>,
    me: SocketAddr,
    peers: Vec<String>,
    tls: Option<(tokio_rustls::TlsConnector, Arc<Sessions>)>,
) {
    let mut failing: HashSet<SocketAddr> = HashSet::new();
    loop {
        let sessions =
            ractor::call_t!(node, NodeServerMessage::GetSessions, 1000).unwrap_or_default();
        let connected: HashSet<SocketAddr> = sessions
            .values()
            .filter_map(|s| s.peer_name.as_ref()?.connection_string.parse().ok())
            .collect();
        for (addr, host) in resolve(&peers).await {
            if addr == me || connected.contains(&addr) {
                continue;
            }
            let r = match &tls {
                None => tokio::time::timeout(TICK * 2, ractor_cluster::client_connect(&node, addr))
                    .await
                    .map(|r| r.map_err(|e| e.to_string())),
                Some((c, sessions)) => {
                    let name = match rustls::pki_types::ServerName::try_from(host.clone()) {
                        Ok(n) => n,
                        Err(e) => {
                            tracing::warn!("peer {host}: not a name a certificate can carry: {e}");
                            continue;
                        }
                    };
                    tokio::time::timeout(TICK * 2, tls::connect(&node, addr, c, name, sessions))
                        .await
                }
            };
            match r {
                Ok(Ok(())) => {
                    failing.remove(&addr);
                    tracing::debug!("dialled the peer at {addr}");
                }
                // Said once per outage: a peer that is down is dialled every second.
                Ok(Err(e)) if failing.insert(addr) => {
                    tracing::warn!("cannot connect to the peer at {addr}: {e}")
                }
                Err(_) if failing.insert(addr) => {
                    tracing::warn!("cannot connect to the peer at {addr}: no answer")
                }
                _ => {}
            }
        }
        tokio::time::sleep(TICK).await;
    }
}

/// Each [`TICK`]: asks for its report each peer's pod actor this pod has not heard
/// from (a pod that joined or restarted: after that its beats come by themselves),
/// marks down the peers silent for `DOWN_AFTER`, and tends replication and recipes.
async fn watch(ctx: Arc<Ctx>) {
    let Some(pods) = &ctx.pods else { return };
    let learning = Arc::new(tokio::sync::Mutex::new(()));
    loop {
        tokio::time::sleep(TICK).await;
        tokio::spawn(transfer::tend(ctx.clone(), learning.clone()));
        let unknown: Vec<_> = ractor::pg::get_scoped_members(&SCOPE.into(), &GROUP.into())
            .into_iter()
            .filter(|c| !c.get_id().is_local() && !crate::fault::cut() && !pods.knows(c))
            .collect();
        let asks = unknown.into_iter().map(|cell| async move {
            let r = pods
                .sessions
                .ask(&cell, TICK, |p| PodMsg::Report(FromPeer::of(()), p))
                .await;
            (cell, r)
        });
        for (cell, r) in futures_util::future::join_all(asks).await {
            match r {
                Ok(report) if report.pod != pods.me => {
                    let name = report.pod.clone();
                    if pods.reported(cell, report).came_up {
                        tracing::info!("pod {name} is up");
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("a peer did not report: {e}"),
            }
        }
        for name in pods.sweep() {
            tracing::warn!(
                "pod {name} stopped answering for {} s: marked down",
                crate::router::state::pods::DOWN_AFTER.as_secs()
            );
        }
    }
}

/// Pushes this pod's report to every peer as beats, paced by [`beats::Pacer`]: looked
/// at each `TICK_S`, sent when its load, readiness or templates changed (and the last
/// beat is old enough) or as a heartbeat. Its template list goes only in the beat
/// after it changed.
async fn beat(ctx: Arc<Ctx>) {
    let Some(pods) = &ctx.pods else { return };
    let start = std::time::Instant::now();
    let mut pacer = beats::Pacer::default();
    let (mut load, mut sent_listing) = (None, None);
    loop {
        tokio::time::sleep(Duration::from_secs_f64(beats::TICK_S)).await;
        if crate::fault::cut() {
            continue;
        }
        let now = Some(load_signature(&ctx.pod_report(Listed::Omitted).await));
        let touched = pods.take_touched();
        let changed = touched || now != load;
        load = now;
        if !pacer.due(start.elapsed().as_secs_f64(), changed) {
            continue;
        }
        let mut report = ctx.pod_report(Listed::All).await;
        if sent_listing == Some(report.listing) {
            report.templates.clear();
            report.listed = false;
        } else if report.listed {
            sent_listing = Some(report.listing);
        }
        for cell in ractor::pg::get_scoped_members(&SCOPE.into(), &GROUP.into()) {
            if !cell.get_id().is_local() {
                pods.sessions
                    .tell(&cell, PodMsg::Beat(FromPeer::of(report.clone())));
            }
        }
    }
}

/// What of a pod's report counts as a change worth a beat: its readiness, its
/// requests (how many, where) and the templates it brings in, not the steps its
/// running requests have left (which move at every step, as its peers expect).
fn load_signature(r: &crate::wire::pods::PodReport) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    (r.ready, r.in_flight, r.limit, r.queued.len(), &r.fetching).hash(&mut h);
    for w in &r.workers {
        w.running.len().hash(&mut h);
    }
    h.finish()
}

/// The actor this pod's peers call.
struct PodActor;

impl Actor for PodActor {
    type Msg = PodMsg;
    type State = (Arc<Ctx>, Arc<transfer::Outgoing>);
    type Arguments = Arc<Ctx>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        ctx: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok((ctx, Default::default()))
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: PodMsg,
        (ctx, out): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Cut off its peers (a fault injected): their calls go unanswered (an ask
        // fails when its reply port drops).
        if crate::fault::cut() {
            return Ok(());
        }
        if let Some(pods) = &ctx.pods {
            if let Err(e) = admitted(&pods.sessions, &msg) {
                msg.refuse(e);
                return Ok(());
            }
        }
        // Each answer is made on its own task: a slow cache listing or an edit never
        // holds up the next peer's call.
        match msg {
            PodMsg::Report(_, reply) => {
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    let _ = reply.send(Wire(Ok(ctx.pod_report(Listed::All).await)));
                });
            }
            PodMsg::Edit(
                FromPeer {
                    body: Ok(mut e), ..
                },
                reply,
            ) => {
                ctx.metrics.pod_forwarded_in.inc();
                let origin = e.origin.take();
                let input = EditInput::from_pod(e);
                submit_peer_edit(
                    ctx,
                    input.finish.format,
                    previews_of(&origin),
                    move |ctx, job| async move {
                        relay_from(&ctx, job, origin);
                        // Run here: a forwarded request is never forwarded again.
                        edit_obtained(&ctx, job, &input).await
                    },
                    move |r| {
                        let _ = reply.send(Wire(r.and_then(|(_, o)| fitting(o))));
                    },
                );
            }
            PodMsg::Generate(
                FromPeer {
                    body: Ok(mut g), ..
                },
                reply,
            ) => {
                ctx.metrics.pod_forwarded_in.inc();
                let origin = g.origin.take();
                let format = g.format;
                let input = GenerateInput::from_pod(g);
                submit_peer(
                    ctx,
                    ("generation", previews_of(&origin)),
                    move |ctx, job| async move {
                        relay_from(&ctx, job, origin);
                        generate_here(&ctx, job, &input).await
                    },
                    move |job, o| GenerationReply::new(job, o, format, false),
                    move |r| {
                        let _ = reply.send(Wire(r.and_then(|(_, o)| fitting(o))));
                    },
                );
            }
            PodMsg::Export(FromPeer { body: Ok(id), .. }, reply) => {
                let _ = reply.send(Wire(out.export(ctx, &id)));
            }
            PodMsg::Open(
                FromPeer {
                    body: Ok(request), ..
                },
                reply,
            ) => {
                let _ = reply.send(Wire(out.open(ctx, request)));
            }
            PodMsg::Next(FromPeer { body: Ok(id), .. }, reply) => {
                let out = out.clone();
                tokio::spawn(async move {
                    let _ = reply.send(Wire(out.next(id).await));
                });
            }
            PodMsg::Close(FromPeer { body: Ok(id), .. }) => out.close(id),
            PodMsg::Cancel(FromPeer {
                body: Ok(origin), ..
            }) => {
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    let job = ctx.pods.as_ref().and_then(|p| p.relayed(&origin));
                    if let Some(job) = job {
                        cancel(&ctx, job).await;
                    }
                });
            }
            PodMsg::Beat(FromPeer {
                body: Ok(report), ..
            }) => {
                let ctx = ctx.clone();
                tokio::spawn(async move { beaten(&ctx, report).await });
            }
            PodMsg::Recipe(FromPeer { body: Ok(id), .. }, reply) => {
                let kept = ctx.pods.as_ref().and_then(|p| p.recipes.stored(&id));
                let _ = reply.send(Wire(match kept {
                    Some((info, image)) => recipe(&id, info, image),
                    None => out.export(ctx, &id),
                }));
            }
            PodMsg::Forget(FromPeer { body: Ok(id), .. }) => {
                let ctx = ctx.clone();
                tokio::spawn(async move { identity::deleted_at_peer(&ctx, &id).await });
            }
            PodMsg::Event(FromPeer {
                body: Ok((job, event)),
                ..
            }) => {
                let events = &ctx.metrics.pod_events;
                events.get_or_create(&[("direction", "in")]).inc();
                match event {
                    // Its end comes with the edit's answer.
                    PodJobEvent::Status(s) if s.is_final() => {}
                    PodJobEvent::Status(s) => ctx.jobs.stage(job, s, None),
                    PodJobEvent::Step { step, steps } => {
                        ctx.jobs.steps(job, steps);
                        ctx.jobs.progress(job, step);
                    }
                    PodJobEvent::Preview { step, jpeg } => ctx.jobs.preview(job, step, jpeg),
                }
            }
            // Refused above.
            _ => {}
        }
        Ok(())
    }
}

/// A peer's beat: its report, taken as an answer to an ask would be; a peer that
/// sent a beat this pod cannot place (its list changed in a beat missed) is asked for
/// its whole report.
async fn beaten(ctx: &Ctx, report: crate::wire::pods::PodReport) {
    let Some(pods) = &ctx.pods else { return };
    if report.pod == pods.me {
        return;
    }
    let name = report.pod.clone();
    let Some((cell, heard)) = pods.beat(report) else {
        return;
    };
    if heard.came_up {
        tracing::info!("pod {name} is up");
    }
    if heard.stale {
        pods.refresh(&name, cell).await;
    }
}

/// A kept recipe as a peer is sent it (its version's name from its description).
fn recipe(id: &str, info: Vec<u8>, image: Vec<u8>) -> Result<Exported, WireError> {
    let stored = crate::workers::cache::disk::stored_info(&info).map_err(WireError::internal)?;
    Ok(Exported {
        name: crate::wire::version_name(id, stored.version),
        info,
        image,
    })
}

/// A forwarded request's result, or the error that it cannot travel back in one frame
/// (a reply over the peer's frame limit would close the session).
fn fitting<T: serde::Serialize>(o: T) -> Result<T, WireError> {
    crate::wire::pods::fits_a_frame(&o)
        .map(|()| o)
        .map_err(|n| {
            WireError::new(
                crate::wire::ErrorKind::TooLarge,
                format!("the result ({n} bytes) is too large to return between pods"),
            )
        })
}

/// Whether a peer's message is taken: it decoded (a pod of another version may send
/// one that does not), it comes from the pod it names (with TLS: that pod's
/// certificate; router/state/sessions.rs), and the pod its content names (a forwarded
/// request's origin, a cancel's, a beat's report) is that one.
fn admitted(sessions: &Sessions, msg: &PodMsg) -> Result<(), WireError> {
    if let Some(e) = msg.undecodable() {
        let m = format!(
            "pod message {} does not decode here: {e} (a pod of another version?)",
            msg.kind()
        );
        tracing::warn!("{m}");
        return Err(WireError::bad_input(m));
    }
    let from = msg.stamp().from;
    sessions
        .check(msg.stamp())
        .map_err(|e| WireError::new(crate::wire::ErrorKind::Conflict, e))?;
    let named = match msg {
        PodMsg::Edit(m, _) => m.body.as_ref().ok().and_then(|e| e.origin.as_ref()),
        PodMsg::Generate(m, _) => m.body.as_ref().ok().and_then(|g| g.origin.as_ref()),
        _ => None,
    }
    .map(|o| o.pod.as_str())
    .or(match msg {
        PodMsg::Cancel(m) => m.body.as_ref().ok().map(|(pod, _)| pod.as_str()),
        PodMsg::Beat(m) => m.body.as_ref().ok().map(|r| r.pod.as_str()),
        _ => None,
    });
    match named {
        Some(pod) if pod != from => {
            let m = format!(
                "pod message {} names pod {pod:?} but comes from pod {from:?}: refused",
                msg.kind()
            );
            tracing::warn!("{m}");
            Err(WireError::new(crate::wire::ErrorKind::Conflict, m))
        }
        _ => Ok(()),
    }
}

/// The previews a forwarded request's origin asked for.
fn previews_of(origin: &Option<PodOrigin>) -> Previews {
    origin.as_ref().map(|o| o.previews).unwrap_or_default()
}

/// Starts telling a forwarded request's origin (if it gave one) job `job`'s events
/// ([`relay`]). The origin is known before any await: a cancel may follow at once.
fn relay_from(ctx: &Arc<Ctx>, job: JobId, origin: Option<PodOrigin>) {
    if let (Some(o), Some(pods)) = (origin, &ctx.pods) {
        pods.relaying((o.pod.clone(), o.job), Some(job));
        tokio::spawn(relay(ctx.clone(), job, o));
    }
}

/// Tells the pod a forwarded edit came from its job's events (status, steps, previews)
/// as this pod's job `job` running it has them, until it ends, and then forgets the
/// edit's origin (which a cancel from that pod looks up meanwhile). Casts: an event
/// lost with a connection is a step its watcher does not see; the edit's answer still
/// comes back.
async fn relay(ctx: Arc<Ctx>, job: JobId, origin: PodOrigin) {
    let Some(pods) = &ctx.pods else { return };
    let key = (origin.pod.clone(), origin.job);
    let watched = ctx.jobs.watch(job).await.and_then(|w| w.events);
    let (Some(mut events), Some(cell)) = (watched, pods.cell(&origin.pod)) else {
        pods.relaying(key, None);
        return;
    };
    while let Some(e) = events.recv().await {
        let event = match e {
            JobEvent::Status(s, _) => PodJobEvent::Status(s),
            JobEvent::Step { step, steps, .. } => PodJobEvent::Step { step, steps },
            JobEvent::Preview { step, jpeg, .. } => PodJobEvent::Preview {
                step,
                jpeg: jpeg.to_vec(),
            },
        };
        pods.sessions
            .tell(&cell, PodMsg::Event(FromPeer::of((origin.job, event))));
        let events = &ctx.metrics.pod_events;
        events.get_or_create(&[("direction", "out")]).inc();
    }
    pods.relaying(key, None);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn peers_resolve_by_address_and_by_dns_name() {
        let got = resolve(&["127.0.0.3:7450".into(), "dns:localhost:7451".into()]).await;
        assert!(got.contains(&("127.0.0.3:7450".parse().unwrap(), "127.0.0.3".into())));
        assert!(got
            .iter()
            .any(|(a, h)| a.port() == 7451 && a.ip().is_loopback() && h == "localhost"));
    }
}
