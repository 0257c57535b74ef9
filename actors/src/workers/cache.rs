//! The cache actor: the host's template index. It holds every registered template's
//! cache (the flat `TemplateLayout` image) and image bytes in its own shared-memory
//! arena; denoise workers map them read-only through the handles it gives out.
//!
//! This is the single host tier; capacity, LRU eviction and the disk tier come with
//! the cache issue. A template that does not fit the arena is refused with a clear
//! error instead of evicting others.
//!
//! Edits pin the template they read (`Pin` ... `Unpin`): deleting or replacing a
//! pinned template takes it out of the index at once (new edits get 404, or the new
//! version), but its slices stay until the last edit reading them is done. Pins belong
//! to the router's requests, so when the router is lost they all go.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::metrics::cache::CacheMetrics;
use crate::node::Shm;
use crate::wire::{CacheMsg, ErrorKind, PutTemplate, TemplateEntry, Wire, WireError};

pub struct CacheActor;

pub struct CacheState {
    shm: Arc<Shm>,
    templates: BTreeMap<String, TemplateEntry>,
    /// Pins per template version (its blob's generation, unique in this arena).
    pins: HashMap<u64, u32>,
    /// Versions out of the index (deleted or replaced) while pinned, freed at the
    /// last unpin.
    retired: HashMap<u64, TemplateEntry>,
    metrics: CacheMetrics,
}

impl Actor for CacheActor {
    type Msg = CacheMsg;
    type State = CacheState;
    type Arguments = (Arc<Shm>, CacheMetrics);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (shm, metrics): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(CacheState {
            shm,
            templates: BTreeMap::new(),
            pins: HashMap::new(),
            retired: HashMap::new(),
            metrics,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CacheMsg::Put(Wire(put), reply) => {
                let r = st.put(put);
                if let Ok(e) = &r {
                    st.metrics.loaded(e.blob.len);
                }
                st.count();
                let _ = reply.send(Wire(r));
            }
            CacheMsg::Get(Wire(id), reply) => {
                let _ = reply.send(Wire(st.get(&id).cloned()));
            }
            CacheMsg::List(_, reply) => {
                let list = st.templates.values().map(|e| e.info.clone()).collect();
                let _ = reply.send(Wire(Ok(list)));
            }
            CacheMsg::Delete(Wire(id), reply) => {
                let r = match st.templates.remove(&id) {
                    Some(e) => {
                        let info = e.info.clone();
                        st.retire(e);
                        Ok(info)
                    }
                    None => Err(not_found(&id)),
                };
                st.count();
                let _ = reply.send(Wire(r));
            }
            CacheMsg::Pin(Wire(id), reply) => {
                let r = st.get(&id).cloned();
                st.metrics.lookup(r.is_ok());
                if let Ok(e) = &r {
                    *st.pins.entry(e.blob.generation).or_default() += 1;
                }
                let _ = reply.send(Wire(r));
            }
            CacheMsg::Unpin(Wire(blob)) => {
                let g = blob.generation;
                if let Some(n) = st.pins.get_mut(&g) {
                    *n -= 1;
                    if *n == 0 {
                        st.pins.remove(&g);
                        if let Some(e) = st.retired.remove(&g) {
                            st.shm.release(&[e.blob, e.image]);
                        }
                    }
                }
            }
            CacheMsg::RouterLost(_) => {
                st.pins.clear();
                for (_, e) in st.retired.drain() {
                    st.shm.release(&[e.blob, e.image]);
                }
            }
        }
        Ok(())
    }
}

fn not_found(id: &str) -> WireError {
    WireError::new(ErrorKind::NotFound, format!("unknown template `{id}`"))
}

impl CacheState {
    /// Updates the gauges of what the tier holds.
    fn count(&self) {
        let bytes = self.templates.values().map(|e| e.blob.len).sum();
        self.metrics.set_held(self.templates.len(), bytes);
    }

    fn get(&self, id: &str) -> Result<&TemplateEntry, WireError> {
        self.templates.get(id).ok_or_else(|| not_found(id))
    }

    /// Copies the capture's cache and the template image into this arena.
    fn put(&mut self, put: PutTemplate) -> Result<TemplateEntry, WireError> {
        if !put.replace && self.templates.contains_key(&put.info.id) {
            return Err(crate::router::flow::exists(&put.info.id));
        }
        // The template's flat image, copied as bytes (its K/V dtype is the capturing
        // device's).
        let blob = self.shm.read_bytes(&put.blob)?;
        let blob = self.shm.write_bytes(&blob).map_err(|e| {
            WireError::new(
                ErrorKind::TooLarge,
                format!(
                    "the template cache does not fit the cache arena: {}",
                    e.message
                ),
            )
        })?;
        let image = match self
            .shm
            .read_bytes(&put.image)
            .and_then(|b| self.shm.write_bytes(&b))
        {
            Ok(h) => h,
            Err(e) => {
                self.shm.release(&[blob]);
                return Err(e);
            }
        };
        let mut info = put.info;
        info.cache_bytes = blob.len;
        let entry = TemplateEntry { info, blob, image };
        if let Some(old) = self.templates.insert(entry.info.id.clone(), entry.clone()) {
            self.retire(old);
        }
        Ok(entry)
    }

    /// A version out of the index: freed now, or at its last unpin.
    fn retire(&mut self, e: TemplateEntry) {
        if self.pins.contains_key(&e.blob.generation) {
            self.retired.insert(e.blob.generation, e);
        } else {
            self.shm.release(&[e.blob, e.image]);
        }
    }
}
