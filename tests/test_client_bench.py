"""`specinfer client bench` as a sweep: concurrency levels x speculative/incremental decoding against
the session's tritonserver; the per-token ITL and the memory sampler on their own."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from specinfer.client.bench import (MemorySampler, Sample, compare_outputs, process_tree, rss_bytes, run_sweep,
                                    sweep_markdown, token_gaps, tree_rss)
from specinfer.client.messages import ClientError


def test_per_token_itl():
    # pieces of 3, 1, 4, 2 tokens; gaps before the 2nd, 3rd, 4th piece
    gaps, pieces = [0.010, 0.040, 0.006], [3, 1, 4, 2]
    got = token_gaps(gaps, pieces)
    assert got == pytest.approx([0.010] + [0.010] * 4 + [0.003] * 2)   # 1 token after 10 ms, 4 after 40, 2 after 6
    assert len(got) == sum(pieces[1:]) and sum(got) == pytest.approx(sum(gaps))
    s = Sample(0, ok=True, latency_s=0.5, ttft_s=0.2, gaps_s=gaps, piece_tokens=pieces, tokens=10)
    assert s.token_gaps_s == got and s.itl_s == pytest.approx(0.3 / 9)   # genai-perf's: one per request
    assert token_gaps([], [5]) == [] and token_gaps([], []) == []
    with pytest.raises(ValueError, match="gaps"):
        token_gaps([0.1, 0.2], [1, 1])
    # percentiles weigh every token the same: 90 tokens at 1 ms, one piece of 10 tokens after 200 ms
    from specinfer.client.bench import summarize
    fast = Sample(0, ok=True, latency_s=1.0, ttft_s=0.1, gaps_s=[0.001] * 90, piece_tokens=[1] * 91, tokens=91)
    slow = Sample(1, ok=True, latency_s=1.0, ttft_s=0.1, gaps_s=[0.2], piece_tokens=[1, 10], tokens=11)
    s = summarize([fast, slow], 2.0)
    expected = np.array([1.0] * 90 + [20.0] * 10)
    assert s["token_itl_ms"]["p50"] == pytest.approx(np.percentile(expected, 50))
    assert s["token_itl_ms"]["p99"] == pytest.approx(np.percentile(expected, 99)) == pytest.approx(20.0)
    assert s["tokens_per_s"] == pytest.approx(51.0) and s["tokens_per_piece"]["mean"] == pytest.approx(102 / 93)


def test_memory_sampler_sums_the_process_tree():
    me = os.getpid()
    assert rss_bytes(me) > 0 and me in process_tree(me)
    alone, _ = tree_rss([me])
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytes(range(256)) * (1 << 18); time.sleep(30)"])
    try:
        deadline = time.time() + 20
        while rss_bytes(child.pid) < 64 << 20 and time.time() < deadline:
            time.sleep(0.05)
        total, procs = tree_rss([me])
        assert child.pid in procs and me in procs
        assert total >= alone + rss_bytes(child.pid) * 0.9 and rss_bytes(child.pid) >= 64 << 20
        assert tree_rss([me, child.pid])[1] == procs   # a descendant watched too is counted once
        sampler = MemorySampler([me], interval=0.05)
        before = sampler.sample()
        sampler.start()
        time.sleep(0.3)
        sampler.stop()
        assert len(sampler.samples) >= 3 and before > 64 and sampler.peak() >= before * 0.9
        assert sampler.processes >= 2
    finally:
        child.kill()
        child.wait()
    assert child.pid not in process_tree(me)
    from specinfer.client import ClientError
    with pytest.raises(ClientError, match="no process"):
        MemorySampler([2**22 + 12345])


def test_compare_outputs():
    sample = lambda p, ids, ok=True: {"prompt": p, "ok": ok, "output_ids": ids}
    runs = [(1, "speculative", [sample(0, [1, 2, 3]), sample(1, [4])]),
            (1, "incremental", [sample(0, [1, 2, 3]), sample(1, [4]), sample(1, None, ok=False)]),
            (2, "speculative", [sample(0, [1, 2, 9]), sample(1, [4])])]
    o = compare_outputs(runs)
    assert (o["compared"], o["prompts"], o["mismatches"]) == (6, 2, 1)
    assert o["details"] == [{"concurrency": 2, "contender": "speculative", "prompt": 0, "first_difference": 2,
                             "reference_tokens": 3, "tokens": 3}]


def test_sweep(triton_server):
    """Levels 1 and 2, speculative and incremental: no failure, every row, the same greedy outputs."""
    r = run_sweep(triton_server.http_url, "http", levels=[1, 2], requests=4, stream=True, max_tokens=16,
                  watch_pids=[os.getpid()], memory_interval=0.1, memory_settle=0.2)
    assert [e["concurrency"] for e in r["levels"]] == [1, 2] and [row["concurrency"] for row in r["rows"]] == [1, 2]
    for e in r["levels"]:
        assert list(e["contenders"]) == ["speculative", "incremental"]
        assert e["contenders"]["incremental"]["tree"] == "none" and e["contenders"]["speculative"]["tree"] is None
        for name, run in e["contenders"].items():
            s = run["summary"]
            assert (s["requests"], s["ok"], s["errors"], s["tokens"]) == (4, 4, 0, 64) and s["tokens_per_s"] > 0
            for sample in run["samples"]:
                assert sample["ok"] and len(sample["output_ids"]) == sample["tokens"] == 16
                assert sum(sample["piece_tokens"]) == 16 and len(sample["gaps_s"]) == len(sample["piece_tokens"]) - 1
                # a piece is what a request generated since its last response (--stream-interval), never empty
                assert min(sample["piece_tokens"]) >= 1
            assert 0 < s["token_itl_ms"]["p50"] <= s["token_itl_ms"]["p99"]
    assert r["outputs"]["checked"] and r["outputs"]["identical"], r["outputs"]
    assert r["outputs"]["compared"] == 16 and r["outputs"]["mismatches"] == 0
    for row in r["rows"]:
        assert row["failures"] == 0 and row["mismatches"] == 0
        runs = next(e for e in r["levels"] if e["concurrency"] == row["concurrency"])["contenders"]
        base = r["levels"][0]["contenders"]
        for name in ("speculative", "incremental"):
            tps = runs[name]["summary"]["tokens_per_s"]
            assert row[name]["tokens_per_s"] == tps > 0
            assert row[name]["over_lowest_level"] == pytest.approx(tps / base[name]["summary"]["tokens_per_s"])
            assert row[name]["token_itl_p99_ms"] == runs[name]["summary"]["token_itl_ms"]["p99"]
        assert row["speculative_over_incremental"] == pytest.approx(
            runs["speculative"]["summary"]["tokens_per_s"] / runs["incremental"]["summary"]["tokens_per_s"])
    assert r["rows"][0]["speculative"]["over_lowest_level"] == 1.0
    m = r["memory"]
    assert 0 < m["before_mb"] <= m["peak_mb"] and m["after_mb"] > 0
    table = sweep_markdown(r)
    assert sum(line.startswith("| ") for line in table.splitlines()) == 3 and "spec ÷ incr tok/s" in table
    assert "outputs identical: yes (0 mismatches" in table
    assert "server memory" in table
    json.dumps(r)   # JSON-ready


def test_sweep_rounds_alternate_the_contenders_and_pair_their_ratio(triton_server):
    """With rounds, each level runs the contenders that many times in alternating order; each one's
    median round stands for it, and spec ÷ incr is the median of the ratios within a round. Every
    round's outputs are compared."""
    order = []
    r = run_sweep(triton_server.http_url, "http", levels=[1], requests=2, stream=True, max_tokens=8, rounds=3,
                  progress=lambda level, name, run: order.append((name, run["summary"]["tokens_per_s"])))
    assert [name for name, _ in order] == ["speculative", "incremental", "incremental", "speculative",
                                           "speculative", "incremental"]
    row, runs = r["rows"][0], r["levels"][0]["contenders"]
    for name in ("speculative", "incremental"):
        rounds = [tps for n, tps in order if n == name]
        assert runs[name]["tokens_per_s_rounds"] == rounds
        assert row[name]["tokens_per_s"] == runs[name]["summary"]["tokens_per_s"] == sorted(rounds)[1]
    paired = sorted(a / b for a, b in zip(runs["speculative"]["tokens_per_s_rounds"],
                                          runs["incremental"]["tokens_per_s_rounds"]))
    assert row["speculative_over_incremental"] == pytest.approx(paired[1])
    assert r["outputs"]["compared"] == 12 and r["outputs"]["identical"], r["outputs"]   # 2 prompts x 2 x 3
    assert r["config"]["rounds"] == 3 and "3 rounds at each level" in sweep_markdown(r)
    with pytest.raises(ClientError, match="rounds must be >= 1"):
        run_sweep(triton_server.http_url, "http", rounds=0)


