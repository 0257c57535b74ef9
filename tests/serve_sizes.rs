//! Images of any size (docs/api.md, "Image sizes"): a photo of any size and aspect is
//! computed at a work size (whole tokens, its area capped by `[server] max_megapixels`)
//! and comes back at its own size, every pixel outside its mask the input's own, bit
//! for bit; above `[server] max_input_pixels` it is a 413.
//!
//! The daemon runs with `max_megapixels = 0.25` (1024 tokens: 512 x 512 for FLUX.1, 128
//! x 128 for the tiny built-in model, whose token is 4 pixels: a VAE that halves,
//! patches of 2) so that these photos compute in a fraction of a second on the CPU.

mod common;

use std::io::Cursor;

use common::*;
use denoised_models::pipeline::image::Rgb8;
use image::{DynamicImage, ImageFormat, Rgba, RgbaImage};
use serde_json::{json, Value};

const CONFIG: &str = "[server]\nmax_megapixels = 0.25\n";

/// A photo-like image: smooth gradients with some texture.
fn photo(w: u32, h: u32) -> image::RgbImage {
    image::RgbImage::from_fn(w, h, |x, y| {
        let t = ((x / 7 + y / 5) % 4) as u8 * 6;
        image::Rgb([
            (x * 200 / w) as u8 + t,
            (y * 200 / h) as u8 + t,
            ((x + y) * 100 / (w + h)) as u8 + 60,
        ])
    })
}

fn encoded(img: DynamicImage, format: ImageFormat) -> Vec<u8> {
    let mut v = Vec::new();
    img.write_to(&mut Cursor::new(&mut v), format).unwrap();
    v
}

/// The reply's image: the input's size; outside `masked`, the input's pixels exactly;
/// inside, mostly changed.
fn check_pasted(v: &Value, input: &Rgb8, masked: impl Fn(usize, usize) -> bool) {
    let got = png(&edit_image(v));
    assert_eq!(
        (got.width, got.height),
        (input.width, input.height),
        "the reply is not at the input's size"
    );
    assert_eq!(v["width"], input.width as u64, "{}", v["width"]);
    assert_eq!(v["height"], input.height as u64);
    let (mut outside_changed, mut inside, mut inside_changed) = (0usize, 0usize, 0usize);
    for y in 0..input.height {
        for x in 0..input.width {
            let i = 3 * (y * input.width + x);
            let same = got.data[i..i + 3] == input.data[i..i + 3];
            match masked(x, y) {
                false => outside_changed += usize::from(!same),
                true => {
                    inside += 1;
                    inside_changed += usize::from(!same);
                }
            }
        }
    }
    assert_eq!(outside_changed, 0, "pixels outside the mask changed");
    assert!(
        inside_changed * 2 > inside,
        "only {inside_changed} of {inside} masked pixels changed"
    );
}

/// A 1080x1350 phone photo with a mask painted in a drawing app (black opaque strokes
/// on a transparent layer) is edited where painted and comes back at 1080x1350; an
/// all-transparent or all-black mask is a 400 that says what to paint.
#[test]
fn a_phone_photo_with_a_mask_painted_in_alpha_comes_back_at_its_size() {
    let (_dir, d) = Daemon::with_config(CONFIG);
    let (w, h) = (1080u32, 1350u32);
    let image = encoded(DynamicImage::ImageRgb8(photo(w, h)), ImageFormat::Png);
    let input = png(&image);
    // A stroke: a disc and a bar, painted opaque black on a transparent layer.
    let stroke = |x: usize, y: usize| {
        let (dx, dy) = (x as f64 - 540.0, y as f64 - 500.0);
        dx * dx + dy * dy < 180.0 * 180.0 || ((200..880).contains(&x) && (900..980).contains(&y))
    };
    let layer = |paint: &dyn Fn(usize, usize) -> bool, colour: [u8; 3]| {
        let [r, g, b] = colour;
        let img = RgbaImage::from_fn(w, h, |x, y| {
            Rgba([
                r,
                g,
                b,
                if paint(x as usize, y as usize) {
                    255
                } else {
                    0
                },
            ])
        });
        b64(&encoded(DynamicImage::ImageRgba8(img), ImageFormat::Png))
    };
    let edit = |mask: String| {
        d.post(
            "/v1/edits",
            &json!({"image": b64(&image), "mask": mask, "prompt": "a red ball", "steps": 4, "seed": 2}),
        )
    };
    let (s, v) = edit(layer(&stroke, [0, 0, 0]));
    assert_eq!(s, 200, "{}", error_of(&v));
    assert_eq!(
        (v["computed_width"].as_u64(), v["computed_height"].as_u64()),
        (Some(112), Some(140)),
        "1080x1350 capped to 16,384 pixels (x 0.106: 114.5 x 143.1) is computed at 112x140"
    );
    check_pasted(&v, &input, stroke);

    let (s, v) = edit(layer(&|_, _| false, [0, 0, 0]));
    assert_eq!(s, 400, "an all-transparent mask: {}", error_of(&v));
    assert!(
        error_of(&v).contains("selects no pixel"),
        "{}",
        error_of(&v)
    );
    let black = RgbaImage::from_pixel(w, h, Rgba([0, 0, 0, 255]));
    let (s, v) = edit(b64(&encoded(
        DynamicImage::ImageRgba8(black),
        ImageFormat::Png,
    )));
    assert_eq!(s, 400, "an all-black mask: {}", error_of(&v));
    assert!(error_of(&v).contains("none is white"), "{}", error_of(&v));
}

