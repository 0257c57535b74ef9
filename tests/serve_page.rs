//! The playground page (`GET /`) in a real browser: headless Chromium driven over
//! WebDriver (chromedriver; tests/webdriver) against the daemon on the built-in model.
//! The test uploads an image, paints a mask with the mouse, runs a streamed edit, and
//! checks what the page shows (the progress bar moving, previews, the result) and that
//! the result keeps the input's pixels outside the mask the page sent. Screenshots of
//! the page before and after go to target/page-screenshots/.
//!
//! Skips (visibly: `denoised_runtime::skip`) only where Chromium or chromedriver is
//! missing; `.ci/run` installs both.

mod common;
mod webdriver;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use denoised_runtime::skip::{skip, Need};
use serde_json::{json, Value};
use webdriver::Browser;

/// Whether a streamed edit over plain HTTP sends a `preview` event: the denoise
/// worker fits its preview factors in the background after it starts.
fn previews_ready(d: &Daemon) -> bool {
    let body = json!({"image": image_b64(), "mask": mask_b64(), "steps": 2, "seed": 1,
        "stream": true, "preview_every": 1});
    let Ok(r) = d
        .http
        .post(format!("{}/v1/edits", d.url))
        .json(&body)
        .send()
    else {
        return false;
    };
    BufReader::new(r)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.trim() == "event: preview")
}

