//! Descriptors on the command line and on standard input, without a GPU:
//! validated before the driver is needed, bounded, and quoted short in
//! errors.

mod common;

use common::*;

#[test]
fn a_descriptor_is_validated_before_the_driver_is_needed() {
    let d = r#"{"cuda_ipc":1,"mechanism":"legacy","handle":"HANDLE","alloc_size":4096,"offset":4096,"len":4,"dtype":"u32","device_uuid":"GPU-00000000-0000-0000-0000-000000000000","pid":1}"#
        .replace("HANDLE", HANDLE);
    let o = cuda_ipc(&["open", "--descriptor", &d]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("passes the end"), "{}", stderr(&o));
    let fixed = d.replace("\"offset\":4096", "\"offset\":0");
    let o = cuda_ipc(&["open", "--descriptor", &fixed]);
    assert_eq!(
        code(&o),
        3,
        "a valid descriptor reaches the driver check: {}",
        stderr(&o)
    );
}

#[test]
fn open_honours_size_and_offset_with_a_descriptor() {
    let d = descriptor(16);
    for (args, exit, why) in [
        (
            vec!["--size", "32"],
            2,
            "passes the end of the described region (16 bytes)",
        ),
        (vec!["--offset", "20"], 2, "passes the end"),
        (vec!["--offset", "8", "--size", "16"], 2, "passes the end"),
        (vec!["--offset", "8"], 3, "libcuda.so.1"),
        (vec!["--offset", "4", "--size", "8"], 3, "libcuda.so.1"),
        (vec!["--size", "16"], 3, "libcuda.so.1"),
    ] {
        let mut full = vec!["open", "--descriptor", &d];
        full.extend(args);
        assert_error(&full, &cuda_ipc(&full), exit, why);
    }
    // With a handle, --size is still required.
    let o = cuda_ipc(&["open", "--handle", HANDLE, "--offset", "8"]);
    assert_error(&["open"], &o, 2, "--size");
}

#[test]
fn a_descriptor_on_standard_input_is_one_bounded_utf8_line() {
    let args = ["open", "--descriptor", "-"];
    let pretty = serde_json::to_string_pretty(
        &serde_json::from_str::<serde_json::Value>(&descriptor(16)).unwrap(),
    )
    .unwrap();
    for (input, exit, why) in [
        (Vec::new(), 2, "standard input is empty"),
        (b"\n".to_vec(), 2, "the first line is empty"),
        (pretty.into_bytes(), 2, "not a whole JSON document"),
        (b"{\"cuda_ipc\":1,\xff}\n".to_vec(), 2, "not UTF-8"),
        (descriptor(16).into_bytes(), 3, "libcuda.so.1"),
        (
            format!("{}\nmore\n", descriptor(16)).into_bytes(),
            3,
            "libcuda.so.1",
        ),
    ] {
        let (o, _) = cuda_ipc_with_input(&args, input);
        assert_error(&args, &o, exit, why);
        if exit == 2 {
            assert!(stderr(&o).contains("one line of JSON"), "{}", stderr(&o));
        }
    }
    // 64 MiB with no newline: refused after 1 MiB, without reading the rest.
    let (o, taken) = cuda_ipc_with_input(&args, vec![b'x'; 64 << 20]);
    assert_error(&args, &o, 2, "longer than 1MiB");
    assert!(taken < 8 << 20, "cuda-ipc read {taken} bytes");
}

#[test]
fn long_arguments_are_not_echoed_in_full() {
    let long = "9".repeat(120_000);
    let junk = "x".repeat(120_000);
    for args in [
        &["demo", "--size", &long][..],
        &["demo", "--device", &long],
        &["demo", "--stream", "--seconds", &long],
        &["export", "--size", "4096", "--fill-u32", &long],
        &["attach", "--socket", &junk],
        &["open", "--descriptor", &junk],
        &[&junk],
        &["info", &junk],
    ] {
        let o = cuda_ipc(args);
        assert_no_panic(&o);
        assert_eq!(code(&o), 2, "{}", &stderr(&o)[..200.min(stderr(&o).len())]);
        assert!(
            stderr(&o).len() < 1200,
            "{} bytes: {}",
            stderr(&o).len(),
            &stderr(&o)[..1200]
        );
    }
}

#[test]
fn a_descriptor_with_a_key_twice_or_a_huge_size_is_refused() {
    let d = descriptor(16);
    let twice = d.replacen('{', "{\"len\":4,", 1);
    assert_error(
        &["open"],
        &cuda_ipc(&["open", "--descriptor", &twice]),
        2,
        "appears twice",
    );
    let huge = d.replace("\"alloc_size\":4096", "\"alloc_size\":18446744073709551616");
    assert_error(
        &["open"],
        &cuda_ipc(&["open", "--descriptor", &huge]),
        2,
        "too large",
    );
}

#[test]
fn a_descriptor_quoting_a_long_value_is_cut_short() {
    let long = "q".repeat(5000);
    let d = descriptor(16);
    for (from, to) in [
        (
            "\"mechanism\":\"legacy\"",
            format!("\"mechanism\":\"{long}\""),
        ),
        ("\"dtype\":\"u32\"", format!("\"dtype\":\"{long}\"")),
        ("\"pid\":1", format!("\"pid\":1,\"{long}\":1")),
    ] {
        let bad = d.replace(from, &to);
        let o = cuda_ipc(&["open", "--descriptor", &bad]);
        assert_error(&["open"], &o, 2, "more characters");
    }
}
