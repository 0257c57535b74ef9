//! Weights reach the device in their stored dtype (`Backend::upload_stored`): parts
//! of a fused layer stack in order, bf16 goes to a bf16 device as stored, and other
//! dtypes are converted with round to nearest even. On the emulator.
#![cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)

use denoised_cuda::{Dt, EmuExec, GpuBackend};
use denoised_runtime::weights::SafetensorsFile;
use denoised_runtime::{Backend, DType, Stored, Tensor};
use safetensors::tensor::{Dtype, TensorView};

fn bf16_le(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

#[test]
fn stored_parts_stack_on_the_device_in_its_dtype() {
    let a: Vec<f32> = (0..24).map(|i| i as f32 * 0.3137 - 3.0).collect(); // [4, 6]
    let b: Vec<f32> = (0..12).map(|i| 1.0 / (i as f32 + 0.7)).collect(); // [2, 6]
                                                                         // A checkpoint file holding `a` in bf16 and `b` in f32, mapped as loaders map it.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let (ab, bb) = (
        bf16_le(&a),
        b.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
    );
    let views = vec![
        ("a", TensorView::new(Dtype::BF16, vec![4, 6], &ab).unwrap()),
        ("b", TensorView::new(Dtype::F32, vec![2, 6], &bb).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    let parts = [file.stored("a").unwrap(), file.stored("b").unwrap()];
    assert_eq!((parts[0].dtype, parts[1].dtype), (DType::BF16, DType::F32));

    let round = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|x| half::bf16::from_f32(*x).to_f32())
            .collect()
    };
    for dt in [Dt::Bf16, Dt::F32] {
        let be = GpuBackend::new(EmuExec::default(), dt);
        let got = be
            .download(&be.upload_weight_stored(&parts).unwrap())
            .unwrap();
        assert_eq!(got.shape(), &[6, 6]);
        // `a` is exactly its bf16 values on both devices; `b` is rounded once on a
        // bf16 device and exact on an f32 one.
        let mut want = round(&a);
        want.extend(if dt == Dt::Bf16 { round(&b) } else { b.clone() });
        assert_eq!(got.data(), &want[..], "{dt:?}");
    }

    // Parts that do not stack are refused with their names.
    let bias = Stored::from_tensor("bias", &Tensor::zeros([6]));
    let be = GpuBackend::new(EmuExec::default(), Dt::Bf16);
    let e = be
        .upload_stored(&[parts[0].clone(), bias])
        .err()
        .expect("shapes [4, 6] and [6] do not stack");
    assert!(e.to_string().contains("`bias`"), "{e}");
}

/// A GGUF file's quantised tensors stay quantised on the device and stand for the
/// values gguf-py gives them (`tests/fixtures/gen_gguf_types.py`).
#[test]
fn gguf_tensors_stay_quantised_on_the_device() {
    use denoised_runtime::gguf::GgufFile;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/formats");
    let g = GgufFile::open(dir.join("types.gguf")).unwrap();
    let want = SafetensorsFile::open(dir.join("types_expected.safetensors")).unwrap();
    for dt in [Dt::Bf16, Dt::F32] {
        let be = GpuBackend::new(EmuExec::default(), dt);
        for ty in ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"] {
            let name = format!("t.{ty}");
            let s = g.stored(&name).unwrap();
            let w = be.upload_weight_stored(std::slice::from_ref(&s)).unwrap();
            assert_eq!(be.weight_bytes(&w), s.bytes.len() as u64, "{name}");
            let expected = want.tensor_f32(&name).unwrap();
            assert_eq!(be.download_weight(&w).unwrap(), expected, "{name} {dt:?}");
            // x = e_0 + 2 e_5: the linear reads columns 0 and 5 of each row.
            let mut x = vec![0f32; 512];
            x[0] = 1.0;
            x[5] = 2.0;
            let y = be
                .download(
                    &be.linear(
                        &be.upload(&Tensor::new([1, 512], x).unwrap()).unwrap(),
                        &w,
                        None,
                    )
                    .unwrap(),
                )
                .unwrap();
            let round = |v: f32| match dt {
                Dt::Bf16 => half::bf16::from_f32(v).to_f32(),
                Dt::F32 => v,
            };
            for r in 0..4 {
                let e = expected.data();
                let want = round(round(e[r * 512]) + 2.0 * round(e[r * 512 + 5]));
                assert!(
                    (y.data()[r] - want).abs() <= 1e-2 * want.abs().max(1e-3),
                    "{name} {dt:?} row {r}: {} vs {want}",
                    y.data()[r]
                );
            }
        }
    }
}
