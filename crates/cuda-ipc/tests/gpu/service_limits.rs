//! The weight service's limits on a real device: a shutdown during a long
//! load returns within two seconds.

use std::path::Path;
use std::time::{Duration, Instant};

use cuda_ipc::Device;
use cuda_ipc::channel::{Client, ClientConfig};
use cuda_ipc::service::admin::{self, LoadRequest};
use cuda_ipc::service::{Quotas, Service, ServiceConfig};
use serde_json::json;

/// A checkpoint of `tensors` U8 tensors of `each` bytes, all a hole (a
/// sparse file: nothing on disk, zeros when read).
fn sparse(path: &Path, tensors: u64, each: u64) {
    let map: serde_json::Map<String, serde_json::Value> = (0..tensors)
        .map(|i| {
            let entry =
                json!({"dtype": "U8", "shape": [each], "data_offsets": [i * each, (i + 1) * each]});
            (format!("t{i}"), entry)
        })
        .collect();
    let text = serde_json::Value::Object(map).to_string();
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    let f = std::fs::File::create(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &bytes, 0).unwrap();
    f.set_len(bytes.len() as u64 + tensors * each).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_shutdown_stops_a_running_load_within_two_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    // 16 GiB copied through one stream in 16 KiB pieces: many seconds.
    sparse(&path, 16, 1 << 30);
    let socket = dir.path().join("svc.sock");
    let device = Device::open(0).unwrap();
    let config = ServiceConfig::default().with_quotas(Quotas::unlimited());
    let service = Service::start(&device, socket.as_path(), config).unwrap();
    let request =
        LoadRequest::new("big", path.to_str().unwrap()).with_copies(Some(1), Some(16 << 10));
    let loading = {
        let socket = socket.clone();
        std::thread::spawn(move || {
            let client = Client::connect(&socket, ClientConfig::default()).unwrap();
            let started = Instant::now();
            let r = client.call_within("load", &admin::encode(&request), Duration::from_secs(120));
            (r, started.elapsed())
        })
    };
    let started = Instant::now();
    while service.stats().loads_in_progress == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the load never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(500));
    let stopping = Instant::now();
    let report = service.shutdown(Duration::from_secs(30));
    let took = stopping.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the shutdown took {took:?}: {report:?}"
    );
    assert!(report.dropped.is_empty(), "{report:?}");
    let (answer, load_took) = loading.join().unwrap();
    let e = answer.expect_err("the load was stopped");
    assert!(e.to_string().contains("stopped"), "{e}");
    assert!(load_took < Duration::from_secs(20), "{load_took:?}");
}
