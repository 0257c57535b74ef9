//! The sparse VAE against the dense one, on the tiny VAE (two levels, the mid-block
//! attention) with seeded weights.

use super::*;
use crate::flux::weights::SplitMix;
use crate::vae::VaeConfig;
use denoised_runtime::cpu::sparse_conv::{GroupSums, Plane, Run, TileData, Tiles};

fn vae() -> AutoencoderKL {
    AutoencoderKL::seeded(VaeConfig::tiny(), 7).unwrap()
}

fn random(shape: [usize; 4], seed: u64) -> Tensor {
    let mut r = SplitMix::new(seed);
    let n = shape.iter().product();
    Tensor::new(shape, (0..n).map(|_| r.uniform() * 2.0 - 1.0).collect()).unwrap()
}

/// A disk of radius `r` at `(cy, cx)` of an `h x w` plane.
fn disk(h: usize, w: usize, cy: f32, cx: f32, r: f32) -> Vec<bool> {
    (0..h * w)
        .map(|i| {
            let (dy, dx) = ((i / w) as f32 - cy, (i % w) as f32 - cx);
            dy * dy + dx * dx <= r * r
        })
        .collect()
}

/// `x` with new values at the `region` pixels of every channel.
fn edited(x: &Tensor, region: &[bool], seed: u64) -> Tensor {
    let mut r = SplitMix::new(seed);
    let mut y = x.clone();
    let plane = region.len();
    for (i, v) in y.data_mut().iter_mut().enumerate() {
        if region[i % plane] {
            *v = r.uniform() * 2.0 - 1.0;
        }
    }
    y
}

