//! Everything the command prints goes through here, so that a full disk
//! (`> /dev/full`), a closed pipe (`| head -1`) or a huge argument is an
//! error message and an exit code, never a panic or a screenful.

use std::fmt;
use std::io::Write;
use std::process::ExitCode;

use cuda_ipc::Error;

/// The context of every error writing to standard output.
const STDOUT: &str = "cannot write to standard output";

/// The longest argument an error message quotes in full.
const MAX_QUOTED: usize = 80;

/// Writes one line to standard output and flushes it.
pub fn line(args: fmt::Arguments<'_>) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
        .map_err(|source| Error::Io {
            context: STDOUT.into(),
            source,
        })
}

/// `println!` that returns an error instead of panicking.
macro_rules! outln {
    () => {
        $crate::out::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

/// `eprintln!` that ignores a failure to write (there is nowhere left to
/// report it) instead of panicking.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::out::to_stderr(&format!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use errln;

/// Writes to standard error; a failure there has nowhere to be reported.
pub fn to_stderr(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Prints an error as one sentence on standard error. A closed standard
/// output is not reported: whoever read it (`head`) has stopped listening.
pub fn report(e: &Error) {
    if let Error::Io { context, source } = e
        && context == STDOUT
        && source.kind() == std::io::ErrorKind::BrokenPipe
    {
        return;
    }
    to_stderr(&format!(
        "cuda-ipc: error: {}\n",
        clip_words(&e.to_string())
    ));
}

/// Prints an error as one JSON line on standard output, for a command
/// given `--json`: `{"error": MESSAGE, "exit_code": CODE}` (the sentence on
/// standard error is printed too).
pub fn report_json(e: &Error, code: u8) {
    let value = serde_json::json!({ "error": clip_words(&e.to_string()), "exit_code": code });
    let _ = line(format_args!("{value}"));
}

/// `text` with every word (a run without spaces) longer than [`MAX_QUOTED`]
/// cut short: a library error may quote a huge argument in full.
fn clip_words(text: &str) -> String {
    text.split(' ').map(clip).collect::<Vec<_>>().join(" ")
}

/// `text` cut to [`MAX_QUOTED`] characters, with the number left out.
pub fn clip(text: &str) -> String {
    let count = text.chars().count();
    if count <= MAX_QUOTED {
        return text.to_owned();
    }
    let head: String = text.chars().take(MAX_QUOTED).collect();
    format!("{head}... ({} more characters)", count - MAX_QUOTED)
}

/// An option that does something only together with another one, as clap
/// ids: `(subcommand, option, the option it needs)`. Giving it without the
/// other is a usage error instead of being ignored.
pub type OnlyWith = (&'static str, &'static str, &'static str);

/// Parses the command line. Help and version go to standard output through
/// [`line`] (a failure to print them is an error, exit 4); usage errors go to
/// standard error with long arguments cut short, exit 2. An option of
/// `only_with` given without the option it needs is a usage error.
pub fn parse_args<P: clap::Parser>(only_with: &[OnlyWith]) -> Result<P, ExitCode> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let help = crate::exit_codes_help();
    let mut cmd = P::command()
        .after_help(help.clone())
        .mut_subcommands(|sub| sub.after_help(help.clone()));
    let parsed = cmd
        .try_get_matches_from_mut(std::env::args_os())
        .and_then(|m| {
            check_only_with(&mut cmd, &m, only_with)?;
            P::from_arg_matches(&m).map_err(|e| e.format(&mut P::command()))
        });
    let mut err = match parsed {
        Ok(p) => return Ok(p),
        Err(e) => e,
    };
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    ) {
        let text = err.render().to_string();
        return match line(format_args!("{}", text.trim_end())) {
            Ok(()) => Err(ExitCode::SUCCESS),
            Err(e) => {
                report(&e);
                Err(ExitCode::from(crate::EXIT_FAILED))
            }
        };
    }
    let clipped: Vec<(ContextKind, ContextValue)> = err
        .context()
        .filter_map(|(kind, value)| match value {
            ContextValue::String(s) if s.chars().count() > MAX_QUOTED => {
                Some((kind, ContextValue::String(clip(s))))
            }
            ContextValue::Strings(v) if v.iter().any(|s| s.chars().count() > MAX_QUOTED) => Some((
                kind,
                ContextValue::Strings(v.iter().map(|s| clip(s)).collect()),
            )),
            _ => None,
        })
        .collect();
    for (kind, value) in clipped {
        err.insert(kind, value);
    }
    // clap's own `error: ...`, under the prefix of every other error.
    to_stderr(&format!("cuda-ipc: {}", err.render()));
    Err(ExitCode::from(crate::EXIT_USAGE))
}

/// The usage error for the first rule of `rules` that the command line
/// `m` breaks: an option given explicitly without the one it needs.
fn check_only_with(
    cmd: &mut clap::Command,
    m: &clap::ArgMatches,
    rules: &[OnlyWith],
) -> Result<(), clap::Error> {
    use clap::parser::ValueSource;
    let Some((name, sub)) = m.subcommand() else {
        return Ok(());
    };
    let given = |id: &str| sub.value_source(id) == Some(ValueSource::CommandLine);
    let Some(&(_, option, needed)) = rules
        .iter()
        .find(|&&(s, option, needed)| s == name && given(option) && !given(needed))
    else {
        return Ok(());
    };
    let Some(sub_cmd) = cmd.find_subcommand_mut(name) else {
        return Ok(());
    };
    let long = |id: &str| {
        sub_cmd
            .get_arguments()
            .find(|a| a.get_id() == id)
            .and_then(clap::Arg::get_long)
            .map_or_else(|| id.to_owned(), |l| format!("--{l}"))
    };
    let (option, needed) = (long(option), long(needed));
    Err(sub_cmd.error(
        clap::error::ErrorKind::ArgumentConflict,
        format!("{option} applies only with {needed}; add {needed}, or leave {option} out"),
    ))
}
