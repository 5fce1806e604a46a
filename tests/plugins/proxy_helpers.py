"""Test helpers of the proxy: a backend that answers fixed bytes, a ``tandem-dash`` process, a backends file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from replay_server import PLUGINS, ROOT, free_port

# a stream as a server may write it: a comment, CRLF and LF separators, a multi-line data field, no usage
FIXED_STREAM = (
    b": keep-alive\r\n\r\n"
    b'data: {"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fixed-model","choices":'
    b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\r\n\r\n'
    b'data: {"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fixed-model","choices":'
    b'[{"index":0,"delta":{"content":"Fixed "},"finish_reason":null}]}\n\n'
    b'data: {"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fixed-model","choices":\n'
    b'data: [{"index":0,"delta":{"content":"bytes, \\u00e9t\\u00e9."},"finish_reason":null}]}\n\n'
    b'data: {"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fixed-model","choices":'
    b'[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
FIXED_WHOLE = (b'{"id":"fx-2","object":"chat.completion","created":1,"model":"fixed-model","choices":[{"index":0,'
               b'"message":{"role":"assistant","content":"Fixed whole."},"finish_reason":"stop"}],'
               b'"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}')


class FixedBackend:
    """An OpenAI-shaped HTTP server in this process: ``/fixed/v1`` answers the bytes above (streamed in small
    pieces), ``/slow/v1`` waits ``slow_s`` before it answers; ``seen`` keeps each request's headers and body."""

    def __init__(self, slow_s: float = 3.0) -> None:
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = json.dumps({"object": "list", "data": [{"id": "fixed-model", "object": "model"}]}).encode()
                self._send(200, "application/json", body)

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(n)
                outer.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if self.path.startswith("/slow/"):
                    time.sleep(slow_s)
                    self._send(200, "application/json", FIXED_WHOLE)
                    return
                if json.loads(body).get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("x-backend-says", "fixed")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(FIXED_STREAM), 37):
                        piece = FIXED_STREAM[i:i + 37]
                        self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                        self.wfile.flush()
                        time.sleep(0.002)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self._send(200, "application/json", FIXED_WHOLE)

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.send_header("x-backend-says", "fixed")
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, kind: str = "fixed") -> str:
        return f"http://127.0.0.1:{self.port}/{kind}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def write_backends(path: Path, backends: list[dict[str, Any]]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"backends": backends}, sort_keys=False))
    return path


class Dash:
    """A ``tandem-dash`` process on a free loopback port."""

    @staticmethod
    def env_for(home: Path) -> dict[str, str]:
        return {**os.environ, "TANDEM_HOME": str(home), "TANDEM_DISABLE_ENTRYPOINTS": "1",
                "TANDEM_EXTRA_PLUGINS": "tandem_llama.plugin",
                "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def __init__(self, backends: Path, home: Path, *args: str) -> None:
        self.port = free_port()
        self.ledger = home / "dash-ledger.sqlite"
        env = self.env_for(home)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_core.proxy.dash_cli", "--backends", str(backends), "--port",
             str(self.port), "--ledger", str(self.ledger), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        for stream, into in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=lambda s=stream, i=into: [i.append(x) for x in s], daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> Dash:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("tandem-dash: relaying" in line for line in self.stdout):
                return self
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"tandem-dash exited {self.proc.returncode}:\n{''.join(self.stderr)}")
            time.sleep(0.05)
        raise TimeoutError(f"tandem-dash not ready after {timeout}s:\n{''.join(self.stderr)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def ledger_rows(path: Path, n: int = 200) -> list[Any]:
    from tandem_core.server.ledger import Ledger

    led = Ledger(path)
    try:
        return led.last(n)
    finally:
        led.close()


def wait_for(check: Any, timeout: float = 20.0, what: str = "a condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
