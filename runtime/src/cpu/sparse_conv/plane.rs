//! A value of a sparse pass as it is held: the template's cached tensor, with the tiles
//! the edit recomputed kept beside it instead of written into a copy.
//!
//! SIGE scatters each layer's tiles into a copy of the cached output. Copying every
//! cached output of the FLUX VAE is 2.2 GB per 512x512 decode (8.7 GB at 1024x1024):
//! fresh memory faulted in page by page, and as much memory traffic as the sparse
//! compute itself at a 10% mask (measured: a fifth of the sparse time went to page
//! faults and copies). So a value is a [`Plane`]: reads go to the recomputed tile when
//! there is one and to the cached tensor elsewhere, and a tensor is made only of the
//! pass's output.

use super::Tiles;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// No active tile at this place of the tile grid.
const NONE: u32 = u32::MAX;

/// The recomputed tiles of one value: tile `i` of `tiles.active` is `[c, th, tw]`,
/// contiguous, at `offsets[i]` of `data`.
#[derive(Clone, Debug)]
pub struct TileData {
    pub tiles: Tiles,
    pub c: usize,
    grid: Vec<u32>,
    offsets: Vec<usize>,
    pub data: Vec<f32>,
}

impl TileData {
    /// Zeroed tiles of `c` channels.
    pub fn new(tiles: Tiles, c: usize) -> TileData {
        let (gh, gw) = (tiles.h.div_ceil(tiles.size), tiles.w.div_ceil(tiles.size));
        let mut grid = vec![NONE; gh * gw];
        let mut offsets = Vec::with_capacity(tiles.active.len());
        let mut off = 0;
        for (i, &(ty, tx)) in tiles.active.iter().enumerate() {
            grid[ty * gw + tx] = i as u32;
            offsets.push(off);
            let (y0, y1, x0, x1) = tiles.rect(i);
            off += c * (y1 - y0) * (x1 - x0);
        }
        TileData {
            tiles,
            c,
            grid,
            offsets,
            data: vec![0.0; off],
        }
    }

    /// The tiles of `t` (`[1, C, H, W]`, the tiles' plane).
    pub fn from_tensor(t: &Tensor, tiles: Tiles) -> Result<TileData> {
        let p = Plane::of(t)?;
        if (p.h, p.w) != (tiles.h, tiles.w) {
            return Err(Error::shape(
                "tile data",
                format!("tiles of {}x{} for {:?}", tiles.h, tiles.w, t.shape()),
            ));
        }
        let mut d = TileData::new(tiles, p.c);
        for i in 0..d.tiles.active.len() {
            let rect = d.tiles.rect(i);
            p.read_rect(rect, d.block_mut(i));
        }
        Ok(d)
    }

    /// Tile `i`'s `[c, th, tw]` block.
    pub fn block(&self, i: usize) -> &[f32] {
        let (y0, y1, x0, x1) = self.tiles.rect(i);
        &self.data[self.offsets[i]..][..self.c * (y1 - y0) * (x1 - x0)]
    }

    pub fn block_mut(&mut self, i: usize) -> &mut [f32] {
        let (y0, y1, x0, x1) = self.tiles.rect(i);
        let len = self.c * (y1 - y0) * (x1 - x0);
        &mut self.data[self.offsets[i]..][..len]
    }

    /// The tiles, and the storage of each group of consecutive tiles (`groups`:
    /// ranges of tile indices, in order, each after the last), to be written in
    /// parallel.
    pub fn parts_mut(&mut self, groups: &[std::ops::Range<usize>]) -> (&Tiles, Vec<&mut [f32]>) {
        let n = self.tiles.active.len();
        let end = |i: usize| self.offsets.get(i).copied().unwrap_or(self.data.len());
        let cuts: Vec<(usize, usize)> = groups.iter().map(|g| (end(g.start), end(g.end))).collect();
        debug_assert!(groups.last().is_none_or(|g| g.end <= n));
        let mut parts = Vec::with_capacity(groups.len());
        let mut rest: &mut [f32] = &mut self.data;
        let mut at = 0;
        for (a, b) in cuts {
            assert!(a >= at && b >= a, "tile groups out of order");
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(a - at);
            let (part, tail) = tail.split_at_mut(b - a);
            parts.push(part);
            rest = tail;
            at = b;
        }
        (&self.tiles, parts)
    }

