//! Moving a template directory between pods (`flux::template_transfer`) over real TCP on
//! loopback: bit for bit, resumed after a cut connection and after a crash left
//! unverified bytes, a corrupt slab found and asked for again, the sender's bandwidth
//! cap, and a refusal.

use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Instant;

use denoised_models::flux::template::{TemplateCache, TemplateLayout};
use denoised_models::flux::template_file::{self, TemplateMeta};
use denoised_models::flux::template_transfer::{
    part_dir, read_request, receive, refuse, send, Received,
};
use denoised_models::flux::weights::SplitMix;
use denoised_models::FluxConfig;
use denoised_runtime::{DType, Tensor};

fn layout(tokens: usize) -> TemplateLayout {
    TemplateLayout::for_model(&FluxConfig::tiny(), tokens, 4, DType::F32)
}

/// A saved template of random data with VAE traces, in `dir`.
fn template(dir: &Path, tokens: usize) -> TemplateLayout {
    let l = layout(tokens);
    let mut c = TemplateCache::new(l).unwrap();
    let mut rng = SplitMix::new(7);
    let mut random = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
    for s in 0..l.steps {
        for b in 0..l.blocks {
            let kv = Tensor::new([tokens, 2 * l.hidden], random(tokens * 2 * l.hidden)).unwrap();
            c.set_slab(s, b, &kv).unwrap();
        }
        let lat = Tensor::new(
            [tokens, l.latent_channels],
            random(tokens * l.latent_channels),
        );
        c.set_latent(s, &lat.unwrap()).unwrap();
    }
    c.mark_complete();
    let meta = TemplateMeta {
        model: "m".into(),
        height: 8,
        width: 8,
        steps: l.steps,
        guidance: 30.0,
        seed: 1,
        prompt: "a template".into(),
        adapters: String::new(),
    };
    std::fs::create_dir_all(dir).unwrap();
    template_file::save(dir, &c, &meta, DType::F32).unwrap();
    template_file::save_vae_traces(dir, b"traces of the VAE").unwrap();
    l
}

/// Serves one connection: the template `dir` for the name "t", cut after `cut_after`
/// bytes or not, at `cap` bytes a second. The thread returns how the send ended.
fn serve_once(
    dir: PathBuf,
    cap: Option<f64>,
    cut_after: Option<usize>,
) -> (String, std::thread::JoinHandle<Result<(), String>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (stream, _) = l.accept().unwrap();
        let mut r = BufReader::new(stream.try_clone().unwrap());
        let (name, offset) = read_request(&mut r).unwrap();
        let mut w = stream;
        if name != "t" {
            refuse(&mut w, &format!("no template `{name}` here")).unwrap();
            return Ok(());
        }
        match cut_after {
            // The link breaks after this many bytes.
            Some(n) => {
                let _ = send(&dir, offset, &mut Cut { inner: w, left: n }, cap);
                Ok(())
            }
            None => send(&dir, offset, &mut w, cap)
                .map(|_| ())
                .map_err(|e| e.to_string()),
        }
    });
    (addr, h)
}

struct Cut<W> {
    inner: W,
    left: usize,
}

impl<W: Write> Write for Cut<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Err(std::io::Error::other("the link broke"));
        }
        let n = buf.len().min(self.left);
        let n = self.inner.write(&buf[..n])?;
        self.left -= n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn fetch(addr: &str, name: &str, dest: &Path) -> denoised_runtime::Result<Received> {
    receive(TcpStream::connect(addr).unwrap(), name, dest, u64::MAX)
}

fn same_files(a: &Path, b: &Path) {
    for f in ["template.json", "cache.bin", template_file::VAE_TRACES] {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs");
    }
}

#[test]
fn a_template_moves_bit_for_bit_and_resumes_after_a_cut() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dest) = (tmp.path().join("src"), tmp.path().join("dest"));
    let l = template(&src, 64);
    let total = l.total_bytes() as u64;

    // The link breaks 40% of the way through the data.
    let (addr, h) = serve_once(src.clone(), None, Some(total as usize * 2 / 5));
    let err = fetch(&addr, "t", &dest).unwrap_err().to_string();
    h.join().unwrap().unwrap();
    assert!(err.contains("receiving the data"), "{err}");
    assert!(!dest.exists());
    let kept = std::fs::metadata(part_dir(&dest).join("cache.bin"))
        .unwrap()
        .len();
    assert!(kept > 0 && kept < total, "kept {kept} of {total}");
    assert_eq!(kept % l.slab_bytes() as u64, 0, "a region boundary");

    // A crash left bytes that were never verified after it.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(part_dir(&dest).join("cache.bin"))
        .unwrap();
    f.write_all(&[0xAB; 1000]).unwrap();
    drop(f);

    let (addr, h) = serve_once(src.clone(), None, None);
    let got = fetch(&addr, "t", &dest).unwrap();
    h.join().unwrap().unwrap();
    assert_eq!(got.resumed_from, kept, "resumed from the verified prefix");
    assert_eq!(got.bytes, total - kept);
    assert!(!part_dir(&dest).exists());
    same_files(&src, &dest);
    // And it loads, every checksum checked.
    template_file::load(&dest, "m", &l).unwrap();
}

