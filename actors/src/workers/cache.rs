//! The cache actor: the host's template index. It holds every registered template's
//! cache (the flat `TemplateLayout` image) and image bytes in its own shared-memory
//! arena; denoise workers map them read-only through the handles it gives out.
//!
//! This is the single host tier; capacity, LRU eviction and the disk tier come with
//! the cache issue. A template that does not fit the arena is refused with a clear
//! error instead of evicting others.

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::node::Shm;
use crate::wire::{CacheMsg, ErrorKind, PutTemplate, TemplateEntry, Wire, WireError};

pub struct CacheActor;

pub struct CacheState {
    shm: Arc<Shm>,
    templates: BTreeMap<String, TemplateEntry>,
}

impl Actor for CacheActor {
    type Msg = CacheMsg;
    type State = CacheState;
    type Arguments = Arc<Shm>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        shm: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(CacheState {
            shm,
            templates: BTreeMap::new(),
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
                let _ = reply.send(Wire(st.put(put)));
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
                        st.shm.release(&[e.blob, e.image]);
                        Ok(e.info)
                    }
                    None => Err(not_found(&id)),
                };
                let _ = reply.send(Wire(r));
            }
        }
        Ok(())
    }
}

fn not_found(id: &str) -> WireError {
    WireError::new(ErrorKind::NotFound, format!("unknown template `{id}`"))
}

impl CacheState {
    fn get(&self, id: &str) -> Result<&TemplateEntry, WireError> {
        self.templates.get(id).ok_or_else(|| not_found(id))
    }

    /// Copies the capture's cache and the template image into this arena.
    fn put(&mut self, put: PutTemplate) -> Result<TemplateEntry, WireError> {
        if !put.replace && self.templates.contains_key(&put.info.id) {
            return Err(crate::router::flow::exists(&put.info.id));
        }
        let blob = self.shm.read_tensor(&put.blob)?;
        let blob = self.shm.write_tensor(&blob).map_err(|e| {
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
            self.shm.release(&[old.blob, old.image]);
        }
        Ok(entry)
    }
}
