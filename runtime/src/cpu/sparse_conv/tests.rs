//! Each sparse op against the dense one (`conv2d`, `group_norm`): random original and
//! edited activations, equal outside a random irregular region; the sparse op on the
//! tiles covering the region grown by the kernel must give the dense result, to 1e-6
//! in f32, everywhere.

use super::*;
use crate::cpu::conv::{conv2d, group_norm};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn tensor(shape: [usize; 4], seed: u64) -> Tensor {
    let mut r = Rng(seed);
    let n = shape.iter().product();
    Tensor::new(shape, (0..n).map(|_| r.next()).collect()).unwrap()
}

/// A union of random disks: an irregular region of an `h x w` plane.
fn blobs(h: usize, w: usize, seed: u64) -> Vec<bool> {
    let mut r = Rng(seed);
    let mut region = vec![false; h * w];
    for _ in 0..3 {
        let cy = (r.next() * 0.5 + 0.5) * h as f32;
        let cx = (r.next() * 0.5 + 0.5) * w as f32;
        let rad = (r.next() * 0.5 + 0.5) * (h.min(w) as f32 / 5.0) + 0.5;
        for y in 0..h {
            for x in 0..w {
                let (dy, dx) = (y as f32 - cy, x as f32 - cx);
                if dy * dy + dx * dx <= rad * rad {
                    region[y * w + x] = true;
                }
            }
        }
    }
    region
}

/// `x` with new values inside `region` (every channel).
fn edited(x: &Tensor, region: &[bool], seed: u64) -> Tensor {
    let mut r = Rng(seed);
    let plane = region.len();
    let mut y = x.clone();
    for (i, v) in y.data_mut().iter_mut().enumerate() {
        if region[i % plane] {
            *v = r.next() * 2.0;
        }
    }
    y
}

/// The dense pre-activation: `x * scale[c] + shift[c]`, then SiLU.
fn apply(x: &Tensor, p: PreAct<'_>) -> Tensor {
    let Plane { c, h, w, .. } = Plane::of(x).unwrap();
    let mut y = x.clone();
    for (i, v) in y.data_mut().iter_mut().enumerate() {
        let ch = i / (h * w) % c;
        let t = *v * p.scale[ch] + p.shift[ch];
        *v = if p.silu { crate::cpu::simd::silu(t) } else { t };
    }
    y
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.shape(), b.shape());
    a.data()
        .iter()
        .zip(b.data())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const DOWN: Conv2dOpts = Conv2dOpts {
    stride: 2,
    pad: [0, 1, 0, 1],
    upsample2x: false,
};
const UP: Conv2dOpts = Conv2dOpts {
    stride: 1,
    pad: [1; 4],
    upsample2x: true,
};

