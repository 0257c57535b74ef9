//! The two FLUX tokenizers, token-for-token equal to what FluxFillPipeline gets from
//! transformers: `CLIPTokenizer` (max_length 77) and `T5TokenizerFast`
//! (`max_sequence_length`), both called with `padding="max_length", truncation=True`.
//!
//! The normalisation, pre-tokenisation and subword models come from the `tokenizers`
//! crate (the same Rust code transformers' fast tokenizers run). Special tokens,
//! truncation and padding are done here instead of through the crate's
//! post-processor and padding options, because the caller needs to know whether a
//! prompt was cut (the pipeline warns about it) and the rule is short: keep as many
//! leading pieces as fit with the specials, then pad.
//!
//! CLIP has no `tokenizer.json` in the FLUX repository, so its pipeline is built
//! from `vocab.json` + `merges.txt` the way transformers' `CLIPConverter` does.

use std::path::Path;

use denoised_runtime::{Error, Result};
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Lowercase, Replace, Sequence as NormSeq, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// CLIP's context length, and so FLUX's CLIP prompt length.
pub const CLIP_MAX_LENGTH: usize = 77;
/// FluxFillPipeline's default `max_sequence_length` for T5.
pub const T5_DEFAULT_MAX_LENGTH: usize = 512;

/// The pre-tokenizer split of transformers 5's CLIP tokenizer: the two specials,
/// English contractions, runs of letters, single digits, runs of other non-space
/// characters. Whitespace between matches is dropped.
const CLIP_SPLIT: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// One tokenized prompt, padded to the fixed length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenIds {
    pub ids: Vec<i64>,
    /// 1 for real tokens (specials included), 0 for padding. The pipeline does not
    /// pass it to either encoder; it is kept for logging and tests.
    pub attention_mask: Vec<i64>,
    /// Length with specials before truncation (`> ids.len()` iff truncated).
    pub untruncated_len: usize,
}

impl TokenIds {
    /// Whether the prompt lost tokens to truncation (FluxFillPipeline warns).
    pub fn truncated(&self) -> bool {
        self.untruncated_len > self.ids.len()
    }

    /// `[prefix] + pieces + [suffix]`, cut to `max_len` by dropping trailing
    /// pieces (never the specials), then padded with `pad`.
    fn build(pieces: &[u32], prefix: Option<u32>, suffix: u32, pad: u32, max_len: usize) -> Self {
        let specials = 1 + prefix.is_some() as usize;
        let keep = pieces.len().min(max_len - specials);
        let mut ids: Vec<i64> = Vec::with_capacity(max_len);
        ids.extend(prefix.map(i64::from));
        ids.extend(pieces[..keep].iter().map(|&i| i64::from(i)));
        ids.push(i64::from(suffix));
        let real = ids.len();
        ids.resize(max_len, i64::from(pad));
        let mut attention_mask = vec![1i64; real];
        attention_mask.resize(max_len, 0);
        TokenIds {
            ids,
            attention_mask,
            untruncated_len: pieces.len() + specials,
        }
    }
}

fn tk_err(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::BadConfig {
        path: path.to_path_buf(),
        reason: format!("{what}: {e}"),
    }
}

/// `tokenizer_config.json` values may be plain strings or AddedToken objects.
fn config_token(cfg: &serde_json::Value, key: &str, default: &str) -> String {
    match cfg.get(key) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v) => v
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or(default)
            .to_string(),
        None => default.to_string(),
    }
}

fn parse_tokenizer_config(text: Option<&str>, origin: &Path) -> Result<serde_json::Value> {
    match text {
        None => Ok(serde_json::Value::Null),
        Some(t) => serde_json::from_str(t)
            .map_err(|e| tk_err(&origin.join("tokenizer_config.json"), "invalid JSON", e)),
    }
}

/// The BPE vocabulary and merges inside a `tokenizer.json`, in the text forms of
/// `vocab.json` and `merges.txt`, so that both layouts build the same pipeline.
/// Merges are `"a b"` strings (tokenizers < 0.20) or `["a", "b"]` pairs.
fn bpe_from_tokenizer_json(text: &str, path: &Path) -> Result<(String, String)> {
    let bad = |why: &str| tk_err(path, "cannot read the BPE model of tokenizer.json", why);
    let json: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
    let model = json.get("model").ok_or_else(|| bad("no `model`"))?;
    if model.get("type").and_then(|t| t.as_str()) != Some("BPE") {
        return Err(bad("the model is not BPE"));
    }
    let vocab = model
        .get("vocab")
        .filter(|v| v.is_object())
        .ok_or_else(|| bad("no `model.vocab` object"))?;
    let merges = model
        .get("merges")
        .and_then(|m| m.as_array())
        .ok_or_else(|| bad("no `model.merges` list"))?;
    let mut lines = String::new();
    for m in merges {
        let pair = match m {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(p) => match &p[..] {
                [serde_json::Value::String(a), serde_json::Value::String(b)] => {
                    format!("{a} {b}")
                }
                _ => return Err(bad(&format!("merge {m} is not a pair of strings"))),
            },
            _ => return Err(bad(&format!("merge {m} is not a pair"))),
        };
        lines.push_str(&pair);
        lines.push('\n');
    }
    Ok((vocab.to_string(), lines))
}

