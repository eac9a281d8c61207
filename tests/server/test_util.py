"""Helpers for the server tests: start the REAL server process on
127.0.0.1 and a free port, wait for /health, stop it.

Until the lead wires ``megac serve`` into the main group, the process is
``python -m megac.cli serve ...`` (the real entry point)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from megac.server.metrics import metric_value, parse_metrics

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def untied_tiny_yaml(directory: Path) -> Path:
    """tiny-llama with untied random embeddings: greedy output varies (with
    tied random weights the model repeats its last token)."""
    from megac.spec import load_spec, spec_to_yaml

    data = load_spec("tiny-llama").model_dump()
    data.update(name="tiny-untied", tie_embeddings=False)
    from megac.spec import ModelSpec

    path = Path(directory) / "tiny-untied.yaml"
    path.write_text(spec_to_yaml(ModelSpec.model_validate(data)))
    return path


def sse_events(raw: str) -> list:
    """The events of a whole SSE body: JSON objects, and "[DONE]" as the string."""
    import json

    assert raw.endswith("\n\n"), raw[-200:]
    out = []
    for e in raw.split("\n\n")[:-1]:
        assert e.startswith("data: "), e
        out.append(e[len("data: "):] if e == "data: [DONE]" else json.loads(e[len("data: "):]))
    return out


def tiny_server(tmp_path_factory, max_model_len: int) -> "ServerProc":
    """The API tests' server: the untied tiny model, random weights, served as "tiny"."""
    spec = untied_tiny_yaml(tmp_path_factory.mktemp("spec"))
    return ServerProc(str(spec), "--random-weights", "--max-model-len", str(max_model_len), "--prefill-chunk", "32",
                      "--max-batch-size", "8", "--served-model-name", "tiny")


class ServerProc:
    """``megac serve ARGS`` in a subprocess (stdout+stderr to a log file)."""

    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="megac-serve-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "megac.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-stats-interval", "0"]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self.wait_ready(startup_timeout)
        except Exception:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=kw.pop("timeout", 300), **kw)

    def post(self, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None, **kw):
        h = {**self.headers(), **(headers or {})}
        if raw is not None:
            h.setdefault("content-type", "application/json")
            return httpx.post(f"{self.url}{path}", content=raw, headers=h, timeout=60, **kw)
        return httpx.post(f"{self.url}{path}", json=body, headers=h, timeout=60, **kw)

    def get(self, path: str, **kw):
        return httpx.get(f"{self.url}{path}", headers=self.headers(), timeout=30, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics").text)

    def metric(self, name: str, **labels) -> float:
        return metric_value(self.metrics(), name, **labels)

    def wait_metric(self, name: str, pred, timeout: float = 20.0, **labels) -> float:
        t0 = time.monotonic()
        while True:
            v = self.metric(name, **labels)
            if pred(v) or time.monotonic() - t0 > timeout:
                return v
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
