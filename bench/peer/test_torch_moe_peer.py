"""CPU tests of bench/peer/torch_moe_peer.py: the parts that run without torch or a GPU (the routing file, the
routing made from counts, the one-line errors when torch or CUDA is missing; a stand-in `torch` package on
PYTHONPATH plays the missing or CUDA-less torch, so the tests mean the same where torch is installed).

Run: python3 -m unittest discover -s bench/peer -p 'test_*.py'
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_moe_peer.py")
sys.path.insert(0, HERE)
import torch_moe_peer as peer  # noqa: E402  (imports no torch at module level)


def counts_of(ids, experts):
    counts = [0] * experts
    for e in ids:
        counts[e] += 1
    return counts


class RoutingFromCounts(unittest.TestCase):
    def test_every_token_gets_top_k_distinct_experts_with_the_given_counts(self):
        tokens, experts, top_k = 37, 16, 4
        others = [e for e in range(experts) if e != 3]
        rest = tokens * top_k - tokens  # 111 rows over 15 experts: 7 or 8 each
        counts = [0] * experts
        counts[3] = tokens  # an expert every token uses
        for i, e in enumerate(others):
            counts[e] = rest // len(others) + (1 if i < rest % len(others) else 0)
        ids = peer.topk_ids_from_counts(counts, tokens, top_k)
        self.assertEqual(len(ids), tokens * top_k)
        for t in range(tokens):
            self.assertEqual(len(set(ids[t * top_k:(t + 1) * top_k])), top_k, f"token {t}")
        self.assertEqual(counts_of(ids, experts), counts)

    def test_counts_that_do_not_sum_to_tokens_times_top_k_are_refused(self):
        with self.assertRaises(peer.PeerError):
            peer.topk_ids_from_counts([1, 2, 3], 2, 2)


class RoutingFile(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def write(self, doc):
        path = os.path.join(self.dir.name, "routing.json")
        with open(path, "w") as f:
            f.write(doc if isinstance(doc, str) else json.dumps(doc))
        return path

    def test_reads_models_and_routing_as_the_benchmark_writes_them(self):
        tokens, counts, ids = peer.uniform_routing(50, 128, 8, seed=3)
        path = self.write({"experts": 128, "top_k": 8,
                           "models": [{"name": "qwen3-30b-a3b", "hidden": 2048, "intermediate": 768}],
                           "routing": [{"tokens": tokens, "expert_counts": counts, "topk_ids": ids},
                                       {"tokens": 4, "expert_counts": [1] * 32 + [0] * 96}]})
        models, experts, top_k, routings = peer.read_routing(path)
        self.assertEqual(models, [("qwen3-30b-a3b", 2048, 768)])
        self.assertEqual((experts, top_k), (128, 8))
        self.assertEqual(routings[0], (50, counts, ids))
        t, c, made = routings[1]  # no topk_ids: made from the counts
        self.assertEqual((t, c), (4, [1] * 32 + [0] * 96))
        self.assertEqual(counts_of(made, 128), c)

    def test_refuses_inconsistent_or_malformed_files_with_one_line(self):
        good = peer.uniform_routing(6, 16, 2, seed=1)
        bad_counts = list(good[1])
        bad_counts[0] += 1
        bad_counts[1 if bad_counts[1] > 0 else 2] -= 1
        twice = list(good[2])
        twice[1] = twice[0]
        cases = {
            "not json": "{",
            "no routing": {"experts": 16, "top_k": 2},
            "counts disagree": {"experts": 16, "top_k": 2,
                                "routing": [{"tokens": 6, "expert_counts": bad_counts, "topk_ids": good[2]}]},
            "expert twice": {"experts": 16, "top_k": 2, "routing": [{"tokens": 6, "expert_counts": counts_of(twice, 16),
                                                                    "topk_ids": twice}]},
            "id out of range": {"experts": 16, "top_k": 2,
                                "routing": [{"tokens": 6, "expert_counts": good[1], "topk_ids": [16] + good[2][1:]}]},
            "wrong count length": {"experts": 16, "top_k": 2, "routing": [{"tokens": 6, "expert_counts": [12]}]},
            "count above tokens": {"experts": 2, "top_k": 2, "routing": [{"tokens": 1, "expert_counts": [2, 0]}]},
            "model without hidden": {"models": [{"name": "m"}], "routing": [{"tokens": 1, "expert_counts": [1] * 8 + [0] * 120}]},
        }
        for name, doc in cases.items():
            with self.subTest(name), self.assertRaises(peer.PeerError) as ctx:
                peer.read_routing(self.write(doc))
            self.assertNotIn("\n", str(ctx.exception), name)
        with self.assertRaises(peer.PeerError):
            peer.read_routing(os.path.join(self.dir.name, "missing.json"))


class WithoutTorchOrCuda(unittest.TestCase):
    """The script run as the benchmark runs it, with a stand-in torch package first on the path."""

    def run_with_fake_torch(self, init_py):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "torch"))
            with open(os.path.join(d, "torch", "__init__.py"), "w") as f:
                f.write(init_py)
            env = dict(os.environ, PYTHONPATH=d)
            out = os.path.join(d, "peer.json")
            p = subprocess.run([sys.executable, SCRIPT, "--tokens", "16", "--out", out], env=env,
                               capture_output=True, text=True, timeout=120)
            return p, os.path.exists(out)

    def test_missing_torch_is_one_line_and_exit_2(self):
        p, wrote = self.run_with_fake_torch("raise ImportError('No module named torch (stand-in)')\n")
        self.assertEqual(p.returncode, 2)
        self.assertEqual(p.stdout, "")
        self.assertEqual(p.stderr.count("\n"), 1, p.stderr)
        self.assertTrue(p.stderr.startswith("torch_moe_peer: PyTorch is not installed"), p.stderr)
        self.assertFalse(wrote)

    def test_torch_without_cuda_is_one_line_and_exit_2(self):
        p, wrote = self.run_with_fake_torch(
            "__version__ = '0.0-stand-in'\n"
            "class version:\n    cuda = None\n"
            "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n")
        self.assertEqual(p.returncode, 2)
        self.assertEqual(p.stderr.count("\n"), 1, p.stderr)
        self.assertTrue(p.stderr.startswith("torch_moe_peer: no CUDA device"), p.stderr)
        self.assertFalse(wrote)

    def test_bad_arguments_are_one_line_and_exit_2(self):
        p = subprocess.run([sys.executable, SCRIPT, "--models", "llama"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertEqual(p.stderr, "torch_moe_peer: --models: unknown model 'llama' (known: qwen3-30b-a3b, qwen3-235b-a22b)\n")


if __name__ == "__main__":
    unittest.main()
