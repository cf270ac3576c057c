"""cuda_ipc.models without a GPU or torch: its argument checks come before
anything is imported or attached, and importing it imports nothing heavy."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _path  # noqa: E402,F401

from cuda_ipc import models  # noqa: E402
from cuda_ipc.errors import InvalidInput  # noqa: E402


class Arguments(unittest.TestCase):
    def test_bad_arguments_are_refused_first(self):
        for call in (
            lambda: models.from_state_dict("/no/config", {}),
            lambda: models.from_state_dict("/no/config", None),
            lambda: models.from_state_dict("/no/config", [1, 2]),
            lambda: models.from_service(object(), "model", "/no/config"),
        ):
            with self.subTest(call=call):
                with self.assertRaises(InvalidInput):
                    call()

    def test_importing_it_imports_neither_torch_nor_transformers(self):
        self.assertEqual(sorted(dir(models)), ["from_service", "from_state_dict"])
        for heavy in ("transformers",):
            self.assertNotIn(heavy, sys.modules, f"importing cuda_ipc.models imported {heavy}")


if __name__ == "__main__":
    unittest.main()
