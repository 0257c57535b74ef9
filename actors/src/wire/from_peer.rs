//! What a peer sends ([`FromPeer`]): its message, the pod it says it is, and a seal.
//!
//! A pod's name is what its peers route by, record as a template's holder and accept
//! beats and cancels under, so with TLS it comes from the peer's certificate, not from
//! what the peer says (docs/cluster.md, "Security"). ractor_cluster does not tell an
//! actor which session a message came on, so each message carries the sender's name
//! and an HMAC-SHA256 of it and of the message's digest, keyed by a secret both ends of
//! that one TLS connection derive from its handshake (RFC 5705's exporter): no other
//! pod, whatever certificate it has, can make a seal the receiver takes under that
//! name. The receiver checks the seal against the sessions whose certificates name the
//! sender (router/state/sessions.rs). Without TLS the seal is empty and a name is what
//! its pod says (the cookie is the only check, as docs/cluster.md says).
//!
//! The seal covers SHA-256 of the message's postcard bytes, which the receiver hashes as
//! it decodes them: postcard is deterministic, so sender and receiver hash the same
//! bytes.

use hmac::{KeyInit, Mac};
use ractor::BytesConvertable;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The secret both ends of a TLS session derive to seal their messages: its label
/// (RFC 5705) and size.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-denoised-pod-messages-v1";
pub type SessionKey = [u8; 32];

/// A peer's message (postcard, as [`super::Wire`]) as sent or received: the pod that
/// says it sent it, the message or why it did not decode (pods of two versions meet
/// during a rolling upgrade, and a call whose message does not decode is answered with
/// that error instead of going unanswered), and its seal.
#[derive(Clone, Debug)]
pub struct FromPeer<T> {
    /// The sending pod, as it says.
    pub from: String,
    pub body: Result<T, String>,
    seal: [u8; 32],
    /// SHA-256 of the body's bytes: computed when sealed, or as received.
    digest: [u8; 32],
}

/// What a receiver checks of a message, whatever its type.
#[derive(Clone, Copy, Debug)]
pub struct Stamp<'a> {
    pub from: &'a str,
    seal: &'a [u8; 32],
    digest: &'a [u8; 32],
}

impl Stamp<'_> {
    /// Whether `key` made this seal (in constant time).
    pub fn sealed_by(&self, key: &SessionKey) -> bool {
        mac(key, self.from, self.digest)
            .verify_slice(self.seal)
            .is_ok()
    }
}

fn mac(key: &SessionKey, from: &str, digest: &[u8; 32]) -> hmac::Hmac<Sha256> {
    let mut m = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key");
    m.update(&(from.len() as u64).to_be_bytes());
    m.update(from.as_bytes());
    m.update(digest);
    m
}

/// The envelope on the wire.
#[derive(Serialize, Deserialize)]
struct Envelope {
    from: String,
    seal: [u8; 32],
    body: Vec<u8>,
}

impl<T: Serialize> FromPeer<T> {
    /// `v`, to be sealed ([`FromPeer::seal`]) as it leaves for a peer.
    pub fn of(v: T) -> Self {
        FromPeer {
            from: String::new(),
            body: Ok(v),
            seal: [0; 32],
            digest: [0; 32],
        }
    }

    /// Signs the message as pod `from`'s, with the key of the session it goes on
    /// (`None`: no TLS, an empty seal).
    pub fn seal(&mut self, from: &str, key: Option<&SessionKey>) {
        let Ok(v) = &self.body else { return };
        let bytes = postcard::to_stdvec(v).expect("postcard encodes the wire types");
        self.digest = Sha256::digest(&bytes).into();
        self.from = from.to_string();
        self.seal = match key {
            Some(k) => mac(k, from, &self.digest).finalize().into_bytes().into(),
            None => [0; 32],
        };
    }

    #[cfg(test)]
    fn sealed(v: T, from: &str, key: Option<&SessionKey>) -> Self {
        let mut m = Self::of(v);
        m.seal(from, key);
        m
    }
}

impl<T> FromPeer<T> {
    pub fn stamp(&self) -> Stamp<'_> {
        Stamp {
            from: &self.from,
            seal: &self.seal,
            digest: &self.digest,
        }
    }
}

impl<T: Serialize + DeserializeOwned> BytesConvertable for FromPeer<T> {
    fn into_bytes(self) -> Vec<u8> {
        let body = match &self.body {
            Ok(v) => postcard::to_stdvec(v).expect("postcard encodes the wire types"),
            // Never sent: a peer's message is built `Ok`.
            Err(_) => Vec::new(),
        };
        let e = Envelope {
            from: self.from,
            seal: self.seal,
            body,
        };
        postcard::to_stdvec(&e).expect("postcard encodes the wire types")
    }

    fn from_bytes(bytes: Vec<u8>) -> Self {
        match postcard::from_bytes::<Envelope>(&bytes) {
            Ok(e) => FromPeer {
                body: postcard::from_bytes(&e.body).map_err(|e| e.to_string()),
                digest: Sha256::digest(&e.body).into(),
                from: e.from,
                seal: e.seal,
            },
            Err(e) => FromPeer {
                from: String::new(),
                body: Err(e.to_string()),
                seal: [0; 32],
                digest: [0; 32],
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn travel<T: Serialize + DeserializeOwned>(m: FromPeer<T>) -> FromPeer<T> {
        FromPeer::from_bytes(m.into_bytes())
    }

    /// A seal holds for the key and the name it was made with, and for nothing else: not
    /// another session's key, not another name, not another message under the same seal.
    #[test]
    fn a_seal_holds_only_for_its_key_its_name_and_its_message() {
        let (k, other) = ([7u8; 32], [8u8; 32]);
        let m = travel(FromPeer::sealed("room".to_string(), "a", Some(&k)));
        assert_eq!(m.body.as_deref(), Ok("room"));
        assert_eq!(m.from, "a");
        assert!(m.stamp().sealed_by(&k));
        assert!(!m.stamp().sealed_by(&other));
        let mut renamed = m.clone();
        renamed.from = "b".into();
        assert!(!renamed.stamp().sealed_by(&k));
        // Another message with this one's name and seal.
        let envelope = |m: FromPeer<String>| postcard::from_bytes::<Envelope>(&m.into_bytes());
        let mut other_message = envelope(FromPeer::sealed("roam".into(), "a", Some(&k))).unwrap();
        other_message.seal = envelope(m).unwrap().seal;
        let forged = FromPeer::<String>::from_bytes(postcard::to_stdvec(&other_message).unwrap());
        assert_eq!(forged.body.as_deref(), Ok("roam"));
        assert!(!forged.stamp().sealed_by(&k));
        // Unsealed (no TLS): no key makes it.
        let plain = travel(FromPeer::sealed(5u64, "a", None));
        assert_eq!(plain.body, Ok(5));
        assert!(!plain.stamp().sealed_by(&[0; 32]));
    }

    /// A message that does not decode keeps why, for the pod actor to answer with.
    #[test]
    fn messages_that_do_not_decode_keep_why() {
        let garbage = FromPeer::<u64>::from_bytes(vec![0xff; 5]);
        assert!(garbage.body.is_err());
        let e = Envelope {
            from: "a".into(),
            seal: [0; 32],
            body: vec![0xff; 3],
        };
        let m = FromPeer::<String>::from_bytes(postcard::to_stdvec(&e).unwrap());
        assert_eq!(m.from, "a");
        assert!(m.body.is_err());
    }
}
