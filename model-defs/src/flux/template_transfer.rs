//! Moving a template directory from one pod to another (docs/cluster.md, "Template
//! transfers") over any byte stream (a TCP connection between pods):
//!
//! - **chunked by region**: the data goes in file order, and the receiver checks each
//!   (step, block) slab, then the latents, against the header's CRC-32 as soon as the
//!   region is complete, so a corrupt byte is found within one slab of where it went
//!   wrong and nothing unchecked is ever installed;
//! - **resumable**: the receiver keeps what it has in `NAME.part/` beside the
//!   destination, verified region by region (again after a restart: the prefix it
//!   keeps is re-checked), and asks the sender for the rest from the end of the last
//!   good region; a region that fails its check is cut off and asked for again;
//! - **capped**: the sender keeps its average rate under a bandwidth cap, so a
//!   transfer does not starve the pods' request traffic on the same link.
//!
//! The exchange: the receiver writes one JSON line, `{"template": NAME, "offset": N}`;
//! the sender answers one JSON line, `{"header": TEXT, "traces": LEN|null}` (the
//! template's `template.json` as it is on its disk, and the length of its VAE traces),
//! then the data from `offset` to its end, then the traces. A sender that cannot serve
//! answers `{"error": TEXT}`. Only files of version 3 or later (a checksum per slab) move.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use denoised_runtime::{Error, Result};
use serde::{Deserialize, Serialize};

use super::template_file::{read_header, regions, FileHeader, DATA, HEADER, VAE_TRACES};

/// Bytes written or read per call: small enough for the cap to act smoothly.
const CHUNK: usize = 1 << 20;

#[derive(Serialize, Deserialize)]
struct Request {
    template: String,
    offset: u64,
}

#[derive(Serialize, Deserialize)]
struct Reply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    traces: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Invalid(format!("template transfer: {what}: {e}"))
}

/// The longest request or reply line read (a header is a few KB).
const MAX_LINE: u64 = 1 << 20;

fn read_line(r: &mut impl BufRead, what: &str) -> Result<String> {
    let mut line = String::new();
    r.take(MAX_LINE).read_line(&mut line).map_err(io(what))?;
    if line.is_empty() {
        return Err(Error::Invalid(format!(
            "template transfer: {what}: the connection closed"
        )));
    }
    if !line.ends_with('\n') && line.len() as u64 >= MAX_LINE {
        return Err(Error::Invalid(format!(
            "template transfer: {what}: a line over {MAX_LINE} bytes"
        )));
    }
    Ok(line)
}

/// The sender's side, first half: which template the receiver asks for, and from where.
pub fn read_request(r: &mut impl BufRead) -> Result<(String, u64)> {
    let line = read_line(r, "reading the request")?;
    let q: Request = serde_json::from_str(&line)
        .map_err(|e| Error::Invalid(format!("template transfer: a bad request: {e}")))?;
    Ok((q.template, q.offset))
}

/// Answers a request the sender cannot serve (an unknown template, say).
pub fn refuse(w: &mut impl Write, why: &str) -> Result<()> {
    let reply = Reply {
        header: None,
        traces: None,
        error: Some(why.into()),
    };
    writeln!(w, "{}", serde_json::to_string(&reply).expect("plain data")).map_err(io("refusing"))
}

/// The sender's side, second half: the template at `dir` from `offset` on, at most
/// `cap` bytes a second on average (`None`: as fast as the stream takes them). The
/// data bytes it sent.
pub fn send(dir: &Path, offset: u64, w: &mut impl Write, cap: Option<f64>) -> Result<u64> {
    let h = read_header(dir)?;
    if h.version() < 3 {
        return Err(Error::Invalid(format!(
            "{}: template format version {} has no checksum per slab; capture it again to move it",
            dir.display(),
            h.version()
        )));
    }
    let total = h.layout.total_bytes() as u64;
    if offset > total {
        return Err(Error::Invalid(format!(
            "template transfer: offset {offset} past the data's {total} bytes"
        )));
    }
    let header = std::fs::read_to_string(dir.join(HEADER)).map_err(io("reading the header"))?;
    let traces = match std::fs::read(dir.join(VAE_TRACES)) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io("reading the VAE traces")(e)),
    };
    let reply = Reply {
        header: Some(header),
        traces: traces.as_ref().map(|t| t.len() as u64),
        error: None,
    };
    writeln!(w, "{}", serde_json::to_string(&reply).expect("plain data"))
        .map_err(io("sending the header"))?;
    let mut f = File::open(dir.join(DATA)).map_err(io("opening the data"))?;
    f.seek(SeekFrom::Start(offset)).map_err(io("seeking"))?;
    let (start, mut sent) = (Instant::now(), 0u64);
    let mut buf = vec![0u8; CHUNK];
    while offset + sent < total {
        let n = (CHUNK as u64).min(total - offset - sent) as usize;
        f.read_exact(&mut buf[..n])
            .map_err(io("reading the data"))?;
        w.write_all(&buf[..n]).map_err(io("sending the data"))?;
        sent += n as u64;
        if let Some(cap) = cap {
            // Sleep until the average is back under the cap.
            let due = Duration::from_secs_f64(sent as f64 / cap);
            if let Some(ahead) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(ahead);
            }
        }
    }
    if let Some(t) = traces {
        w.write_all(&t).map_err(io("sending the VAE traces"))?;
    }
    w.flush().map_err(io("flushing"))?;
    Ok(sent)
}

/// What a finished transfer moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// Where the data started: the bytes an earlier, broken transfer had verified.
    pub resumed_from: u64,
    /// Data bytes received by this call.
    pub bytes: u64,
}

