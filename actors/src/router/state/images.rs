//! The image store behind OpenAI's `response_format: "url"`: a finished image kept in
//! the router's memory for `[server] image_url_ttl_seconds`, served at `GET
//! /v1/images/{id}` (behind the API's bearer token), within `[server]
//! image_store_bytes` (the oldest go first beyond it).
//!
//! Memory, not disk: a URL is a convenience with an expiry (OpenAI's last an hour), not
//! an acknowledged write; a router restart loses the store, and its URLs then answer
//! 404 like expired ones (docs/api.md says so).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::wire::ImageFormat;

/// One stored image.
#[derive(Clone)]
pub struct Stored {
    pub bytes: Arc<Vec<u8>>,
    pub format: ImageFormat,
    expires: Instant,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Stored>,
    /// Ids by age (every id stays as long as the same ttl: age order is expiry order).
    order: VecDeque<String>,
    bytes: usize,
}

/// The store (a lock around a map; its operations are short).
pub struct Images {
    inner: Mutex<Inner>,
    ttl: Duration,
    max_bytes: usize,
    next: std::sync::atomic::AtomicU64,
}

impl Images {
    pub fn new(ttl: Duration, max_bytes: usize) -> Images {
        // Ids start from the clock so that a restarted router's never repeat.
        let t0 = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Images {
            inner: Mutex::default(),
            ttl,
            max_bytes,
            next: t0.into(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `bytes` and returns its id (`img_<16 hex>`), or `None` when one image is
    /// larger than the whole store.
    pub fn put(&self, bytes: Vec<u8>, format: ImageFormat) -> Option<String> {
        if bytes.len() > self.max_bytes {
            return None;
        }
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Not guessable from another id: the counter mixed (splitmix64's finaliser).
        let id = format!("img_{:016x}", mix(n));
        let now = Instant::now();
        let mut s = self.lock();
        s.sweep(now);
        while s.bytes + bytes.len() > self.max_bytes {
            s.drop_oldest();
        }
        s.bytes += bytes.len();
        s.order.push_back(id.clone());
        let stored = Stored {
            bytes: Arc::new(bytes),
            format,
            expires: now + self.ttl,
        };
        s.by_id.insert(id.clone(), stored);
        Some(id)
    }

    /// The image `id` while it is kept.
    pub fn get(&self, id: &str) -> Option<Stored> {
        let mut s = self.lock();
        s.sweep(Instant::now());
        s.by_id.get(id).cloned()
    }
}

impl Inner {
    fn drop_oldest(&mut self) {
        if let Some(id) = self.order.pop_front() {
            if let Some(old) = self.by_id.remove(&id) {
                self.bytes -= old.bytes.len();
            }
        }
    }

    /// Drops what has expired (the oldest first, so it stops at the first kept).
    fn sweep(&mut self, now: Instant) {
        while let Some(first) = self.order.front() {
            match self.by_id.get(first) {
                Some(s) if s.expires > now => break,
                _ => self.drop_oldest(),
            }
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_expire_and_the_oldest_go_first_beyond_the_bytes() {
        let s = Images::new(Duration::from_millis(200), 10);
        let a = s.put(vec![1; 4], ImageFormat::Png).unwrap();
        let b = s.put(vec![2; 4], ImageFormat::Jpeg).unwrap();
        assert_ne!(a, b);
        assert_eq!(*s.get(&a).unwrap().bytes, vec![1; 4]);
        // A third 4-byte image passes the 10 bytes: the oldest goes.
        let c = s.put(vec![3; 4], ImageFormat::Webp).unwrap();
        assert!(s.get(&a).is_none());
        assert_eq!(s.get(&b).unwrap().format, ImageFormat::Jpeg);
        assert!(
            s.put(vec![0; 11], ImageFormat::Png).is_none(),
            "larger than the store"
        );
        std::thread::sleep(Duration::from_millis(250));
        assert!(s.get(&b).is_none() && s.get(&c).is_none(), "expired");
        assert_eq!(s.lock().bytes, 0);
    }
}
