//! The attackers, run as children (`--attack KIND PATH`): raw wire frames,
//! each attack's connections (`attack`, `assault`), the ring and
//! shared-memory attacks, and the helpers that read what the server sends.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use cuda_ipc_channel::wire::{HEADER_LEN, Message, PROTOCOL_VERSION};
use cuda_ipc_channel::{Client, ClientConfig, NOTICE_RING_BYTES};
use serde_json::json;

use super::{PER_PROCESS, takes_rings};

pub(crate) fn header(len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(b"CIPC");
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&1u16.to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h
}

pub(crate) fn frame(m: &Message) -> Vec<u8> {
    let payload = m.encode();
    let mut f = header(payload.len() as u32).to_vec();
    f.extend_from_slice(&payload);
    f
}

/// Reads one whole wire message (and drops any descriptors with it).
pub(crate) fn read_message(s: &UnixStream) -> Option<Message> {
    read_message_with_fds(s).map(|(m, _)| m)
}

/// One attacker process: opens its connections, attacks, reports, and
/// holds everything until stdin closes.
pub(crate) fn attack(kind: &str, path: &Path) {
    let hello = frame(&Message::Hello {
        protocol: PROTOCOL_VERSION,
        pid: std::process::id(),
        shm_notices: takes_rings(kind),
        shm_requests: takes_rings(kind),
    });
    if takes_rings(kind) {
        return ring_attack(kind, path, &hello);
    }
    if kind == "ring-laggard" {
        return laggards(path);
    }
    let mut conns = Vec::new();
    for _ in 0..PER_PROCESS {
        let Ok(mut s) = UnixStream::connect(path) else {
            continue;
        };
        s.set_write_timeout(Some(Duration::from_millis(200))).ok();
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        if kind == "half-written" || kind == "trickle" {
            let _ = s.write_all(&hello[..10]);
            conns.push(s);
            continue;
        }
        if s.write_all(&hello).is_err() {
            continue;
        }
        if let Some(Message::Welcome { .. }) = read_message(&s) {
            conns.push(s);
        }
    }
    let admitted = conns.len();
    let threads: Vec<_> = conns
        .into_iter()
        .map(|s| {
            let kind = kind.to_owned();
            let hello = hello.clone();
            std::thread::spawn(move || assault(&kind, s, &hello))
        })
        .collect();
    let mut conns: Vec<UnixStream> = threads.into_iter().filter_map(|t| t.join().ok()).collect();
    let mut admitted = admitted;
    if kind == "cut-off" {
        admitted += reconnect(path, &hello, &mut conns);
    }
    out!("ATTACKING {admitted}");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(conns);
}

