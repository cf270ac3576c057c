"""Tests of first_attach.py that need neither torch nor a GPU:
python3 -m unittest discover -s bench."""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import first_attach  # noqa: E402
from test_cuda_ipc_share import HIDE, lines  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "first_attach.py")


def run(args, hide=None):
    if hide is None:
        argv = [sys.executable, SCRIPT] + args
    else:
        argv = [sys.executable, "-c", HIDE % (hide, SCRIPT, args, SCRIPT)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


class Model(unittest.TestCase):
    def test_the_table_is_a_qwen2_of_about_4_4_gb_with_tied_embeddings(self):
        shapes, ties = first_attach.qwen2_shapes()
        m = first_attach.model_summary(shapes, ties)
        self.assertEqual((m["keys"], m["tensors"]), (291, 290))
        self.assertEqual(m["params"], 2_186_192_896)
        self.assertEqual(m["bytes"], 4_372_385_792)
        self.assertEqual(ties, {"lm_head.weight": "model.embed_tokens.weight"})
        keys = dict(shapes)
        self.assertEqual(len(keys), len(shapes), "keys repeat")
        self.assertEqual(keys["model.embed_tokens.weight"], (151936, 2048))
        self.assertEqual(keys["model.layers.23.self_attn.k_proj.weight"], (512, 2048))
        self.assertEqual(keys["model.layers.0.mlp.down_proj.weight"], (2048, 11008))
        self.assertEqual(shapes[0][0], "model.embed_tokens.weight")
        self.assertEqual(shapes[-1][0], "lm_head.weight")

    def test_untied_models_have_no_ties(self):
        cfg = dict(first_attach.QWEN2_LIKE, tie_word_embeddings=False, num_hidden_layers=2)
        shapes, ties = first_attach.qwen2_shapes(cfg)
        self.assertEqual(ties, {})
        self.assertEqual(first_attach.model_summary(shapes, ties)["keys"], 2 * 12 + 3)

    def test_print_model_needs_no_torch(self):
        out = run(["--print-model"], hide="torch")
        self.assertEqual(out.returncode, 0, out.stderr)
        got = json.loads(out.stdout)
        self.assertEqual((got["keys"], got["tensors"], got["bytes"]), (291, 290, 4_372_385_792))


class Pattern(unittest.TestCase):
    def test_sums_are_those_of_the_elements(self):
        for k in (0, 1, 249, 250, 251, 500, 1234):
            a, b = first_attach.pattern_params(k)
            self.assertNotEqual(a % first_attach.PATTERN_MOD, 0)
            for n in (0, 1, 250, 251, 252, 1000, 5021):
                want = sum(((j % 251) * a + b) % 251 for j in range(n))
                self.assertEqual(first_attach.pattern_sum(n, k), want, (k, n))

    def test_values_are_exact_in_bfloat16(self):
        # bfloat16 has 8 significant bits: every whole number up to 256 is exact.
        self.assertLessEqual(first_attach.PATTERN_MOD, 256)

    def test_tensors_differ_and_tied_keys_share_their_sum(self):
        shapes = [("e", (300, 2)), ("w", (300, 2)), ("head", (300, 2))]
        ties = {"head": "e"}
        got = first_attach.expectations(shapes, ties)
        self.assertEqual([g[0] for g in got], ["e", "w", "head"])
        self.assertEqual(got[0][1], [300, 2])
        self.assertEqual(got[2][2], got[0][2])
        self.assertNotEqual(got[1][2], got[0][2])
        self.assertEqual(got[1][2], first_attach.pattern_sum(600, 1))


class Script(unittest.TestCase):
    def test_bad_arguments_are_an_error_line(self):
        for args in (["--reps", "1"], ["--reps", "1:0"], ["--reps=-1:3"], ["--loads", "-1"]):
            with self.subTest(args=args):
                out = run(["--device", "0"] + args)
                self.assertEqual(out.returncode, 2, out.stderr)
                self.assertEqual([g["kind"] for g in lines(out)], ["error"])

    def test_without_cuda_ipc_or_torch_it_skips_saying_why(self):
        for module, says in (("cuda_ipc", "cuda_ipc is not importable"), ("torch", "not importable")):
            with self.subTest(module=module):
                out = run(["--device", "0", "--reps", "0:1"], hide=module)
                self.assertEqual(out.returncode, 0, out.stderr)
                got = lines(out)
                self.assertEqual(got[-1]["kind"], "skip", got)
                self.assertIn(says, got[-1]["reason"])

    def test_parse_reps(self):
        self.assertEqual(first_attach.parse_reps("1:10"), (1, 10))
        self.assertEqual(first_attach.parse_reps("0:3"), (0, 3))


if __name__ == "__main__":
    unittest.main()