fn wait_for_previews(d: &Daemon) {
    let t0 = Instant::now();
    while !previews_ready(d) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no previews after a minute"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The browser, or a visible skip where it is missing.
fn tools() -> Option<(PathBuf, PathBuf)> {
    match webdriver::find_tools() {
        Ok(t) => Some(t),
        Err(why) => {
            skip("serve_page", Need::Tool, &why);
            None
        }
    }
}

fn screenshots_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/page-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Polls `cond` (a script returning a boolean) until true.
fn wait_js(b: &Browser, cond: &str, what: &str, limit: Duration) {
    let t0 = Instant::now();
    while b.js(cond, json!([])) != json!(true) {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Records in the page every value the progress bar's `value` attribute takes and
/// every `src` of the after image, as the DOM sees them: MutationObservers, so
/// nothing is missed between two polls (several changes in one task come as several
/// records; each one's new value is the next one's old value).
const OBSERVE: &str = r#"
window.__seen = {progress: [], srcs: []};
const track = (el, attr, out) => new MutationObserver((records) => {
  records.forEach((r, i) => out.push(i + 1 < records.length ? records[i + 1].oldValue : el.getAttribute(attr)));
}).observe(el, {attributes: true, attributeFilter: [attr], attributeOldValue: true});
track(document.getElementById('progress'), 'value', window.__seen.progress);
track(document.getElementById('after'), 'src', window.__seen.srcs);
return true;"#;

fn data_url_png(v: &Value) -> Vec<u8> {
    let s = v.as_str().expect("a data URL");
    let (head, data) = s.split_once(',').unwrap();
    assert_eq!(head, "data:image/png;base64", "{head}");
    unb64(data)
}

/// The page: upload, paint, stream an edit; the result keeps the input outside the mask.
#[test]
fn the_playground_page_edits_an_uploaded_image_with_a_painted_mask() {
    let Some((chromium, driver)) = tools() else {
        return;
    };
    let d = Daemon::start(&[]);
    // The page is public, and is the page.
    let r = d.http.get(format!("{}/", d.url)).send().unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().unwrap().contains("/page/app.js"));
    wait_for_previews(&d);

    let b = Browser::start(&chromium, &driver, 1280, 1300);
    b.goto(&format!("{}/", d.url));
    wait_js(
        &b,
        "return window.__ready === true",
        "the page's script",
        Duration::from_secs(30),
    );
    wait_js(
        &b,
        "return document.getElementById('server').textContent.startsWith('ready')",
        "the server panel",
        Duration::from_secs(30),
    );

    let input = case("e2e_input.png");
    b.send_keys("#image-file", input.to_str().unwrap());
    wait_js(
        &b,
        "return document.getElementById('before').naturalWidth === 64",
        "the uploaded image",
        Duration::from_secs(30),
    );
    // A stroke across the upper left of the canvas (64x64 shown at 384x384).
    b.drag(
        "#mask-canvas",
        &[(-150, -110), (-90, -105), (-30, -90), (15, -75)],
    );
    b.js("document.getElementById('steps').value = 8; document.getElementById('seed').value = 5; return true", json!([]));
    let dir = screenshots_dir();
    b.screenshot(&dir.join("before.png"));

    b.js(OBSERVE, json!([]));
    b.click("#submit");
    wait_js(
        &b,
        "return window.__state === 'done' || window.__state === 'error'",
        "the edit",
        Duration::from_secs(120),
    );
    let state = b.js(
        "return {state: window.__state, status: document.getElementById('status').textContent, \
         seen: window.__seen, previews: window.__previews.length, mask: window.__lastMask, \
         result: window.__result, shown: window.__shown, \
         download: document.getElementById('download').getAttribute('href')}",
        json!([]),
    );
    b.screenshot(&dir.join("after.png"));
    println!("screenshots: {}", dir.display());
    assert_eq!(state["state"], "done", "{}", state["status"]);

    // The progress bar moved through the steps, and at least two distinct previews
    // were shown before the result.
    let progress: Vec<u64> = state["seen"]["progress"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().parse().unwrap())
        .collect();
    println!("progress bar values seen: {progress:?}");
    let mut between: Vec<u64> = progress
        .iter()
        .copied()
        .filter(|p| (1..8).contains(p))
        .collect();
    between.dedup();
    assert!(
        between.len() >= 3,
        "the progress bar did not move by steps: {progress:?}"
    );
    assert!(progress.windows(2).all(|w| w[0] <= w[1]), "{progress:?}");
    assert_eq!(progress.last(), Some(&8));
    let srcs: Vec<&str> = state["seen"]["srcs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let mut previews: Vec<&str> = srcs
        .iter()
        .copied()
        .filter(|s| s.starts_with("data:image/jpeg"))
        .collect();
    previews.dedup();
    println!(
        "previews shown: {} ({} kept by the page)",
        previews.len(),
        state["previews"]
    );
    assert!(
        previews.len() >= 2,
        "fewer than two distinct previews shown"
    );
    // The result is the job's binary reply, shown (and downloaded) from its bytes.
    assert!(
        state["shown"]
            .as_str()
            .is_some_and(|s| s.starts_with("blob:")),
        "{}",
        state["shown"]
    );
    assert_eq!(
        srcs.last().copied(),
        state["shown"].as_str(),
        "the result is shown last"
    );
    assert_eq!(state["download"], state["shown"]);

    check_outside_mask(
        &std::fs::read(&input).unwrap(),
        &data_url_png(&state["mask"]),
        &data_url_png(&state["result"]),
    );
}

/// A daemon with an API token: the page is served without it, the API still wants it,
/// and the page asks for it on the first 401, then lists the templates with it and
/// keeps it for the tab only (sessionStorage).
#[test]
fn the_playground_page_asks_for_the_token_the_api_wants() {
    let Some((chromium, driver)) = tools() else {
        return;
    };
    const TOKEN: &str = "s3cret";
    let d = Daemon::start(&["--api-token", TOKEN]);
    let get = |path: &str| d.http.get(format!("{}{path}", d.url)).send().unwrap();
    assert_eq!(get("/").status(), 200);
    assert_eq!(get("/page/app.js").status(), 200);
    assert_eq!(get("/v1/templates").status(), 401);
    let r = d
        .http
        .post(format!("{}/v1/templates", d.url))
        .bearer_auth(TOKEN)
        .json(&json!({"id": "room", "image": image_b64(), "steps": 4}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 201);

    let b = Browser::start(&chromium, &driver, 1280, 1300);
    b.goto(&format!("{}/", d.url));
    wait_js(
        &b,
        "return document.getElementById('auth').hidden === false",
        "the token form",
        Duration::from_secs(30),
    );
    b.send_keys("#token", TOKEN);
    b.click("#auth button");
    wait_js(
        &b,
        "return [...document.getElementById('template-select').options].some(o => o.value === 'room')",
        "the templates, listed with the token",
        Duration::from_secs(30),
    );
    let v = b.js(
        "const s = document.getElementById('template-select'); s.value = 'room'; \
         s.dispatchEvent(new Event('change')); \
         return {token: sessionStorage.getItem('denoised.token'), \
         info: document.getElementById('source-info').textContent, \
         width: document.getElementById('mask-canvas').width, \
         steps: document.getElementById('steps').disabled}",
        json!([]),
    );
    assert_eq!(v["token"], TOKEN);
    assert!(
        v["info"]
            .as_str()
            .unwrap()
            .starts_with("template room: 64x64"),
        "{v}"
    );
    assert_eq!(v["width"], 64);
    assert_eq!(
        v["steps"], true,
        "a template edit takes the template's steps"
    );
    // Registering the uploaded image as a template, with the kept token.
    b.send_keys("#image-file", case("e2e_input.png").to_str().unwrap());
    wait_js(
        &b,
        "return document.getElementById('before').naturalWidth === 64 \
         && document.getElementById('template-select').value === ''",
        "the uploaded image, in place of the template",
        Duration::from_secs(30),
    );
    b.send_keys("#template-id", "mine");
    b.click("#template-register");
    wait_js(
        &b,
        "return [...document.getElementById('template-select').options].some(o => o.value === 'mine')",
        "the registered template in the list",
        Duration::from_secs(60),
    );
    let r = d
        .http
        .get(format!("{}/v1/templates/mine", d.url))
        .bearer_auth(TOKEN)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    b.screenshot(&screenshots_dir().join("token.png"));
}

/// The result equals the input outside the painted mask (the paste-back's feather lies
/// inside it), and the mask is a real stroke, not empty nor everything.
fn check_outside_mask(input: &[u8], mask: &[u8], result: &[u8]) {
    let input = image::load_from_memory(input).unwrap().to_rgb8();
    let mask = image::load_from_memory(mask).unwrap().to_luma8();
    let result = image::load_from_memory(result).unwrap().to_rgb8();
    assert_eq!(mask.dimensions(), input.dimensions());
    assert_eq!(result.dimensions(), input.dimensions());
    let (w, h) = input.dimensions();
    let painted = |x: u32, y: u32| mask.get_pixel(x, y)[0] >= 128;
    let count = (0..h)
        .flat_map(|y| (0..w).map(move |x| (x, y)))
        .filter(|&(x, y)| painted(x, y))
        .count();
    println!("mask: {count} of {} pixels painted", w * h);
    assert!(count > 20 && count < (w * h / 2) as usize, "{count}");
    let (mut checked, mut differ) = (0, 0);
    for y in 0..h {
        for x in 0..w {
            if painted(x, y) {
                continue;
            }
            checked += 1;
            if input.get_pixel(x, y) != result.get_pixel(x, y) {
                differ += 1;
            }
        }
    }
    println!("outside the mask: {checked} pixels checked, {differ} differ");
    assert!(checked > (w * h / 3) as usize, "{checked}");
    assert_eq!(differ, 0, "pixels outside the mask changed");
}
