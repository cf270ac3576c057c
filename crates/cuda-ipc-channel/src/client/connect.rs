//! Connecting the socket: without blocking past the deadline, and with an
//! error that says what the path really is when nobody answers.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType, connect, socket_with};

use crate::ChannelError;

/// Why nobody answered at `path`, from what the path really is.
fn refused_context(path: &Path) -> String {
    let what = match rustix::fs::stat(path) {
        Ok(st) => match rustix::fs::FileType::from_raw_mode(st.st_mode) {
            rustix::fs::FileType::Socket => {
                return format!(
                    "nothing is listening on {}: it is a socket that no server serves (its \
                     producer exited); start the producer",
                    path.display()
                );
            }
            rustix::fs::FileType::RegularFile => "a regular file",
            rustix::fs::FileType::Directory => "a directory",
            rustix::fs::FileType::Fifo => "a named pipe",
            rustix::fs::FileType::CharacterDevice | rustix::fs::FileType::BlockDevice => "a device",
            _ => "not a socket",
        },
        Err(_) => "not a socket",
    };
    format!(
        "{} is {what}, not a channel socket; check the path (a producer creates the socket \
         when it starts)",
        path.display()
    )
}

/// Connects a Unix stream socket without blocking past `deadline` (a
/// listener with a full backlog makes `connect` wait).
pub(super) fn connect_socket(path: &Path, deadline: Instant) -> Result<UnixStream, ChannelError> {
    let addr = SocketAddrUnix::new(path).map_err(|e| {
        ChannelError::io(format!("{} is not a valid socket path", path.display()), e)
    })?;
    let fd = socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| ChannelError::io("cannot create a Unix socket", e))?;
    let started = Instant::now();
    loop {
        match connect(&fd, &addr) {
            Ok(()) => return Ok(UnixStream::from(fd)),
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => {
                if Instant::now() >= deadline {
                    return Err(ChannelError::Timeout {
                        what: format!(
                            "the server at {} to accept the connection (its backlog is full)",
                            path.display()
                        ),
                        after: started.elapsed(),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                let context = match e {
                    Errno::NOENT => format!(
                        "no channel server at {}: the socket does not exist; start the \
                         producer first, or check the path",
                        path.display()
                    ),
                    Errno::CONNREFUSED | Errno::NOTSOCK => refused_context(path),
                    Errno::ACCESS => format!(
                        "permission denied connecting to {}: the socket or its directory \
                         belongs to another user",
                        path.display()
                    ),
                    _ => format!("cannot connect to {}", path.display()),
                };
                return Err(ChannelError::io(context, e));
            }
        }
    }
}