/// One attacker process of a `shm-` attack: its connections with the
/// rings the server granted, abused as `kind` says until stdin closes.
pub(crate) fn ring_attack(kind: &str, path: &Path, hello: &[u8]) {
    let mut conns: Vec<(UnixStream, Vec<OwnedFd>)> = Vec::new();
    for _ in 0..PER_PROCESS {
        let Ok(mut s) = UnixStream::connect(path) else {
            continue;
        };
        s.set_write_timeout(Some(Duration::from_millis(200))).ok();
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        if s.write_all(hello).is_err() {
            continue;
        }
        // The memfd and our end of the wake-up pair.
        if let Some((Message::Welcome { .. }, fds)) = read_message_with_fds(&s)
            && fds.len() == 2
        {
            conns.push((s, fds));
        }
    }
    out!("ATTACKING {}", conns.len());
    // Held until the end: the request rings' ends keep their mappings.
    let mut rings = Vec::new();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut abuser = None;
    if kind == "shm-freeze" {
        for (s, fds) in &conns {
            rings.extend(freeze(s, fds));
        }
    }
    if kind == "shm-requests" {
        for (_, fds) in &conns {
            let Some((mut tx, rx)) = cuda_ipc_shm::Area::open(&fds[0], NOTICE_RING_BYTES)
                .ok()
                .zip(fds[1].try_clone().ok())
                .and_then(|(area, wake)| area.split(cuda_ipc_shm::Side::Opener, wake).ok())
            else {
                continue;
            };
            for id in 0..2000u64 {
                let mut record = 0u64.to_le_bytes().to_vec();
                record.extend(frame(&Message::Attach {
                    id,
                    name: "e".into(),
                }));
                if !matches!(tx.send(&record), Ok(true)) {
                    break;
                }
            }
            rings.push((tx, rx));
        }
    } else {
        let scribble = kind == "shm-scribble";
        let freezing = kind == "shm-freeze";
        let fds: Vec<(OwnedFd, OwnedFd)> = conns
            .iter()
            .filter_map(|(_, f)| Some((f[0].try_clone().ok()?, f[1].try_clone().ok()?)))
            .collect();
        let stop = std::sync::Arc::clone(&stop);
        abuser = Some(std::thread::spawn(move || {
            let mut x = u64::from(std::process::id()) | 1;
            let len = fds
                .first()
                .and_then(|(m, _)| rustix::fs::fstat(m).ok())
                .map_or(0, |st| st.st_size as u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (memfd, wake) in &fds {
                    if scribble && len > 64 {
                        // xorshift64: a different 64 bytes each time.
                        let bytes: Vec<u8> = (0..8)
                            .flat_map(|_| {
                                x ^= x << 13;
                                x ^= x >> 7;
                                x ^= x << 17;
                                x.to_le_bytes()
                            })
                            .collect();
                        let _ = rustix::io::pwrite(memfd, &bytes, x % (len - 64));
                    }
                    if freezing {
                        // Asleep for ever on the notice ring (ring 0's
                        // sleeping flag, its 25th word), so that every
                        // notice sends a wake-up.
                        let _ = rustix::io::pwrite(memfd, &1u64.to_le_bytes(), 24 * 8);
                    }
                    let _ = rustix::net::send(
                        wake,
                        &[1; 64],
                        rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
                    );
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }));
    }
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(t) = abuser {
        let _ = t.join();
    }
    drop(rings);
    drop(conns);
}

/// For the `shm-freeze` attack, on one connection granted the rings
/// (`fds`: the memfd, our wake-up end): blocking mode on every
/// descriptor, the smallest receive buffer on the wake-up end, a ring
/// subscription (its frames come through our ring, each with a wake-up
/// while we claim to sleep), and pings through our ring; the ring's ends,
/// to hold until the end.
pub(crate) fn freeze(
    s: &UnixStream,
    fds: &[OwnedFd],
) -> Option<(cuda_ipc_shm::Sender, cuda_ipc_shm::Receiver)> {
    for fd in fds {
        let flags = rustix::fs::fcntl_getfl(fd).ok()?;
        let _ = rustix::fs::fcntl_setfl(fd, flags - rustix::fs::OFlags::NONBLOCK);
    }
    let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&fds[1], 1);
    let _ = (&*s).write_all(&frame(&Message::AttachRing {
        id: 1,
        name: "r".into(),
    }));
    let area = cuda_ipc_shm::Area::open(&fds[0], NOTICE_RING_BYTES).ok()?;
    let (mut tx, rx) = area
        .split(cuda_ipc_shm::Side::Opener, fds[1].try_clone().ok()?)
        .ok()?;
    for id in 0..500 {
        // After the hello and the subscription on the socket.
        let mut record = 2u64.to_le_bytes().to_vec();
        record.extend(frame(&Message::Ping { id }));
        if !matches!(tx.send(&record), Ok(true)) {
            break;
        }
    }
    Some((tx, rx))
}

/// One attacker process of the `ring-laggard` attack: a client per
/// connection, each subscribed to the ring, taking every frame and acking
/// one in 25, subscribing again when skipped or evicted, until stdin
/// closes.
pub(crate) fn laggards(path: &Path) {
    let server_uid = rustix::fs::stat(path).map_or(0, |st| st.st_uid);
    let config = ClientConfig::default().with_allowed_server_uids([server_uid]);
    let clients: Vec<Client> = (0..PER_PROCESS)
        .filter_map(|_| Client::connect(path, config.clone()).ok())
        .collect();
    out!("ATTACKING {}", clients.len());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = clients
        .into_iter()
        .map(|client| {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(r) = client.attach_ring("r") else {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match client.next_frame(r.lease, Duration::from_millis(50)) {
                            Ok(f) => {
                                n += 1;
                                if n.is_multiple_of(25) {
                                    let _ = client.ack(r.lease, f.slot, f.seq);
                                }
                            }
                            Err(e) if e.kind() == cuda_ipc_channel::ChannelErrorKind::Timeout => {}
                            Err(_) => break,
                        }
                    }
                    let _ = client.release(r.lease);
                }
            })
        })
        .collect();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
}

