"""`peerflow sandbox serve`: this machine's sandbox as a `run_code` HTTP service.

It answers the Sandbox Fusion route `POST /run_code` (`peerflow.sandbox.remote` has the
shapes) from a local sandbox (bubblewrap by default), so code execution can live on a
machine of its own and trainers reach it with `sandbox.backend: remote`. Bound to
127.0.0.1 unless told otherwise; with a token, every request must carry it as
`Authorization: Bearer …` (refused with 401 otherwise). Limits asked for are capped by
the server's own.
"""

from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxUnavailableError


def _reply(sandbox: Sandbox, request: dict[str, Any], cap: SandboxLimits) -> dict[str, Any]:
    if request.get("language", "python") != "python":
        return {"status": "SandboxError", "message": "only language=python is served"}
    limits = SandboxLimits(
        timeout_s=min(float(request.get("run_timeout") or cap.timeout_s), cap.timeout_s),
        memory_mb=min(int(request.get("memory_limit_MB") or cap.memory_mb), cap.memory_mb),
        max_processes=cap.max_processes, max_output_mb=cap.max_output_mb)
    try:
        result = sandbox.run(str(request.get("code", "")), str(request.get("stdin") or ""),
                             limits)
    except SandboxUnavailableError as exc:
        return {"status": "SandboxError", "message": str(exc)}
    run_status = {"ok": "Finished", "error": "Finished", "timeout": "TimeLimitExceeded"}
    return {"status": "Success" if result.status == "ok" else "Failed", "message": "",
            "run_result": {"status": run_status[result.status],
                           "return_code": result.returncode, "stdout": result.stdout,
                           "stderr": result.stderr}}


def make_server(sandbox: Sandbox, host: str = "127.0.0.1", port: int = 0,
                token: str | None = None, cap: SandboxLimits | None = None,
                ) -> ThreadingHTTPServer:
    """An HTTP server answering `/run_code` from `sandbox` (call `serve_forever`)."""
    cap = cap or SandboxLimits(timeout_s=60.0, memory_mb=4096)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/run_code":
                self._send(404, {"status": "SandboxError", "message": "POST /run_code"})
                return
            given = self.headers.get("Authorization", "")
            if token and not hmac.compare_digest(given, f"Bearer {token}"):
                self._send(401, {"status": "SandboxError", "message": "a bearer token is "
                                 "required (sandbox.token_env)"})
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length))
            except ValueError:
                self._send(400, {"status": "SandboxError", "message": "a JSON body"})
                return
            self._send(200, _reply(sandbox, request, cap))

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            del format, args  # one line per program would flood the terminal

    return ThreadingHTTPServer((host, port), Handler)


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    """Serves in a daemon thread (tests and benchmarks); `server.shutdown()` stops it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True,
                              name="peerflow-sandbox-server")
    thread.start()
    return thread
