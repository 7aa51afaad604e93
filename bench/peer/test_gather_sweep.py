"""CPU tests of bench/peer/gather_sweep.py (the sweep's runs gathered into one JSON for engine_bench_tables --sweep).

Run: python3 -m unittest discover -s bench/peer -p 'test_*.py'
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "gather_sweep.py")
TABLES = os.path.join(HERE, "..", "..", "scripts", "engine_bench_tables.py")


def run_doc(commit, ms):
    return {"command": "fulcrum bench generate ...", "git_commit": commit, "gpu": "NVIDIA H100 80GB HBM3",
            "runs": [{"phase": "decode", "batch": 1, "context": 512, "ms_per_step": ms, "roofline_ms": ms / 2}]}


class GatherSweep(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, name, doc):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def gather(self, *args):
        out = os.path.join(self.dir.name, "sweep.json")
        proc = subprocess.run([sys.executable, SCRIPT, out, "--what", "w", "--command", "c", *args],
                              capture_output=True, text=True)
        return proc, out

    def test_runs_keep_their_order_and_repeats_and_print_as_a_sweep_table(self):
        a = self.write("a.json", run_doc("abc", 3.4))
        b = self.write("b.json", run_doc("abc", 3.6))
        a2 = self.write("a2.json", run_doc("abc", 3.3))
        proc, out = self.gather(f"X unset={a}", f"X=1={b}", f"X unset (run 2)={a2}")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual(list(doc["runs_by_value"]), ["X unset", "X=1", "X unset (run 2)"])
        self.assertEqual(doc["git_commit"], "abc")
        self.assertEqual(doc["machine"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(doc["commands"], ["c"])
        table = subprocess.run([sys.executable, TABLES, "--sweep", out], capture_output=True, text=True)
        self.assertEqual(table.returncode, 0, table.stderr)
        self.assertIn("| X=1 | 3.600 (50.0%) |", table.stdout)
        self.assertIn("| X unset (run 2) | 3.300 (50.0%) |", table.stdout)

    def test_bad_runs_are_one_line_errors_and_write_nothing(self):
        good = self.write("good.json", run_doc("abc", 3.4))
        other = self.write("other.json", run_doc("def", 3.4))
        broken = os.path.join(self.dir.name, "broken.json")
        with open(broken, "w") as f:
            f.write("{not json")
        cases = [([f"a={good}", f"b={other}"], "commit def"),
                 ([f"a={good}", f"a={good}"], "given twice"),
                 ([f"a={broken}"], "broken.json"),
                 ([f"a={os.path.join(self.dir.name, 'missing.json')}"], "missing.json"),
                 ([good], "expected LABEL=RUN.json")]
        for args, message in cases:
            with self.subTest(message=message):
                proc, out = self.gather(*args)
                self.assertEqual(proc.returncode, 1)
                self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)
                self.assertIn(message, proc.stderr)
                self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main()
