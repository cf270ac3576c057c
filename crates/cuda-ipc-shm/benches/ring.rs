//! A record through a ring, sent and received in one process over two
//! mappings of one memfd (as two processes map it): the copy in and out of
//! shared memory, at a notice's size (64 B), a ring frame's notice with
//! its metadata (4 KiB) and an attach's answer carrying a 1,000-entry set
//! record (48 KiB), in the default 64 KiB ring.
//!
//! Run: `cargo bench -p cuda-ipc-shm --bench ring`.

use cuda_ipc_shm::{Area, DEFAULT_CAPACITY, Side, wake_pair};
use divan::{Bencher, black_box};

fn main() {
    divan::main();
}

#[divan::bench(args = [64, 4096, 48 * 1024])]
fn send_and_recv(bencher: Bencher, len: usize) {
    let (area, memfd) = Area::create(DEFAULT_CAPACITY).expect("an area");
    let theirs = Area::open(&memfd, DEFAULT_CAPACITY).expect("its second mapping");
    let (ours, other) = wake_pair().unwrap();
    let (mut sender, _) = area.split(Side::Creator, ours).unwrap();
    let (_, mut receiver) = theirs.split(Side::Opener, other).unwrap();
    // An odd length, so that the last word is a partial one.
    let record: Vec<u8> = (0..len - 3).map(|i| i as u8).collect();
    let mut out = Vec::with_capacity(len);
    bencher.bench_local(|| {
        assert!(sender.send(black_box(&record)).unwrap());
        assert!(receiver.recv(&mut out).unwrap());
        black_box(&out);
    });
}