/// A 4000x3000 camera JPEG is computed at the capped size and returned at 4000x3000;
/// a template of an odd size edits the same way; a photo over `max_input_pixels` is a
/// 413 that names the limit.
#[test]
fn a_camera_photo_is_computed_at_the_capped_size_and_returned_at_its_own() {
    let (_dir, d) = Daemon::with_config(CONFIG);
    let jpeg = encoded(
        DynamicImage::ImageRgb8(photo(4000, 3000)),
        ImageFormat::Jpeg,
    );
    let input = png(&jpeg);
    let (bx, by, bw, bh) = (1500usize, 1000usize, 900usize, 700usize);
    let in_box = |x: usize, y: usize| (bx..bx + bw).contains(&x) && (by..by + bh).contains(&y);
    let t0 = std::time::Instant::now();
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"image": b64(&jpeg), "boxes": [[bx, by, bw, bh]], "prompt": "a window", "steps": 4}),
    );
    assert_eq!(s, 200, "{}", error_of(&v));
    eprintln!(
        "4000x3000 JPEG ({:.1} MB): edited in {:.2} s, timings {}",
        jpeg.len() as f64 / 1e6,
        t0.elapsed().as_secs_f64(),
        v["timings"]
    );
    assert_eq!(
        (v["computed_width"].as_u64(), v["computed_height"].as_u64()),
        (Some(144), Some(108)),
        "4000x3000 capped to 16,384 pixels (x 0.0370: 147.8 x 110.9) is computed at 144x108"
    );
    check_pasted(&v, &input, in_box);

    // A template of an odd size: captured at its work size, edited back at its own.
    let odd = encoded(DynamicImage::ImageRgb8(photo(100, 75)), ImageFormat::Png);
    let (s, v) = d.post(
        "/v1/templates",
        &json!({"image": b64(&odd), "id": "odd", "steps": 4, "seed": 3, "prompt": "a room"}),
    );
    assert_eq!(s, 201, "{}", error_of(&v));
    // A template's `width` x `height` are the size it is computed at (75 rounds to 76),
    // its image's are its own.
    assert_eq!(
        (v["width"].as_u64(), v["height"].as_u64()),
        (Some(100), Some(76))
    );
    assert_eq!(
        (v["image_width"].as_u64(), v["image_height"].as_u64()),
        (Some(100), Some(75))
    );
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"template_id": "odd", "boxes": [[10, 10, 40, 30]], "prompt": "a lamp"}),
    );
    assert_eq!(s, 200, "{}", error_of(&v));
    let in_odd = |x: usize, y: usize| (10..50).contains(&x) && (10..40).contains(&y);
    check_pasted(&v, &png(&odd), in_odd);

    // Over the input limit (32 MiP): 6000 x 6000 = 36 MP.
    let huge = image::RgbImage::from_pixel(6000, 6000, image::Rgb([90, 90, 90]));
    let huge = encoded(DynamicImage::ImageRgb8(huge), ImageFormat::Png);
    let (s, v) = d.post(
        "/v1/edits",
        &json!({"image": b64(&huge), "boxes": [[0, 0, 8, 8]], "prompt": "x", "steps": 4}),
    );
    assert_eq!(s, 413, "{}", error_of(&v));
    assert!(
        error_of(&v).contains("exceeds the limit"),
        "{}",
        error_of(&v)
    );
}

fn error_of(v: &Value) -> String {
    v["error"]["message"]
        .as_str()
        .map_or_else(|| v.to_string().chars().take(300).collect(), str::to_string)
}