/// [`kept_error`], for tensors of one shape.
fn diff_in(a: &Tensor, b: &Tensor, keep: &[bool]) -> (f32, f32) {
    assert_eq!(a.shape(), b.shape());
    kept_error(a, b, keep)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.data().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn the_trace_is_the_dense_pass_bit_for_bit() {
    let vae = vae();
    let image = random([1, 3, 40, 48], 1);
    let (mean, logvar) = vae.encode(&image).unwrap();
    let t = vae.trace_encode(&image).unwrap();
    let (tm, tl) = split_moments(&t.output().to_tensor(), 16).unwrap();
    assert_eq!(bits(&tm), bits(&mean));
    assert_eq!(bits(&tl), bits(&logvar));
    let z = random([1, 16, 20, 24], 2);
    let t = vae.trace_decode(&z).unwrap();
    assert_eq!(
        bits(&t.output().to_tensor()),
        bits(&vae.decode(&z).unwrap())
    );
    assert!(t.kv.is_some() && t.bytes() > t.output().len() * 4);
}

#[test]
fn an_empty_edit_returns_the_templates_outputs_bit_for_bit() {
    let vae = vae();
    let image = random([1, 3, 32, 32], 3);
    let z = random([1, 16, 16, 16], 4);
    let (te, td) = (
        vae.trace_encode(&image).unwrap(),
        vae.trace_decode(&z).unwrap(),
    );
    for region in [RegionMode::Exact, RegionMode::Local, RegionMode::Dilated(2)] {
        for stats in [StatsMode::Frozen, StatsMode::Incremental] {
            for crop in [false, true] {
                let opts = SparseOpts {
                    region,
                    stats,
                    tile: 8,
                    crop,
                };
                let ((m, l), r) = vae
                    .encode_sparse(&image, &te, &[false; 32 * 32], &[true; 16 * 16], opts)
                    .unwrap();
                let (tm, tl) = split_moments(&te.output().to_tensor(), 16).unwrap();
                assert_eq!((bits(&m), bits(&l)), (bits(&tm), bits(&tl)), "{opts:?}");
                assert_eq!(r.sparse_macs, 0);
                let (img, r) = vae
                    .decode_sparse(&z, &td, &[false; 16 * 16], &[true; 32 * 32], opts)
                    .unwrap();
                assert_eq!(bits(&img), bits(&td.output().to_tensor()), "{opts:?}");
                assert!(r.sparse_macs == 0 && r.dense_macs > 0);
            }
        }
    }
}

#[test]
fn a_full_mask_with_incremental_statistics_is_the_dense_vae() {
    let vae = vae();
    let opts = SparseOpts {
        tile: 8,
        ..SparseOpts::default()
    };
    let z_old = random([1, 16, 12, 20], 5);
    let z_new = random([1, 16, 12, 20], 6);
    let trace = vae.trace_decode(&z_old).unwrap();
    let all = |n| vec![true; n];
    let (got, r) = vae
        .decode_sparse(&z_new, &trace, &all(12 * 20), &all(24 * 40), opts)
        .unwrap();
    let want = vae.decode(&z_new).unwrap();
    let (d, _) = diff_in(&got, &want, &all(24 * 40));
    // The reference tests' strict tolerance for `decoded` (2e-5).
    assert!(d <= 2e-5, "decode: max abs diff {d:.2e}");
    assert!(r.sparse_macs >= r.dense_macs, "every tile computed");

    let i_old = random([1, 3, 24, 40], 7);
    let i_new = random([1, 3, 24, 40], 8);
    let trace = vae.trace_encode(&i_old).unwrap();
    let ((m, _), _) = vae
        .encode_sparse(&i_new, &trace, &all(24 * 40), &all(12 * 20), opts)
        .unwrap();
    let (want, _) = vae.encode(&i_new).unwrap();
    let (d, _) = diff_in(&m, &want, &all(12 * 20));
    assert!(d <= 3e-5, "encode: max abs diff {d:.2e}");
}

/// What `local` regions guarantee: under the same GroupNorm statistics (the template's:
/// `frozen`), the sparse pass equals a recompute of every pixel inside the kept region
/// within 1e-5 relative, for both halves. (Against the dense VAE only `exact` with
/// `incremental` statistics is exact: the edit moves every GroupNorm's statistics, so
/// every value moves a little; see the module docs and the next test.)
#[test]
fn local_regions_equal_a_full_recompute_under_the_same_statistics() {
    let vae = vae();
    let opts = SparseOpts {
        region: RegionMode::Local,
        stats: StatsMode::Frozen,
        tile: 8,
        crop: false,
    };
    let all = |n| vec![true; n];
    let (h, w) = (24, 24);
    let z_old = random([1, 16, h, w], 11);
    let diff = disk(h, w, 9.0, 14.0, 3.5);
    let z_new = edited(&z_old, &diff, 12);
    let keep = program::resample(&diff, h, w, 2 * h, 2 * w);
    let trace = vae.trace_decode(&z_old).unwrap();
    let (got, r) = vae
        .decode_sparse(&z_new, &trace, &diff, &keep, opts)
        .unwrap();
    let (want, _) = vae
        .decode_sparse(&z_new, &trace, &all(h * w), &all(4 * h * w), opts)
        .unwrap();
    let (d, m) = diff_in(&got, &want, &keep);
    eprintln!(
        "decoder: {d:.2e} of {m:.2}, {:.0}% of the MACs",
        100.0 * r.fraction()
    );
    assert!(d <= 1e-5 * m, "decoder: max abs diff {d:.3e} of {m:.3}");
    assert!(r.fraction() < 1.0);

    let (h, w) = (48, 48);
    let i_old = random([1, 3, h, w], 13);
    let diff = disk(h, w, 20.0, 26.0, 6.0);
    let i_new = edited(&i_old, &diff, 14);
    let keep = disk(h / 2, w / 2, 10.0, 13.0, 3.0);
    let trace = vae.trace_encode(&i_old).unwrap();
    let ((got, _), r) = vae
        .encode_sparse(&i_new, &trace, &diff, &keep, opts)
        .unwrap();
    let ((want, _), _) = vae
        .encode_sparse(&i_new, &trace, &all(h * w), &all(h * w / 4), opts)
        .unwrap();
    let (d, m) = diff_in(&got, &want, &keep);
    eprintln!(
        "encoder: {d:.2e} of {m:.2}, {:.0}% of the MACs",
        100.0 * r.fraction()
    );
    assert!(d <= 1e-5 * m, "encoder: max abs diff {d:.3e} of {m:.3}");
    assert!(r.fraction() < 1.0);
}

/// The exactness point: `exact` regions with `incremental` statistics equal the
/// dense VAE on the edited input within 1e-5 relative inside the kept region (the mask
/// for the decoder, the active tokens for the encoder), on a disk edit of each half.
/// They recompute what every GroupNorm's moved statistics reach, so they save little:
/// the test prints the share of the MACs (the pipeline never picks them for speed).
#[test]
fn exact_regions_with_incremental_statistics_equal_the_dense_vae() {
    let vae = vae();
    let opts = SparseOpts {
        region: RegionMode::Exact,
        stats: StatsMode::Incremental,
        tile: 8,
        crop: false,
    };
    let (h, w) = (24, 24);
    let z_old = random([1, 16, h, w], 21);
    let diff = disk(h, w, 9.0, 14.0, 3.5);
    let z_new = edited(&z_old, &diff, 22);
    let keep = program::resample(&diff, h, w, 2 * h, 2 * w);
    let trace = vae.trace_decode(&z_old).unwrap();
    let (got, r) = vae
        .decode_sparse(&z_new, &trace, &diff, &keep, opts)
        .unwrap();
    let (d, m) = diff_in(&got, &vae.decode(&z_new).unwrap(), &keep);
    eprintln!(
        "decoder: {:.2e} relative, {:.0}% of the MACs",
        d / m,
        100.0 * r.fraction()
    );
    assert!(d <= 1e-5 * m, "decoder: max abs diff {d:.3e} of {m:.3}");

    let (h, w) = (48, 48);
    let i_old = random([1, 3, h, w], 23);
    let diff = disk(h, w, 20.0, 26.0, 6.0);
    let i_new = edited(&i_old, &diff, 24);
    let keep = disk(h / 2, w / 2, 10.0, 13.0, 3.0);
    let trace = vae.trace_encode(&i_old).unwrap();
    let ((got, _), r) = vae
        .encode_sparse(&i_new, &trace, &diff, &keep, opts)
        .unwrap();
    let (want, _) = vae.encode(&i_new).unwrap();
    let (d, m) = diff_in(&got, &want, &keep);
    eprintln!(
        "encoder: {:.2e} relative, {:.0}% of the MACs",
        d / m,
        100.0 * r.fraction()
    );
    assert!(d <= 1e-5 * m, "encoder: max abs diff {d:.3e} of {m:.3}");
}

/// The decoder edit of a latent disk, kept at the disk's pixels: each mode's error
/// against the dense decoder inside the kept region, relative to the largest value
/// there. The bounds are the measured errors with headroom: see the module docs for
/// why no mode but a full recompute is exact, and docs/performance.md for the study.
#[test]
fn sparse_modes_stay_close_to_dense_inside_the_kept_region() {
    let vae = vae();
    let (h, w) = (24, 24);
    let z_old = random([1, 16, h, w], 9);
    let diff = disk(h, w, 9.0, 14.0, 3.5);
    let z_new = edited(&z_old, &diff, 10);
    let keep = program::resample(&diff, h, w, 2 * h, 2 * w);
    let trace = vae.trace_decode(&z_old).unwrap();
    let want = vae.decode(&z_new).unwrap();
    for (region, stats, crop, bound) in [
        (RegionMode::Local, StatsMode::Incremental, false, 0.05),
        (RegionMode::Local, StatsMode::Frozen, false, 0.05),
        (RegionMode::Dilated(2), StatsMode::Frozen, false, 0.1),
        // Crop-with-halo: the local region's bounding box, at least as close.
        (RegionMode::Local, StatsMode::Incremental, true, 0.05),
    ] {
        let opts = SparseOpts {
            region,
            stats,
            tile: 8,
            crop,
        };
        let (got, r) = vae
            .decode_sparse(&z_new, &trace, &diff, &keep, opts)
            .unwrap();
        let (d, m) = diff_in(&got, &want, &keep);
        eprintln!(
            "{region} {stats} crop {crop}: max abs diff {d:.3e} of {m:.2} in the kept region, {:.1}% of the MACs",
            100.0 * r.sparse_macs as f64 / r.dense_macs as f64
        );
        assert!(d / m <= bound, "{region} {stats}: {d:.3e} of {m:.3}");
        assert!(
            r.sparse_macs < r.dense_macs,
            "{region} {stats}: nothing saved"
        );
    }
}

#[test]
fn sparse_attention_equals_dense_at_its_queries() {
    let vae = vae();
    let a = vae
        .weights()
        .decoder
        .as_ref()
        .unwrap()
        .mid
        .attn
        .as_ref()
        .unwrap();
    let (c, h, w) = (64, 10, 12);
    let x_old = random([1, c, h, w], 11);
    let region = disk(h, w, 4.0, 5.0, 3.0);
    let x_new = edited(&x_old, &region, 12);
    let (want, _) = vae.attention_traced(&x_new, a).unwrap();
    let (cached, qkv_old) = vae.attention_traced(&x_old, a).unwrap();
    let kv_old: Vec<f32> = qkv_old
        .chunks_exact(3 * c)
        .flat_map(|r| &r[c..])
        .copied()
        .collect();
    let kv_old = Tensor::new([h * w, 2 * c], kv_old).unwrap();
    let sums = GroupSums::of(&x_new, vae.config().norm_num_groups).unwrap();
    let (scale, shift) =
        sums.scale_shift(a.norm.w.data(), a.norm.b.data(), crate::vae::config::GN_EPS);
    // Every key refreshed (the new statistics move them all); queries at the region
    // (the runs of 4-pixel tiles, some of them partial). The input is the template's
    // with the edited tiles over it.
    let all: Vec<Run> = (0..h).map(|y| Run { y, x0: 0, x1: w }).collect();
    let over = TileData::from_tensor(&x_new, Tiles::covering(&region, h, w, 4).unwrap()).unwrap();
    let x = Plane::of(&x_old).unwrap().with(Some(&over)).unwrap();
    let tiles = Tiles::covering(&region, h, w, 4).unwrap();
    assert!((0..tiles.active.len()).any(|i| !tiles.is_full(i)));
    let cp = Plane::of(&cached).unwrap();
    let td =
        sparse_attention(x, a, &scale, &shift, kv_old.data(), &all, cp, tiles.clone()).unwrap();
    let mut got = cached.clone();
    td.scatter_into(got.data_mut());
    let (d, _) = diff_in(&got, &want, &region);
    assert!(d <= 1e-5, "at the queries: {d:.2e}");
    let outside: Vec<bool> = region.iter().map(|r| !r).collect();
    let (d, _) = diff_in(&got, &cached, &outside);
    assert_eq!(d, 0.0, "other pixels keep the cached output");
    // Wrong shapes are refused, not read out of bounds.
    let short = Tensor::new([h * w - 1, 2 * c], vec![0.0; (h * w - 1) * 2 * c]).unwrap();
    assert!(sparse_attention(x, a, &scale, &shift, short.data(), &all, cp, tiles.clone()).is_err());
    let twice = [all[0], all[0]];
    let e = sparse_attention(
        x,
        a,
        &scale,
        &shift,
        kv_old.data(),
        &twice,
        cp,
        tiles.clone(),
    );
    assert!(e.unwrap_err().to_string().contains("overlap"));
    assert!(sparse_attention(
        x,
        a,
        &scale,
        &shift,
        kv_old.data(),
        &[Run { y: h, x0: 0, x1: 1 }],
        cp,
        tiles
    )
    .is_err());
}

#[test]
fn mismatched_traces_and_masks_are_refused() {
    let vae = vae();
    let z = random([1, 16, 8, 8], 13);
    let trace = vae.trace_decode(&z).unwrap();
    let opts = SparseOpts::default();
    let other = random([1, 16, 8, 10], 14);
    let e = vae.decode_sparse(&other, &trace, &[true; 80], &[true; 320], opts);
    assert!(e.is_err());
    let e = vae.decode_sparse(&z, &trace, &[true; 63], &[true; 256], opts);
    assert!(e.unwrap_err().to_string().contains("difference mask of 63"));
    let e = vae.encode_sparse(
        &random([1, 3, 16, 16], 15),
        &trace,
        &[true; 256],
        &[true; 64],
        opts,
    );
    assert!(e.is_err(), "a decoder trace for the encoder");
    assert_eq!("dilated:3".parse(), Ok(RegionMode::Dilated(3)));
    assert_eq!("local".parse(), Ok(RegionMode::Local));
    assert!("dilated".parse::<RegionMode>().is_err());
    assert_eq!("frozen".parse(), Ok(StatsMode::Frozen));
}
