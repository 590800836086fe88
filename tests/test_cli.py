"""The CLI end to end, as a user runs it: real processes, real exit codes, one-line errors."""
import subprocess
import sys

import pytest

from conftest import make_checkpoint


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specinfer.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_export_then_generate(tmp_path, checkpoints):
    out = tmp_path / "onnx"
    r = run("export", str(checkpoints["llama3"]), "-o", str(out), "--max-context", "128")
    assert r.returncode == 0, r.stderr
    assert "validated" in r.stdout and (out / "manifest.json").is_file()
    r = run("generate", "--model", str(out), "def f(x):", "--max-tokens", "8", "--stats")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr and r.stdout.strip()
    # the same text from the Python API
    from specinfer import Pipeline
    assert Pipeline(out).generate("def f(x):", 8) + "\n" == r.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/dir", "hi"], "model folder not found: /no/such/dir"),
    (["generate", "--model", "{ckpt}", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["generate", "--model", "{ckpt}", "hi", "--temperature", "-0.5"], "temperature must be >= 0"),
    (["generate", "--model", "{ckpt}", "x" * 2000, "--max-context", "64"], "the prompt has"),
    (["generate", "--model", "{noweights}", "hi"], "no *.safetensors weights"),
    (["export", "/no/such/dir", "-o", "{tmp}/x"], "model folder not found"),
])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path, checkpoints):
    noweights = make_checkpoint(tmp_path / "nw", "llama2")
    (noweights / "model.safetensors").unlink()
    args = [a.format(ckpt=checkpoints["llama2"], noweights=noweights, tmp=tmp_path) for a in args]
    r = run(*args, "--threads", "1") if args[0] == "generate" else run(*args)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.stderr
