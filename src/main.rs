//! `denoised`: the command-line entry point. It stays thin: argument parsing lives in
//! `cli`, and each subcommand in its own module there.

mod cli;

use std::process::ExitCode;

use clap::Parser;

/// Keeps large buffers in the allocator instead of returning them to the kernel.
///
/// glibc serves allocations above its mmap threshold (at most 32 MiB by default) with
/// fresh mappings and unmaps them on free, so every VAE activation at 512x512 (100+ MiB)
/// paid page faults and kernel page zeroing on each layer (9% of a decode in perf). The
/// compute loops allocate the same sizes again and again, so a process-lifetime heap is
/// the right trade: memory stays at its high-water mark, which a serving process
/// reaches on its first request anyway.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let args = cli::Cli::parse();
    denoised_actors::logging::init();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