#[test]
fn sparse_ops_equal_dense_on_the_grown_region() {
    // (name, in channels, out channels, h, w, kernel, geometry, GroupNorm+SiLU, residual)
    let cases: &[(
        &str,
        usize,
        usize,
        usize,
        usize,
        usize,
        Conv2dOpts,
        bool,
        bool,
    )] = &[
        (
            "3x3 + gn/silu + residual",
            8,
            16,
            37,
            29,
            3,
            Conv2dOpts::same(3),
            true,
            true,
        ),
        (
            "3x3 plain",
            6,
            5,
            20,
            24,
            3,
            Conv2dOpts::same(3),
            false,
            false,
        ),
        (
            "3x3 stride 2 (0,1,0,1)",
            8,
            8,
            33,
            26,
            3,
            DOWN,
            false,
            false,
        ),
        ("upsample 2x + 3x3", 8, 4, 15, 18, 3, UP, false, false),
        (
            "1x1 shortcut",
            8,
            12,
            21,
            17,
            1,
            Conv2dOpts::same(1),
            false,
            false,
        ),
        (
            "1x1 + gn, no silu, residual",
            4,
            4,
            16,
            16,
            1,
            Conv2dOpts::same(1),
            true,
            true,
        ),
    ];
    for &(name, ci, co, h, w, k, opts, gn, res) in cases {
        for seed in 0..3u64 {
            for tile in [4, 7, 16] {
                let x_old = tensor([1, ci, h, w], seed * 10 + 1);
                let region = blobs(h, w, seed * 10 + 2);
                let x_new = edited(&x_old, &region, seed * 10 + 3);
                let wt = tensor([co, ci, k, k], seed * 10 + 4);
                let b = tensor([1, co, 1, 1], seed * 10 + 5);
                let b = Tensor::new([co], b.data().to_vec()).unwrap();
                let (scale, shift): (Vec<f32>, Vec<f32>) = {
                    let s = tensor([1, ci, 1, 2], seed * 10 + 6);
                    s.data().chunks(2).map(|p| (1.0 + p[0], p[1])).unzip()
                };
                let pre = gn.then_some(PreAct {
                    scale: &scale,
                    shift: &shift,
                    silu: name.contains("silu"),
                });
                let act = |x: &Tensor| match pre {
                    Some(p) => apply(x, p),
                    None => x.clone(),
                };
                let (grown, oh, ow) = grow(&region, h, w, k, opts);
                let res_old = tensor([1, co, oh, ow], seed * 10 + 7);
                let res_new = edited(&res_old, &grown, seed * 10 + 8);
                let dense = |x: &Tensor, r: &Tensor| {
                    conv2d(&act(x), &wt, Some(&b), opts, res.then_some(r)).unwrap()
                };
                let want = dense(&x_new, &res_new);
                let tiles = Tiles::covering(&grown, oh, ow, tile).unwrap();
                // The input and residual as whole tensors, and as the template's with
                // the edited tiles over them (how a sparse pass holds its values).
                let x_tiles = Tiles::covering(&region, h, w, 5).unwrap();
                let x_over = TileData::from_tensor(&x_new, x_tiles).unwrap();
                let r_over = TileData::from_tensor(&res_new, tiles.clone()).unwrap();
                let planes = [
                    (Plane::of(&x_new).unwrap(), Plane::of(&res_new).unwrap()),
                    (
                        Plane::of(&x_old).unwrap().with(Some(&x_over)).unwrap(),
                        Plane::of(&res_old).unwrap().with(Some(&r_over)).unwrap(),
                    ),
                ];
                // The tiles' pixels outside the grown region keep the cached output.
                let cached = dense(&x_old, &res_old);
                let cp = Plane::of(&cached).unwrap();
                for (k, (xp, rp)) in planes.into_iter().enumerate() {
                    let r = res.then_some(rp);
                    let td =
                        sparse_conv2d(xp, &wt, Some(&b), opts, pre, r, cp, tiles.clone()).unwrap();
                    let mut got = cached.clone();
                    td.scatter_into(got.data_mut());
                    let d = max_diff(&got, &want);
                    assert!(
                        d <= 1e-6,
                        "{name}, seed {seed}, tile {tile}, planes {k}: max abs error {d} ({} of {} tiles)",
                        tiles.active.len(),
                        oh.div_ceil(tile) * ow.div_ceil(tile)
                    );
                }
                // Every tile active: the dense layer itself.
                let mut all = tensor([1, co, oh, ow], 99);
                let every = Tiles::all(oh, ow, tile);
                let r = res.then(|| Plane::of(&res_new).unwrap());
                let x = Plane::of(&x_new).unwrap();
                let junk = tensor([1, co, oh, ow], 98);
                let c = Plane::of(&junk).unwrap();
                sparse_conv2d(x, &wt, Some(&b), opts, pre, r, c, every)
                    .unwrap()
                    .scatter_into(all.data_mut());
                assert!(max_diff(&all, &want) <= 1e-6, "{name}: full cover");
            }
        }
    }
}

#[test]
fn grow_is_the_set_of_outputs_whose_window_reads_the_region() {
    for (k, opts) in [
        (3, Conv2dOpts::same(3)),
        (3, DOWN),
        (3, UP),
        (1, Conv2dOpts::same(1)),
    ] {
        for seed in 0..4 {
            let (h, w) = (13 + seed as usize, 11);
            let region = blobs(h, w, seed + 40);
            let (got, oh, ow) = grow(&region, h, w, k, opts);
            assert_eq!((oh, ow), out_size(h, w, k, opts));
            let up = if opts.upsample2x { 2 } else { 1 };
            let [pt, _, pl, _] = opts.pad;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut reads = false;
                    for ky in 0..k {
                        for kx in 0..k {
                            let uy = (oy * opts.stride + ky) as isize - pt as isize;
                            let ux = (ox * opts.stride + kx) as isize - pl as isize;
                            if uy >= 0
                                && ux >= 0
                                && (uy as usize) < h * up
                                && (ux as usize) < w * up
                            {
                                let (iy, ix) = (uy as usize / up, ux as usize / up);
                                reads |= region[iy * w + ix];
                            }
                        }
                    }
                    assert_eq!(got[oy * ow + ox], reads, "k {k} {opts:?} at ({oy}, {ox})");
                }
            }
        }
    }
}

