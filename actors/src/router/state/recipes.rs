//! Templates' recipes (docs/cluster.md): what a pod needs to capture a template again
//! when every pod that held it is lost — its description (prompt, seed, steps, LoRAs:
//! the capture's parameters) and its image, a few MB where the template is tens of GB.
//! `[cluster] recipe_copies` pods besides a template's holders keep its recipe, under
//! `<cache dir>/.recipes/<id>/` (a name the disk tier's scan passes over), so a
//! template outlives all its copies; another pod asks one of them when it needs it.

use std::path::PathBuf;

use crate::wire::TemplateInfo;
use crate::workers::cache::disk;

pub struct Recipes {
    dir: PathBuf,
}

const INFO: &str = "info.json";
const IMAGE: &str = "image.bin";

impl Recipes {
    pub fn new(cache_dir: PathBuf) -> Self {
        Recipes {
            dir: cache_dir.join(".recipes"),
        }
    }

    fn path(&self, id: &str) -> Option<PathBuf> {
        // Anything but a template id is not one of theirs (nor a safe path part).
        crate::wire::check_template_id(id)
            .ok()
            .map(|()| self.dir.join(id))
    }

    pub fn has(&self, id: &str) -> bool {
        self.path(id).is_some_and(|p| p.join(IMAGE).is_file())
    }

    /// Keeps template `id`'s recipe: its description as the disk tier stores it, and
    /// its image. Written whole or not at all.
    pub fn save(&self, id: &str, info: &[u8], image: &[u8]) -> Result<(), String> {
        let dest = self
            .path(id)
            .ok_or_else(|| format!("`{id}` is no template id"))?;
        disk::stored_info(info)?;
        let tmp = self.dir.join(format!(".{id}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(&tmp)?;
            std::fs::write(tmp.join(INFO), info)?;
            std::fs::write(tmp.join(IMAGE), image)?;
            let _ = std::fs::remove_dir_all(&dest);
            std::fs::rename(&tmp, &dest)
        };
        write().map_err(|e| format!("{}: {e}", dest.display()))
    }

    /// Template `id`'s description, if this pod kept its recipe.
    pub fn info(&self, id: &str) -> Option<TemplateInfo> {
        let p = self.path(id)?;
        disk::stored_info(&std::fs::read(p.join(INFO)).ok()?).ok()
    }

    /// Template `id`'s description and image, if this pod kept its recipe.
    pub fn get(&self, id: &str) -> Option<(TemplateInfo, Vec<u8>)> {
        let image = std::fs::read(self.path(id)?.join(IMAGE)).ok()?;
        Some((self.info(id)?, image))
    }

    /// Template `id`'s description as stored and its image (what a peer is sent).
    pub fn stored(&self, id: &str) -> Option<(Vec<u8>, Vec<u8>)> {
        let p = self.path(id)?;
        Some((
            std::fs::read(p.join(INFO)).ok()?,
            std::fs::read(p.join(IMAGE)).ok()?,
        ))
    }

    /// The ids of the recipes this pod keeps.
    pub fn ids(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .filter(|n| !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Drops template `id`'s recipe.
    pub fn remove(&self, id: &str) {
        if let Some(p) = self.path(id) {
            let _ = std::fs::remove_dir_all(p);
        }
    }

    /// How many recipes this pod keeps.
    pub fn count(&self) -> usize {
        self.ids().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recipe_is_kept_whole_and_read_back() {
        let d = tempfile::tempdir().unwrap();
        let r = Recipes::new(d.path().to_path_buf());
        let info = serde_json::to_vec(&serde_json::json!({"version": 7, "info": {
            "id": "room", "model": "m", "width": 64, "height": 64, "tokens": 16,
            "steps": 4, "guidance": 30.0, "seed": 1, "prompt": "a room",
            "max_sequence_length": 32, "cache_bytes": 1, "created_unix": 0.0,
        }}))
        .unwrap();
        assert!(!r.has("room"));
        r.save("room", &info, b"png").unwrap();
        let (got, image) = r.get("room").unwrap();
        assert_eq!((got.id.as_str(), image.as_slice()), ("room", &b"png"[..]));
        assert_eq!(r.count(), 1);
        // Not a description: refused, and the kept recipe stands.
        assert!(r.save("room", b"{}", b"x").is_err());
        assert_eq!(r.get("room").unwrap().1, b"png");
        assert!(r.save("../x", &info, b"x").is_err());
        r.remove("room");
        assert!(!r.has("room") && r.get("room").is_none());
    }
}
