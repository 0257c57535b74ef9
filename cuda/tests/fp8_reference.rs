//! fp8 weights against an independent reference: tests/fixtures/fp8/linear.safetensors,
//! written by tests/fixtures/gen_fp8_linear.py with ml_dtypes' float8_e4m3fn (the same
//! E4M3 rounding as PyTorch's). For both scalings (`tensor`: one scale per weight and
//! per input; `channel`: per output channel and per token):
//! - the host quantiser's bytes and scales equal the fixture's, byte for byte;
//! - the CPU's fp8 linear and the GPU backend's on the emulator (f32 and bf16 modes:
//!   the activation kernels, the fp8 GEMM with its scales, the bias) equal the
//!   fixture's float64 linear of the rounded operands, within the dtype's rounding.

use denoised_cuda::{Dt, EmuExec, GpuBackend};
use denoised_runtime::backend::Backend;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::fp8::{quantize_rows, quantize_tensor, Scaling};
use denoised_runtime::{CpuBackend, Stored, Tensor};

struct Fixture(Vec<u8>);

impl Fixture {
    fn open() -> Fixture {
        let path = fixtures_dir().join("fp8/linear.safetensors");
        Fixture(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
    }
    fn raw(&self, name: &str) -> (Vec<u8>, Vec<usize>) {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        (t.data().to_vec(), t.shape().to_vec())
    }
    fn f32s(&self, name: &str) -> Tensor {
        let (b, shape) = self.raw(name);
        let v = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Tensor::new(shape, v).unwrap()
    }
}

fn scalings() -> [(Scaling, &'static str); 2] {
    [(Scaling::Tensor, "tensor"), (Scaling::Channel, "channel")]
}

/// `max |got - want| / max |want|`.
fn rel_diff(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.shape(), want.shape());
    let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got
        .data()
        .iter()
        .zip(want.data())
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

#[test]
fn the_host_quantiser_rounds_as_ml_dtypes() {
    let f = Fixture::open();
    for (name, cols) in [("w", 96), ("x", 96)] {
        let values = f.f32s(name);
        for (scaling, tag) in scalings() {
            let (bytes, scales) = match scaling {
                Scaling::Tensor => {
                    let (b, s) = quantize_tensor(values.data());
                    (b, vec![s])
                }
                Scaling::Channel => quantize_rows(values.data(), cols),
            };
            let (want, _) = f.raw(&format!("{tag}.{name}_bytes"));
            let differ = bytes.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ, 0,
                "{tag} {name}: {differ} bytes differ from ml_dtypes'"
            );
            let want_scales = f.f32s(&format!("{tag}.{name}_scales"));
            assert_eq!(scales, want_scales.data(), "{tag} {name} scales");
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")] // the emulator (see cuda/build.rs)
fn fp8_linears_match_the_independent_reference() {
    let f = Fixture::open();
    let (x, w, b) = (f.f32s("x"), f.f32s("w"), f.f32s("b"));
    let parts = [Stored::from_tensor("w", &w)];
    for (scaling, tag) in scalings() {
        let want = f.f32s(&format!("{tag}.y"));
        let cpu = CpuBackend::new().with_fp8_weights(scaling);
        let got = cpu.linear(&x, &cpu.upload_weight_fp8(&parts).unwrap(), Some(&b));
        let d = rel_diff(&got.unwrap(), &want);
        println!("{tag}: CPU {d:.2e}");
        assert!(d <= 1e-5, "{tag}: the CPU's fp8 linear is {d:.2e} off");
        // f32 mode: only summation order differs. bf16: the input and output rounded
        // to bf16 (2^-9 relative each; an input rounded first may move an fp8 code).
        for (dt, bound) in [(Dt::F32, 1e-5), (Dt::Bf16, 1.6e-2)] {
            let gpu = GpuBackend::new(EmuExec::default(), dt).with_fp8_weights(Some(scaling));
            let wg = gpu.upload_weight_fp8(&parts).unwrap();
            let (xg, bg) = (gpu.upload(&x).unwrap(), gpu.upload(&b).unwrap());
            let got = gpu.download(&gpu.linear(&xg, &wg, Some(&bg)).unwrap());
            let d = rel_diff(&got.unwrap(), &want);
            println!("{tag}: emulated GPU {dt:?} {d:.2e}");
            assert!(
                d <= bound,
                "{tag}: the emulated GPU's fp8 linear ({dt:?}) is {d:.2e} off"
            );
        }
    }
}