#[test]
fn grow_back_is_the_transpose_of_grow() {
    // Input pixel i is read by output o exactly when o is in grow({i}); so grow_back of
    // any output region is the set of inputs whose grown singleton meets it.
    for (k, opts) in [
        (3, Conv2dOpts::same(3)),
        (3, DOWN),
        (3, UP),
        (1, Conv2dOpts::same(1)),
    ] {
        let (h, w) = (9, 7);
        let (oh, ow) = out_size(h, w, k, opts);
        for seed in 0..3 {
            let out_region = blobs(oh, ow, seed + 70);
            let got = grow_back(&out_region, h, w, k, opts);
            for i in 0..h * w {
                let mut one = vec![false; h * w];
                one[i] = true;
                let (reach, _, _) = grow(&one, h, w, k, opts);
                let want = reach.iter().zip(&out_region).any(|(a, b)| *a && *b);
                assert_eq!(got[i], want, "k {k} {opts:?} input {i}");
            }
        }
    }
}

#[test]
fn tiles_cover_the_region_and_nothing_idle() {
    let (h, w) = (23, 30);
    let region = blobs(h, w, 5);
    let t = Tiles::covering(&region, h, w, 6).unwrap();
    let mut covered = vec![false; h * w];
    for i in 0..t.active.len() {
        let (y0, y1, x0, x1) = t.rect(i);
        let mut any = false;
        for y in y0..y1 {
            for x in x0..x1 {
                covered[y * w + x] = true;
                any |= region[y * w + x];
            }
        }
        assert!(any, "tile {:?} holds no region pixel", t.active[i]);
    }
    assert!(region.iter().zip(&covered).all(|(r, c)| !r || *c));
    // The runs are the region exactly, each inside its tile, in row-major order.
    let mut ran = vec![false; h * w];
    for i in 0..t.active.len() {
        let (y0, y1, x0, x1) = t.rect(i);
        let mut last = None;
        for r in t.runs(i) {
            assert!((y0..y1).contains(&r.y) && x0 <= r.x0 && r.x0 < r.x1 && r.x1 <= x1);
            assert!(last < Some((r.y, r.x0)), "runs out of order in tile {i}");
            last = Some((r.y, r.x0));
            for x in r.x0..r.x1 {
                assert!(!ran[r.y * w + x], "pixel ({}, {x}) in two runs", r.y);
                ran[r.y * w + x] = true;
            }
        }
    }
    assert_eq!(ran, region);
    assert_eq!(t.computed(), region.iter().filter(|&&r| r).count());
    assert_eq!(
        t.all_runs().len(),
        (0..t.active.len()).map(|i| t.runs(i).len()).sum::<usize>()
    );
    let whole = t.clone().whole();
    assert_eq!(whole.active, t.active);
    assert_eq!(whole.computed(), t.pixels());
    assert!((0..whole.active.len()).all(|i| whole.is_full(i)));
    assert_eq!(Tiles::all(h, w, 6).pixels(), h * w);
    assert!((0..Tiles::all(h, w, 6).active.len()).all(|i| Tiles::all(h, w, 6).is_full(i)));
    assert!(Tiles::covering(&region, h, w + 1, 6).is_err());
}

