//! The metrics actor of a worker process: answers the router's scrape with this
//! process's exposition. One per process, in its own group, so that a scrape never
//! waits behind a role's work (a preprocess worker's actor may be busy handing out a
//! request; this one only encodes).

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::ProcessRegistry;
use crate::node::Shm;
use crate::wire::{MetricsMsg, Wire};

pub struct MetricsActor;

pub struct MetricsState {
    registry: Arc<ProcessRegistry>,
    shm: Arc<Shm>,
}

impl Actor for MetricsActor {
    type Msg = MetricsMsg;
    type State = MetricsState;
    type Arguments = (Arc<ProcessRegistry>, Arc<Shm>);

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        (registry, shm): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(MetricsState { registry, shm })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MetricsMsg::Scrape(_, reply) => {
                let (_, capacity) = st.shm.room();
                let text = st.registry.encode(st.shm.used_bytes(), capacity);
                let _ = reply.send(Wire(Ok(text)));
            }
        }
        Ok(())
    }
}
