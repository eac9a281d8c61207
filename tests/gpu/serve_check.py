"""GPU serving checks (issue 13): ``megac serve --backend cuda`` with
SmolLM2's real weights, driven over HTTP and through the official
``openai`` client.

* :func:`check_serve`: a greedy chat completion, plain and streamed; the
  ``openai`` client streaming chat and completions; 8 concurrent greedy
  requests give each the text it gets alone.
* :func:`check_serve_fault`: a server whose decode step N launches a broken
  task list (``MEGAC_FAULT_HANG_STEPS``): the request in that step ends with
  an error, ``/health`` stays up, later requests are served, the log shows
  the hang record.

``python -m gpu.serve_check --backend cpu`` runs the first on the CPU VM (a
dry run of the driver code; slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
           "What is 12 times 7?", "Give me a synonym for 'happy'.", "List three prime numbers.",
           "Describe a cat in five words.", "How many days are in a leap year?"]


class Server:
    """``megac serve`` in a subprocess on 127.0.0.1:``port``, its log in a
    file (a pipe could fill and stall it); stopped with SIGINT."""

    def __init__(self, port: int, backend: str = "cuda", env: dict | None = None, max_batch: int = 8,
                 extra: list[str] | tuple = ()) -> None:
        """``extra``: more ``megac serve`` arguments (a model, options; a
        repeated option overrides the defaults here)."""
        self.port, self.base = port, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from megac.cli import main; main()", "serve", "--backend", backend,
             "--port", str(port), "--max-batch-size", str(max_batch), "--max-model-len", "2048", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})

    def __enter__(self) -> "Server":
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 300:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited: " + self.log_text()[-3000:])
            if self.health() == 200:
                self.ready_s = round(time.perf_counter() - t0, 1)
                return self
            time.sleep(1.0)
        raise RuntimeError("server not ready in 300 s: " + self.log_text()[-3000:])

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return None

    def post(self, path: str, payload: dict) -> tuple[int, str]:
        req = urllib.request.Request(self.base + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=180) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()


def _chat(prompt: str, n: int = 24, **kw) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": n, "messages": [{"role": "user", "content": prompt}],
            **kw}


def _text(body: str) -> str:
    return json.loads(body)["choices"][0]["message"]["content"]


def check_serve(backend: str = "cuda", port: int = 8731, extra: tuple = ()) -> dict:
    """See the module docstring (``extra``: more ``megac serve`` arguments)."""
    import openai

    with Server(port, backend, extra=extra) as srv:
        code, body = srv.post("/v1/chat/completions", _chat(PROMPTS[0]))
        plain = _text(body)
        code_s, raw = srv.post("/v1/chat/completions", _chat(PROMPTS[0], stream=True))
        chunks = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: {")]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        # the official client, streaming chat and completions
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=180)
        oc_chat = "".join(ev.choices[0].delta.content or "" for ev in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=24,
            stream=True) if ev.choices)
        oc_text = "".join(ev.choices[0].text or "" for ev in client.completions.create(
            model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=16, stream=True)
            if ev.choices)
        # 8 concurrent greedy requests against each alone
        alone = [_text(srv.post("/v1/chat/completions", _chat(p))[1]) for p in PROMPTS]
        together: list = [None] * len(PROMPTS)

        def one(i):
            together[i] = _text(srv.post("/v1/chat/completions", _chat(PROMPTS[i]))[1])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with urllib.request.urlopen(srv.base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        return {"ready_s": srv.ready_s, "answer": plain, "status": [code, code_s],
                "streamed_equals_plain": streamed == plain, "mentions_paris": "Paris" in plain,
                "openai_chat_stream_equals_plain": oc_chat == plain, "openai_completion_stream": oc_text,
                "concurrent_equal_alone": [a == b for a, b in zip(alone, together)],
                "concurrent_texts": together, "metrics_lines": len(metrics.splitlines()),
                "log_tail": srv.log_text()[-1500:]}


def check_serve_fault(port: int = 8732, fault_step: int = 30, extra: tuple = ()) -> dict:
    """See the module docstring. ``extra``: more ``megac serve`` arguments
    (``--decode-burst 4``: the hang inside a burst)."""
    env = {"MEGAC_FAULT_HANG_STEPS": str(fault_step)}
    with Server(port, "cuda", env=env, max_batch=4, extra=extra) as srv:
        results = []
        for i in range(6):  # 24 tokens each: the fault step falls in the second request
            code, body = srv.post("/v1/chat/completions", _chat(PROMPTS[i % len(PROMPTS)]))
            results.append({"status": code, "error": code != 200 or '"error"' in body[:200],
                            "body": body[:300]})
        health_after = srv.health()
        log = srv.log_text()
    failed = [i for i, r in enumerate(results) if r["error"]]
    return {"results": results, "failed": failed, "health_after": health_after,
            "served_after_fault": bool(failed) and all(not r["error"] for r in results[failed[-1] + 1:])
            and failed[-1] + 1 < len(results),
            "log_names_the_hang": "decode step failed" in log and "record" in log,
            "log_hang_lines": [ln for ln in log.splitlines() if "decode step failed" in ln or "fault injection" in ln]}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="gpu.serve_check")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--port", type=int, default=8731)
    args = ap.parse_args()
    print(json.dumps(check_serve(args.backend, args.port), indent=1))
