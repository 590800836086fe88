"""The built wheel serves: `pip install` (not editable) carries the serving layer and its model
repository templates, and `specinfer serve` runs from the installed copy alone, away from the
checkout, down to the Triton stubs (which import what SPECINFER_PYTHONPATH names)."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = {f"specinfer/serving/templates/{m}/config.pbtxt.in" for m in ("llm", "orchestrator", "spec_step", "ssm",
                                                                          "tree_builder")} | \
            {f"specinfer/serving/templates/{m}/1/model.py" for m in ("llm", "orchestrator", "ssm", "tree_builder")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder, environment): the project's wheel, built offline from a clean copy of the
    sources (no stale build/ folder) and installed with --target; in that environment Python runs
    with -S, so the virtual environment's .pth files (the editable install's finder) are not read."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "specinfer", src / "specinfer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    r = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next((tmp / "dist").glob("specinfer-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert TEMPLATES <= names, sorted(TEMPLATES - names)
    for source in ("f16w_matmul.c", "tree_attention.c", "register.c", "ort_api.h"):   # the native kernels build from them
        assert f"specinfer/engines/kernels/{source}" in names
    assert "specinfer/serving.py" not in names and "specinfer/repo.py" not in names
    site = tmp / "site"
    r = subprocess.run(pip + ["install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECINFER_TEMPLATES", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    return site, env


def test_the_installed_wheel_is_what_imports(installed, tmp_path):
    site, env = installed
    code = ("import json, sys, specinfer; from specinfer.serving import templates_dir; "
            "print(json.dumps([specinfer.__file__, str(templates_dir()), sys.path]))")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    package, templates, path = json.loads(r.stdout)
    assert Path(package).is_relative_to(site) and Path(templates) == site / "specinfer" / "serving" / "templates"
    assert not any(p and Path(p).resolve() == ROOT for p in path)   # the checkout is not on the path


def test_the_installed_wheel_serves(installed, tmp_path):
    """`specinfer serve` on the embedded models, from the installed copy: one /generate answer, and
    the orchestrator's stub says it imported the installed specinfer."""
    if importlib.util.find_spec("pytriton") is None and not shutil.which("tritonserver"):
        pytest.skip("no tritonserver here (pip install --no-deps nvidia-pytriton)")
    import http.client
    site, env = installed
    http_port, log = free_port(), tmp_path / "triton.log"
    stderr = open(tmp_path / "serve.stderr", "w")
    proc = subprocess.Popen(
        [sys.executable, "-S", "-m", "specinfer.cli", "serve", "--http-port", str(http_port), "--grpc-port",
         str(free_port()), "--metrics-port", str(free_port()), "--grace-period", "2", "--log-file", str(log)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready:"), (tmp_path / "serve.stderr").read_text()[-3000:]
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        conn.request("POST", "/v2/models/ensemble/generate", json.dumps({"text_input": "def f(x):", "max_tokens": 8}),
                     {"Content-Type": "application/json"})
        answer = conn.getresponse()
        body = answer.read().decode()
        assert answer.status == 200 and json.loads(body)["text_output"], body
        # Each orchestrator's stub logs where its specinfer came from (its model.py's first import).
        served = dict(re.findall(r"(ensemble\w*): specinfer from ([^\s\"]+)", log.read_text(errors="replace")))
        # The default layout: ensemble holds every model, ensemble_sync relays unary infer to it.
        assert served == {"ensemble": str(site / "specinfer"), "ensemble_sync": str(site / "specinfer")}
    finally:
        if proc.poll() is None:
            proc.send_signal(2)   # SIGINT: serve stops tritonserver and removes its temporary repository
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        stderr.close()