def test_a_sweeps_failures_count_every_round():
    """A failure in a round that is not the contender's median one still counts in its row."""
    from specinfer.client.bench import summarize, sweep_rows

    ok = summarize([Sample(0, ok=True, latency_s=0.1, tokens=3, output_ids=[1, 2, 3])], 0.1)
    failed = summarize([Sample(0, ok=False, latency_s=0.1, error="boom")], 0.1)
    run = {"summary": ok, "samples": [], "tree": None, "tokens_per_s_rounds": [30.0, 0.0, 30.0],
           "round_summaries": [ok, failed, ok]}
    row = sweep_rows([{"concurrency": 1, "requests": 1, "contenders": {"incremental": run}}])[0]
    assert row["failures"] == 1 and row["incremental"]["failures"] == 1
    assert sweep_rows([{"concurrency": 1, "requests": 1, "contenders": {"incremental": {
        "summary": ok, "samples": [], "tree": None}}}])[0]["failures"] == 0   # one round, as before


def test_cli_sweep_and_exit_code(triton_server, tmp_path, capsys):
    from test_client import cli

    out = tmp_path / "sweep.json"
    assert cli("client", "bench", "--url", triton_server.grpc_url, "--protocol", "grpc", "--concurrency", "1,2",
               "--contenders", "incremental", "--requests", "2", "--max-tokens", "8", "--json", str(out)) == 0
    printed = capsys.readouterr().out
    assert "concurrency 2, incremental (tree none): 2 of 2 requests ok" in printed
    assert "outputs identical: yes" in printed and "incr tok/s" in printed and "spec tok/s" not in printed
    report = json.loads(out.read_text())
    assert report["config"]["levels"] == [1, 2] and report["outputs"]["compared"] == 4
    assert "speculative_over_incremental" not in report["rows"][0]
    # sampled decoding is not compared (and no mismatch fails it)
    assert cli("client", "bench", "--url", triton_server.http_url, "--concurrency", "1", "--requests", "2",
               "--max-tokens", "4", "--temperature", "1.0", "--seed", "1") == 0
    assert "outputs not compared: sampled decoding" in capsys.readouterr().out
    for argv, says in ((["--concurrency", "0"], "must be >= 1"), (["--contenders", "fast"], "expected speculative"),
                       (["--concurrency", "1,x"], "expected N or N,N")):
        with pytest.raises(SystemExit):
            cli("client", "bench", *argv)
        assert says in capsys.readouterr().err


