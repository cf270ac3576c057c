//! Sets at scale and under abuse: 1 to 10,000 buffers, dropped buffers
//! kept while a consumer holds them, consumers killed in the middle of set
//! hand-offs, the hand-off soak, and a crude timing of a fresh hand-off
//! from an arena.

use std::time::{Duration, Instant};

use cuda_ipc::exchange::Sharing;
use cuda_ipc::kernels::{self, Speed};
use cuda_ipc::set::weight_sizes;
use cuda_ipc::{Device, DeviceMemory, Dtype};
use serde_json::json;

use super::super::common::{free_memory, open_fds};
use crate::test_name;

use super::*;

/// Sets of 1, 100, 1,000 and 10,000 buffers (256 MiB in all), every value
/// of every buffer checked by the consumer; the chunks are mapped once.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sets_of_1_to_10000_buffers() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let mut p = spawn(
            &test_name!("sets_of_1_to_10000_buffers"),
            dir.path().join("s.sock").as_path(),
        );
        for (k, n) in [1usize, 100, 1000, 10_000].into_iter().enumerate() {
            let sizes = weight_sizes(n, 256 * MIB, 42).unwrap();
            let base = 1000 * k as u32;
            let set = Set::new(&publisher, &sizes, base);
            let name = format!("set{n}");
            set.publish(&publisher, &name);
            let t = Instant::now();
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": name, "base": base }),
            );
            assert_eq!(r["len"], n);
            println!(
                "set of {n}: attached and every value checked in {:?}",
                t.elapsed()
            );
            assert_eq!(r["table_hits"], k, "{n}: a new layout is read");
            // Published again (10,000 entries travel in parts): the table
            // read for the first is reused, the values checked again.
            let again = format!("{name}-again");
            set.publish(&publisher, &again);
            let t = Instant::now();
            let r = ask(
                &mut p,
                &json!({ "op": "attach_set", "name": again, "base": base }),
            );
            assert_eq!(
                (r["len"].clone(), r["table_hits"].clone()),
                (json!(n), json!(k + 1))
            );
            println!(
                "set of {n} again (its entry table kept): attached and checked in {:?}",
                t.elapsed()
            );
            ask(&mut p, &json!({ "op": "release" }));
            for name in [&name, &again] {
                publisher
                    .unpublish_set(name, Some(Duration::from_secs(10)))
                    .unwrap();
            }
        }
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
    });
}

/// The producer drops buffers a consumer still holds: their ranges stay
/// allocated (new buffers land elsewhere, and the consumer still reads the
/// old values) until the consumer releases the set.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dropped_buffers_stay_until_the_consumer_releases() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let sizes = weight_sizes(64, 128 * MIB, 3).unwrap();
        let set = Set::new(&publisher, &sizes, 5);
        set.publish(&publisher, "w");
        let mut p = spawn(
            &test_name!("dropped_buffers_stay_until_the_consumer_releases"),
            dir.path().join("s.sock").as_path(),
        );
        ask(
            &mut p,
            &json!({ "op": "attach_set", "name": "w", "base": 5 }),
        );
        publisher.unpublish_set("w", None).unwrap();
        drop(set);
        let stats = publisher.arena().unwrap().stats();
        assert_eq!(stats.held_by_leases_only, 64, "{stats:?}");
        assert_eq!(publisher.retired_sets(), 1);
        // New buffers of the same sizes, filled with other values.
        let other = Set::new(&publisher, &sizes, 999);
        for b in &other.buffers {
            b.synchronize().unwrap();
        }
        ask(&mut p, &json!({ "op": "check_held", "base": 5 }));
        ask(&mut p, &json!({ "op": "release" }));
        let deadline = Instant::now() + Duration::from_secs(10);
        while publisher.reap() == 0 && publisher.retired_sets() > 0 {
            assert!(
                Instant::now() < deadline,
                "the released set was never reaped"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let stats = publisher.arena().unwrap().stats();
        assert_eq!(stats.buffers, 64, "only the new set is left: {stats:?}");
        drop(other);
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
    });
}

