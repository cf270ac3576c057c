//! The corpus of the `shm_ring` fuzz target (rings that a hostile peer
//! wrote into), replayed through the target's checks (`fuzz/src/shm_ring.rs`,
//! included here), so that a plain `cargo test` keeps what fuzzing found.

#[path = "../../cuda-ipc/tests/support/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/src/shm_ring.rs"]
mod fuzz_shm_ring;

#[test]
fn the_shm_ring_corpus_passes_its_checks() {
    corpus::replay("shm_ring", fuzz_shm_ring::shm_ring, fuzz_shm_ring::is_valid);
}
