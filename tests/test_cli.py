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
    from specinfer.engines import native
    for dtype in ("bfloat16", "int8"):   # the LLM's products in bfloat16, int8: the same text as the API's on them
        if native.products_run(dtype):
            r = run("generate", "--model", str(out), "def f(x):", "--max-tokens", "8", "--matmul-dtype", dtype)
            assert r.returncode == 0, r.stderr
            assert Pipeline(out, matmul_dtype=dtype).generate("def f(x):", 8) + "\n" == r.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/dir", "hi"], "model folder not found: /no/such/dir"),
    (["generate", "--model", "{ckpt}", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["generate", "--model", "{ckpt}", "hi", "--temperature", "-0.5"], "--temperature must be >= 0"),
    (["generate", "--model", "{ckpt}", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--model", "{ckpt}", "x" * 2000, "--max-context", "64"], "the prompt has"),
    (["generate", "--model", "{noweights}", "hi"], "no *.safetensors weights"),
    (["export", "/no/such/dir", "-o", "{tmp}/x"], "model folder not found"),
    (["generate", "--model", "{ckpt}", b"\xff\xfe"], "the prompt is not valid UTF-8 text"),
    (["generate", "--model", "{ckpt}", "hi", "--threads", "-3"], "argument --threads: must be >= 1, got -3"),
    (["generate", "--model", "{ckpt}", "hi", "--budget", "x"], "argument --budget: expected an integer >= 1"),
    (["export", "{ckpt}", "-o", "{tmp}/x", "--max-context", "0"], "argument --max-context: must be >= 1, got 0"),
    (["export", "{ckpt}", "-o", "{tmp}/a_file"], "a_file is a file: the export writes a folder there"),
    (["export", "{ckpt}", "-o", "{tmp}/full"], "is not empty and is not an export of this model"),
    (["generate", "--model", "{ckpt}"], "give the prompt as an argument, - for stdin, or --prompt-file FILE"),
    (["generate", "--model", "{ckpt}", "--prompt-file", "{tmp}/none.txt"], "--prompt-file {tmp}/none.txt: No such file"),
    (["generate", "--model", "{ckpt}", "--prompt-file", "{tmp}/bad.txt"], "bad.txt is not valid UTF-8 text"),
])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path, checkpoints):
    noweights = make_checkpoint(tmp_path / "nw", "llama2")
    (noweights / "model.safetensors").unlink()
    (tmp_path / "a_file").write_text("mine")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    message = message.format(tmp=tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    args = [a.format(ckpt=checkpoints["llama2"], noweights=noweights, tmp=tmp_path) if isinstance(a, str) else a
            for a in args]
    r = run(*args, "--threads", "1") if args[0] == "generate" else run(*args)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.stderr


def test_a_fixed_tree_over_the_budget_is_said(exported):
    r = run("generate", "--model", str(exported["llama3"]), "hi", "--max-tokens", "2", "--tree", "1000,1000",
            "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "warning: --tree 1000,1000 has up to 1001001 nodes per SSM; each step keeps the first 64" in r.stderr


def test_version():
    from specinfer import __version__
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"specinfer {__version__}"


def test_the_onnx_runtime_path_imports_neither_torch_nor_transformers(exported):
    """generate on an export, and the modules the server's models load, without torch: its import
    alone took 7-10 s of every CLI call."""
    code = ("import sys; from specinfer.cli import main; "
            f"rc = main(['generate', '--model', {str(exported['llama3'])!r}, 'def f(x):', '--max-tokens', '4']); "
            "import specinfer.serving.models, specinfer.serving.orchestrator, specinfer.serving.triton_glue, "
            "specinfer.serving.repository, specinfer.client, specinfer.benchmark; "
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "0 []"


def test_long_prompts_from_a_file_or_stdin(exported, tmp_path):
    model, prompt = str(exported["llama3"]), "def f(x):\n    return x\n" * 8
    want = run("generate", "--model", model, prompt, "--max-tokens", "6").stdout
    (tmp_path / "p.txt").write_text(prompt)
    assert run("generate", "--model", model, "--prompt-file", str(tmp_path / "p.txt"), "--max-tokens", "6").stdout == want
    r = subprocess.run([sys.executable, "-m", "specinfer.cli", "generate", "--model", model, "-", "--max-tokens", "6"],
                       input=prompt, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == want and len(want) > 1


def test_every_option_says_what_it_does_and_its_default():
    import argparse

    from specinfer.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"specinfer {name} {'/'.join(action.option_strings) or action.dest}: no help"
    assert "(default: fp32)" in commands["export"].format_help()
    assert "(default: 8000)" in " ".join(commands["serve"].format_help().split())
