//! Handing the kept descriptors to a standby serving process at once,
//! when the one serving dies: the standby started ahead (its CUDA context
//! made) and waits on its end of a `SOCK_SEQPACKET` pair, handed to it as
//! the one descriptor named [`HANDOVER_NAME`]; the keeper sends messages of
//! names, one a line, each with its descriptor attached, then `GO`.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType, recvmsg,
    sendmsg, socketpair,
};

/// The name a standby's end of the pair is handed over under.
pub const HANDOVER_NAME: &str = "handover";

/// Descriptors per message (the kernel takes at most 253).
const BATCH: usize = 200;

/// The last message.
const GO: &[u8] = b"GO";

/// The longest message: a batch of names of at most 255 bytes and a newline.
const MAX_MESSAGE: usize = BATCH * 256;

/// A pair: the keeper's end and the standby's.
pub(crate) fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Sends `kept` over `sock`, then `GO`.
pub(crate) fn send(sock: &OwnedFd, kept: &[(String, OwnedFd)]) -> io::Result<()> {
    for batch in kept.chunks(BATCH) {
        let names: Vec<&str> = batch.iter().map(|(n, _)| n.as_str()).collect();
        let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, fd)| fd.as_fd()).collect();
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(BATCH))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(io::Error::other("too many descriptors for one message"));
        }
        let text = names.join("\n");
        sendmsg(
            sock,
            &[io::IoSlice::new(text.as_bytes())],
            &mut control,
            SendFlags::NOSIGNAL,
        )?;
    }
    rustix::net::send(sock, GO, SendFlags::NOSIGNAL)?;
    Ok(())
}

/// Waits for the keeper's descriptors on `sock`, until `GO`.
pub(crate) fn receive(sock: &OwnedFd) -> io::Result<Vec<(String, OwnedFd)>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(BATCH))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = loop {
            match recvmsg(
                sock,
                &mut [io::IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Err(rustix::io::Errno::INTR) => {}
                other => break other?,
            }
        };
        let fds: Vec<OwnedFd> = control
            .drain()
            .flat_map(|m| match m {
                RecvAncillaryMessage::ScmRights(r) => r.collect(),
                _ => Vec::new(),
            })
            .collect();
        if got.bytes == 0 && fds.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the keeper went away before it handed over the service",
            ));
        }
        if got
            .flags
            .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a hand-over message was cut short",
            ));
        }
        let text = &buf[..got.bytes];
        if text == GO && fds.is_empty() {
            return Ok(out);
        }
        let text = std::str::from_utf8(text)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "names that are not UTF-8"))?;
        let names: Vec<&str> = text.split('\n').collect();
        if names.len() != fds.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} names for {} descriptors", names.len(), fds.len()),
            ));
        }
        out.extend(names.into_iter().map(str::to_string).zip(fds));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_cross_in_batches_with_their_names() {
        let (keeper, standby) = pair().unwrap();
        let kept: Vec<(String, OwnedFd)> = (0..450)
            .map(|i| {
                let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
                rustix::io::write(&fd, format!("{i}").as_bytes()).unwrap();
                (format!("chunk.{i}"), fd)
            })
            .collect();
        let sender = std::thread::spawn(move || send(&keeper, &kept).map(|()| kept.len()));
        let got = receive(&standby).unwrap();
        assert_eq!(sender.join().unwrap().unwrap(), 450);
        assert_eq!(got.len(), 450);
        for (i, (name, fd)) in got.iter().enumerate() {
            assert_eq!(name, &format!("chunk.{i}"));
            let mut b = [0u8; 8];
            let n = rustix::io::pread(fd, &mut b, 0).unwrap();
            assert_eq!(&b[..n], format!("{i}").as_bytes());
        }
    }

    #[test]
    fn a_keeper_that_goes_away_is_an_error_not_a_hang() {
        let (keeper, standby) = pair().unwrap();
        drop(keeper);
        let e = receive(&standby).unwrap_err();
        assert!(e.to_string().contains("went away"), "{e}");
    }
}
