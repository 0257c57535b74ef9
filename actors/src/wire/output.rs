//! How a request's image is finished and encoded: its format and quality, and the
//! paste-back over its source.

use serde::{Deserialize, Serialize};

/// An output image's encoding (`"png"` / `"jpeg"` / `"webp"` in the HTTP API's JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    #[default]
    Png,
    Jpeg,
    /// Lossy WebP (libwebp).
    Webp,
}

impl ImageFormat {
    /// Its media type.
    pub fn mime(self) -> &'static str {
        match self {
            ImageFormat::Png => "image/png",
            ImageFormat::Jpeg => "image/jpeg",
            ImageFormat::Webp => "image/webp",
        }
    }

    /// Its name in the API (and a file's extension).
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Png => "png",
            ImageFormat::Jpeg => "jpeg",
            ImageFormat::Webp => "webp",
        }
    }

    /// The quality a lossy format is encoded at without a `compression`: JPEG 92,
    /// WebP 90 (what most image services default to); PNG is lossless.
    pub fn quality(self, compression: Option<u8>) -> u8 {
        compression.unwrap_or(match self {
            ImageFormat::Webp => 90,
            _ => 92,
        })
    }
}

/// Postprocessing options of a request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FinishParams {
    pub paste_back: bool,
    pub feather: u32,
    pub format: ImageFormat,
    /// OpenAI's `output_compression` (0-100): the quality of a JPEG or WebP (lower is
    /// smaller); `None` is the format's default ([`ImageFormat::quality`]).
    #[serde(default)]
    pub compression: Option<u8>,
}

impl FinishParams {
    /// The decoded image as it is, nothing pasted back (a generation, a capture's
    /// reconstruction).
    pub fn whole_image(format: ImageFormat, compression: Option<u8>) -> Self {
        FinishParams {
            paste_back: false,
            feather: 0,
            format,
            compression,
        }
    }
}
