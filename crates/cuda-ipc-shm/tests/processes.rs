//! Two real processes: the test executable re-runs itself as the opener,
//! receives the memfd and its end of the wake-up socket pair over a Unix socket (its stdin) with
//! `SCM_RIGHTS`, and echoes records back; a parent sleeping on its ring
//! wakes at once when the child dies.

use std::io::Read;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cuda_ipc_shm::{Area, DEFAULT_CAPACITY, Ready, Side, wake_pair};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};

const ROLE_ENV: &str = "CUDA_IPC_SHM_TEST_ROLE";
const RECORDS: usize = 10_000;

fn send_fds(sock: &UnixStream, fds: &[BorrowedFd<'_>]) {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    sendmsg(
        sock,
        &[std::io::IoSlice::new(b"x")],
        &mut control,
        SendFlags::empty(),
    )
    .unwrap();
}

fn recv_fds(sock: BorrowedFd<'_>) -> Vec<OwnedFd> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    recvmsg(
        sock,
        &mut [std::io::IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .unwrap();
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            fds.extend(r);
        }
    }
    fds
}

fn record(i: usize) -> Vec<u8> {
    (0..i % 300).map(|k| (i + k) as u8).collect()
}

/// The child: takes the area from its stdin and echoes every record.
fn echo_child() {
    let stdin = std::io::stdin();
    let fds = recv_fds(stdin.as_fd());
    let [memfd, wake] = <[OwnedFd; 2]>::try_from(fds).unwrap();
    let area = Area::open(&memfd, DEFAULT_CAPACITY).unwrap();
    let (mut tx, mut rx) = area.split(Side::Opener, wake).unwrap();
    let mut buf = Vec::new();
    loop {
        if rx.recv(&mut buf).unwrap() {
            if buf == b"stop" {
                return;
            }
            while !tx.send(&buf).unwrap() {
                std::thread::yield_now();
            }
            continue;
        }
        let deadline = Some(Instant::now() + Duration::from_secs(30));
        assert_ne!(
            rx.wait(Duration::from_micros(20), deadline, Some(stdin.as_fd()))
                .unwrap(),
            Ready::Timeout
        );
    }
}

/// Starts the child with one end of a socket pair as its stdin, and sends
/// it a new area's memfd and its wake-up end; returns the child, our socket end
/// and our ends of the area.
fn start_child(
    test: &str,
) -> (
    std::process::Child,
    UnixStream,
    (cuda_ipc_shm::Sender, cuda_ipc_shm::Receiver),
) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, "echo")
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (area, memfd) = Area::create(DEFAULT_CAPACITY).unwrap();
    let (wake, their_wake) = wake_pair().unwrap();
    send_fds(&ours, &[memfd.as_fd(), their_wake.as_fd()]);
    // Only the child holds its end from here on.
    drop(their_wake);
    let ends = area.split(Side::Creator, wake).unwrap();
    (child, ours, ends)
}

#[test]
fn records_cross_between_two_processes() {
    if std::env::var(ROLE_ENV).is_ok() {
        return echo_child();
    }
    let (mut child, _sock, (mut tx, mut rx)) = start_child("records_cross_between_two_processes");
    let mut buf = Vec::new();
    let mut next_back = 0;
    for i in 0..RECORDS {
        while !tx.send(&record(i)).unwrap() {
            std::thread::yield_now();
        }
        // Take what came back so far, so that neither ring stays full.
        while rx.recv(&mut buf).unwrap() {
            assert_eq!(buf, record(next_back));
            next_back += 1;
        }
    }
    while next_back < RECORDS {
        if rx.recv(&mut buf).unwrap() {
            assert_eq!(buf, record(next_back));
            next_back += 1;
        } else {
            let deadline = Some(Instant::now() + Duration::from_secs(30));
            assert_eq!(
                rx.wait(Duration::ZERO, deadline, None).unwrap(),
                Ready::Ring
            );
        }
    }
    assert!(tx.send(b"stop").unwrap());
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_sleeper_wakes_when_the_other_process_dies() {
    if std::env::var(ROLE_ENV).is_ok() {
        return echo_child();
    }
    let (mut child, sock, (_tx, mut rx)) =
        start_child("a_sleeper_wakes_when_the_other_process_dies");
    std::thread::sleep(Duration::from_millis(100));
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let killed = Instant::now();
        child.kill().unwrap();
        child.wait().unwrap();
        killed
    });
    let deadline = Some(Instant::now() + Duration::from_secs(30));
    let r = rx
        .wait(Duration::ZERO, deadline, Some(sock.as_fd()))
        .unwrap();
    let killed_at = killer.join().unwrap();
    assert_eq!(r, Ready::Other);
    assert!(killed_at.elapsed() < Duration::from_secs(1));
    // The socket reads end of file: the peer is gone.
    let mut rest = Vec::new();
    assert_eq!((&sock).read_to_end(&mut rest).unwrap(), 0);
    assert!(rx.sleeps() >= 1);
}