    /// The active tile holding pixel `(y, x)`, if any.
    #[inline]
    fn tile_at(&self, y: usize, x: usize) -> Option<usize> {
        let s = self.tiles.size;
        let gw = self.tiles.w.div_ceil(s);
        match self.grid[(y / s) * gw + x / s] {
            NONE => None,
            i => Some(i as usize),
        }
    }

    /// Writes the tiles into `out` (`[c, h, w]` of the tiles' plane).
    pub fn scatter_into(&self, out: &mut [f32]) {
        let (h, w) = (self.tiles.h, self.tiles.w);
        for i in 0..self.tiles.active.len() {
            let (y0, y1, x0, x1) = self.tiles.rect(i);
            let tw = x1 - x0;
            let b = self.block(i);
            for ch in 0..self.c {
                for (y, src) in (y0..y1).zip(b[ch * (y1 - y0) * tw..].chunks_exact(tw)) {
                    out[(ch * h + y) * w + x0..][..tw].copy_from_slice(src);
                }
            }
        }
    }
}

/// A `[C, H, W]` value: `base` with `new`'s tiles over it.
#[derive(Clone, Copy)]
pub struct Plane<'a> {
    pub base: &'a [f32],
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub new: Option<&'a TileData>,
}

impl<'a> Plane<'a> {
    /// A whole tensor of one image (`[1, C, H, W]`).
    pub fn of(t: &'a Tensor) -> Result<Plane<'a>> {
        match *t.shape() {
            [1, c, h, w] => Ok(Plane {
                base: t.data(),
                c,
                h,
                w,
                new: None,
            }),
            ref s => Err(Error::shape(
                "sparse plane",
                format!("expected one image [1, C, H, W], got {s:?}"),
            )),
        }
    }

    /// This plane with `new`'s tiles over it.
    pub fn with(self, new: Option<&'a TileData>) -> Result<Plane<'a>> {
        if let Some(d) = new {
            if (d.c, d.tiles.h, d.tiles.w) != (self.c, self.h, self.w) {
                return Err(Error::shape(
                    "sparse plane",
                    format!(
                        "tiles of [{}, {}, {}] over a [{}, {}, {}] value",
                        d.c, d.tiles.h, d.tiles.w, self.c, self.h, self.w
                    ),
                ));
            }
        }
        Ok(Plane { new, ..self })
    }

    /// `[1, C, H, W]`.
    pub fn shape(&self) -> [usize; 4] {
        [1, self.c, self.h, self.w]
    }

    /// Copies columns `x0..x1` of row `y` of channel `ch` into `dst`.
    #[inline]
    pub fn read_row(&self, ch: usize, y: usize, x0: usize, x1: usize, dst: &mut [f32]) {
        let row = (ch * self.h + y) * self.w;
        let Some(d) = self.new else {
            dst.copy_from_slice(&self.base[row + x0..row + x1]);
            return;
        };
        let s = d.tiles.size;
        let mut x = x0;
        while x < x1 {
            let end = x1.min((x / s + 1) * s);
            let dst = &mut dst[x - x0..end - x0];
            match d.tile_at(y, x) {
                None => dst.copy_from_slice(&self.base[row + x..row + end]),
                Some(i) => {
                    let (ty0, ty1, tx0, tx1) = d.tiles.rect(i);
                    let tw = tx1 - tx0;
                    let at = d.offsets[i] + (ch * (ty1 - ty0) + y - ty0) * tw + x - tx0;
                    dst.copy_from_slice(&d.data[at..at + (end - x)]);
                }
            }
            x = end;
        }
    }

    /// Copies the rectangle `(y0, y1, x0, x1)` of every channel into `dst`
    /// (`[c, y1 - y0, x1 - x0]`, a tile's layout).
    pub fn read_rect(&self, (y0, y1, x0, x1): (usize, usize, usize, usize), dst: &mut [f32]) {
        let tw = x1 - x0;
        for (ch, plane) in dst.chunks_exact_mut((y1 - y0) * tw).enumerate() {
            for (y, row) in (y0..y1).zip(plane.chunks_exact_mut(tw)) {
                self.read_row(ch, y, x0, x1, row);
            }
        }
    }

    /// The value as a tensor.
    pub fn to_tensor(&self) -> Tensor {
        let mut data = self.base.to_vec();
        if let Some(d) = self.new {
            d.scatter_into(&mut data);
        }
        Tensor::new(self.shape(), data).expect("sized from the plane")
    }
}
