//! A second, independent implementation of the documented wire format
//! (see `cuda_ipc_channel::wire`), for tests that play a raw or hostile
//! peer: they build headers the library would never write, send bytes and
//! descriptors as they like, and read what the other end answers.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use cuda_ipc_channel::ChannelError;
use cuda_ipc_channel::wire::{HEADER_LEN, MAX_FDS, Message, PROTOCOL_VERSION, decode_header};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};

/// The magic bytes that start every header.
pub const MAGIC: [u8; 4] = *b"CIPC";
/// The header's kind field for a JSON payload.
pub const KIND_JSON: u16 = 1;

/// A header as the documentation lays it out.
pub fn header(len: u32, fds: u16) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&KIND_JSON.to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h[12..14].copy_from_slice(&fds.to_le_bytes());
    h
}

/// A header followed by `payload`.
pub fn json_frame(payload: &[u8], fds: u16) -> Vec<u8> {
    let mut f = header(payload.len() as u32, fds).to_vec();
    f.extend_from_slice(payload);
    f
}

/// The wire message of `message`, announcing `fds` descriptors.
pub fn encode(message: &Message, fds: u16) -> Vec<u8> {
    json_frame(&message.encode(), fds)
}

/// Sends `bytes` with `fds` attached to the first byte (blocking; the
/// deadline, if any, bounds each write).
pub fn send_bytes(
    stream: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Option<Instant>,
) -> Result<(), ChannelError> {
    let timeout = deadline.map(|d| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    });
    stream.set_write_timeout(timeout).map_err(io)?;
    let mut sent = 0;
    if !fds.is_empty() {
        let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(64))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        sent = sendmsg(
            stream,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .map_err(|e| io(e.into()))?;
    }
    let mut s = stream;
    s.write_all(&bytes[sent..]).map_err(io)
}

/// Sends `message` with `fds`.
pub fn send_message(
    stream: &UnixStream,
    message: &Message,
    fds: &[BorrowedFd<'_>],
    deadline: Option<Instant>,
) -> Result<(), ChannelError> {
    send_bytes(stream, &encode(message, fds.len() as u16), fds, deadline)
}

/// Connects and, if `handshake`, says hello and reads the welcome.
pub fn raw_connect(path: &std::path::Path, handshake: bool) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    if handshake {
        hello(&s);
    }
    s
}

/// The handshake on a raw connection.
pub fn hello(s: &UnixStream) {
    let hello = Message::Hello {
        protocol: PROTOCOL_VERSION,
        pid: std::process::id(),
        shm_notices: false,
        shm_requests: false,
    };
    send_message(s, &hello, &[], None).unwrap();
    let (m, _) = recv_message(s, Some(Instant::now() + Duration::from_secs(5))).unwrap();
    assert!(matches!(m, Message::Welcome { protocol: 1, .. }), "{m:?}");
}

/// Receives one wire message and its descriptors: end of file before it
/// begins is `PeerGone`, no first byte by the deadline is `Timeout`.
pub fn recv_message(
    stream: &UnixStream,
    deadline: Option<Instant>,
) -> Result<(Message, Vec<OwnedFd>), ChannelError> {
    let started = Instant::now();
    let timeout = deadline.map(|d| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    });
    stream.set_read_timeout(timeout).map_err(io)?;
    let mut head = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < HEADER_LEN {
        let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let r = recvmsg(
            stream.as_fd(),
            &mut [IoSliceMut::new(&mut head[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let n = match r {
            Ok(r) => r.bytes,
            Err(rustix::io::Errno::AGAIN) if got == 0 => {
                return Err(ChannelError::Timeout {
                    what: "a message".into(),
                    after: started.elapsed(),
                });
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::CONNRESET) if got == 0 => return Err(ChannelError::PeerGone),
            Err(e) => return Err(io(e.into())),
        };
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
        if n == 0 {
            if got == 0 {
                return Err(ChannelError::PeerGone);
            }
            return Err(ChannelError::Protocol {
                reason: "end of file inside a header".into(),
            });
        }
        got += n;
    }
    let h = decode_header(&head)?;
    let mut payload = vec![0u8; h.len as usize];
    let mut s = stream;
    s.read_exact(&mut payload).map_err(io)?;
    Ok((Message::decode(&payload)?, fds))
}

fn io(e: std::io::Error) -> ChannelError {
    ChannelError::Io {
        context: "raw test peer".into(),
        source: e,
    }
}
