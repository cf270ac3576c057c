//! `serve --checkpoint` and `attach --set --checkpoint` without a GPU: the
//! options (`--read-only` too), and a bad path, checkpoint or option refused
//! (exit 2) before the driver is loaded; a good checkpoint gets as far as
//! the driver (exit 3 here).

mod common;

use std::path::Path;

use common::{assert_error, cuda_ipc};

/// A safetensors file of one f32 tensor `w` of shape [2] (no padding).
fn write_checkpoint(path: &Path) {
    let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_bad_checkpoint_is_refused_before_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a checkpoint at all").unwrap();
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        br#"{"weight_map":{"w":"model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let no_tensor = dir.path().join("none.safetensors");
    let header = br#"{"__metadata__":{"format":"pt"}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(&no_tensor, bytes).unwrap();
    for (path, why) in [
        (&missing, "missing.safetensors"),
        (&junk, "junk.safetensors"),
        (&empty_dir, "empty"),
        (&index, "model-00001-of-00002.safetensors"),
        (&no_tensor, "holds no tensor"),
    ] {
        let p = path.to_str().unwrap();
        let args = ["serve", "--checkpoint", p];
        assert_error(&args, &cuda_ipc(&args), 2, why);
        let args = ["attach", "--set", "model", "--checkpoint", p];
        assert_error(&args, &cuda_ipc(&args), 2, why);
    }
}

#[test]
fn a_good_checkpoint_gets_as_far_as_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_checkpoint(&file);
    let sock = dir.path().join("s.sock");
    let (f, d, s) = (
        file.to_str().unwrap(),
        dir.path().to_str().unwrap(),
        sock.to_str().unwrap(),
    );
    for args in [
        vec!["serve", "--checkpoint", f, "--socket", s],
        vec!["serve", "--checkpoint", d, "--socket", s, "--name", "m"],
        vec![
            "serve",
            "--checkpoint",
            f,
            "--socket",
            s,
            "--streams",
            "2",
            "--staging",
            "4KiB",
        ],
    ] {
        assert_error(&args, &cuda_ipc(&args), 3, "libcuda.so.1");
    }
}

#[test]
fn load_options_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_checkpoint(&file);
    let f = file.to_str().unwrap();
    for (extra, exit, why) in [
        (vec!["--streams", "0"], 2, "0 is not from 1 to 1024"),
        (vec!["--streams", "2000"], 2, "2000 is not from 1 to 1024"),
        (vec!["--staging", "0"], 2, "at least one byte"),
        (vec!["--staging", "lots"], 2, "lots"),
        (vec!["--name", ""], 2, "must not be empty"),
        (vec!["--name", "a\nb"], 2, "control character"),
        (vec!["--size", "4096"], 2, "cannot be used with"),
        (vec!["--set", "3"], 2, "cannot be used with"),
        (vec!["--fill-u32", "1"], 2, "cannot be used with"),
    ] {
        let mut args = vec!["serve", "--checkpoint", f];
        args.extend(extra);
        assert_error(&args, &cuda_ipc(&args), exit, why);
    }
}

#[test]
fn checkpoint_options_need_a_checkpoint() {
    for (args, why) in [
        (
            vec!["serve", "--size", "4096", "--fill-u32", "1", "--name", "m"],
            "--name applies only with --checkpoint",
        ),
        (
            vec![
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--streams",
                "2",
            ],
            "--streams applies only with --checkpoint",
        ),
        (
            vec![
                "serve",
                "--size",
                "4096",
                "--fill-u32",
                "1",
                "--staging",
                "1MiB",
            ],
            "--staging applies only with --checkpoint",
        ),
        (vec!["serve"], "--size"),
        (vec!["attach", "--checkpoint", "/m"], "--set"),
    ] {
        assert_error(&args, &cuda_ipc(&args), 2, why);
    }
}

