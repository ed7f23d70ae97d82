"""Start `specrt serve` as a real process on a free loopback port, for the server tests."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(art: Path, *args: str, timeout: float = 180.0, log: Path | None = None,
                   env: dict[str, str] | None = None, processes: list | None = None):
    """Yield the base URL of `specrt serve ART ARGS` once /health answers; stop it afterwards. `log`: a file that
    gets the server's output (else it is read only if the server fails to start); `processes`: gets the server's
    Popen."""
    port = free_port()
    cmd = [sys.executable, "-c", "from specrt.cli import main; main()", "serve", str(art), "--port", str(port),
           "--log-level", "warning", *args]
    out = open(log, "w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    if processes is not None:
        processes.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                output = proc.stdout.read() if log is None else Path(log).read_text()
                raise RuntimeError(f"specrt serve exited with {proc.returncode}: {output}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("specrt serve did not come up")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not None:
            out.close()


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples as {name{labels}: value}, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def post(url: str, path: str, body: bytes | dict, timeout: float = 60,
         headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST raw bytes or a JSON object; returns (status, JSON body) for 2xx and 4xx alike."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
