"""Run the OpenAI server as a real subprocess on 127.0.0.1 (tests, benchmarks).

Output goes to a log file, not a pipe (a full pipe would block the server); when start-up
fails the log's tail is in the exception. Every wait is bounded.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], *, env: dict[str, str] | None = None,
                 startup_timeout: float = 240.0, api_key: str | None = None,
                 wait: bool = True, command: list[str] | None = None,
                 stop_timeout: float = 20.0) -> None:
        """Launch the server; with wait=False call wait_healthy() later (so the caller can
        do other start-up work, e.g. build an offline engine, while the server compiles).
        command: what to run instead of the api_server module (e.g. the CLI's serve-ray).
        stop_timeout: how long stop() lets it shut down after SIGTERM before killing it."""
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vtl-server-", suffix=".log",
                                               delete=False)
        cmd = [*(command or [sys.executable, "-m", "vllm_tpu_lora.entrypoints.openai.api_server"]),
               "--host", HOST, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        if wait:
            self.wait_healthy()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def wait_healthy(self) -> None:
        try:
            self._wait_healthy(self.startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # A loaded host can take seconds to answer (Ray Serve's ingress forwards
                # /health to a replica): a short timeout would cancel every answer.
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-n:]

    def thread_dump(self) -> str:
        """Every thread's stack in the server (SIGUSR1, see api_server.run), from its log:
        for a test to say what a server that stopped answering was doing."""
        import signal

        if self.proc.poll() is not None:
            return f"server exited with {self.proc.returncode}:\n{self.log_tail()}"
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        return self.log_tail(20000)

    def wait_exit(self, timeout: float) -> int:
        """For a server expected to fail start-up: its exit code (the log has the why)."""
        return self.proc.wait(timeout=timeout)

    def stats(self) -> dict:
        """The engine's /stats (behind the API key when the server has one)."""
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(self.url + "/stats", headers=auth, timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