/// The receiver's side: asks `stream` for template `name` and installs it at `dest`
/// (which must not exist yet), resuming from what `NAME.part/` beside it holds. On an
/// error the verified prefix stays there for the next call. `max_bytes` bounds what
/// the sender may send (cache and VAE traces together): a header or a traces length
/// that claims more is refused before anything is allocated or written.
pub fn receive<S: Read + Write>(
    stream: S,
    name: &str,
    dest: &Path,
    max_bytes: u64,
) -> Result<Received> {
    let part = part_dir(dest);
    std::fs::create_dir_all(&part).map_err(io("creating the partial directory"))?;
    let offset = verified_prefix(&part)?;
    let mut s = BufReader::new(stream);
    let q = Request {
        template: name.into(),
        offset,
    };
    writeln!(
        s.get_mut(),
        "{}",
        serde_json::to_string(&q).expect("plain data")
    )
    .map_err(io("sending the request"))?;
    let reply: Reply = serde_json::from_str(&read_line(&mut s, "reading the reply")?)
        .map_err(|e| Error::Invalid(format!("template transfer: a bad reply: {e}")))?;
    if let Some(e) = reply.error {
        return Err(Error::Invalid(format!(
            "template transfer: the sender refused: {e}"
        )));
    }
    let text = reply
        .header
        .ok_or_else(|| Error::Invalid("template transfer: a reply without a header".into()))?;
    // A header that differs from the one the prefix was verified against starts over.
    let hp = part.join(HEADER);
    let offset = match std::fs::read_to_string(&hp) {
        Ok(old) if old == text => offset,
        _ => 0,
    };
    std::fs::write(&hp, &text).map_err(io("writing the header"))?;
    let h = read_header(&part)?;
    let claimed = h.layout.total_bytes() as u64 + reply.traces.unwrap_or(0);
    if claimed > max_bytes {
        let _ = std::fs::remove_file(&hp);
        return Err(Error::Invalid(format!(
            "template transfer: the sender announced {claimed} bytes, over the {max_bytes} this template may take: refused"
        )));
    }
    let bytes = receive_data(&mut s, &part, &h, offset)?;
    if let Some(len) = reply.traces {
        // Streamed to the file a chunk at a time: no buffer of the announced size.
        let tp = part.join(VAE_TRACES);
        let mut f = std::fs::File::create(&tp).map_err(io("writing the VAE traces"))?;
        let n = std::io::copy(&mut (&mut s).take(len), &mut f)
            .map_err(io("receiving the VAE traces"))?;
        if n != len {
            return Err(Error::Invalid(format!(
                "template transfer: the VAE traces ended after {n} of {len} bytes"
            )));
        }
        f.sync_all().map_err(io("syncing the VAE traces"))?;
    }
    std::fs::rename(&part, dest).map_err(io("installing the template"))?;
    Ok(Received {
        resumed_from: offset,
        bytes,
    })
}

/// `dest` with `.part` added to its name: where a transfer keeps what it has.
pub fn part_dir(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".part");
    dest.with_file_name(name)
}

/// Receives the data from `offset` into `part`'s data file, checking each region as it
/// completes; a failed region is cut off (so the next call asks for it again) and is
/// the error, naming the slab.
fn receive_data(s: &mut impl Read, part: &Path, h: &FileHeader, offset: u64) -> Result<u64> {
    let dp = part.join(DATA);
    let mut f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(&dp)
        .map_err(io("opening the partial data"))?;
    f.set_len(offset).map_err(io("cutting the partial data"))?;
    f.seek(SeekFrom::Start(offset)).map_err(io("seeking"))?;
    let crcs = h.slab_crc32();
    let mut received = 0u64;
    let mut buf = vec![0u8; CHUNK];
    for (i, r) in regions(&h.layout).enumerate() {
        if (r.end as u64) <= offset {
            continue;
        }
        // Regions start at the offset: it is a region boundary (`verified_prefix`).
        let mut crc = crc32fast::Hasher::new();
        let mut left = r.len();
        while left > 0 {
            let n = left.min(CHUNK);
            s.read_exact(&mut buf[..n])
                .map_err(io("receiving the data"))?;
            crc.update(&buf[..n]);
            f.write_all(&buf[..n]).map_err(io("writing the data"))?;
            left -= n;
            received += n as u64;
        }
        let (got, want) = (crc.finalize(), crcs[i]);
        if got != want {
            f.set_len(r.start as u64)
                .map_err(io("cutting a bad region"))?;
            let what = match i < h.layout.slab_count() {
                true => format!("slab {i}"),
                false => "the latents".into(),
            };
            return Err(Error::Invalid(format!(
                "template transfer: {what} arrived corrupt (crc32 {got:08x}, header {want:08x}); it is asked for again on the next try"
            )));
        }
    }
    f.sync_all().map_err(io("syncing the data"))?;
    Ok(received)
}

/// The bytes of `part`'s data file that end on a region boundary and pass their
/// checks against `part`'s header; the file is cut there (0 without a header).
fn verified_prefix(part: &Path) -> Result<u64> {
    let Ok(h) = read_header(part) else {
        return Ok(0);
    };
    let dp = part.join(DATA);
    let Ok(mut f) = OpenOptions::new().read(true).write(true).open(&dp) else {
        return Ok(0);
    };
    let len = f.metadata().map_err(io("reading the partial data"))?.len();
    let crcs = h.slab_crc32();
    let mut good = 0u64;
    let mut buf = Vec::new();
    for (i, r) in regions(&h.layout).enumerate() {
        if r.end as u64 > len {
            break;
        }
        buf.resize(r.len(), 0);
        f.read_exact(&mut buf)
            .map_err(io("reading the partial data"))?;
        if crc32fast::hash(&buf) != crcs[i] {
            break;
        }
        good = r.end as u64;
    }
    f.set_len(good).map_err(io("cutting the partial data"))?;
    Ok(good)
}
