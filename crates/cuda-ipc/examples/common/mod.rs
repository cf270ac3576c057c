//! What the numbered examples share: the second process is the example run
//! again with a role, and an error is one sentence on standard error with
//! the `cuda-ipc` command's exit codes (2 bad input, 3 no driver or device
//! here, 4 another failure).
#![allow(dead_code)] // each example uses its own part

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, ExitCode, Stdio};

use cuda_ipc::{Error, ErrorKind};

/// Runs `body` as the example `name`.
pub fn main(name: &str, body: impl FnOnce() -> Result<(), Error>) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e}");
            ExitCode::from(match e.kind() {
                ErrorKind::InvalidInput => 2,
                ErrorKind::Unavailable => 3,
                _ => 4,
            })
        }
    }
}

/// The role and argument this process was started with by [`Second::start`];
/// `None` in the first process.
pub fn role() -> Option<(String, String)> {
    let mut args = std::env::args().skip(1);
    Some((args.next()?, args.next().unwrap_or_default()))
}

/// This program again, as another process; its standard output comes back
/// line by line.
pub struct Second {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

fn io_error(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

impl Second {
    /// Starts this program with `role` and `arg`.
    pub fn start(role: &str, arg: &str) -> Result<Second, Error> {
        let what = format!("starting the {role} process");
        let exe = std::env::current_exe().map_err(io_error(what.clone()))?;
        let mut child = Command::new(exe)
            .args([role, arg])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(io_error(what))?;
        let out = child.stdout.take().expect("its standard output is piped");
        let lines = BufReader::new(out).lines();
        Ok(Second { child, lines })
    }

    /// Waits for its next line and prints it; `None` once it has exited.
    pub fn line(&mut self) -> Result<Option<String>, Error> {
        let line = self.lines.next().transpose();
        let line = line.map_err(io_error("reading the other process".into()))?;
        if let Some(l) = &line {
            println!("{l}");
        }
        Ok(line)
    }

    /// Prints the rest of its output and waits for it: an error unless it
    /// succeeded.
    pub fn wait(mut self) -> Result<(), Error> {
        while self.line()?.is_some() {}
        let status = self.child.wait().map_err(io_error("waiting".into()))?;
        if status.success() {
            return Ok(());
        }
        let why = std::io::Error::other(format!("it exited with {status}; its error is above"));
        Err(io_error("the other process failed".into())(why))
    }
}
