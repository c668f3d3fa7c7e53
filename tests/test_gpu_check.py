"""``benchmarks/gpu_check.py`` in its dry mode: every phase's logic on CPU with a tiny model.

The figures mean nothing here; what is checked is that each phase runs, that the exactness checks
hold (float32 greedy tokens equal transformers', tokens over HTTP equal the in-process engine's)
and that the report is written, so that the script works the first time a GPU is lent.
"""

import json
import subprocess
import sys

from tests.server_process import REPO

PHASES = ["env", "checkpoint", "load", "residency", "parity_dtype", "decode", "prefetch", "step_profile",
          "sampling_syncs", "serve", "parity_fp32", "cpu_offload", "quantized", "compiled", "families", "peer_transfer"]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert (out / "gpu_check.json").exists(), proc.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    failed = {name: p.get("error") for name, p in doc["phases"].items() if not p.get("ok")}
    assert not failed, failed
    assert list(doc["phases"]) == PHASES
    assert proc.returncode == 0 and doc["ok"] and doc["complete"]
    phases = doc["phases"]
    assert phases["parity_fp32"]["equal"] == phases["parity_fp32"]["of"] == 4
    assert phases["serve"]["greedy_equal_to_engine"] and phases["serve"]["exit_code"] == 0
    assert phases["cpu_offload"]["equal_to_resident_engine"]
    assert phases["peer_transfer"]["receiver"]["equal"] and phases["peer_transfer"]["backend"] == "gloo"
    assert phases["sampling_syncs"]["greedy_syncs"] is None  # counted on a GPU only
    assert phases["env"]["torch_private"] == "ok"
    assert all(phases["quantized"][f]["equal"] == phases["quantized"][f]["of"] == 3
               for f in ("fp8-block-16", "w4a16", "w8a8", "fp8-experts", "w4a16-experts"))
    from benchmarks.gpu_check import COMPILED_FAMILIES, GPU_FAMILIES

    assert all(phases["families"][f]["equal"] == phases["families"][f]["of"] == 3 for f in GPU_FAMILIES)
    compiled_family = phases["families"][f"{COMPILED_FAMILIES[0]}-compiled"]  # an adapter's, compiled
    assert compiled_family["equal"] == compiled_family["of"] == 3 and compiled_family["compiled_steps"] > 0
    compiled = phases["compiled"]
    assert compiled["sizes"] == "1,2+" and set(compiled["regions"]) == {"layer", "model"}
    for region in compiled["regions"].values():  # float32: equal (the phase raises otherwise)
        assert region["tokens_equal_eager"] == region["of"] == 4 and region["graphs"] >= 2
        assert [r["concurrency"] for r in region["runs"]] == [1, 4] and region["compiled_steps"] > 0
    layer = compiled["regions"]["layer"]  # a second warm-up loads what the first saved
    assert layer["graphs_loaded"] == layer["graphs"], layer
    systems = {(r["concurrency"], r["system"]) for r in phases["decode"]["runs"]}
    assert systems == {(c, s) for c in (1, 4) for s in ("transformers generate", "engine, all resident",
                                                          "engine, none resident")}
    markdown = (out / "gpu_check.md").read_text()
    assert "| serve | yes |" in markdown and "dtype: float32" in markdown
    assert (out / "step_profile.txt").read_text().count("function calls") == 2


def test_phases_past_the_budget_are_skipped_not_failed(tmp_path):
    """A lent device's minutes are few: what the budget leaves out is recorded as skipped, and the
    run is ok where nothing that ran failed."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out),
                           "--workdir", str(tmp_path / "work"), "--budget-s", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    doc = json.loads((out / "gpu_check.json").read_text())
    assert proc.returncode == 0 and doc["ok"], proc.stderr[-3000:]
    assert doc["phases"]["env"]["ok"] is True and doc["skipped"] == PHASES[1:] and not doc["complete"]
    assert "| checkpoint | skipped |" in (out / "gpu_check.md").read_text()
