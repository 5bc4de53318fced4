//! `tollgate`: the two halves of the check that a service keeps no state in process memory.
//!
//! - `tollgate audit [PATH]` reads the Rust code under PATH for state kept in process memory
//!   across requests and reports each piece by its use — an "already done" set, a rate limit, a
//!   lock, records, subscribers, a counter — with the lines that show it, what breaks with N
//!   copies and the fix for that use.
//! - `tollgate check --target URL --target URL PATH` sends many requests at once, spread over the
//!   copies of a running service, and compares the statuses with what one service would answer
//!   (`--expect 200=1 --expect 409=49`).
//! - `tollgate inspect --store URL --config FILE --header NAME=VALUE` shows a caller's remaining
//!   rate-limit quota in the store the copies share, spending none; `tollgate reset …` forgets
//!   what the caller spent. `tollgate inspect lock|permits|record` shows a lock's holder, a
//!   concurrency limit's permits and an idempotency record, changing nothing.
//!
//! Exit codes: 0 when all is well, 1 when the audit found something, an expectation failed or
//! the store holds nothing under what `inspect` or `reset` was asked about,
//! 2 on an error (bad arguments, an unreadable path, no request sent).

mod audit;
mod check;
mod inspect;
mod limits;
mod rate;
mod secret;
mod store;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

const ABOUT: &str = "Find and check state that breaks when a service runs as several copies.";

const LONG_ABOUT: &str = "\
Find and check state that breaks when a service runs as several copies.

A lock, a counter or an \"already done\" set kept in process memory works with one copy of a \
service and silently breaks behind a load balancer: with three copies a coupon is redeemed three \
times and a rate limit lets a caller through three times as often. `tollgate audit` reads the \
code for such state; `tollgate check` sends parallel requests to the running copies and compares \
the answers with what one service would give. For a service that keeps its rate limits in a \
shared store, `tollgate inspect` shows what a caller has left of each limit (and who holds a \
lock, the permits of a concurrency limit, an idempotency record), and `tollgate reset` gives a \
caller its full quota back on every copy at once.";

const AFTER_HELP: &str = "\
Examples:
  tollgate audit                      # the Rust code under the current directory
  tollgate audit --format sarif src > tollgate.sarif
  tollgate check --target http://10.0.0.1:8080 --target http://10.0.0.2:8080 \\
      -X POST /coupons/WELCOME5/redeem --requests 50 --expect 200=1 --expect 409=49
  tollgate inspect --store redis://10.0.0.5:6379/ --config tollgate.toml --header x-api-key=alice
  tollgate inspect lock nightly-report --store redis://10.0.0.5:6379/
  TOLLGATE_STORE=redis://:secret@10.0.0.5:6379/ tollgate inspect lock nightly-report
  tollgate reset --store redis://10.0.0.5:6379/ --config tollgate.toml --header x-api-key=alice

Exit codes: 0 all is well; 1 findings, an expectation that failed, or nothing in the store under \
what inspect or reset named; 2 an error.";

/// The command line.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about = ABOUT, long_about = LONG_ABOUT, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands. Each returns the process's exit code.
#[derive(Debug, Subcommand)]
enum Command {
    /// Report state kept in process memory that several copies of a service would not share.
    #[command(
        long_about = audit::LONG_ABOUT,
        after_help = audit::AFTER_HELP,
    )]
    Audit(audit::AuditArgs),
    /// Send parallel requests over a service's copies and check the statuses they answer.
    #[command(long_about = check::LONG_ABOUT, after_help = check::AFTER_HELP)]
    Check(check::CheckArgs),
    /// Show what a service keeps in the shared store: a caller's quota, a lock, permits, an
    /// idempotency record.
    #[command(long_about = inspect::LONG_ABOUT, after_help = inspect::AFTER_HELP)]
    Inspect(inspect::InspectCommand),
    /// Show and change the limits in force of a service's rate-limit and concurrency-limit
    /// layers, kept in the store.
    #[command(long_about = limits::LONG_ABOUT, after_help = limits::AFTER_HELP)]
    Limits(limits::LimitsCommand),
    /// Forget what a caller has spent of a service's rate limits, on every copy at once.
    #[command(long_about = rate::RESET_LONG_ABOUT, after_help = rate::RESET_AFTER_HELP)]
    Reset(rate::ResetArgs),
}

impl Command {
    fn run(self) -> ExitCode {
        match self {
            Command::Audit(args) => audit::run(&args),
            Command::Check(args) => check::run(&args),
            Command::Inspect(args) => inspect::run(&args),
            Command::Reset(args) => rate::run_reset(&args),
            Command::Limits(args) => args.run(),
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    match Cli::try_parse_from(&args) {
        Ok(cli) => cli.command.run(),
        Err(error) => command_line_error(&error, &args),
    }
}

/// Prints clap's answer to a command line it did not take: help and the version as they are
/// (exit 0), an error with no caller key or password of `args` in it (exit 2).
fn command_line_error(error: &clap::Error, args: &[OsString]) -> ExitCode {
    if matches!(
        error.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    ) {
        let _ = error.print();
        return ExitCode::SUCCESS;
    }
    // clap repeats the arguments it refuses: a key or a store URL among them is hidden
    let message = error.render().to_string();
    eprint!("{}", secret::hide_arguments(&message, args));
    ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2))
}
