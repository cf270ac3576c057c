//! Fences where events fail: a consumer in a new mount namespace with its
//! own tmpfs on /dev/shm (what Docker gives every container) cannot open an
//! interprocess event (`cuIpcOpenEventHandle` fails with
//! `CUDA_ERROR_MAP_FAILED`), and orders its work with a fence instead.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use cuda_ipc::device::Capabilities;
use cuda_ipc::fence::{Fence, FenceBlock, FenceMapping};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Descriptor, Device, Dtype, IpcEvent, IpcEventHandle, Mechanism};
use serde_json::{Value, json};

use crate::common::{Parent, Peer, role};
use crate::test_name;

const MARKER_ENV: &str = "CUDA_IPC_FENCE_SHM_MARKER";

/// The consumer inside the namespace: tries the event, then the fence.
fn contained_consumer() {
    let device = Device::open(0).unwrap();
    let parent = Parent::new();
    let marker = std::env::var(MARKER_ENV).unwrap();
    let marker_visible = Path::new(&marker).exists();
    while let Some(m) = parent.recv() {
        let handle: IpcEventHandle = m["event"].as_str().unwrap().parse().unwrap();
        let event_error = IpcEvent::open(&device, handle).err().map(|e| e.to_string());
        let opened = serde_json::from_value::<FenceBlock>(m["fence"].clone())
            .map_err(|e| e.to_string())
            .and_then(|b| FenceMapping::open(&device, &b, Vec::new()).map_err(|e| e.to_string()))
            .and_then(|f| {
                let d = Descriptor::from_value(&m["data"]).map_err(|e| e.to_string())?;
                let data =
                    share::open::<u32>(&device, &d, Vec::new()).map_err(|e| e.to_string())?;
                Ok((f, data))
            });
        let (fence, data) = match opened {
            Ok(x) => x,
            Err(e) => {
                parent.send(&json!({ "waiting": false }));
                parent.send(&json!({ "error": e, "event_error": event_error, "marker_visible": marker_visible }));
                continue;
            }
        };
        fence.wait(device.stream(), 0, 1).unwrap();
        parent.send(&json!({ "waiting": true }));
        let p = Pattern::ramp(
            m["expect"][0].as_u64().unwrap() as u32,
            m["expect"][1].as_u64().unwrap() as u32,
        );
        let bad = kernels::check_u32(&data, p).unwrap();
        parent.send(
            &json!({ "bad": bad, "event_error": event_error, "marker_visible": marker_visible }),
        );
    }
}

fn usable(caps: &Capabilities, m: Mechanism) -> bool {
    share::check_mechanism(caps, m).is_ok()
}

