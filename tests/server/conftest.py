"""Starts the real `vireo serve` binary on 127.0.0.1 (a port the kernel picks) for the server tests.

VIREO_BIN names the binary (CTest passes it); the default is build/vireo. Every server is stopped
with SIGTERM at the end of its scope (SIGKILL if it does not exit within 20 s).
"""
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("VIREO_BIN", str(ROOT / "build" / "vireo"))
DEMO = ROOT / "models" / "vireo-demo"
FIXTURES = ROOT / "tests" / "fixtures"
API_KEY = "test-key-123"


class Server:
    def __init__(self, model_dir, *args, api_key=API_KEY):
        self.api_key = api_key
        cmd = [BIN, "serve", "-m", str(model_dir), "--host", "127.0.0.1", "--port", "0", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = []
        got_port = threading.Event()

        def drain():  # keeps the pipe empty for the server's whole life
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m and not port:
                    port.append(int(m.group(1)))
                    got_port.set()
            got_port.set()

        threading.Thread(target=drain, daemon=True).start()
        if not got_port.wait(60) or not port:
            self.stop()
            raise RuntimeError("vireo serve did not start: " + "".join(self.log))
        self.port = port[0]
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 120
        while self.http("GET", "/health")[0] != 200:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("vireo serve never became healthy: " + "".join(self.log))
            time.sleep(0.05)

    def http(self, method, path, body=None, headers=None, auth=True, raw=None):
        """(status, body bytes) of one request; never raises for HTTP errors."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json"}
        if auth and self.api_key:
            h["Authorization"] = "Bearer " + self.api_key
        h.update(headers or {})
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError):
            return 0, b""

    def metrics(self):
        status, body = self.http("GET", "/metrics")
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def rss_bytes(self, field="VmRSS"):
        """The process's resident bytes now (VmRSS), or at their peak so far (field="VmHWM")."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=120, **kw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def demo_cases():
    return json.loads((FIXTURES / "demo" / "expected.json").read_text())["greedy"]["cases"]


def demo_server(*args):
    if not (DEMO / "config.json").exists():
        pytest.skip("models/vireo-demo is not present")
    return Server(DEMO, *args)


@pytest.fixture(scope="session")
def demo():
    s = demo_server("--max-batch", "8", "--prefill-chunk", "64", "--max-body", "65536")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def demo_mtp():
    """The demo model served with --mtp (speculative decoding with its MTP layer)."""
    s = demo_server("--max-batch", "4", "--prefill-chunk", "32", "--mtp")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def demo_reasoning():
    """The demo model served with --reasoning-parser glm45 (chat replies split at </think>)."""
    s = demo_server("--max-batch", "4", "--prefill-chunk", "64", "--reasoning-parser", "glm45")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def fixture_server():
    s = Server(FIXTURES / "glm_dsa_shared_f32", "--max-batch", "4", "--context", "128", "--prefill-chunk", "8",
               api_key=None)
    yield s
    s.stop()