/// Reads one whole wire message with the descriptors that came with it.
pub(crate) fn read_message_with_fds(s: &UnixStream) -> Option<(Message, Vec<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let mut head = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < HEADER_LEN {
        let mut space = vec![
            std::mem::MaybeUninit::<u8>::uninit();
            rustix::cmsg_space!(ScmRights(cuda_ipc_channel::MAX_FDS))
        ];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let n = recvmsg(
            s,
            &mut [std::io::IoSliceMut::new(&mut head[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .ok()?
        .bytes;
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
        if n == 0 {
            return None;
        }
        got += n;
    }
    let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    let mut payload = vec![0u8; len];
    (&*s).read_exact(&mut payload).ok()?;
    Some((Message::decode(&payload).ok()?, fds))
}

/// Sends `n` messages made by `message` (ids 0 to n - 1) until one cannot
/// be written, reading nothing.
pub(crate) fn send_all(s: &mut UnixStream, n: u64, message: impl Fn(u64) -> Message) {
    for id in 0..n {
        if s.write_all(&frame(&message(id))).is_err() {
            break;
        }
    }
}

/// What one attacking connection does.
pub(crate) fn assault(kind: &str, mut s: UnixStream, hello: &[u8]) -> UnixStream {
    match kind {
        "no-read" => send_all(&mut s, 400, |id| Message::Attach {
            id,
            name: "e".into(),
        }),
        "not-found" => send_all(&mut s, 2000, |id| Message::Attach {
            id,
            name: format!("{id:0>256}"),
        }),
        "big-request" => {
            let mut m = header(1 << 20).to_vec();
            m.resize(HEADER_LEN + (1 << 20), b' ');
            let _ = s.write_all(&m);
        }
        "calls" => send_all(&mut s, 2000, |id| Message::Call {
            id,
            method: "drop".into(),
            body: json!({ "set": format!("{id:0>256}") }),
        }),
        "cut-off" => send_all(&mut s, 17, |id| Message::Attach {
            id,
            name: "e".into(),
        }),
        "ring-no-read" => {
            let m = frame(&Message::AttachRing {
                id: 1,
                name: "r".into(),
            });
            let _ = s.write_all(&m);
        }
        "ring-no-ack" => {
            let m = frame(&Message::AttachRing {
                id: 1,
                name: "r".into(),
            });
            if s.write_all(&m).is_ok() {
                // Reads every frame (and the slots) for as long
                // as the connection lasts; acks nothing.
                let reader = s.try_clone().expect("clone");
                reader.set_read_timeout(None).ok();
                std::thread::spawn(move || while read_message(&reader).is_some() {});
            }
        }
        "ack-flood" => {
            let m = frame(&Message::AttachRing {
                id: 1,
                name: "r".into(),
            });
            let acks: Vec<u8> = (0..64)
                .flat_map(|i| {
                    frame(&Message::Ack {
                        lease: 1_000 + i,
                        slot: 0,
                        seq: i,
                    })
                })
                .collect();
            if s.write_all(&m).is_ok() {
                let mut w = s.try_clone().expect("clone");
                w.set_write_timeout(None).ok();
                std::thread::spawn(move || while w.write_all(&acks).is_ok() {});
            }
        }
        "trickle" => {
            let mut t = s.try_clone().expect("clone");
            let rest = hello[10..].to_vec();
            std::thread::spawn(move || {
                for b in rest.into_iter().cycle() {
                    if t.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            });
        }
        "leases" => {
            for chunk in 0..(4096 / 64) as u64 {
                let batch: Vec<u8> = (0..64)
                    .flat_map(|i| {
                        frame(&Message::Attach {
                            id: chunk * 64 + i,
                            name: "e".into(),
                        })
                    })
                    .collect();
                if s.write_all(&batch).is_err() {
                    break;
                }
                for _ in 0..64 {
                    if read_message(&s).is_none() {
                        break;
                    }
                }
            }
        }
        _ => {}
    }
    s
}

/// For the cut-off attack: waits to be cut off (the server's send
/// timeout), keeps the sockets with their unread descriptors, and connects
/// again; how many of the new connections were admitted.
pub(crate) fn reconnect(path: &Path, hello: &[u8], conns: &mut Vec<UnixStream>) -> usize {
    let deadline = Instant::now() + Duration::from_secs(8);
    for s in conns.iter() {
        while !cut_off(s) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut admitted = 0;
    for _ in 0..PER_PROCESS {
        let Ok(mut s) = UnixStream::connect(path) else {
            continue;
        };
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        if s.write_all(hello).is_ok()
            && let Some(Message::Welcome { .. }) = read_message(&s)
        {
            admitted += 1;
            conns.push(s);
        }
    }
    admitted
}

/// Whether the server has shut its side of `s`.
pub(crate) fn cut_off(s: &UnixStream) -> bool {
    let mut pfd = [rustix::event::PollFd::new(
        s,
        rustix::event::PollFlags::RDHUP,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    rustix::event::poll(&mut pfd, Some(&zero)).unwrap_or(0) > 0
}
