//! Both tokenizer layouts load and tokenize alike: the FLUX repository's (CLIP as
//! `vocab.json` + `merges.txt`, T5 with `spiece.model`) and what transformers 5's
//! `save_pretrained` writes (`tokenizer.json` only). Token ids are compared with what
//! transformers itself produced for the same prompts (`tests/fixtures/tokenizers-tf5`,
//! made by its `gen.py`).

use denoised_models::text::{ClipTokenizer, T5Tokenizer};
use denoised_runtime::fixtures::tiny_model_dir;

fn tf5_dir() -> std::path::PathBuf {
    denoised_runtime::fixtures::fixtures_dir().join("tokenizers-tf5")
}

#[test]
fn transformers5_tokenizer_layout_loads_and_matches_transformers() {
    let dir = tf5_dir();
    assert!(
        !dir.join("tokenizer/vocab.json").exists(),
        "the new layout has no vocab.json"
    );
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let t5_len = expected["t5_max_length"].as_u64().unwrap() as usize;
    let layouts = [
        ("repository layout", tiny_model_dir()),
        ("transformers 5 layout", dir.clone()),
    ];
    for (what, root) in layouts {
        let clip = ClipTokenizer::from_dir(root.join("tokenizer")).unwrap();
        let t5 = T5Tokenizer::from_dir(root.join("tokenizer_2")).unwrap();
        for case in expected["cases"].as_array().unwrap() {
            let prompt = case["prompt"].as_str().unwrap();
            let ids = |v: &serde_json::Value| -> Vec<i64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect()
            };
            assert_eq!(
                clip.encode(prompt).unwrap().ids,
                ids(&case["clip"]),
                "{what}: CLIP ids of {prompt:?}"
            );
            assert_eq!(
                t5.encode(prompt, t5_len).unwrap().ids,
                ids(&case["t5"]),
                "{what}: T5 ids of {prompt:?}"
            );
        }
        println!(
            "{what}: {} prompts tokenize as transformers does",
            expected["cases"].as_array().unwrap().len()
        );
    }
}
