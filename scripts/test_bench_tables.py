"""scripts/bench_tables.py on a report of the bench's JSON form
(testdata/bench-report.json: rows of the H200 run of 2026-12-03 copied from
its text report, p50 and tails only). No GPU."""

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_tables  # noqa: E402

REPORT = os.path.join(HERE, "testdata", "bench-report.json")


def run(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = bench_tables.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


class BenchTables(unittest.TestCase):
    def test_tables_carry_machine_date_and_commit_once(self):
        code, out, _ = run(REPORT, "--commit", "abc1234")
        self.assertEqual(code, 0)
        self.assertEqual(out.count("Measured on an NVIDIA H200, driver CUDA 13.0, 2026-12-03, commit abc1234"), 2)
        self.assertIn("| a new 64 MiB buffer from an arena (vmm) | 0.066 ms | PyTorch, torch.multiprocessing "
                      "| 0.541 ms | 8.19x |", out)
        self.assertIn("| 4 KiB frames through a ring, fences | 101,326 frames/s |", out)

    def test_write_replaces_only_what_is_between_the_markers(self):
        root = tempfile.mkdtemp()
        try:
            os.makedirs(os.path.join(root, "docs"))
            for path, name in (("README.md", "headline"), ("docs/PERFORMANCE.md", "full")):
                with open(os.path.join(root, path), "w") as f:
                    f.write(f"before\n<!-- bench-table:{name}:begin -->\nold\n<!-- bench-table:{name}:end -->\nafter\n")
            code, _, err = run(REPORT, "--commit", "abc1234", "--write", "--root", root)
            self.assertEqual(code, 0, err)
            with open(os.path.join(root, "README.md")) as f:
                text = f.read()
            self.assertTrue(text.startswith("before\n<!-- bench-table:headline:begin -->\n*Measured on"), text)
            self.assertTrue(text.endswith("<!-- bench-table:headline:end -->\nafter\n"), text)
            self.assertNotIn("old", text)
            with open(os.path.join(root, "docs", "PERFORMANCE.md")) as f:
                self.assertGreater(f.read().count("\n| "), 15)
        finally:
            shutil.rmtree(root)

    def test_a_missing_row_is_named_and_exit_2(self):
        with open(REPORT) as f:
            report = json.load(f)
        report["sections"] = [s for s in report["sections"] if s["id"] != "torch"]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(report, f)
        try:
            code, _, err = run(f.name, "--commit", "abc1234")
        finally:
            os.unlink(f.name)
        self.assertEqual(code, 2)
        self.assertIn("no measured row with section 'torch'", err)

    def test_bad_arguments_are_exit_2(self):
        self.assertEqual(run(REPORT, "--commit", "HEAD")[0], 2)
        self.assertEqual(run(os.path.join(HERE, "check_docs.py"), "--commit", "abc1234")[0], 2)


if __name__ == "__main__":
    unittest.main()
