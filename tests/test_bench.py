"""`specinfer bench`: every contender in one run, outputs checked, the report in three formats."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import make_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from specinfer.checkpoints import truncate_layers
    root = tmp_path_factory.mktemp("bench")
    llm = make_checkpoint(root / "llm", "llama3", seed=3, layers=3, tie_word_embeddings=False)
    return llm, truncate_layers(llm, root / "ssm", 1)


def bench(*args):
    return subprocess.run([sys.executable, "-m", "specinfer.cli", "bench", *args, "--threads", "1"],
                          capture_output=True, text=True, timeout=900)


def test_bench_greedy_report(tmp_path, pair):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):\n", "class A:\n    def g(self):\n", "import os\n"]))
    r = bench("--llm", str(pair[0]), "--ssm", str(pair[1]), "--ssm", str(pair[1]), "--prompts", str(prompts),
              "--max-tokens", "12", "--tree", "1,1,1", "--tree", "2,1", "--streams", "1,2", "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {row["contender"]: row for row in report["rows"]}
    assert list(rows)[:9] == ["ours incremental", "ours 1,1,1 SSM 1", "ours 1,1,1 all 2 SSMs",
                              "ours 2,1 SSM 1", "ours 2,1 all 2 SSMs",
                              "ours incremental, 1 streams (scheduler)", "ours 1,1,1 SSM 1, 1 streams (scheduler)",
                              "ours incremental, 2 streams (scheduler)", "ours 1,1,1 SSM 1, 2 streams (scheduler)"]
    assert rows["ours 1,1,1 SSM 1, 2 streams (scheduler)"]["streams"] == 2
    for name, row in rows.items():
        if row["tool"] == "specinfer":
            assert row["identical"] == 3 and row["tokens_per_s"] > 0
            assert sum(int(k) * v for k, v in row["histogram"].items()) == row["tokens"]
            if name != "ours incremental":
                assert 1 <= row["tokens_per_step"] <= 4
    # the peers decode the same checkpoints greedily: the same tokens
    assert rows["transformers greedy"]["identical"] == 3
    assert rows["transformers assisted"]["identical"] == 3
    if "onnxruntime-genai greedy" in rows and not rows["onnxruntime-genai greedy"].get("unavailable"):
        assert rows["onnxruntime-genai greedy"]["identical"] == 3
    assert {t["target"].split(" / ")[-1] for t in report["targets"]} >= {"ours incremental (tokens/s)",
                                                                         "transformers assisted"}
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| ours 2,1 all 2 SSMs |" in md and "3/3" in md and md in r.stdout
    assert (tmp_path / "out" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sampling_compares_the_rules_at_two_temperatures(tmp_path, pair):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nimport sys\n")
    r = bench("--llm", str(pair[0]), "--ssm", str(pair[1]), "--prompts", str(prompts), "--max-tokens", "16",
              "--tree", "2,2,1", "--sampling", "--rounds", "2", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench-sampling.json").read_text())
    assert [row["contender"] for row in report["rows"]] == [
        f"ours {name} T={t}" for t in ("1", "0.7") for name in ("incremental", "mss 2,2,1", "traversal 2,2,1",
                                                                "naive 2,2,1")]
    assert report["mode"] == "sampling (temperature 1 and 0.7)" and report["targets"] == []  # greedy targets only
    for i, row in enumerate(report["rows"]):
        base = report["rows"][i - i % 4]      # its temperature's incremental sampling
        assert row["tokens"] == 32 and row["temperature"] == base["temperature"]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / base["tokens_per_s"])
        assert i % 4 == 0 or row["tokens_per_step"] >= 1
        assert len(row["tokens_per_s_rounds"]) == 2 and row["tokens_per_s"] == max(row["tokens_per_s_rounds"])
    assert "2 rounds in alternating order" in r.stdout


def test_bench_rounds_alternate_the_order_and_report_the_median_round(monkeypatch, pair):
    """Round 1 runs the contenders in order, round 2 in reverse, and so on; each row is its median
    round; an output that changes between rounds fails the identity check."""
    from specinfer import benchmark
    from specinfer.generate import Stats

    calls, speed = [], iter([10, 20, 30, 60, 50, 40, 70, 80, 90]).__next__

    def fake_ours(cfg, llm, ssms, tree, name, params, rule="mss", lookup=False):
        if name != "warm-up":
            calls.append(name)
        return Stats(new_tokens=speed() if name != "warm-up" else 1, total_seconds=1.0), [[1, 2]]

    monkeypatch.setattr(benchmark, "_ours", fake_ours)
    cfg = benchmark.BenchConfig(pair[0], [pair[1]], [[5, 6, 7]], {"1,1": [1, 1], "2": [2]}, peers=False, rounds=3,
                                progress=False)
    report = benchmark.run_bench(cfg)
    names = ["ours incremental", "ours 1,1 SSM 1", "ours 2 SSM 1"]
    assert calls == names + names[::-1] + names
    rows = {r["contender"]: r for r in report["rows"]}
    assert rows["ours incremental"]["tokens_per_s_rounds"] == [10, 40, 70]
    assert rows["ours incremental"]["tokens_per_s"] == 40 and rows["ours 2 SSM 1"]["tokens_per_s"] == 60
    assert rows["ours 1,1 SSM 1"]["speedup"] == pytest.approx(50 / 40)

    changing = iter([[[1]], [[1]], [[2]], [[1]]]).__next__   # the SSM row's second round differs
    monkeypatch.setattr(benchmark, "_ours", lambda *a, **k: (Stats(new_tokens=1, total_seconds=1.0), changing())
                        if a[4] != "warm-up" else (Stats(), []))
    with pytest.raises(AssertionError, match="ours 1,1 SSM 1: 1 outputs differ"):
        benchmark.run_bench(replace(cfg, rounds=2, trees={"1,1": [1, 1]}))


def test_bench_runs_a_short_chain_by_default_under_sampling():
    """Under sampling the default trees are short chains, the fixed trees that pay there; a tree
    given replaces the defaults."""
    from specinfer.cli import bench_trees
    assert bench_trees(None, sampling=True) == {"dynamic": None, "1,1,1": [1, 1, 1], "1,1,1,1": [1] * 4}
    assert list(bench_trees(None, sampling=False)) == ["dynamic", "1,1,1,1,1,1,1,1", "1,1,3,1,1,1,1,1"]
    assert bench_trees(["2,1"], sampling=True) == {"2,1": [2, 1]}


@pytest.mark.parametrize("args, message", [
    (["--prompts", "/no/such/file"], "--prompts /no/such/file: no such file or folder"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--tree", "1,x"], "tree"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_bench_bad_input(args, message, pair):
    r = bench("--llm", str(pair[0]), "--ssm", str(pair[1]), *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