/// Consumers killed in the middle of set hand-offs (before, during and
/// after attaching): the channel ends their leases, the publisher gets its
/// ranges back, and a healthy consumer still sees every value.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chaos_kills_in_the_middle_of_set_handoffs() {
    child_or(|| {
        let rounds = env_count("CUDA_IPC_SET_CHAOS_ROUNDS", 10);
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let socket = dir.path().join("s.sock");
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        let sizes = weight_sizes(1000, 256 * MIB, 9).unwrap();
        let test = test_name!("chaos_kills_in_the_middle_of_set_handoffs");
        for round in 0..rounds {
            let base = round as u32 * 31;
            let set = Set::new(&publisher, &sizes, base);
            let name = format!("round{round}");
            set.publish(&publisher, &name);
            let mut p = spawn(&test, &socket);
            p.send(&json!({ "op": "attach_set", "name": name, "base": base }));
            // Kill at a different moment each round: 0 to 9 ms into the hand-off.
            std::thread::sleep(Duration::from_micros(round * 1000 % 10_000));
            p.kill();
            publisher.unpublish_set(&name, None).unwrap();
            drop(set);
            let deadline = Instant::now() + Duration::from_secs(10);
            while publisher.retired_sets() > 0 {
                publisher.reap();
                assert!(
                    Instant::now() < deadline,
                    "round {round}: leases of a killed consumer stayed"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(
                publisher.arena().unwrap().stats().buffers,
                0,
                "round {round}"
            );
        }
        // A healthy consumer after the chaos.
        let set = Set::new(&publisher, &sizes, 4242);
        set.publish(&publisher, "after");
        let mut p = spawn(&test, &socket);
        ask(
            &mut p,
            &json!({ "op": "attach_set", "name": "after", "base": 4242 }),
        );
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
        println!("{rounds} consumers killed in the middle of set hand-offs; ranges all came back");
    });
}

/// A set hand-off soak: every cycle allocates a fresh set of 16 buffers,
/// publishes it, the consumer attaches, reads and releases it, the producer
/// unpublishes and drops it. Device memory (cuMemGetInfo) and the open
/// descriptors of both processes are the same at the end as after warm-up.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn set_handoff_soak_a_hundred_thousand_cycles() {
    child_or(|| {
        let cycles = env_count("CUDA_IPC_SET_SOAK_CYCLES", 100_000);
        let device = Device::open(0).unwrap();
        let dir = socket_dir();
        let publisher = publisher_on(&device, dir.path(), Sharing::auto());
        publisher.arena().unwrap().reserve(256 * MIB).unwrap();
        let sizes = weight_sizes(16, 64 * MIB, 5).unwrap();
        let mut p = spawn(
            &test_name!("set_handoff_soak_a_hundred_thousand_cycles"),
            dir.path().join("s.sock").as_path(),
        );
        let warm = 100.min(cycles);
        let mut before = None;
        let started = Instant::now();
        for c in 0..cycles {
            if c == warm {
                device.stream().synchronize().unwrap();
                let child = ask(&mut p, &json!({ "op": "fds" }))["fds"]
                    .as_u64()
                    .unwrap();
                before = Some((free_memory(&device), open_fds(), child));
            }
            let base = c as u32;
            let set = Set::new(&publisher, &sizes, base);
            set.publish(&publisher, "soak");
            ask(
                &mut p,
                &json!({ "op": "cycle", "name": "soak", "base": base }),
            );
            publisher
                .unpublish_set("soak", Some(Duration::from_secs(10)))
                .unwrap();
            drop(set);
        }
        device.stream().synchronize().unwrap();
        let child = ask(&mut p, &json!({ "op": "fds" }))["fds"]
            .as_u64()
            .unwrap();
        let after = (free_memory(&device), open_fds(), child);
        if let Some(before) = before {
            assert_eq!(
                before, after,
                "(free device memory, our fds, the consumer's fds)"
            );
        }
        assert_eq!(publisher.arena().unwrap().stats().buffers, 0);
        p.send(&json!({ "op": "exit" }));
        assert!(p.finish());
        println!(
            "{cycles} set hand-offs in {:?}; device memory and fds unchanged",
            started.elapsed()
        );
    });
}

/// A fresh hand-off from an arena, timed crudely (publish to the consumer
/// holding the buffer checked, over this test's pipe): prints the p50. The
/// real figure comes from `cuda-ipc bench`.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fresh_handoff_from_an_arena_p50() {
    child_or(|| {
        let device = Device::open(0).unwrap();
        for m in mechanisms(&device) {
            let dir = socket_dir();
            let publisher = publisher_on(&device, dir.path(), Sharing::arena(m));
            publisher.arena().unwrap().reserve(512 * MIB).unwrap();
            let mut p = spawn(
                &test_name!("fresh_handoff_from_an_arena_p50"),
                dir.path().join("s.sock").as_path(),
            );
            let mut times = Vec::new();
            for i in 0..200u32 {
                let b = publisher.alloc(64 * MIB).unwrap();
                kernels::fill_u32(&b, pattern(i, 0), Speed::Full).unwrap();
                b.synchronize().unwrap();
                let t = Instant::now();
                publisher
                    .publish_buffer("fresh", &b, Dtype::U32, &[16 * MIB])
                    .unwrap();
                p.send(&json!({ "op": "cycle", "name": "fresh", "base": i }));
                let r = p.recv();
                times.push(t.elapsed());
                assert!(r["bad"].is_null(), "{r}");
                publisher
                    .unpublish_set("fresh", Some(Duration::from_secs(10)))
                    .unwrap();
            }
            times.sort();
            println!(
                "{m}: fresh 64 MiB hand-off from an arena, publish to checked first word (with a pipe round trip): p50 {:?}",
                times[times.len() / 2]
            );
            p.send(&json!({ "op": "exit" }));
            assert!(p.finish());
        }
    });
}
