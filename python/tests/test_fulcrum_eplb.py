"""fulcrum_eplb against DeepSeek EPLB's reference outputs (../shared/golden/deepseek_eplb), against the
`fulcrum plan` CLI, and on its own contracts (shapes, dtypes, inverse maps, migration, bad input).

Environment: FULCRUM_GOLDEN_DIR overrides the golden folder; FULCRUM_BIN names the CLI binary (else
build/bin/fulcrum or build-cpu/bin/fulcrum at the repository root).
"""

import glob
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import fulcrum_eplb as eplb

REPO = Path(__file__).resolve().parents[2]


def golden_dir() -> Path:
    if os.environ.get("FULCRUM_GOLDEN_DIR"):
        return Path(os.environ["FULCRUM_GOLDEN_DIR"])
    return REPO.parent / "shared" / "golden" / "deepseek_eplb"


def golden_cases():
    files = sorted(glob.glob(str(golden_dir() / "*.json")))
    return [json.loads(Path(f).read_text()) for f in files]


def fulcrum_bin():
    named = os.environ.get("FULCRUM_BIN")
    if named:  # named explicitly (CI): a missing binary is a failure, not a skip
        if not os.access(named, os.X_OK):
            pytest.fail(f"FULCRUM_BIN={named} is not an executable")
        return named
    for d in ("build", "build-cpu"):
        candidate = REPO / d / "bin" / "fulcrum"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def args_of(case):
    return case["num_physical_experts"], case["num_groups"], case["num_nodes"], case["num_gpus"]


def check_inverse(phy2log, log2phy, logcnt):
    """log2phy lists exactly each expert's slots (ascending, -1 padded) and logcnt counts them."""
    num_layers, num_experts, width = log2phy.shape
    assert width == logcnt.max()
    for layer in range(num_layers):
        for expert in range(num_experts):
            slots = np.flatnonzero(phy2log[layer] == expert)
            assert logcnt[layer, expert] == len(slots)
            assert list(log2phy[layer, expert, : len(slots)]) == list(slots)
            assert (log2phy[layer, expert, len(slots):] == -1).all()


# ---- DeepSeek's reference outputs ----

def test_golden_cases_present():
    cases = golden_cases()
    assert len(cases) >= 60, f"golden cases missing under {golden_dir()}"
    assert sum(c["tie_free"] for c in cases) >= 8


@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["name"])
def test_deepseek_matches_reference(case):
    weight = np.array(case["weight"], dtype=np.float32)  # the reference ran on float32 loads
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, *args_of(case), algorithm="deepseek")
    num_layers, num_experts = weight.shape
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64
    assert phy2log.shape == (num_layers, case["num_physical_experts"])
    assert logcnt.shape == (num_layers, num_experts)
    check_inverse(phy2log, log2phy, logcnt)
    assert eplb.balancedness(weight, phy2log, case["num_gpus"]).mean() == pytest.approx(case["balancedness_mean"], abs=1e-3)
    if case["tie_free"]:  # equal loads may be ordered either way; without them the maps are the reference's
        assert (phy2log == np.array(case["physical_to_logical_map"])).all()
        assert (logcnt == np.array(case["logical_count"])).all()


@pytest.mark.parametrize("case", [c for c in golden_cases() if c["num_logical_experts"] >= 64][:6], ids=lambda c: c["name"])
def test_fulcrum_planner_at_least_as_balanced_as_deepseek(case):
    weight = np.array(case["weight"])
    phy2log, _, logcnt = eplb.rebalance_experts(weight, *args_of(case))
    report = eplb.evaluate(weight, phy2log, case["num_gpus"], case["num_nodes"])
    assert report["balancedness_mean"] >= case["balancedness_mean"] - 1e-9
    assert report["balancedness_mean"] <= report["lower_bound_balancedness_mean"] + 1e-9
    assert (logcnt.sum(axis=1) == case["num_physical_experts"]).all()