#[test]
fn a_corrupt_slab_is_cut_off_and_asked_for_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, bad, dest) = (
        tmp.path().join("src"),
        tmp.path().join("bad"),
        tmp.path().join("dest"),
    );
    let l = template(&src, 64);
    // A sender whose disk flipped a bit in slab 3 (the header's checksums are right).
    std::fs::create_dir_all(&bad).unwrap();
    for f in ["template.json", template_file::VAE_TRACES] {
        std::fs::copy(src.join(f), bad.join(f)).unwrap();
    }
    let mut data = std::fs::read(src.join("cache.bin")).unwrap();
    data[3 * l.slab_bytes() + 17] ^= 0x10;
    std::fs::write(bad.join("cache.bin"), data).unwrap();

    let (addr, h) = serve_once(bad, None, None);
    let err = fetch(&addr, "t", &dest).unwrap_err().to_string();
    // The receiver hangs up at the bad slab: the sender may or may not have written
    // everything into the socket's buffers by then, so its own result is not checked.
    let _ = h.join().unwrap();
    assert!(err.contains("slab 3 arrived corrupt"), "{err}");
    let kept = std::fs::metadata(part_dir(&dest).join("cache.bin"))
        .unwrap()
        .len();
    assert_eq!(kept, 3 * l.slab_bytes() as u64, "cut at the bad slab");

    let (addr, h) = serve_once(src.clone(), None, None);
    let got = fetch(&addr, "t", &dest).unwrap();
    h.join().unwrap().unwrap();
    assert_eq!(got.resumed_from, kept);
    same_files(&src, &dest);
}

#[test]
fn the_sender_keeps_under_its_bandwidth_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dest) = (tmp.path().join("src"), tmp.path().join("dest"));
    let l = template(&src, 256);
    let total = l.total_bytes() as f64;
    let cap = 8e6;
    let t0 = Instant::now();
    let (addr, h) = serve_once(src.clone(), Some(cap), None);
    fetch(&addr, "t", &dest).unwrap();
    h.join().unwrap().unwrap();
    let took = t0.elapsed().as_secs_f64();
    // The last chunk goes before its sleep: at most one chunk under the cap's time.
    let floor = (total - (1 << 20) as f64) / cap;
    assert!(
        took >= floor,
        "{total} bytes in {took:.3} s at a cap of {cap} B/s"
    );
    println!(
        "{total} bytes in {took:.3} s: {:.1} MB/s at a cap of 8 MB/s",
        total / took / 1e6
    );
    same_files(&src, &dest);
}

#[test]
fn an_unknown_template_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    template(&src, 16);
    let (addr, h) = serve_once(src, None, None);
    let err = fetch(&addr, "other", &tmp.path().join("dest"))
        .unwrap_err()
        .to_string();
    h.join().unwrap().unwrap();
    assert!(err.contains("refused: no template `other` here"), "{err}");
}

/// A receiver takes no more than it allows: a sender announcing more than `max_bytes`
/// (cache and VAE traces together) is refused before anything is allocated or written,
/// and the same transfer within its bound completes.
#[test]
fn a_sender_announcing_more_than_the_receiver_allows_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dest) = (tmp.path().join("src"), tmp.path().join("dest"));
    let l = template(&src, 64);
    let traces = std::fs::metadata(src.join(template_file::VAE_TRACES))
        .unwrap()
        .len();
    let total = l.total_bytes() as u64 + traces;
    let (addr, h) = serve_once(src.clone(), None, None);
    let err = receive(TcpStream::connect(&addr).unwrap(), "t", &dest, total - 1)
        .unwrap_err()
        .to_string();
    let _ = h.join().unwrap();
    assert!(err.contains("refused"), "{err}");
    assert!(!dest.exists());
    let kept = std::fs::metadata(part_dir(&dest).join("cache.bin")).map_or(0, |m| m.len());
    assert_eq!(kept, 0, "nothing of the data was written");
    let (addr, h) = serve_once(src.clone(), None, None);
    receive(TcpStream::connect(&addr).unwrap(), "t", &dest, total).unwrap();
    h.join().unwrap().unwrap();
    same_files(&src, &dest);
}
