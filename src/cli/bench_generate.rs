//! `denoised bench generate`: what an approximate-cache hit saves end to end, against a
//! running daemon that serves a text-to-image model (e.g. `denoised serve --model
//! builtin:flux-small-t2i`).
//!
//! Each round sends a generation of a fresh prompt (a miss: it runs every step and
//! stores its noise states), then the same prompt and seed again with
//! `approx_cache: "exact"` (a hit at the deepest K the similarity of 1 allows: half the
//! steps with the default thresholds), one request at a time so neither shares a batch.
//! A hit at K can at best take (N - K) / N of a miss's denoising; the report gives the
//! measured ratio against that bound, for the denoise stage and for the whole request
//! (whose text encoding and VAE decode a hit does not skip).

use std::time::Duration;

use serde_json::{json, Value};

use super::CliResult;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Base URL of the daemon.
    #[arg(long, env = "DENOISED_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Bearer token, when the daemon sets `[server] api_token`.
    #[arg(long, env = "DENOISED_API_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Miss-then-hit rounds.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Denoising steps of every request.
    #[arg(long, default_value_t = 28)]
    pub steps: u32,
    /// Image side in pixels.
    #[arg(long, default_value_t = 256)]
    pub size: u32,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

pub fn run(a: Args) -> CliResult {
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs_f64(a.timeout))
        .build()?;
    let post = |body: &Value| -> CliResult<Value> {
        let mut r = http.post(format!("{}/v1/generations", a.url)).json(body);
        if let Some(t) = &a.token {
            r = r.bearer_auth(t);
        }
        let r = r.send()?;
        let status = r.status();
        let v: Value = r.json()?;
        if !status.is_success() {
            return Err(format!("{status}: {v}").into());
        }
        Ok(v)
    };
    let unique = std::process::id();
    let (mut den, mut total, mut k_seen) = (Vec::new(), Vec::new(), 0);
    for round in 0..a.rounds {
        let body = json!({
            "prompt": format!("a lighthouse on a cliff at dusk, study {unique}-{round}"),
            "seed": round, "steps": a.steps, "width": a.size, "height": a.size,
            "approx_cache": "exact",
        });
        let miss = post(&body)?;
        let hit = post(&body)?;
        let a_hit = &hit["approx_cache"];
        if miss["approx_cache"]["hit"] != false || a_hit["hit"] != true {
            return Err(format!(
                "round {round}: expected a miss then a hit, got {} then {a_hit} (is the approximate cache on?)",
                miss["approx_cache"]
            )
            .into());
        }
        let k = a_hit["k"].as_u64().unwrap_or(0);
        k_seen = k;
        let t = |v: &Value, s: &str| v["timings"][s].as_f64().unwrap_or(f64::NAN);
        let r = (
            t(&hit, "denoise_s") / t(&miss, "denoise_s"),
            t(&hit, "total_s") / t(&miss, "total_s"),
        );
        eprintln!(
            "round {round}: miss denoise {:.3} s, total {:.3} s; hit at K = {k}: denoise {:.3} s, total {:.3} s",
            t(&miss, "denoise_s"),
            t(&miss, "total_s"),
            t(&hit, "denoise_s"),
            t(&hit, "total_s")
        );
        den.push(r.0);
        total.push(r.1);
    }
    let bound = (a.steps as f64 - k_seen as f64) / a.steps as f64;
    let (d, t) = (median(den), median(total));
    println!(
        "{}",
        json!({
            "steps": a.steps, "size": a.size, "k": k_seen, "rounds": a.rounds,
            "bound": bound,
            "hit_over_miss_denoise": d, "denoise_over_bound": d / bound,
            "hit_over_miss_total": t, "total_over_bound": t / bound,
        })
    );
    Ok(())
}
