"""Property-based fuzzing of the whole REST API from /openapi.json (schemathesis): no request may produce a 5xx.

Runs the ``st`` CLI against a real uvicorn; a middleware counts 5xx responses on the server side as well, so the
count is reported even if the CLI's own accounting changes. Skipped when schemathesis is not installed.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ST = shutil.which("st") or str(Path(sys.executable).with_name("st"))


class CountErrors:
    def __init__(self, app):
        self.app = app
        self.server_errors: list[tuple[str, str, int]] = []
        self.total = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.total += 1
                if message["status"] >= 500:
                    self.server_errors.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, send=counting_send)


@pytest.mark.skipif(not Path(ST).exists(), reason="schemathesis not installed")
def test_no_server_errors_anywhere(live_server, tmp_path):
    # Jobs the fuzzer manages to submit start a trainer that exits at once.
    srv = live_server(job_command=["{python}", "-c", "pass"], require_token=True)
    counter = CountErrors(srv.app.middleware_stack or srv.app.build_middleware_stack())
    srv.app.middleware_stack = counter
    examples = os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "25")
    cmd = [ST, "run", f"{srv.url}/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", examples, "--exclude-path-regex", "/stream$",
           "-H", "Authorization: Bearer test-token", "--workers", "1", "--no-color",
           "--seed", "1", "--report", "junit", "--report-dir", str(tmp_path / "report")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    print(proc.stdout[-4000:])
    print(f"schemathesis: {counter.total} requests, {len(counter.server_errors)} server errors")
    assert counter.total > 100
    assert counter.server_errors == [], counter.server_errors
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
