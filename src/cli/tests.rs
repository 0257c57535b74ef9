//! The command line an operator sees: the commands that operate the service at the top,
//! the benchmarks and tools one level down under `bench`.

use clap::CommandFactory;

use super::Cli;

/// What `denoised --help` lists, in order.
const OPERATE: [&str; 10] = [
    "serve",
    "edit",
    "generate",
    "template",
    "profile",
    "selftest",
    "devices",
    "footprint",
    "inspect",
    "bench",
];

/// What `denoised bench --help` lists, in order.
const MEASURE: [&str; 16] = [
    "step",
    "weights",
    "attn",
    "pipeline",
    "edit",
    "cache-quality",
    "mask-aware-quality",
    "lora",
    "controlnet-stream",
    "overheads",
    "serve",
    "generate",
    "approx-cache",
    "simulate",
    "profile-lora",
    "forward",
];

fn visible(cmd: &clap::Command) -> Vec<String> {
    cmd.get_subcommands()
        .filter(|c| !c.is_hide_set() && c.get_name() != "help")
        .map(|c| c.get_name().to_string())
        .collect()
}

#[test]
fn the_cli_is_well_formed() {
    Cli::command().debug_assert();
}

#[test]
fn the_top_level_lists_the_operator_commands_and_bench() {
    let cmd = Cli::command();
    assert_eq!(visible(&cmd), OPERATE);
    // The daemon's own worker processes are started through a hidden command.
    let worker = cmd
        .find_subcommand("worker")
        .expect("the hidden worker command");
    assert!(worker.is_hide_set());
    // The help text names exactly those commands, one line each.
    let help = Cli::command().render_help().to_string();
    let listed: Vec<&str> = help
        .split("Commands:\n")
        .nth(1)
        .expect("a command list")
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .collect();
    assert_eq!(listed, OPERATE, "{help}");
}

#[test]
fn every_benchmark_and_tool_is_under_bench() {
    let cmd = Cli::command();
    let bench = cmd.find_subcommand("bench").expect("bench");
    assert_eq!(visible(bench), MEASURE);
    for name in MEASURE {
        let sub = bench.find_subcommand(name).unwrap();
        // One line each in `denoised bench --help`.
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        assert!(
            !about.is_empty() && !about.contains('\n'),
            "{name}: {about:?}"
        );
        assert!(
            about.len() <= 90,
            "{name}'s summary is {} characters",
            about.len()
        );
        // Reachable as `denoised bench NAME` (its help is an early exit, not an error
        // about the command).
        let e = Cli::command()
            .try_get_matches_from(["denoised", "bench", name, "--help"])
            .unwrap_err();
        assert_eq!(
            e.kind(),
            clap::error::ErrorKind::DisplayHelp,
            "bench {name}: {e}"
        );
    }
}

#[test]
fn the_old_top_level_names_are_gone() {
    for old in [
        "bench-step",
        "bench-attn",
        "bench-pipeline",
        "bench-cache-quality",
        "bench-approx-cache",
        "bench-generate",
        "bench-lora",
        "bench-controlnet-stream",
        "bench-serve",
        "bench-overheads",
        "simulate",
        "forward",
        "profile-lora",
    ] {
        let e = Cli::command()
            .try_get_matches_from(["denoised", old, "--help"])
            .unwrap_err();
        assert_eq!(
            e.kind(),
            clap::error::ErrorKind::InvalidSubcommand,
            "{old}: {e}"
        );
    }
}

#[test]
fn a_benchmark_parses_its_arguments_under_bench() {
    let cli = <Cli as clap::Parser>::try_parse_from([
        "denoised",
        "bench",
        "simulate",
        "--workers",
        "2",
        "--rps",
        "1",
    ])
    .unwrap();
    assert!(matches!(
        cli.command,
        super::Command::Bench(super::BenchCommand::Simulate(_))
    ));
}
