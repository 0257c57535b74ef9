//! `[templates]`: templates the daemon makes by itself from the images clients send
//! again and again (docs/api.md, "Templates that make themselves").

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TemplatesConfig {
    /// An uploaded image edited `auto_admit_after` times within `auto_window_seconds`
    /// is captured as a template, and its later edits are template edits (on by
    /// default: what denoised is for; a request's `auto_template: false` keeps its
    /// full run). Off: every edit of an upload runs in full.
    pub auto: bool,
    /// The sighting that captures it (2: the second; 1 captures every upload).
    pub auto_admit_after: u32,
    /// The sightings must fall within this many seconds of the first of them.
    pub auto_window_seconds: f64,
    /// How many images' sightings are counted (each a 32-byte digest and its count);
    /// past it the one seen least recently is forgotten.
    pub auto_track: usize,
}

impl Default for TemplatesConfig {
    fn default() -> Self {
        TemplatesConfig {
            auto: true,
            auto_admit_after: 2,
            auto_window_seconds: 3600.0,
            auto_track: 65536,
        }
    }
}

impl TemplatesConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.auto_admit_after == 0 {
            return Err("[templates] auto_admit_after must be at least 1".into());
        }
        if self.auto_window_seconds.is_nan()
            || self.auto_window_seconds <= 0.0
            || self.auto_track == 0
        {
            return Err("[templates] auto_window_seconds and auto_track must be above 0".into());
        }
        Ok(())
    }
}
