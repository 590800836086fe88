"""`specinfer serve`: a real NVIDIA Triton Inference Server over a model repository.

The server is the ``tritonserver`` on PATH (NVIDIA's container), or the one bundled in the
``nvidia-pytriton`` wheel (these CPU machines). Its Python backend needs the stub built for our
Python beside ``libtriton_python.so``; the stub's embedded interpreter ignores PYTHONPATH, so our
package folders travel in ``SPECINFER_PYTHONPATH`` (read by every ``model.py``).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecInferError


@dataclass
class Installation:
    binary: Path
    backends: Path
    library_path: str = ""


def find_tritonserver() -> Installation:
    """The server binary and a backend folder whose Python backend matches this Python."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return Installation(Path(on_path), Path(os.environ.get("TRITON_BACKENDS", "/opt/tritonserver/backends")))
    import importlib.util

    spec = importlib.util.find_spec("pytriton")  # located, not imported: we need its files only
    if spec is None or spec.origin is None:
        raise SpecInferError("no tritonserver: install NVIDIA's Triton container, or `pip install --no-deps "
                             "nvidia-pytriton` for the bundled server")
    package = Path(spec.origin).parent
    root = package / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SpecInferError(f"the bundled Triton has no Python backend stub for Python {version}")
    backends = Path(tempfile.gettempdir()) / f"specinfer-triton-backends-{version}"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    for f in (root / "backends" / "python").iterdir():
        if f.is_file() and not (python / f.name).exists():
            os.symlink(f, python / f.name)
    if not (python / stub.name).exists():
        shutil.copy(stub, python / stub.name)  # the stub must sit beside libtriton_python.so
    libs = package.parent / "nvidia_pytriton.libs"
    return Installation(root / "bin" / "tritonserver", backends, str(libs))


def python_path() -> str:
    """The folders this process imports from, for the models' stub interpreters."""
    import specinfer
    folders = [str(Path(specinfer.__file__).resolve().parent.parent)] + [p for p in sys.path if p and Path(p).is_dir()]
    return os.pathsep.join(dict.fromkeys(folders))


class TritonServer:
    """A tritonserver process on 127.0.0.1 by default; a context manager that stops it."""

    def __init__(self, repository: str | Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 host: str = "127.0.0.1", log_file: str | Path | None = None, verbose: bool = False):
        self.repository = Path(repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port, self.host = http_port, grpc_port, metrics_port, host
        self.log_file, self.verbose = log_file, verbose
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, timeout: float = 120.0) -> "TritonServer":
        if not (self.repository / "spec_step").is_dir():
            raise SpecInferError(f"{self.repository} is not a specinfer model repository (`specinfer repo` writes one)")
        install = find_tritonserver()
        env = dict(os.environ, SPECINFER_PYTHONPATH=python_path())
        if install.library_path:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [install.library_path, env.get("LD_LIBRARY_PATH")]))
        cmd = [str(install.binary), f"--model-repository={self.repository}", f"--backend-directory={install.backends}",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
               f"--http-address={self.host}", f"--grpc-address={self.host}", "--exit-timeout-secs=5",
               "--allow-metrics=true", f"--log-verbose={int(self.verbose)}"]
        log = open(self.log_file, "w") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecInferError(f"tritonserver exited with code {self.process.returncode}"
                                     + (f"; see {self.log_file}" if self.log_file else ""))
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise SpecInferError(f"tritonserver was not ready within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