/// `serve --read-only` (readers map the set read-only) and `attach
/// --read-only`: checked before the driver; a vmm or auto arena gets as
/// far as the driver.
#[test]
fn read_only_is_checked_before_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_checkpoint(&file);
    let sock = dir.path().join("s.sock");
    let (f, s) = (file.to_str().unwrap(), sock.to_str().unwrap());
    for mechanism in ["legacy", "pool"] {
        for mut args in [
            vec!["serve", "--checkpoint", f],
            vec!["serve", "--set", "3", "--size", "64MiB"],
        ] {
            args.extend(["--read-only", "--mechanism", mechanism, "--socket", s]);
            let o = cuda_ipc(&args);
            assert_error(&args, &o, 2, &format!("an arena of {mechanism} chunks"));
            assert_error(&args, &o, 2, "--mechanism vmm");
        }
    }
    for args in [
        vec!["serve", "--checkpoint", f, "--read-only", "--socket", s],
        vec![
            "serve",
            "--checkpoint",
            f,
            "--read-only",
            "--mechanism",
            "vmm",
            "--socket",
            s,
        ],
        vec![
            "serve",
            "--set",
            "3",
            "--size",
            "64MiB",
            "--read-only",
            "--socket",
            s,
        ],
    ] {
        assert_error(&args, &cuda_ipc(&args), 3, "libcuda.so.1");
    }
    for (args, why) in [
        (
            vec!["serve", "--size", "4096", "--fill-u32", "1", "--read-only"],
            "--read-only: it applies to sets",
        ),
        (
            vec!["attach", "--read-only", "--fill-u32", "1"],
            "cannot be used with",
        ),
        (
            vec!["attach", "--read-only", "--list"],
            "cannot be used with",
        ),
    ] {
        assert_error(&args, &cuda_ipc(&args), 2, why);
    }
    for sub in ["serve", "attach"] {
        let o = cuda_ipc(&[sub, "--help"]);
        let help = String::from_utf8_lossy(&o.stdout);
        assert!(help.contains("--read-only"), "{sub}: {help}");
        assert!(help.contains("read-only"), "{sub}: {help}");
    }
}

/// `serve --checkpoint --tp R/N [--tp-rule P=D]`: the shard (rank, world,
/// rules, a dimension that does not split evenly) is checked before the
/// driver; a good one gets as far as the driver.
#[test]
fn tensor_parallel_shards_are_checked_before_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_checkpoint(&file);
    let sock = dir.path().join("s.sock");
    let (f, s) = (file.to_str().unwrap(), sock.to_str().unwrap());
    // A name that fits alone, and not with the shard's suffix.
    let long = "m".repeat(250);
    for (extra, exit, why) in [
        (vec!["--tp", "2/2"], 2, "rank"),
        (vec!["--tp", "1"], 2, "is not R/N"),
        (vec!["--tp", "0/2", "--tp-rule", "w"], 2, "--tp-rule"),
        (
            vec!["--tp", "0/4", "--tp-rule", "w=0"],
            2,
            "--tp or --tp-rule",
        ),
        (vec!["--tp", "0/2", "--name", &long], 2, "--name"),
        (vec!["--tp", "0/2"], 3, "libcuda.so.1"),
        (vec!["--tp", "1/2", "--tp-rule", "w=0"], 3, "libcuda.so.1"),
        (
            vec!["--tp", "0/2", "--tp-rule", "w=replicate"],
            3,
            "libcuda.so.1",
        ),
    ] {
        let mut args = vec!["serve", "--checkpoint", f, "--socket", s];
        args.extend(extra);
        assert_error(&args, &cuda_ipc(&args), exit, why);
    }
    for (args, why) in [
        (
            vec!["serve", "--size", "4096", "--fill-u32", "1", "--tp", "0/2"],
            "--tp applies only with --checkpoint",
        ),
        (
            vec!["serve", "--checkpoint", f, "--tp-rule", "w=0"],
            "--tp-rule applies only with --tp",
        ),
    ] {
        assert_error(&args, &cuda_ipc(&args), 2, why);
    }
}
