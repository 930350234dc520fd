"""A real S3-compatible server for tests and benchmarks: moto's server mode, a process of
its own on 127.0.0.1, reached over HTTP like any object store. Its log (one line per
request) lets a test count what was fetched."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from vllm_tpu_lora.testing.server import free_port


class LocalS3Server:
    def __init__(self, log_path: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or tempfile.NamedTemporaryFile(
            prefix="moto-", suffix=".log", delete=False).name
        # What an SDK client needs to reach it (the standard AWS variables).
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test",
                    "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        self.proc = None

    def __enter__(self) -> LocalS3Server:
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT)
        for _ in range(100):
            try:
                httpx.get(self.url, timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.__exit__()
        raise TimeoutError(f"the S3 server on {self.url} did not start")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


class CuttingProxy:
    """A TCP proxy in front of an HTTP server that breaks one object's downloads mid-way:
    after a request whose line contains `cut_path`, it passes on `keep_bytes` of the
    answer (headers and the start of the body) and then drops the connection, as a
    network failure would. Everything else is passed through unchanged."""

    def __init__(self, upstream_port: int, cut_path: str, keep_bytes: int = 2048) -> None:
        import socket
        import threading

        self.upstream_port, self.cut, self.keep = upstream_port, cut_path.encode(), keep_bytes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cuts = 0  # downloads broken so far
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._threading, self._socket = threading, socket
        self._closed = False

    def __enter__(self) -> CuttingProxy:
        self._threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = self._socket.create_connection(("127.0.0.1", self.upstream_port))
            state = {"budget": None}  # bytes of the answer still passed on after a cut request
            self._threading.Thread(target=self._requests, args=(client, upstream, state),
                                   daemon=True).start()
            self._threading.Thread(target=self._answers, args=(upstream, client, state),
                                   daemon=True).start()

    def _requests(self, src, dst, state) -> None:
        try:
            while data := src.recv(65536):
                if self.cut in data:
                    state["budget"] = self.keep
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _answers(self, src, dst, state) -> None:
        try:
            while data := src.recv(65536):
                budget = state["budget"]
                if budget is not None:
                    if len(data) >= budget:
                        dst.sendall(data[:budget])
                        self.cuts += 1
                        break
                    state["budget"] = budget - len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)


def _close(*socks) -> None:
    import socket

    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
