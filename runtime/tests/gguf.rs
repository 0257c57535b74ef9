//! The GGUF reader and the dequantisers against gguf-py: `tests/fixtures/formats/
//! types.gguf` and the values `gguf.quants.dequantize` gave for it
//! (`tests/fixtures/gen_gguf_types.py`), compared bit for bit.

use std::path::PathBuf;

use denoised_runtime::gguf::GgufFile;
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{DType, Error, QuantType, StoredFormat};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/formats")
        .join(name)
}

const TYPES: [&str; 9] = [
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K",
];

#[test]
fn every_type_dequantises_bit_exactly_as_gguf_py() {
    let g = GgufFile::open(fixture("types.gguf")).unwrap();
    let want = SafetensorsFile::open(fixture("types_expected.safetensors")).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.metadata_str("general.architecture"), Some("flux"));
    assert_eq!(g.metadata_u64("denoised.fixture.rows"), Some(4));
    assert_eq!(g.names().len(), TYPES.len() + 1);
    for ty in TYPES {
        let name = format!("t.{ty}");
        assert_eq!(g.info(&name), Some((vec![4, 512], ty.to_string())));
        let s = g.stored(&name).unwrap();
        assert_eq!(s.format_name(), ty);
        let got = s.to_f32().unwrap();
        let want = want.tensor_f32(&name).unwrap();
        assert_eq!(got.shape(), want.shape(), "{name}");
        let mismatches: Vec<_> = got
            .data()
            .iter()
            .zip(want.data())
            .enumerate()
            .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
            .map(|(i, (a, b))| (i, *a, *b))
            .collect();
        assert!(
            mismatches.is_empty(),
            "{name}: {} of {} differ, first {:?}",
            mismatches.len(),
            got.len(),
            &mismatches[..mismatches.len().min(4)]
        );
        assert!(got.data().iter().all(|v| v.is_finite()), "{name}");
        // Rows are whole blocks, and chunked conversion agrees with the whole.
        let rows = s.rows(1..3).unwrap();
        assert_eq!(rows.shape, vec![2, 512]);
        assert_eq!(rows.to_f32().unwrap().data(), &got.data()[512..1536]);
        let chunked: Vec<u8> = s
            .chunks_as(DType::F32, 700)
            .unwrap()
            .flat_map(|c| c.into_owned())
            .collect();
        let whole: Vec<u8> = got.data().iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(chunked, whole, "{name}");
    }
    let q = g.stored("t.Q4_K").unwrap();
    assert_eq!(q.format(), StoredFormat::Quant(QuantType::Q4_K));
    assert_eq!(q.bytes.len(), 4 * 2 * 144);
    g.release_pages().unwrap();
}

#[test]
fn an_unsupported_type_is_refused_naming_file_tensor_and_type() {
    let g = GgufFile::open(fixture("types.gguf")).unwrap();
    assert_eq!(g.info("t.Q3_K"), Some((vec![4, 512], "Q3_K".to_string())));
    let e = g.stored("t.Q3_K").unwrap_err().to_string();
    assert!(e.contains("types.gguf"), "{e}");
    assert!(e.contains("`t.Q3_K`"), "{e}");
    assert!(e.contains("Q3_K is not supported (supported: "), "{e}");
    assert!(e.contains("Q4_K"), "{e}");
    assert!(matches!(
        g.stored("nope").unwrap_err(),
        Error::MissingTensor { .. }
    ));
}

#[test]
fn a_truncated_file_names_the_first_tensor_it_cuts() {
    let bytes = std::fs::read(fixture("types.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let names = GgufFile::open(fixture("types.gguf")).unwrap().names();
    // Cut inside the last tensor's data (Q3_K, 880 bytes).
    let cut = bytes.len() - 100;
    let path = dir.path().join("cut.gguf");
    std::fs::write(&path, &bytes[..cut]).unwrap();
    let e = GgufFile::open(&path).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Truncated { .. }), "{msg}");
    assert!(
        msg.contains("cut.gguf") && msg.contains("truncated"),
        "{msg}"
    );
    // The last tensor's bytes reach the end of the file.
    assert!(
        msg.contains(&format!("`{}`", names[names.len() - 1])),
        "{msg}"
    );

    // Cut inside the header: the error says what it was reading.
    let path = dir.path().join("head.gguf");
    std::fs::write(&path, &bytes[..200]).unwrap();
    let msg = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        msg.contains("head.gguf") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn bad_magic_and_versions_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    let st = std::fs::read(fixture("types_expected.safetensors")).unwrap();
    std::fs::write(&path, &st).unwrap();
    let msg = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        msg.contains("model.gguf") && msg.contains("bad magic"),
        "{msg}"
    );

    let mut bytes = std::fs::read(fixture("types.gguf")).unwrap();
    bytes[4..8].copy_from_slice(&7u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let msg = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        msg.contains("model.gguf") && msg.contains("version 7"),
        "{msg}"
    );

    // Version 2 has the v3 layout (little-endian, u64 counts): it reads the same.
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 2);
    assert_eq!(g.stored("t.Q6_K").unwrap().len(), 2048);
}

#[test]
fn fp8_safetensors_tensors_are_stored_as_fp8_with_a_scale() {
    use denoised_runtime::fp8::DECODE;
    use safetensors::tensor::{Dtype, TensorView};
    let bytes: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect(); // no NaN
    let n = bytes.len();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fp8.safetensors");
    let scale = [0.75f32.to_le_bytes()].concat();
    let views = vec![
        (
            "w.weight".to_string(),
            TensorView::new(Dtype::F8_E4M3, vec![2, n / 2], &bytes).unwrap(),
        ),
        (
            "w.scale_weight".to_string(),
            TensorView::new(Dtype::F32, vec![1], &scale).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let f = SafetensorsFile::open(&path).unwrap();
    let s = f.stored("w.weight").unwrap();
    assert_eq!(s.format(), StoredFormat::Fp8 { scale: 1.0 });
    let unscaled: Vec<f32> = bytes.iter().map(|&b| DECODE[b as usize]).collect();
    assert_eq!(f.weight("w.weight").unwrap().data(), &unscaled[..]);
    assert_eq!(f.tensor_f32("w.weight").unwrap().data(), &unscaled[..]);
    let s = s.with_scale(0.75).unwrap();
    let want: Vec<f32> = unscaled.iter().map(|v| v * 0.75).collect();
    assert_eq!(s.to_f32().unwrap().data(), &want[..]);
    assert_eq!(
        s.rows(1..2).unwrap().to_f32().unwrap().data(),
        &want[n / 2..]
    );
    let bf: Vec<u8> = s
        .chunks_as(DType::BF16, 7)
        .unwrap()
        .flat_map(|c| c.into_owned())
        .collect();
    let want_bf: Vec<u8> = want
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    assert_eq!(bf, want_bf);
    // A scale is for fp8 tensors only.
    let e = f
        .stored("w.scale_weight")
        .unwrap()
        .with_scale(2.0)
        .unwrap_err();
    assert!(e.to_string().contains("w.scale_weight"), "{e}");
}