#[test]
fn group_sums_give_group_norm_and_update_exactly() {
    let (c, h, w, groups) = (8, 19, 14, 4);
    let x_old = tensor([1, c, h, w], 1);
    let region = blobs(h, w, 2);
    let x_new = edited(&x_old, &region, 3);
    let gw = tensor([1, 1, 1, c], 4);
    let gb = tensor([1, 1, 1, c], 5);
    let (gw, gb) = (
        Tensor::new([c], gw.data().to_vec()).unwrap(),
        Tensor::new([c], gb.data().to_vec()).unwrap(),
    );
    let eps = 1e-6;
    // The statistics, as scale and shift, give the dense GroupNorm (and its SiLU).
    let sums = GroupSums::of(&x_new, groups).unwrap();
    let (scale, shift) = sums.scale_shift(gw.data(), gb.data(), eps);
    for silu in [false, true] {
        let p = PreAct {
            scale: &scale,
            shift: &shift,
            silu,
        };
        let dense = group_norm(&x_new, groups, &gw, &gb, eps, silu).unwrap();
        let d = max_diff(&apply(&x_new, p), &dense);
        assert!(d <= 1e-6, "silu {silu}: {d}");
    }
    // Incremental: the template's sums updated from the changed tiles' old and new
    // values equal the edited input's own sums.
    for tile in [1, 5, 32] {
        let mut inc = GroupSums::of(&x_old, groups).unwrap();
        let tiles = Tiles::covering(&region, h, w, tile).unwrap();
        inc.update(
            Plane::of(&x_old).unwrap(),
            &TileData::from_tensor(&x_new, tiles).unwrap(),
        )
        .unwrap();
        for g in 0..groups {
            let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1.0);
            assert!(
                rel(inc.sum[g], sums.sum[g]) < 1e-12,
                "tile {tile} group {g}"
            );
            assert!(
                rel(inc.sumsq[g], sums.sumsq[g]) < 1e-12,
                "tile {tile} group {g}"
            );
        }
    }
    // Frozen statistics are the template's: they differ once the edit moves them.
    let frozen = GroupSums::of(&x_old, groups).unwrap();
    assert_ne!(frozen, sums);
}

#[test]
fn bad_shapes_are_refused() {
    let x = tensor([1, 4, 8, 8], 1);
    let w = tensor([2, 4, 3, 3], 2);
    let tiles = Tiles::all(8, 8, 4);
    let two = tensor([2, 4, 8, 8], 4);
    let opts = Conv2dOpts::same(3);
    assert!(Plane::of(&two).is_err());
    let xp = Plane::of(&x).unwrap();
    let out = tensor([1, 2, 8, 8], 3);
    let c = Plane::of(&out).unwrap();
    let wrong = Tiles::all(7, 8, 4);
    assert!(sparse_conv2d(xp, &w, None, opts, None, None, c, wrong).is_err());
    let small = tensor([1, 2, 4, 4], 5);
    let r = Some(Plane::of(&small).unwrap());
    assert!(sparse_conv2d(xp, &w, None, opts, None, r, c, tiles.clone()).is_err());
    let cached_small = Plane::of(&small).unwrap();
    assert!(sparse_conv2d(xp, &w, None, opts, None, None, cached_small, tiles.clone()).is_err());
    let w3 = tensor([2, 3, 3, 3], 6);
    assert!(sparse_conv2d(xp, &w3, None, opts, None, None, c, tiles.clone()).is_err());
    let other = TileData::new(Tiles::all(8, 8, 4), 3);
    assert!(xp.with(Some(&other)).is_err(), "tiles of 3 channels over 4");
    assert!(sparse_conv2d(xp, &w, None, opts, None, None, c, tiles).is_ok());
}

#[test]
fn a_plane_reads_its_tiles_over_the_base() {
    let (c, h, w) = (3, 13, 11);
    let old = tensor([1, c, h, w], 1);
    let region = blobs(h, w, 2);
    let new = edited(&old, &region, 3);
    for size in [1, 4, 5, 16] {
        let tiles = Tiles::covering(&region, h, w, size).unwrap();
        let d = TileData::from_tensor(&new, tiles).unwrap();
        let p = Plane::of(&old).unwrap().with(Some(&d)).unwrap();
        assert_eq!(p.to_tensor().data(), new.data(), "tile {size}");
        for (ch, y, x) in [(0, 0, 0), (2, 12, 10), (1, 6, 3)] {
            let mut one = [0.0];
            p.read_row(ch, y, x, x + 1, &mut one);
            assert_eq!(one[0], new.data()[(ch * h + y) * w + x]);
        }
        let mut row = vec![0.0; 7];
        p.read_row(1, 4, 2, 9, &mut row);
        assert_eq!(row, new.data()[(h + 4) * w + 2..][..7]);
    }
}
