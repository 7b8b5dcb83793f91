"""Real servers on 127.0.0.1 for the remote-data tests: an HTTP server that serves byte ranges
(optionally failing some requests, as a flaky object store does) and a moto S3 server."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import threading


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files under the server's folder, honouring ``Range: bytes=a-b`` (206). The
    server's ``fail_every`` > 0 answers every n-th request with 503 (``fail_mode="503"``) or
    closes the connection mid-response (``"reset"``)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _should_fail(self) -> bool:
        srv = self.server
        with srv.lock:
            srv.requests += 1
            k = srv.requests
        return srv.fail_every > 0 and k % srv.fail_every == 0

    def do_HEAD(self):  # noqa: N802
        if self._should_fail():
            self.send_error(503)
            return
        self._serve(head=True)

    def do_GET(self):  # noqa: N802
        if self._should_fail():
            if self.server.fail_mode == "reset":
                self.send_response(200)
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                self.wfile.write(b"x" * 10)
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.send_error(503)
            return
        self._serve(head=False)

    def _serve(self, head: bool):
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        st = os.stat(path)
        rng = self.headers.get("Range")
        start, end = 0, size - 1
        status = 200
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            if a:
                start = int(a)
                end = min(int(b), size - 1) if b else size - 1
            else:  # a suffix range
                start = max(0, size - int(b))
            status = 206
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        n = max(0, end - start + 1)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(n if status == 206 else size))
        self.send_header("ETag", f'"{size}-{st.st_mtime_ns}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        with open(path, "rb") as f:
            f.seek(start)
            self.wfile.write(f.read(n))


@contextlib.contextmanager
def http_server(root, *, fail_every: int = 0, fail_mode: str = "503"):
    """``http://127.0.0.1:PORT`` serving ``root``; the server object is yielded too
    (``.requests`` counts what it was asked)."""
    root = os.fspath(root)

    def handler(*a, **k):
        return RangeHandler(*a, directory=root, **k)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    srv.lock = threading.Lock()
    srv.requests = 0
    srv.fail_every = fail_every
    srv.fail_mode = fail_mode
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    finally:
        srv.shutdown()
        srv.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(*, process: bool = False):
    """A moto S3 server on 127.0.0.1, configured as boto3 is: ``AWS_ENDPOINT_URL`` and test
    credentials in the environment (restored afterwards). Yields the endpoint URL.
    ``process=True``: the server runs in its own process (a benchmark's client then does not
    share its interpreter with the server); else on a thread of this one."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    if process:
        import subprocess
        import sys
        import time
        import urllib.request

        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)

        class _Proc:
            def stop(self):
                proc.terminate()
                proc.wait(timeout=30)

        server = _Proc()
    else:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
