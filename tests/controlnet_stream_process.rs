//! The ControlNet service's stream across a real process boundary, against sequential
//! execution: a child process (this test binary, re-run as `stream_service_child`)
//! owns the arena and runs the ControlNets on each step's latents as the service does
//! (`control_step`, residuals published block by block); this process's stepper feeds
//! on it (`StreamFeed`) as a denoise worker does. Every step's latents equal, bit for
//! bit, those of the same run with the ControlNets in process, sequentially
//! (`LocalControl`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use denoised_actors::controlnet::stream::{Stream, StreamFeed, StreamLayout};
use denoised_models::flux::control_feed::{
    control_step, layout_of, ControlFeed, ControlInputs, ControlUse, LocalControl,
};
use denoised_models::flux::controlnet::ControlNet;
use denoised_models::flux::edit::{DenoiseInputs, Mode};
use denoised_models::flux::stepper::{ModelStepper, Stepper};
use denoised_models::pipeline::control::{control_rng, ControlEncoder};
use denoised_models::pipeline::flux_fill::{FluxFill, Timings};
use denoised_models::pipeline::generate::GenerateOptions;
use denoised_models::pipeline::image::decode_image;
use denoised_models::scheduler::FlowMatchEuler;
use denoised_models::ModelSource;
use denoised_runtime::fixtures::fixtures_dir;
use denoised_runtime::shm::{futex, Arena, ArenaView, Handle};
use denoised_runtime::{CpuBackend, DType, Tensor};

const CHILD: &str = "DENOISED_TEST_STREAM_CHILD";
const STEPS: usize = 6;

/// What both processes compute alike: the generation's inputs, schedule and
/// ControlNets (canny-tiny at 0.7 and depth-tiny at 0.5, control images encoded with
/// the seed's draws).
struct Setup {
    fill: FluxFill<CpuBackend>,
    inputs: DenoiseInputs,
    schedule: Arc<FlowMatchEuler>,
    uses: Vec<ControlUse>,
}

fn setup() -> Setup {
    let source = ModelSource::dir(fixtures_dir().join("flux-dev-tiny"));
    let fill = FluxFill::load(&source, CpuBackend::new()).unwrap();
    let opts = GenerateOptions {
        steps: STEPS,
        guidance: 3.5,
        seed: 3,
        max_sequence_length: 32,
        width: 64,
        height: 64,
    };
    let inputs = fill
        .prepare_generate(
            "a red fox in the snow",
            &opts,
            None,
            &mut Timings::default(),
        )
        .unwrap()
        .inputs;
    let schedule = Arc::new(fill.schedule(STEPS, 64, 64).unwrap());
    let encoder = ControlEncoder::load(&source).unwrap();
    let mut rng = control_rng(opts.seed);
    let nets = fixtures_dir().join("controlnets");
    let uses = [
        ("canny-tiny", "control_a.png", 0.7),
        ("depth-tiny", "control_b.png", 0.5),
    ]
    .into_iter()
    .map(|(n, img, scale)| {
        let bytes = std::fs::read(nets.join(img)).unwrap();
        let image = decode_image(&bytes, &fill.limits).unwrap();
        ControlUse {
            net: Arc::new(ControlNet::load(CpuBackend::new(), nets.join(n)).unwrap()),
            control: encoder.encode(&image, None, &mut rng).unwrap(),
            scale,
        }
    })
    .collect();
    Setup {
        fill,
        inputs,
        schedule,
        uses,
    }
}

fn layout(s: &Setup) -> StreamLayout {
    let inputs = ControlInputs::new(&s.inputs, &s.schedule);
    let fl = layout_of(&s.uses, &inputs).unwrap().unwrap();
    StreamLayout {
        doubles: fl.doubles as u32,
        singles: fl.singles as u32,
        rows: s.inputs.tokens() as u32,
        cols: s.inputs.latents.cols() as u32,
        residual_rows: fl.rows as u32,
        hidden: fl.hidden as u32,
        scale: fl.scale,
    }
}

