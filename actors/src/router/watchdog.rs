//! The router's side of the systemd protocol (`crate::notify`): `READY=1` once every
//! worker group is up, then `WATCHDOG=1` and a `STATUS=` line on every tick, sent only
//! after the router's actors have answered, so a router whose actors or runtime stall
//! stops feeding the watchdog and systemd restarts the daemon (`WatchdogSec`).
//!
//! systemd gives the watchdog interval to the main process (the supervisor) as
//! `WATCHDOG_USEC`; the router inherits it. `WATCHDOG_PID` names the supervisor, but
//! the unit's `NotifyAccess=all` accepts the router's notifications.

use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;

use super::state::Ctx;
use crate::notify::notify;
use crate::wire::{RouterMsg, Wire};

/// Ticks without a watchdog: `STATUS=` lines only.
const STATUS_EVERY: Duration = Duration::from_secs(5);

/// The watchdog interval systemd asked for, if any.
fn interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// Whether the router's actors answer within `limit`.
async fn alive(ctx: &Ctx, router: &ActorRef<RouterMsg>, limit: Duration) -> bool {
    let ping = ractor::call_t!(
        router,
        |p| RouterMsg::Ping(Wire(7), p),
        limit.as_millis() as u64
    );
    let pinged = matches!(ping, Ok(Wire(Ok(7))));
    pinged && tokio::time::timeout(limit, ctx.jobs.get(0)).await.is_ok()
}

/// Runs for the router's life.
pub async fn run(ctx: Arc<Ctx>, router: ActorRef<RouterMsg>, addr: String) {
    while !ctx.ready().iter().all(|(_, have, want)| have >= want) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    notify(&format!("READY=1\nSTATUS=serving on http://{addr}"));
    // Twice per interval, as sd_watchdog_enabled(3) advises.
    let watchdog = interval();
    let tick = watchdog.map_or(STATUS_EVERY, |w| w / 2);
    loop {
        tokio::time::sleep(tick).await;
        if !alive(&ctx, &router, tick).await {
            tracing::warn!("watchdog: the router's actors did not answer in {tick:?}");
            continue;
        }
        let n = ctx.admission.in_flight();
        let status = if ctx.admission.is_draining() {
            format!("STATUS=draining {n} requests")
        } else {
            format!("STATUS=serving on http://{addr}: {n} requests in flight")
        };
        if watchdog.is_some() {
            notify(&format!("WATCHDOG=1\n{status}"));
        } else {
            notify(&status);
        }
    }
}