def test_readme_example_of_deepseek():
    # DeepSeek's README example (2 layers, 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs) with its printed output.
    weight = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                       [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, _, _ = eplb.rebalance_experts(weight, 16, 4, 2, 8, algorithm="deepseek")
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


# ---- the CLI ----

def run_cli_plan(tmp_path, weight, num_physical, num_groups, num_nodes, num_gpus, algorithm, current=None):
    binary = fulcrum_bin()
    if binary is None:
        pytest.skip("no fulcrum binary (set FULCRUM_BIN or build build/bin/fulcrum): CLI equality not checked")
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"logical_count": np.asarray(weight).tolist()}))
    out = tmp_path / "plan.json"
    cmd = [binary, "plan", "--loads", str(loads), "--gpus", str(num_gpus), "--physical-experts", str(num_physical),
           "--nodes", str(num_nodes), "--groups", str(num_groups), "--algorithm", algorithm, "--output", str(out), "--json"]
    if current is not None:
        cur = tmp_path / "current.json"
        cur.write_text(json.dumps({"physical_to_logical_map": np.asarray(current).tolist(), "num_gpus": num_gpus,
                                   "num_nodes": num_nodes, "num_logical_experts": int(np.shape(weight)[1])}))
        cmd += ["--current", str(cur)]
    summary = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return np.array(json.loads(out.read_text())["physical_to_logical_map"]), summary


CLI_CASES = ["small_hier", "small_global", "qwen3_30b_ep8_r32", "qwen3-30b-a3b_prefill_gsm8k_en_ep16_p160",
             "dsv3_hier_ep32"]


@pytest.mark.parametrize("algorithm", ["fulcrum", "deepseek"])
@pytest.mark.parametrize("name", CLI_CASES)
def test_equals_fulcrum_plan(tmp_path, name, algorithm):
    case = json.loads((golden_dir() / f"{name}.json").read_text())
    weight = np.array(case["weight"])
    cli_map, summary = run_cli_plan(tmp_path, weight, *args_of(case), algorithm)
    phy2log, _, _ = eplb.rebalance_experts(weight, *args_of(case), algorithm=algorithm)
    assert (phy2log == cli_map).all()
    report = eplb.evaluate(weight, phy2log, case["num_gpus"], case["num_nodes"])
    assert report["balancedness_mean"] == pytest.approx(summary["balancedness_mean"], rel=1e-12)


def test_current_equals_fulcrum_plan(tmp_path):
    case = json.loads((golden_dir() / "qwen3-30b-a3b_prefill_gsm8k_en_ep16_p160.json").read_text())
    other = json.loads((golden_dir() / "qwen3-30b-a3b_prefill_mmlu_en_ep16_p160.json").read_text())
    current, _, _ = eplb.rebalance_experts(np.array(other["weight"]), *args_of(case))
    weight = np.array(case["weight"])
    cli_map, summary = run_cli_plan(tmp_path, weight, *args_of(case), "fulcrum", current=current)
    phy2log, _, _ = eplb.rebalance_experts(weight, *args_of(case), current=current)
    assert (phy2log == cli_map).all()
    assert eplb.plan_migration(current, phy2log, weight.shape[1], case["num_gpus"])["layer"].size == summary["experts_moved"]


# ---- the module's own contracts ----

def qwen_case():
    return json.loads((golden_dir() / "qwen3_30b_ep8_r32.json").read_text())


def test_current_keeps_slots_and_migration_plan_realizes_the_new_map():
    case = qwen_case()
    weight = np.array(case["weight"])
    num_physical, num_groups, num_nodes, num_gpus = args_of(case)
    rng = np.random.default_rng(7)
    drifted = weight * rng.uniform(0.8, 1.25, size=weight.shape)
    current, _, _ = eplb.rebalance_experts(weight, *args_of(case))
    fresh, _, _ = eplb.rebalance_experts(drifted, *args_of(case))
    kept, _, _ = eplb.rebalance_experts(drifted, *args_of(case), current=current)
    moved_fresh, moved_kept = (fresh != current).sum(), (kept != current).sum()
    assert moved_kept < moved_fresh
    plan = eplb.plan_migration(current, kept, weight.shape[1], num_gpus, num_nodes)
    assert plan["layer"].size == moved_kept
    # Applying the transfers to the old map gives the new one; every source held the expert before.
    applied = current.copy()
    for layer, dst, src, expert in zip(plan["layer"], plan["dst_slot"], plan["src_slot"], plan["expert"]):
        assert current[layer, src] == expert
        applied[layer, dst] = expert
    assert (applied == kept).all()
    assert plan["num_local"] + plan["num_intra_node"] + plan["num_inter_node"] == moved_kept


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch", reason="torch not installed: torch in/out not checked (numpy paths are)")
    case = qwen_case()
    weight = torch.tensor(case["weight"], dtype=torch.float32)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, *args_of(case))
    assert isinstance(phy2log, torch.Tensor) and phy2log.dtype == torch.int64
    expected, _, _ = eplb.rebalance_experts(weight.numpy(), *args_of(case))
    assert (phy2log.numpy() == expected).all()
    assert log2phy.shape[:2] == logcnt.shape == weight.shape


