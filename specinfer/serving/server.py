"""`specinfer serve`: a real NVIDIA Triton Inference Server over a model repository.

The server is the ``tritonserver`` on PATH (NVIDIA's container), or the one bundled in the
``nvidia-pytriton`` wheel (these CPU machines). Its Python backend needs the stub built for our
Python beside ``libtriton_python.so``; the stub's embedded interpreter ignores PYTHONPATH, so our
package folders travel in ``SPECINFER_PYTHONPATH`` (read by every ``model.py``).

Clients reach HTTP through our gateway (:mod:`.gateway`; Triton's own HTTP listens on a private
127.0.0.1 port) and gRPC directly. Triton's administrative APIs need the admin key on both.
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecInferError
from .gateway import ADMIN_HEADER, DEFAULT_MAX_REQUEST_BYTES, Gateway
from .repository import is_repository

# The API groups a deployment does not expose (Triton's names, the same for HTTP and gRPC).
RESTRICTED_APIS = "shared-memory,model-config,model-repository,statistics,trace,logging"
ADMIN_KEY_ENV = "SPECINFER_ADMIN_KEY"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"   # Triton reads --grpc-restricted-protocol's key under this
DEFAULT_GRACE_PERIOD = 5.0
# Once the exit timeout has passed, Triton logs "Exiting immediately" but may still hang in its
# teardown (seen: until killed at 30 s, with streams open); it gets this long more, then is killed.
KILL_MARGIN = 3.0
SHM_DIR = Path("/dev/shm")
# A file that appears when a stop begins, named to the models in this variable: Triton calls no
# model's finalize() while requests are in flight (at its exit timeout it just hangs until
# killed), so a model that streams can watch this file to end its streams cleanly in time.
STOP_FILE_ENV = "SPECINFER_STOP_FILE"


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
    libs = package.parent / "nvidia_pytriton.libs"
    return Installation(root / "bin" / "tritonserver", _backends_folder(root, stub, version), str(libs))


def _backends_folder(root: Path, stub: Path, version: str) -> Path:
    """A backend folder whose ``python/`` has the stub beside libtriton_python.so, shared by every
    server of this installation. Made complete under a temporary name and renamed into place, so
    a server starting at the same moment finds either none or a whole one (an exists-then-copy
    raced: a second server could start on a half-copied stub, or fail on the first's symlink)."""
    stat = stub.stat()
    key = hashlib.sha1(f"{root.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    final = Path(tempfile.gettempdir()) / f"specinfer-triton-backends-{version}-{key}"
    if (final / "python" / stub.name).is_file():
        return final
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    python = staging / "python"
    python.mkdir()
    for f in (root / "backends" / "python").iterdir():
        if f.is_file():
            os.symlink(f, python / f.name)
    shutil.copy2(stub, python / stub.name)
    try:
        os.rename(staging, final)   # atomic; fails if another process has put its folder there
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (final / "python" / stub.name).is_file():
            raise
    return final


def python_path() -> str:
    """The folders this process imports from, for the models' stub interpreters."""
    import specinfer
    folders = [str(Path(specinfer.__file__).resolve().parent.parent)] + [p for p in sys.path if p and Path(p).is_dir()]
    return os.pathsep.join(dict.fromkeys(folders))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """A Popen return code in words: 'exit code 1' or 'signal 11 (SIGSEGV)'."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


class TritonServer:
    """A tritonserver process (and its HTTP gateway) on 127.0.0.1 by default; a context manager.

    ``gateway``: HTTP goes through the gateway on ``http_port`` (Triton's own HTTP on a private
    127.0.0.1 port); without it Triton's HTTP listens on ``http_port`` itself.
    ``admin_key``: the key the administrative APIs need (header ``specinfer-admin-key``), on HTTP and
    gRPC; by default $SPECINFER_ADMIN_KEY, else random per launch. ``open_admin_api``: no key needed.
    ``grace_period``: seconds a stop gives in-flight requests (Triton's exit timeout) before the
    process group is killed. ``log_file``: Triton's log; by default a temporary file, deleted on a
    clean stop and kept when the server fails."""

    def __init__(self, repository: str | Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 host: str = "127.0.0.1", log_file: str | Path | None = None, verbose: bool = False, *,
                 gateway: bool = True, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 admin_key: str | None = None, open_admin_api: bool = False,
                 grace_period: float = DEFAULT_GRACE_PERIOD):
        self.repository = Path(repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port, self.host = http_port, grpc_port, metrics_port, host
        self.verbose, self.gateway_enabled, self.max_request_bytes = verbose, gateway, max_request_bytes
        self.admin_key = None if open_admin_api else (admin_key or os.environ.get(ADMIN_KEY_ENV)
                                                      or secrets.token_urlsafe(24))
        self.grace_period = grace_period
        self._own_log = log_file is None
        self.log_file = Path(log_file) if log_file else None
        # The Python backend names its shared memory regions <prefix><uuid> in /dev/shm and leaves
        # them behind when it is killed: a prefix of our own lets us delete exactly ours.
        self.shm_prefix = f"specinfer_{os.getpid()}_{secrets.token_hex(4)}_"
        self.stop_file = Path(tempfile.gettempdir()) / f"{self.shm_prefix}stopping"
        self.triton_http_port = http_port
        self.process: subprocess.Popen | None = None
        self.gateway: Gateway | None = None

    @property
    def http_url(self) -> str:
        """The public HTTP address (the gateway's, when there is one)."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        """HTTP headers that open the administrative APIs."""
        return {ADMIN_HEADER: self.admin_key} if self.admin_key else {}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """gRPC metadata that opens them: Triton expects the key under its own prefix there."""
        return {f"{GRPC_HEADER_PREFIX}{ADMIN_HEADER}": self.admin_key} if self.admin_key else {}

    def command(self, install: Installation) -> list[str]:
        """tritonserver's command line."""
        triton_http_host = "127.0.0.1" if self.gateway_enabled else self.host
        cmd = [str(install.binary), f"--model-repository={self.repository}", f"--backend-directory={install.backends}",
               f"--http-port={self.triton_http_port}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", f"--http-address={triton_http_host}",
               f"--grpc-address={self.host}", f"--metrics-address={self.host}",
               f"--exit-timeout-secs={max(1, math.ceil(self.grace_period))}",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               "--allow-metrics=true", f"--log-verbose={int(self.verbose)}"]
        if self.admin_key:
            restricted = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}"
            cmd += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
        return cmd

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Start, and return once every model is ready; on failure nothing is left running."""
        if not is_repository(self.repository):
            raise SpecInferError(f"{self.repository} is not a specinfer model repository (`specinfer repo` writes one)")
        install = find_tritonserver()
        env = dict(os.environ, SPECINFER_PYTHONPATH=python_path(), **{STOP_FILE_ENV: str(self.stop_file)})
        if install.library_path:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [install.library_path, env.get("LD_LIBRARY_PATH")]))
        if self.gateway_enabled:
            self.triton_http_port = free_port()
        if self._own_log:
            fd, name = tempfile.mkstemp(prefix="specinfer-triton-", suffix=".log")
            os.close(fd)
            self.log_file = Path(name)
        try:
            with open(self.log_file, "w") as log:   # the child keeps its own descriptor
                # A session of its own: its stubs are in its process group, which a stop kills whole.
                self.process = subprocess.Popen(self.command(install), env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)
            self._wait_ready(timeout)
            if self.gateway_enabled:
                self.gateway = Gateway(f"127.0.0.1:{self.triton_http_port}", self.host, self.http_port,
                                       self.max_request_bytes, self.admin_key).start()
        except BaseException:
            self.stop(clean=False)
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecInferError(f"tritonserver exited with {describe_exit(self.process.returncode)} while "
                                     f"starting; its log: {self.log_file}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.triton_http_port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise SpecInferError(f"tritonserver was not ready within {timeout:.0f} s; its log: {self.log_file}")

    def stop(self, clean: bool | None = None) -> None:
        """Drain the gateway, announce the stop (``stop_file``), ask Triton to stop (SIGTERM: it
        refuses new requests and gives in-flight ones the grace period), kill its process group if it is still there after grace + KILL_MARGIN, stop the
        gateway, and delete the shared memory it left. The log file we made is deleted unless the
        server had failed (``clean`` False, or a crash: it exited on its own)."""
        crashed = self.process is not None and self.process.poll() is not None
        if self.gateway is not None:
            self.gateway.drain()
        if self.process is not None and self.process.poll() is None:
            self.stop_file.touch()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.grace_period + KILL_MARGIN)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            # Also after a clean exit: a stub outliving its server would keep its shared memory.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        for path in glob.glob(str(SHM_DIR / f"{glob.escape(self.shm_prefix)}*")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.stop_file.unlink(missing_ok=True)
        if clean is None:
            clean = not crashed
        if self._own_log and clean and self.log_file is not None:
            self.log_file.unlink(missing_ok=True)

    def rss_bytes(self) -> int:
        """Resident memory of tritonserver and its stubs (its process group), for reports."""
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if self.process is not None and int(fields[2]) == self.process.pid:   # pgrp
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")   # rss in pages
        return total

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
