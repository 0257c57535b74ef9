//! The prompts under one exact key, their unit embeddings in one contiguous buffer, so
//! the exact scan streams through memory (with an allocation and a hash lookup per
//! prompt it cost 3x the bare dot products at 10,000 prompts).

use std::collections::HashMap;

use super::PromptId;

#[derive(Default)]
pub struct Rows {
    ids: Vec<PromptId>,
    /// `ids.len()` rows of `dim` values.
    data: Vec<f32>,
    dim: usize,
    at: HashMap<PromptId, usize>,
}

impl Rows {
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Adds a prompt. Every row of a key has one width (the key names the model); a
    /// row of another width is refused.
    pub fn push(&mut self, id: PromptId, unit: &[f32]) -> bool {
        if self.ids.is_empty() {
            self.dim = unit.len();
        }
        if unit.len() != self.dim {
            return false;
        }
        self.at.insert(id, self.ids.len());
        self.ids.push(id);
        self.data.extend_from_slice(unit);
        true
    }

    /// Takes a prompt out (the last row moves into its place).
    pub fn remove(&mut self, id: PromptId) {
        let Some(i) = self.at.remove(&id) else { return };
        let last = self.ids.len() - 1;
        self.ids.swap_remove(i);
        if i != last {
            let d = self.dim;
            self.data.copy_within(last * d..(last + 1) * d, i * d);
            self.at.insert(self.ids[i], i);
        }
        self.data.truncate(last * self.dim);
    }

    pub fn get(&self, id: PromptId) -> Option<&[f32]> {
        let i = *self.at.get(&id)?;
        Some(&self.data[i * self.dim..(i + 1) * self.dim])
    }

    /// Every row, in storage order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (PromptId, &[f32])> {
        self.ids
            .iter()
            .copied()
            .zip(self.data.chunks_exact(self.dim.max(1)))
    }
}
