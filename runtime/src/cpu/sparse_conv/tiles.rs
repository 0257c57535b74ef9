//! Where a sparse layer works: square tiles of its output plane (the unit a sparse
//! value is stored in, see [`super::TileData`]) and, inside each, the runs of region
//! pixels it computes.
//!
//! A tile is storage, a run is work. A region grown by the receptive field is a blob
//! with a ragged edge, and square tiles around it hold 1.2-1.4x its pixels (at
//! 512x512 and m <= 0.1, 16-pixel tiles). Computing whole tiles spent those MACs on
//! pixels nothing needs: those outside the region either equal the template (outside
//! the difference) or are never read (outside what the output needs). So a layer
//! computes only the runs, and the rest of an active tile keeps the cached output.

use crate::error::{Error, Result};

/// A row segment of region pixels: row `y`, columns `x0..x1`, inside one tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub y: usize,
    pub x0: usize,
    pub x1: usize,
}

impl Run {
    pub fn len(&self) -> usize {
        self.x1 - self.x0
    }

    pub fn is_empty(&self) -> bool {
        self.x1 == self.x0
    }
}

/// Square tiles of an `h x w` plane, the active ones listed in row-major order, each
/// with the runs of region pixels it computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tiles {
    pub h: usize,
    pub w: usize,
    pub size: usize,
    /// `(tile row, tile column)` of each active tile.
    pub active: Vec<(usize, usize)>,
    /// Tile `i`'s runs are `runs[starts[i]..starts[i + 1]]`, row-major.
    runs: Vec<Run>,
    starts: Vec<usize>,
}

impl Tiles {
    /// The tiles of an `h x w` plane holding any pixel of `region` (`[h * w]`,
    /// row-major), computing exactly the region's pixels.
    pub fn covering(region: &[bool], h: usize, w: usize, size: usize) -> Result<Tiles> {
        if region.len() != h * w || size == 0 {
            return Err(Error::shape(
                "sparse tiles",
                format!(
                    "region of {} pixels for a {h}x{w} plane, tile size {size}",
                    region.len()
                ),
            ));
        }
        let (th, tw) = (h.div_ceil(size), w.div_ceil(size));
        // Runs per tile, found row by row: a run is cut at tile borders.
        let mut per_tile: Vec<Vec<Run>> = vec![Vec::new(); th * tw];
        for y in 0..h {
            let row = &region[y * w..(y + 1) * w];
            let mut x = 0;
            while x < w {
                if !row[x] {
                    x += 1;
                    continue;
                }
                let end = (x / size + 1) * size;
                let mut x1 = x;
                while x1 < end.min(w) && row[x1] {
                    x1 += 1;
                }
                per_tile[(y / size) * tw + x / size].push(Run { y, x0: x, x1 });
                x = x1;
            }
        }
        let mut t = Tiles {
            h,
            w,
            size,
            active: Vec::new(),
            runs: Vec::new(),
            starts: vec![0],
        };
        for (i, runs) in per_tile.into_iter().enumerate() {
            if !runs.is_empty() {
                t.active.push((i / tw, i % tw));
                t.runs.extend(runs);
                t.starts.push(t.runs.len());
            }
        }
        Ok(t)
    }

    /// Every tile of the plane, computed whole.
    pub fn all(h: usize, w: usize, size: usize) -> Tiles {
        let region = vec![true; h * w];
        Tiles::covering(&region, h, w, size.max(1)).expect("a region of the plane's size")
    }

    /// The same active tiles, each computed whole.
    pub fn whole(self) -> Tiles {
        let mut t = Tiles {
            runs: Vec::new(),
            starts: vec![0],
            ..self
        };
        for i in 0..t.active.len() {
            let (y0, y1, x0, x1) = t.rect(i);
            t.runs.extend((y0..y1).map(|y| Run { y, x0, x1 }));
            t.starts.push(t.runs.len());
        }
        t
    }

    /// Pixel rectangle `(y0, y1, x0, x1)` of active tile `i`, clipped to the plane.
    pub fn rect(&self, i: usize) -> (usize, usize, usize, usize) {
        let (ty, tx) = self.active[i];
        let (y0, x0) = (ty * self.size, tx * self.size);
        (
            y0,
            (y0 + self.size).min(self.h),
            x0,
            (x0 + self.size).min(self.w),
        )
    }

    /// The runs active tile `i` computes.
    pub fn runs(&self, i: usize) -> &[Run] {
        &self.runs[self.starts[i]..self.starts[i + 1]]
    }

    /// Every run, tile by tile.
    pub fn all_runs(&self) -> &[Run] {
        &self.runs
    }

    /// Pixels of active tile `i` that its runs compute.
    pub fn computed_in(&self, i: usize) -> usize {
        self.runs(i).iter().map(Run::len).sum()
    }

    /// Whether the runs of active tile `i` cover it whole.
    pub fn is_full(&self, i: usize) -> bool {
        let (y0, y1, x0, x1) = self.rect(i);
        self.computed_in(i) == (y1 - y0) * (x1 - x0)
    }

    /// Pixels the active tiles hold (what their values take in memory).
    pub fn pixels(&self) -> usize {
        (0..self.active.len())
            .map(|i| {
                let (y0, y1, x0, x1) = self.rect(i);
                (y1 - y0) * (x1 - x0)
            })
            .sum()
    }

    /// Pixels the runs compute: the region's.
    pub fn computed(&self) -> usize {
        self.runs.iter().map(Run::len).sum()
    }
}