/// Starts the consumer as `unshare --mount` (private propagation) with a
/// new tmpfs over /dev/shm, running this executable; the script lives in
/// the returned directory.
fn spawn_contained(marker: &str) -> (Peer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("contained.sh");
    let exe = std::env::current_exe().unwrap();
    let mut script = std::fs::File::create(&wrapper).unwrap();
    writeln!(
        script,
        "#!/bin/sh\nexec unshare --mount --propagation private sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" \"$@\"' '{}' \"$@\"",
        exe.display()
    )
    .unwrap();
    drop(script);
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let peer = Peer::spawn_exe_with(
        &wrapper,
        &test_name!("fences_work_where_events_fail_with_a_private_dev_shm"),
        "contained",
        |c| {
            c.env(MARKER_ENV, marker);
        },
    );
    (peer, dir)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fences_work_where_events_fail_with_a_private_dev_shm() {
    if role().as_deref() == Some("contained") {
        return contained_consumer();
    }
    if !rustix::process::geteuid().is_root() {
        println!(
            "skipped: a private /dev/shm needs `unshare --mount` and `mount`, which need root"
        );
        return;
    }
    if Command::new("unshare").arg("--version").output().is_err() {
        println!("skipped: `unshare` (util-linux) is not installed");
        return;
    }
    let device = Device::open(0).unwrap();
    share::allow_fd_fetching().unwrap();
    let caps = device.capabilities().unwrap();

    // A file in the host's /dev/shm, which the consumer must not see.
    let marker = format!("/dev/shm/cuda-ipc-fence-marker-{}", std::process::id());
    std::fs::File::create(&marker).unwrap();
    let (mut peer, _dir) = spawn_contained(&marker);

    let mut results: Vec<(String, Value)> = Vec::new();
    let rounds = [
        (Mechanism::Vmm, false),
        (Mechanism::Pool, false),
        (Mechanism::Legacy, false),
        (Mechanism::Vmm, true),
    ];
    for (m, host) in rounds {
        let name = if host {
            format!("{m} data, host-word fence")
        } else {
            format!("{m}")
        };
        if !usable(&caps, m) {
            println!("private /dev/shm, {name}: not supported by this device, skipped");
            continue;
        }
        let event = IpcEvent::new(&device).unwrap();
        event.record(device.stream()).unwrap();
        let fence = if host {
            Fence::new_host(&device, 1).unwrap()
        } else if m == Mechanism::Pool {
            // A consumer cannot wait on words in imported pool memory
            // (cuStreamWaitValue64: CUDA_ERROR_INVALID_VALUE), so the
            // library refuses to put them there.
            let e = Fence::new(&device, 1, Some(m)).unwrap_err();
            assert_eq!(e.kind(), cuda_ipc::ErrorKind::Unavailable, "{e}");
            println!(
                "private /dev/shm, {name}: fence words in pool memory refused ({e}); words in the default memory"
            );
            Fence::new(&device, 1, None).unwrap()
        } else {
            Fence::new(&device, 1, Some(m)).unwrap()
        };
        let data = SharedBuffer::alloc(&device, 16 << 20, Some(m)).unwrap();
        let fe = fence.export().unwrap();
        let de = data.export_region(0, 16 << 20, Dtype::U32, None).unwrap();
        let pattern = Pattern::ramp(0xF00D, 5);
        peer.send(&json!({
            "event": event.handle().unwrap().to_string(),
            "fence": fe.block,
            "data": de.descriptor.to_value(),
            "expect": [pattern.base, pattern.step],
        }));
        let w = peer.recv();
        if w["waiting"] == true {
            kernels::fill_u32(&data, pattern, Speed::Slow).unwrap();
            fence.signal(device.stream(), 0, 1).unwrap();
        }
        let r = peer.recv();
        device.synchronize().unwrap();
        println!(
            "private /dev/shm, {name}: event open: {}; fence: {}",
            r["event_error"].as_str().unwrap_or("opened"),
            match (r.get("error"), r["bad"].is_null()) {
                (Some(e), _) => format!("failed: {e}"),
                (None, true) => "ordered the consumer after a slow fill, data checked".into(),
                (None, false) => format!("WRONG DATA at {}", r["bad"]),
            }
        );
        results.push((name, r));
    }
    let _ = std::fs::remove_file(&marker);
    assert!(peer.finish(), "the contained consumer failed");

    check_results(&results);
}

/// The consumer saw its own /dev/shm, could not open the events, and was
/// ordered by every fence it could map (VMM data with both kinds of words
/// at least).
fn check_results(results: &[(String, Value)]) {
    for (m, r) in results {
        assert_eq!(
            r["marker_visible"], false,
            "the consumer's /dev/shm is the host's, so the test proves nothing"
        );
        if r.get("error").is_none() {
            assert!(
                r["bad"].is_null(),
                "{m}: the fence let the consumer read early: {r}"
            );
        }
    }
    for name in ["vmm", "vmm data, host-word fence"] {
        let (_, r) = results
            .iter()
            .find(|(n, _)| n == name)
            .expect("the device supports VMM file descriptors");
        assert!(
            r.get("error").is_none(),
            "{name}: the fence failed in the namespace: {r}"
        );
    }
    let vmm = &results[0].1;
    let event_error = vmm["event_error"]
        .as_str()
        .expect("the event opened with a private /dev/shm");
    assert!(
        event_error.contains("cuIpcOpenEventHandle"),
        "{event_error}"
    );
}