def test_dlpack_and_integer_inputs():
    case = qwen_case()
    weight = np.array(case["weight"])
    expected, _, _ = eplb.rebalance_experts(weight, *args_of(case))

    class DlpackOnly:  # an array offered only through DLPack
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    got, _, _ = eplb.rebalance_experts(DlpackOnly(weight), *map(np.int64, args_of(case)))
    assert (got == expected).all()
    counts = np.rint(weight * 1000).astype(np.int32)  # token counts, as servers record them
    phy2log, _, logcnt = eplb.rebalance_experts(counts.tolist(), *args_of(case))
    assert phy2log.shape == expected.shape and (logcnt >= 1).all()


def test_gpu_loads_and_static_dispatch():
    weight = np.array([[6.0, 1.0, 1.0, 0.0]])
    phy2log = np.array([[0, 1, 0, 2, 3, 0]])  # expert 0 on all three GPUs (2 slots per GPU)
    loads = eplb.gpu_loads(weight, phy2log, 3)
    assert loads.tolist() == [[3.0, 3.0, 2.0]]
    assert eplb.balancedness(weight, phy2log, 3).tolist() == pytest.approx([(8 / 3) / 3])
    table = eplb.static_dispatch(phy2log, 4, 3)
    assert table.shape == (1, 3, 4)
    assert table[0, :, 0].tolist() == [0, 2, 5]  # each GPU uses its own replica of expert 0
    for g in range(3):
        assert (phy2log[0, table[0, g]] == np.arange(4)).all()


def test_simulate_rebalances_on_cadence():
    case = qwen_case()
    weight = np.array(case["weight"])
    windows = np.stack([weight, weight[::-1], weight, weight[::-1]])
    out = eplb.simulate(windows, case["num_physical_experts"], case["num_gpus"], rebalance_every=2)
    assert out["rebalance_windows"].tolist() == [2]
    assert out["balancedness_per_window"].shape == (4,)
    assert out["balancedness_min"] == out["balancedness_per_window"].min()
    # Window 2 runs the plan made from windows 0 and 1; it beats the trivial placement of window 0.
    assert out["balancedness_per_window"][2] > out["balancedness_per_window"][0]


@pytest.mark.parametrize("call, message", [
    (lambda w: eplb.rebalance_experts(w, 30, 1, 1, 4), "multiple of num_gpus"),
    (lambda w: eplb.rebalance_experts(w[0], 32, 1, 1, 4), "weight must have 2 dimensions"),
    (lambda w: eplb.rebalance_experts(-w, 32, 1, 1, 4), "not a finite value >= 0"),
    (lambda w: eplb.rebalance_experts(w, 32, 1, 1, 4, algorithm="greedy"), "unknown planner 'greedy'"),
    (lambda w: eplb.rebalance_experts(w, 32.0, 1, 1, 4), "num_replicas must be an integer"),
    (lambda w: eplb.rebalance_experts(w, 32, 1, 1, 4, current=np.zeros((2, 32), np.int64)), "has no replica"),
    (lambda w: eplb.rebalance_experts(w, 32, 1, 1, 4, current=np.full((2, 32), 1 << 40)), "is not a logical expert"),
    (lambda w: eplb.rebalance_experts(w, 32, 1, 1, 4, current=np.zeros((3, 32), np.int64)), "current has 3 layers"),
    (lambda w: eplb.rebalance_experts(w, 32, 1, 1, 4, current=np.zeros((2, 32)) + 0.5), "must hold integers"),
])
def test_bad_input_is_a_one_line_value_error(call, message):
    weight = np.arange(32, dtype=np.float64).reshape(2, 16)
    with pytest.raises(ValueError, match=message) as err:
        call(weight)
    assert isinstance(err.value, eplb.FulcrumError)
    assert "\n" not in str(err.value)
