//! One async lock per key (a template id): what must run one at a time per template
//! (its registration, bringing it into this pod, capturing an upload as it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub struct KeyedLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl KeyedLocks {
    /// The lock of `key`, made on first use (locks nobody holds or waits for are
    /// dropped as others are made).
    pub fn of(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, l| Arc::strong_count(l) > 1);
        m.entry(key.to_string()).or_default().clone()
    }

    /// The keys whose lock is held now.
    pub fn held(&self) -> Vec<String> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .filter(|(_, l)| l.try_lock().is_err())
            .map(|(k, _)| k.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_per_key_and_idle_locks_go() {
        let locks = KeyedLocks::default();
        let a = locks.of("a");
        let held = a.lock().await;
        assert!(locks.of("a").try_lock().is_err(), "the same key's lock");
        assert!(locks.of("b").try_lock().is_ok(), "another key's");
        assert_eq!(locks.held(), vec!["a".to_string()]);
        drop(held);
        drop(a);
        let _c = locks.of("c");
        assert_eq!(locks.0.lock().unwrap().len(), 1, "idle locks dropped");
    }
}