/// Runs the generation on a stepper fed by `feed`: every step's latents.
fn run(s: &Setup, feed: Arc<dyn ControlFeed>) -> Vec<Vec<f32>> {
    let m = s.fill.shared_transformer().unwrap();
    let mut st = ModelStepper::unbounded(m, 4);
    st.admit(1, &s.inputs, s.schedule.clone(), Mode::Full)
        .unwrap();
    st.set_control_feed(1, feed).unwrap();
    (0..STEPS)
        .map(|_| {
            st.step(&[1]).unwrap();
            st.latents(1).unwrap().into_data()
        })
        .collect()
}

/// The service side, in the child process: owns the arena, publishes the slice's
/// handle in a file, serves the steps the parent announces.
#[test]
fn stream_service_child() {
    let Ok(dir) = std::env::var(CHILD) else {
        println!("stream_service_child: a helper process of streamed_residuals_across_processes_equal_sequential; nothing to do alone");
        return;
    };
    let dir = PathBuf::from(dir);
    let s = setup();
    let layout = layout(&s);
    let mut arena = Arena::create(&dir, "t", "controlnet0", 1 << 24).unwrap();
    let h = arena.alloc(DType::U8, &[layout.total_bytes()]).unwrap();
    let slice = arena.shared_view().host_slice(&h).unwrap();
    // SAFETY: a fresh slice nobody else maps yet.
    unsafe { slice.bytes_mut() }.fill(0);
    let stream = Stream::new(slice, layout.clone()).unwrap();
    let tmp = dir.join("handle.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&h).unwrap()).unwrap();
    std::fs::rename(&tmp, dir.join("handle.json")).unwrap();
    let inputs = ControlInputs::new(&s.inputs, &s.schedule);
    let mut last = 0;
    while (last as usize) < STEPS {
        let v = futex::wait_while(stream.step_word(), last, Duration::from_secs(60));
        assert_ne!(v, last, "the parent announced no step for 60 s");
        last = v;
        let step = v as usize - 1;
        let latents = Tensor::new(
            [layout.rows as usize, layout.cols as usize],
            stream.latents().to_vec(),
        )
        .unwrap();
        control_step(&s.uses, &inputs, step, &latents, &mut |k, r| {
            stream.put_residual(step, k, r.data())
        })
        .unwrap();
    }
    // Stay until the parent has read the last step's residuals.
    std::thread::sleep(Duration::from_millis(500));
}

#[test]
fn streamed_residuals_across_processes_equal_sequential() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "stream_service_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, dir.path())
        .spawn()
        .unwrap();
    let s = setup();
    let layout = layout(&s);
    let t0 = Instant::now();
    let handle_file = dir.path().join("handle.json");
    while !handle_file.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the child never opened its stream"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child exited early: {status}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let h: Handle = serde_json::from_slice(&std::fs::read(&handle_file).unwrap()).unwrap();
    let view = Arc::new(ArenaView::attach_rw(dir.path(), "t", "controlnet0").unwrap());
    let stream = Stream::new(view.host_slice(&h).unwrap(), layout).unwrap();
    let streamed = run(&s, Arc::new(StreamFeed::new(stream, child.id(), None)));
    assert!(child.wait().unwrap().success(), "the child failed");

    let inputs = ControlInputs::new(&s.inputs, &s.schedule);
    let local = LocalControl::new(s.uses, inputs).unwrap().unwrap();
    let s2 = setup();
    let sequential = run(&s2, Arc::new(local));
    for (i, (a, b)) in streamed.iter().zip(&sequential).enumerate() {
        assert!(
            a == b,
            "step {i}: streamed latents differ from sequential ones"
        );
    }
    println!(
        "{STEPS} steps: the latents streamed from another process equal the sequential ones bit for bit"
    );
}