fn read_tokenizer_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(serde_json::Value::Null);
    }
    super::ops::read_json(&path)
}

/// `CLIPTokenizer` as FLUX's `tokenizer/` directory defines it.
pub struct ClipTokenizer {
    tk: Tokenizer,
    bos: u32,
    eos: u32,
    pad: u32,
    max_len: usize,
}

impl ClipTokenizer {
    /// Builds the tokenizer from `vocab.json`, `merges.txt` and (optionally)
    /// `tokenizer_config.json` for the special-token names and `model_max_length`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(|e| {
                let kind = e.kind();
                Error::io(
                    &p,
                    std::io::Error::new(kind, format!("CLIP tokenizer file: {e}")),
                )
            })
        };
        // transformers 5's `save_pretrained` writes only `tokenizer.json`; older
        // versions (and the FLUX repository) `vocab.json` + `merges.txt`.
        let (vocab, merges) =
            if !dir.join("vocab.json").exists() && dir.join("tokenizer.json").exists() {
                bpe_from_tokenizer_json(&read("tokenizer.json")?, &dir.join("tokenizer.json"))?
            } else {
                (read("vocab.json")?, read("merges.txt")?)
            };
        Self::build(&vocab, &merges, read_tokenizer_config(dir)?, dir)
    }

    /// From the contents of `vocab.json`, `merges.txt` and `tokenizer_config.json`:
    /// how the built-in model carries its tokenizer inside the binary.
    pub fn from_parts(
        vocab_json: &str,
        merges_txt: &str,
        tokenizer_config: Option<&str>,
    ) -> Result<Self> {
        let origin = Path::new("<built-in CLIP tokenizer>");
        Self::build(
            vocab_json,
            merges_txt,
            parse_tokenizer_config(tokenizer_config, origin)?,
            origin,
        )
    }

    fn build(
        vocab_json: &str,
        merges_txt: &str,
        cfg: serde_json::Value,
        dir: &Path,
    ) -> Result<Self> {
        let vocab_path = dir.join("vocab.json");
        let merges_path = dir.join("merges.txt");
        let vocab: tokenizers::models::bpe::Vocab =
            serde_json::from_str::<std::collections::HashMap<String, u32>>(vocab_json)
                .map_err(|e| tk_err(&vocab_path, "cannot read vocab.json", e))?
                .into_iter()
                .collect();
        // The merges format of BPE::read_file: an optional `#version` line, then one
        // `left right` pair per line, highest priority first.
        let mut merges = Vec::new();
        for (i, line) in merges_txt
            .lines()
            .filter(|l| !l.starts_with("#version"))
            .enumerate()
        {
            match line.split(' ').collect::<Vec<_>>()[..] {
                [a, b] => merges.push((a.to_string(), b.to_string())),
                _ => {
                    return Err(tk_err(
                        &merges_path,
                        "cannot read vocab.json + merges.txt",
                        format!("merge {} is not a pair: `{line}`", i + 1),
                    ))
                }
            }
        }
        let bos_tok = config_token(&cfg, "bos_token", "<|startoftext|>");
        let eos_tok = config_token(&cfg, "eos_token", "<|endoftext|>");
        let pad_tok = config_token(&cfg, "pad_token", &eos_tok);
        let unk_tok = config_token(&cfg, "unk_token", &eos_tok);
        let id_of = |t: &str| {
            vocab.get(t).copied().ok_or_else(|| {
                tk_err(
                    &vocab_path,
                    "special token",
                    format!("`{t}` is not in the vocabulary"),
                )
            })
        };
        let (bos, eos, pad) = (id_of(&bos_tok)?, id_of(&eos_tok)?, id_of(&pad_tok)?);
        id_of(&unk_tok)?;
        let max_len = cfg
            .get("model_max_length")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .unwrap_or(CLIP_MAX_LENGTH);
        if !(2..=1 << 16).contains(&max_len) {
            return Err(tk_err(
                &dir.join("tokenizer_config.json"),
                "model_max_length",
                format!("{max_len} is not a usable CLIP context length"),
            ));
        }

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .end_of_word_suffix("</w>".into())
            .unk_token(unk_tok)
            .build()
            .map_err(|e| tk_err(&merges_path, "cannot build the BPE model", e))?;
        let mut tk = Tokenizer::new(bpe);
        let ws = Replace::new(
            tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()),
            " ",
        )
        .map_err(|e| tk_err(&vocab_path, "normalizer", e))?;
        tk.with_normalizer(Some(NormSeq::new(vec![
            NFC.into(),
            ws.into(),
            Lowercase.into(),
        ])));
        let split = Split::new(
            SplitPattern::Regex(CLIP_SPLIT.into()),
            SplitDelimiterBehavior::Removed,
            true,
        )
        .map_err(|e| tk_err(&vocab_path, "pre-tokenizer", e))?;
        // ByteLevel(add_prefix_space=False) with its default use_regex=True, as in
        // transformers' converter; after the split above its regex changes nothing.
        tk.with_pre_tokenizer(Some(PreSeq::new(vec![
            split.into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        // Specials typed into a prompt are matched as whole tokens, as transformers does.
        let mut specials = vec![
            AddedToken::from(bos_tok, true),
            AddedToken::from(eos_tok.clone(), true),
        ];
        if pad_tok != eos_tok {
            specials.push(AddedToken::from(pad_tok, true));
        }
        tk.add_special_tokens(&specials);
        Ok(ClipTokenizer {
            tk,
            bos,
            eos,
            pad,
            max_len,
        })
    }

    /// Padded length of every encoding (77 for CLIP).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// `tokenizer(prompt, padding="max_length", max_length=77, truncation=True)`:
    /// `<|startoftext|>`, at most 75 pieces, `<|endoftext|>`, then `<|endoftext|>`
    /// padding.
    pub fn encode(&self, prompt: &str) -> Result<TokenIds> {
        let enc = self
            .tk
            .encode(prompt, false)
            .map_err(|e| Error::Invalid(format!("CLIP tokenizer failed on the prompt: {e}")))?;
        Ok(TokenIds::build(
            enc.get_ids(),
            Some(self.bos),
            self.eos,
            self.pad,
            self.max_len,
        ))
    }
}

/// `T5TokenizerFast` from FLUX's `tokenizer_2/tokenizer.json`.
pub struct T5Tokenizer {
    tk: Tokenizer,
    eos: u32,
    pad: u32,
}

impl T5Tokenizer {
    /// Loads `tokenizer.json` (SentencePiece unigram, precompiled normalizer) and
    /// looks up `</s>` and `<pad>` (names from `tokenizer_config.json` when present).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::io(
                &path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "T5 tokenizer file missing"),
            ));
        }
        let tk = Tokenizer::from_file(&path).map_err(|e| tk_err(&path, "cannot load", e))?;
        Self::build(tk, read_tokenizer_config(dir)?, &path)
    }

    /// From the contents of `tokenizer.json` and `tokenizer_config.json` (the built-in
    /// model's tokenizer lives in the binary).
    pub fn from_parts(tokenizer_json: &str, tokenizer_config: Option<&str>) -> Result<Self> {
        let path = Path::new("<built-in T5 tokenizer>");
        let tk = Tokenizer::from_bytes(tokenizer_json.as_bytes())
            .map_err(|e| tk_err(path, "cannot load", e))?;
        Self::build(tk, parse_tokenizer_config(tokenizer_config, path)?, path)
    }

    fn build(mut tk: Tokenizer, cfg: serde_json::Value, path: &Path) -> Result<Self> {
        // Truncation and padding are applied in `encode`.
        tk.with_truncation(None)
            .map_err(|e| tk_err(path, "truncation", e))?;
        tk.with_padding(None);
        let id_of = |key: &str, default: &str| {
            let t = config_token(&cfg, key, default);
            tk.token_to_id(&t).ok_or_else(|| {
                tk_err(
                    path,
                    "special token",
                    format!("`{t}` is not in the vocabulary"),
                )
            })
        };
        let eos = id_of("eos_token", "</s>")?;
        let pad = id_of("pad_token", "<pad>")?;
        Ok(T5Tokenizer { tk, eos, pad })
    }

    /// `tokenizer_2(prompt, padding="max_length", max_length=max_len, truncation=True)`:
    /// at most `max_len - 1` pieces, `</s>`, then `<pad>` padding.
    pub fn encode(&self, prompt: &str, max_len: usize) -> Result<TokenIds> {
        if max_len == 0 {
            return Err(Error::Invalid(
                "T5 tokenizer: max_sequence_length must be at least 1".into(),
            ));
        }
        let enc = self
            .tk
            .encode(prompt, false)
            .map_err(|e| Error::Invalid(format!("T5 tokenizer failed on the prompt: {e}")))?;
        Ok(TokenIds::build(
            enc.get_ids(),
            None,
            self.eos,
            self.pad,
            max_len,
        ))
    }
}