def test_cli_exits_2_on_a_greedy_mismatch(monkeypatch, capsys):
    """A sweep whose greedy outputs differ prints its table, then fails (exit 2)."""
    from dataclasses import asdict

    from specinfer.client import bench
    from test_client import cli

    def fake_sweep(*args, levels, contenders, progress, **kwargs):
        results = []
        for level in levels:
            entry = {"concurrency": level, "requests": 1, "contenders": {}}
            for name in contenders:
                ids = [1, 2, 3] if (level, name) != (2, "speculative") else [1, 2, 4]
                samples = [bench.Sample(0, ok=True, latency_s=0.1, tokens=3, output_ids=ids)]
                run = {"summary": bench.summarize(samples, 0.1), "samples": [asdict(s) for s in samples], "tree": None}
                entry["contenders"][name] = run
                progress(level, name, run)
            results.append(entry)
        outputs = bench.compare_outputs([(e["concurrency"], n, r["samples"]) for e in results
                                         for n, r in e["contenders"].items()])
        outputs |= {"checked": True, "greedy": True, "identical": outputs["mismatches"] == 0}
        return {"config": {"levels": levels, "contenders": contenders}, "levels": results,
                "rows": bench.sweep_rows(results, outputs), "outputs": outputs, "memory": {"pids": []}}

    monkeypatch.setattr(bench, "run_sweep", fake_sweep)
    assert cli("client", "bench", "--concurrency", "1,2") == 2
    out, err = capsys.readouterr()
    assert "outputs identical: no (1 mismatches" in out and "| 2 | 30.0 |" in out
    assert err.startswith("specinfer: error: greedy outputs differ: 1 of 4 outputs")


def test_sampled_sweeps_count_no_mismatches():
    """Sampled outputs are not compared, so the table shows no mismatch count for them (differing
    sampled outputs are no error), where a greedy sweep counts them."""
    from dataclasses import asdict

    from specinfer.client import bench

    results = []
    for level in (1, 2):
        samples = [bench.Sample(0, ok=True, latency_s=0.1, tokens=3, output_ids=[1, 2, level])]
        run = {"summary": bench.summarize(samples, 0.1), "samples": [asdict(s) for s in samples], "tree": None}
        results.append({"concurrency": level, "requests": 1, "contenders": {"speculative": run}})
    outputs = bench.compare_outputs([(e["concurrency"], n, r["samples"]) for e in results
                                     for n, r in e["contenders"].items()])
    for greedy, counts, cell in ((True, [0, 1], "| 0 | 1 |"), (False, [None, None], "| 0 | - |")):
        o = outputs | {"checked": greedy, "greedy": greedy, "identical": outputs["mismatches"] == 0 if greedy else None}
        rows = bench.sweep_rows(results, o)
        assert [r["mismatches"] for r in rows] == counts
        table = bench.sweep_markdown({"config": {"contenders": ["speculative"]}, "rows": rows, "outputs": o,
                                      "memory": {"pids": []}})
        assert table.splitlines()[3].endswith(cell), table
