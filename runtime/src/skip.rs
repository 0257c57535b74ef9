//! Visible test skips. A test that cannot run on this machine (a tool or a GPU is
//! missing) calls [`skip`] instead of returning quietly, which cargo would count as a
//! pass that nobody sees:
//! - it says why on stderr (shown even though cargo captures a passing test's stdout);
//! - it appends `tool|gpu test: why` to the file `$DENOISED_SKIP_LOG` names, which `.ci/run`
//!   prints as its closing summary of every skipped test;
//! - for a tool that `.ci/run` installs ([`Need::Tool`]), it fails the test when
//!   `DENOISED_REQUIRE_TOOLS=1` (which `.ci/run` sets unless
//!   `DENOISED_ALLOW_MISSING_TOOLS=1`): where the tool is expected, its absence is a
//!   failure, not a skip. A missing GPU ([`Need::Gpu`]) is never a failure: CI has none.

use std::io::Write;

/// What a skipped test lacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// A tool `.ci/run` installs (promtool, Prometheus, the openai client, NVRTC, ...).
    Tool,
    /// A CUDA GPU.
    Gpu,
}

/// Reports that `test` skips for `why` (see the module docs); panics instead where the
/// missing thing is a tool and tools are required.
pub fn skip(test: &str, need: Need, why: &str) {
    let required =
        need == Need::Tool && std::env::var("DENOISED_REQUIRE_TOOLS").as_deref() == Ok("1");
    if required {
        panic!("{test}: {why}, and DENOISED_REQUIRE_TOOLS=1 says it must be here (DENOISED_ALLOW_MISSING_TOOLS=1 in .ci/run allows the skip)");
    }
    eprintln!("SKIPPED {test}: {why}");
    if let Ok(path) = std::env::var("DENOISED_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let kind = match need {
                Need::Tool => "tool",
                Need::Gpu => "gpu",
            };
            let _ = writeln!(f, "{kind} {test}: {why}");
        }
    }
}
