//! The set record (`cuda_ipc::set`): strict decoding of formats 1 to 3
//! with errors that name the field (format 3's table read through a
//! fetch), format 2's entry table byte by byte,
//! 10,000 entries, the fuzz corpora of `fuzz/set_record` and
//! `fuzz/set_table` replayed, and property tests (round trip; every
//! mutation decodes to a valid record or fails cleanly).

use cuda_ipc::arena::ArenaId;
use cuda_ipc::descriptor::{Descriptor, Dtype, Source};
use cuda_ipc::device::DeviceUuid;
use cuda_ipc::set::{NameIndex, SetChunk, SetEntry, SetRecord};

#[path = "../../../../fuzz/src/set_record.rs"]
mod fuzz_set_record;

#[path = "../../../../fuzz/src/set_table.rs"]
mod fuzz_set_table;

#[path = "../support/corpus.rs"]
mod corpus;
mod decoding;
mod fields;
mod fuzzed;

const UUID: DeviceUuid = DeviceUuid([7; 16]);
const MIB: u64 = 1 << 20;

fn chunk(id: u64, fd: i32, len: u64) -> SetChunk {
    SetChunk::new(
        id,
        Descriptor::new(Source::Vmm { fd }, len, UUID, 4242)
            .with_generation(u64::from(fd.unsigned_abs())),
    )
}

fn entry(name: &str, dtype: Dtype, shape: &[u64], chunk: u64, offset: u64) -> SetEntry {
    let len = shape.iter().product::<u64>() * dtype.size();
    SetEntry::new(name.into(), dtype, shape.to_vec(), chunk, offset, len)
}

fn sample() -> SetRecord {
    SetRecord::new(
        "weights".into(),
        ArenaId(0x1234_5678_9abc_def0),
        vec![chunk(0, 7, 2 * MIB), chunk(3, 9, 4 * MIB)],
        vec![
            entry("layer0.weight", Dtype::F32, &[256, 256], 0, 0),
            entry("layer0.bias", Dtype::F32, &[256], 0, 262_144),
            entry("layer1.weight", Dtype::Bf16, &[1024, 1024], 3, 1024),
            entry("step", Dtype::I64, &[], 0, 263_168),
        ],
    )
    .unwrap()
}

#[test]
fn name_index_finds_every_entry_and_nothing_else() {
    let r = std::sync::Arc::new(sample());
    let index = NameIndex::new(r.clone());
    for (i, e) in r.entries.iter().enumerate() {
        assert_eq!(index.position(&e.name), Some(i), "{}", e.name);
    }
    assert_eq!(index.position("layer2.weight"), None);
    assert_eq!(index.position(""), None);
    assert_eq!(index.position("layer0.weigh"), None);
}
