//! Running the `pgoutbox` binary to completion, as a user at a shell would: the one place
//! that decides which binary runs, with which environment, and how its output is read.
//! (`Streamer` spawns the long-running `run`; this is for commands that end.)

use std::process::{Command, Output};

/// The binary under test: `PGOUTBOX_TEST_BIN` when set (an older or a release build, to
/// see a new test fail on it), else the one cargo built for this test binary.
pub fn bin() -> String {
    std::env::var("PGOUTBOX_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_pgoutbox").into())
}

/// A hermetic command for [`bin`]: the test process's own `PGOUTBOX_*` variables are
/// removed (`PGOUTBOX_TEST_*` kept), `NO_COLOR=1`, `RUST_BACKTRACE=0`, and
/// `PGOUTBOX_HTTP_ADDR=off` (tests run in parallel: no two may take the default metrics
/// address). Later `.env(...)` calls override any of these.
pub fn command() -> Command {
    let mut cmd = Command::new(bin());
    for (k, _) in std::env::vars_os() {
        let ks = k.to_string_lossy();
        if ks.starts_with("PGOUTBOX_") && !ks.starts_with("PGOUTBOX_TEST_") {
            cmd.env_remove(&k);
        }
    }
    cmd.env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0")
        .env("PGOUTBOX_HTTP_ADDR", "off");
    cmd
}

/// Runs `pgoutbox ARGS` to completion.
pub fn pgoutbox(args: &[&str]) -> Output {
    pgoutbox_env(args, &[])
}

/// Runs `pgoutbox ARGS` to completion with extra environment variables.
pub fn pgoutbox_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    command()
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run pgoutbox")
}

/// A command's stdout, lossily decoded.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A command's stderr, lossily decoded.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}
