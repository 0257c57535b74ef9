//! This pod's sessions with its peers, as TLS opened them (router/mesh/tls.rs): for
//! each, the certificate its peer presented and the key both ends derived from the
//! handshake. Every message to a peer leaves through here, sealed for the session it
//! travels on ([`Sessions::tell`], [`Sessions::ask`], [`Sessions::call`]); every message
//! from a peer is checked here ([`Sessions::check`]): a pod's name comes from its
//! certificate, not from what it says (wire/from_peer.rs says how).
//!
//! Without TLS, messages go unsealed and every name is taken as said.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use ractor::{ActorCell, ActorId, RpcReplyPort};
use rustls::pki_types::{CertificateDer, ServerName};

use crate::node;
use crate::wire::pods::{PodMsg, SessionKey, Stamp};
use crate::wire::{Res, WireError};

pub struct Sessions {
    /// This pod's name, which its messages carry.
    pub me: String,
    tls: bool,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Sessions TLS opened, by the label the mesh gave ractor_cluster's session, until
    /// that session is known by its node id.
    opening: HashMap<String, Session>,
    /// By ractor_cluster's node id (a remote actor's id names it).
    live: HashMap<u64, Session>,
    /// The sessions whose certificates were found to name each pod (a cache).
    named: HashMap<String, Vec<u64>>,
    /// The names refused, logged once each.
    said: HashSet<String>,
}

#[derive(Clone)]
pub struct Session {
    pub cert: CertificateDer<'static>,
    pub key: SessionKey,
}

/// Whether `cert` names pod `name`: is valid for it as a DNS name, by webpki's rules
/// (its subject alternative names, wildcards included).
pub fn names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let (Ok(ee), Ok(sn)) = (
        webpki::EndEntityCert::try_from(cert),
        ServerName::try_from(name),
    ) else {
        return false;
    };
    ee.verify_is_valid_for_subject_name(&sn).is_ok()
}

fn node_of(cell: &ActorCell) -> Option<u64> {
    match cell.get_id() {
        ActorId::Remote { node_id, .. } => Some(node_id),
        ActorId::Local(_) => None,
    }
}

impl Sessions {
    pub fn new(me: String, tls: bool) -> Self {
        Sessions {
            me,
            tls,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// TLS opened a session, which ractor_cluster will know by `label`.
    pub fn opened(&self, label: String, session: Session) {
        self.inner().opening.insert(label, session);
    }

    /// ractor_cluster's session `label` is node `node`.
    pub fn attached(&self, node: u64, label: &str) {
        let mut i = self.inner();
        if let Some(s) = i.opening.remove(label) {
            i.live.insert(node, s);
        }
    }

    /// Node `node`'s session ended.
    pub fn closed(&self, node: u64) {
        let mut i = self.inner();
        i.live.remove(&node);
        for nodes in i.named.values_mut() {
            nodes.retain(|n| *n != node);
        }
        i.named.retain(|_, nodes| !nodes.is_empty());
    }

    /// `msg`, sealed as this pod's for the session to `to` (unsealed without TLS, or
    /// when that session is gone: the receiver then refuses it).
    fn sealed(&self, to: &ActorCell, mut msg: PodMsg) -> PodMsg {
        let key = match self.tls {
            true => node_of(to).and_then(|n| Some(self.inner().live.get(&n)?.key)),
            false => None,
        };
        msg.seal(&self.me, key.as_ref());
        msg
    }

    /// Casts `msg` to a peer's pod actor.
    pub fn tell(&self, to: &ActorCell, msg: PodMsg) {
        node::tell(to, self.sealed(to, msg));
    }

    /// Calls a peer's pod actor ([`node::ask`]).
    pub async fn ask<T: Send + 'static>(
        &self,
        to: &ActorCell,
        timeout: Duration,
        build: impl FnOnce(RpcReplyPort<Res<T>>) -> PodMsg,
    ) -> Result<T, WireError> {
        node::ask(to, timeout, |p| self.sealed(to, build(p))).await
    }

    /// Calls a peer's pod actor, telling the call's own failure ([`node::call`]).
    pub async fn call<T: Send + 'static>(
        &self,
        to: &ActorCell,
        timeout: Duration,
        build: impl FnOnce(RpcReplyPort<Res<T>>) -> PodMsg,
    ) -> Result<Result<T, WireError>, WireError> {
        node::call(to, timeout, |p| self.sealed(to, build(p))).await
    }

