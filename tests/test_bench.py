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
        paired = [a / b for a, b in zip(row["tokens_per_s_rounds"], base["tokens_per_s_rounds"])]
        assert row["speedup"] == pytest.approx(sum(paired) / 2)     # the median of two: their mean
        assert i % 4 == 0 or row["tokens_per_step"] >= 1
        assert len(row["tokens_per_s_rounds"]) == 2 and row["tokens_per_s"] == max(row["tokens_per_s_rounds"])
    assert "taking turns prompt by prompt, 2 rounds" in r.stdout


def test_bench_contenders_take_turns_prompt_by_prompt_and_report_the_median_round(monkeypatch, pair):
    """Within a round the contenders take turns on each prompt, in alternating order (the first
    prompt in order, the second in reverse, ...), each after an untimed 2-token run of the prompt
    (as the peers warm up), all of them once on the first prompt before the rounds; a round's
    figures add up its prompts; each row is its median round; an output that changes between
    rounds fails the identity check."""
    from specinfer import benchmark
    from specinfer.generate import Stats

    calls, warm_ups = [], []
    # tokens per call: the contender's round 1 / 2 / 3 figure is what its two prompts add up to
    per_round = {"ours incremental": [10, 40, 70], "ours 1,1 SSM 1": [20, 50, 80], "ours 2 SSM 1": [30, 60, 90]}
    trees = {(1, 1): "ours 1,1 SSM 1", (2,): "ours 2 SSM 1", (): "ours incremental"}

    def fake_ours(cfg, llm, ssms, tree, params, index, stats, rule="mss", lookup=False):
        name = trees[tuple(tree)]
        if cfg.max_new_tokens == 2:
            warm_ups.append((name, index))
            return [index]
        calls.append((name, index))
        round_ = sum(1 for n, i in calls if n == name and i == index) - 1 - (index == 0)  # - the first warm-up
        stats.add(Stats(new_tokens=per_round[name][max(round_, 0)] // 2, total_seconds=0.5))
        return [index]

    monkeypatch.setattr(benchmark, "_ours", fake_ours)
    cfg = benchmark.BenchConfig(pair[0], [pair[1]], [[5, 6, 7], [8, 9]], {"1,1": [1, 1], "2": [2]}, peers=False,
                                rounds=3, progress=False)
    report = benchmark.run_bench(cfg)
    names = ["ours incremental", "ours 1,1 SSM 1", "ours 2 SSM 1"]
    forward, backward = [(n, 0) for n in names], [(n, 1) for n in names[::-1]]
    assert calls == forward + (forward + backward) * 3 and warm_ups == calls
    rows = {r["contender"]: r for r in report["rows"]}
    assert rows["ours incremental"]["tokens_per_s_rounds"] == [10, 40, 70]
    assert rows["ours incremental"]["tokens_per_s"] == 40 and rows["ours 2 SSM 1"]["tokens_per_s"] == 60
    assert rows["ours 1,1 SSM 1"]["speedup"] == pytest.approx(50 / 40)
    assert rows["ours 2 SSM 1"]["identical"] == 2

    # (the first two: each contender's warm-up on the first prompt) the SSM row's second round differs
    changing = iter([[1], [1], [1], [1], [2], [1], [1], [1]]).__next__
    monkeypatch.setattr(benchmark, "_ours", lambda cfg, llm, ssms, tree, *a, **k:
                        [1] if cfg.max_new_tokens == 2 else changing())
    with pytest.raises(AssertionError, match="ours 1,1 SSM 1: 1 outputs differ"):
        benchmark.run_bench(replace(cfg, prompts=[[5, 6, 7]], rounds=3, trees={"1,1": [1, 1]}))


def test_jobs_that_serve_every_prompt_at_once_take_turns_in_an_order_reversed_each_round():
    """The scheduler's rows (``whole`` jobs) run after the prompt-by-prompt turns, each on every
    prompt; their order flips each round, so that a slower spell does not always fall on the same
    row (each row's round-by-round figures stay its own)."""
    from specinfer import benchmark
    from specinfer.generate import Stats

    calls = []

    def job(name: str, whole: bool):
        def run(indices, stats):
            calls.append((name, tuple(indices)))
            stats.add(Stats(new_tokens=len(indices), total_seconds=1.0))
            return [[i] for i in indices]
        return benchmark._Job({"contender": name}, run, whole=whole)

    jobs = [job("alone", False), job("1 stream", True), job("16 streams", True)]
    results = benchmark._interleaved(jobs, prompts=2, rounds=3, progress=False)
    one_round = lambda served: [("alone", (0,)), ("alone", (1,))] + [(name, (0, 1)) for name in served]
    assert calls == (one_round(["1 stream", "16 streams"]) + one_round(["16 streams", "1 stream"])
                     + one_round(["1 stream", "16 streams"]))
    assert [len(r) for r in results] == [3, 3, 3] and results[2][1][1] == [[0], [1]]


def test_a_peer_that_cannot_run_is_reported_not_raised(monkeypatch, pair):
    """A peer that turns out unavailable keeps its row with the reason and is not run again."""
    from specinfer import benchmark, peers

    from specinfer.generate import Stats

    def fake_ours(cfg, llm, ssms, tree, params, index, stats, *a, **k):
        stats.add(Stats(new_tokens=1, total_seconds=0.5))
        return [index]
    monkeypatch.setattr(benchmark, "_ours", fake_ours)
    tried = []

    def broken(*a, **k):
        tried.append(1)
        return peers._unavailable("onnxruntime-genai greedy", "no such tool")
    ok = lambda name: lambda llm, *a, prompts, **k: peers.PeerResult(name, [[i] for i, _ in enumerate(prompts)], 1.0, 1)
    monkeypatch.setattr(peers, "ortgenai_greedy", broken)
    monkeypatch.setattr(peers, "transformers_greedy", ok("transformers greedy"))
    monkeypatch.setattr(peers, "transformers_assisted", ok("transformers assisted"))
    monkeypatch.setattr(peers, "ortgenai_speculative", ok("onnxruntime-genai speculative"))
    # (the fakes live in this process: the bench's peer process would run the real ones)
    monkeypatch.setattr(peers.PeerProcess, "call", lambda self, name, *a, **k: getattr(peers, name)(*a, **k))
    cfg = benchmark.BenchConfig(pair[0], [pair[1]], [[5, 6, 7], [8, 9]], {"1,1": [1, 1]}, rounds=2, progress=False)
    rows = {r["contender"]: r for r in benchmark.run_bench(cfg)["rows"]}
    assert rows["onnxruntime-genai greedy"]["unavailable"] == "no such tool" and tried == [1]
    assert rows["transformers greedy"]["tokens_per_s_rounds"] == [1.0, 1.0]   # a token a second
    assert "ssm_s" not in rows["transformers greedy"] and rows["ours incremental"]["ssm_s"] == 0.0
    assert rows["transformers greedy"]["speedup"] == pytest.approx(1 / 2)


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


def test_a_ratio_of_two_rows_pairs_their_rounds():
    """Rows measured in rounds compare round by round (the runs of one round were seconds apart):
    the median of the per-round ratios, not the ratio of two medians from different rounds."""
    from specinfer.benchmark import ratio, targets

    fast = {"contender": "ours chain", "tool": "specinfer", "tree": "1,1", "tokens_per_s": 200.0,
            "tokens_per_s_rounds": [100.0, 300.0, 200.0]}
    base = {"contender": "ours incremental", "tool": "specinfer", "tree": "-", "tokens_per_s": 100.0,
            "tokens_per_s_rounds": [90.0, 100.0, 280.0]}
    assert ratio(fast, base) == pytest.approx(100 / 90)     # rounds: 1.11, 3.0, 0.71; medians: 2.0
    assert ratio(dict(fast, tokens_per_s_rounds=None), base) == pytest.approx(2.0)   # one round each
    assert ratio(fast, dict(base, tokens_per_s=None)) is None
    first = targets([base, fast])[0]
    assert first["ratio"] == pytest.approx(100 / 90) and not first["met"]


def test_the_drafting_target_is_the_best_rows_ssm_share_at_most_a_quarter():
    from specinfer.benchmark import report_markdown, targets

    base = {"contender": "ours incremental", "tool": "specinfer", "tree": "-", "tokens_per_s": 100.0}
    rows = [base, {"contender": "ours chain", "tool": "specinfer", "tree": "1,1", "tokens_per_s": 120.0,
                   "ssm_s": 0.2, "llm_s": 1.0},
            {"contender": "ours lookup", "tool": "specinfer", "tree": "dynamic", "tokens_per_s": 110.0,
             "ssm_s": 0.01, "llm_s": 1.0}]
    share = next(t for t in targets(rows) if "SSM s / LLM s" in t["target"])   # the fastest row's, as every target
    assert share["target"].startswith("ours chain") and share["ratio"] == pytest.approx(0.2) and share["met"]
    rows[1]["ssm_s"] = 0.26
    share = next(t for t in targets(rows) if "SSM s / LLM s" in t["target"])
    assert share["ratio"] == pytest.approx(0.26) and not share["met"]
    text = report_markdown({"mode": "greedy", "rows": rows, "targets": targets(rows), "prompts": 1, "max_new_tokens": 1,
                            "min_confidence": None, "threads": 2})
    assert "| <= 0.25 | NO |" in text
