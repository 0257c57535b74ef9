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
