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