    /// Whether a message comes from the pod it names: sealed by the key of a session
    /// whose certificate names that pod. Always, without TLS.
    pub fn check(&self, stamp: Stamp<'_>) -> Result<(), String> {
        if !self.tls {
            return Ok(());
        }
        let from = stamp.from;
        let mut i = self.inner();
        let known = i.named.get(from).cloned().unwrap_or_default();
        let by = |n: &u64| i.live.get(n).is_some_and(|s| stamp.sealed_by(&s.key));
        if known.iter().any(by) {
            return Ok(());
        }
        // The seal first (an HMAC), the certificate only for the session that sealed it.
        let found = i
            .live
            .iter()
            .find(|(n, s)| !known.contains(n) && stamp.sealed_by(&s.key) && names(&s.cert, from))
            .map(|(n, _)| *n);
        match found {
            Some(n) => {
                i.named.entry(from.to_string()).or_default().push(n);
                Ok(())
            }
            None => {
                let why = format!(
                    "a message that says it is from pod {from:?} came on no session whose \
                     certificate names that pod"
                );
                if i.said.insert(from.to_string()) {
                    tracing::warn!("refused {why}");
                }
                Err(why)
            }
        }
    }

    /// Whether the certificate of the session `cell` is reached on names pod `name`
    /// (what a peer's report says it is). Always, without TLS.
    pub fn names(&self, cell: &ActorCell, name: &str) -> bool {
        if !self.tls {
            return true;
        }
        let mut i = self.inner();
        let ok = node_of(cell)
            .and_then(|n| i.live.get(&n))
            .is_some_and(|s| names(&s.cert, name));
        if !ok && i.said.insert(name.to_string()) {
            tracing::warn!(
                "refused a peer that says it is pod {name:?}: its certificate does not name it"
            );
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::pods::FromPeer;

    /// A certificate tests/fixtures/tls/make.sh made with openssl.
    fn cert(name: &str) -> CertificateDer<'static> {
        use rustls::pki_types::pem::PemObject;
        let p = format!(
            "{}/../tests/fixtures/tls/{name}.crt",
            env!("CARGO_MANIFEST_DIR")
        );
        CertificateDer::from_pem_file(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    /// A message sealed on a session whose certificate names its sender passes; one that
    /// says it is from another pod, or sealed with another session's key, does not.
    #[test]
    fn a_name_comes_from_the_certificate_of_the_session_that_sealed_it() {
        let s = Sessions::new("me".into(), true);
        let (ka, kc) = ([1u8; 32], [3u8; 32]);
        s.opened(
            "10.0.0.2:7450 #0".into(),
            Session {
                cert: cert("a"),
                key: ka,
            },
        );
        s.opened(
            "10.0.0.4:7450 #1".into(),
            Session {
                cert: cert("c"),
                key: kc,
            },
        );
        s.attached(0, "10.0.0.2:7450 #0");
        s.attached(1, "10.0.0.4:7450 #1");
        let msg = |from: &str, key: &SessionKey| {
            let mut m = FromPeer::of("room".to_string());
            m.seal(from, Some(key));
            m
        };
        assert_eq!(s.check(msg("a", &ka).stamp()), Ok(()));
        // Again, from the cache.
        assert_eq!(s.check(msg("a", &ka).stamp()), Ok(()));
        assert_eq!(s.check(msg("c", &kc).stamp()), Ok(()));
        // Pod c says it is a: its session's key, a's name.
        assert!(s.check(msg("a", &kc).stamp()).is_err());
        // a's name and key, but a key no session has.
        assert!(s.check(msg("a", &[9; 32]).stamp()).is_err());
        assert!(s.check(msg("b", &ka).stamp()).is_err());
        // a's session ended: its seal no longer holds.
        s.closed(0);
        assert!(s.check(msg("a", &ka).stamp()).is_err());
        // Without TLS every name is as said.
        let plain = Sessions::new("me".into(), false);
        assert_eq!(plain.check(msg("a", &kc).stamp()), Ok(()));
    }

    #[test]
    fn certificates_name_their_dns_names_and_wildcards() {
        assert!(names(&cert("a"), "a"));
        assert!(!names(&cert("a"), "c"));
        let shared = cert("shared");
        assert!(names(
            &shared,
            "denoised-0.denoised-peers.ns.svc.cluster.local"
        ));
        assert!(names(
            &shared,
            "denoised-7.denoised-peers.ns.svc.cluster.local"
        ));
        assert!(!names(&shared, "denoised-0"));
        assert!(!names(&shared, "x.y.denoised-peers.ns.svc.cluster.local"));
    }
}
