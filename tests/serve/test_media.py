"""The image URL loader (dsv4/serve/http/media.py): data: URLs, local files inside the allowed
folder only, http(s) only when allowed and within the size limit (a loopback server)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsv4.serve.http.errors import APIError
from dsv4.serve.http.media import MediaPolicy, load_media

BODY = b"\x89PNG fake image bytes" * 100


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/img":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def refused(url, policy, words):
    with pytest.raises(APIError) as e:
        load_media(url, policy, "messages.0.content.1")
    assert e.value.status == 400 and words in str(e.value) and "messages.0.content.1" in str(e.value)


def test_data_urls():
    assert load_media("data:image/png;base64,aGVsbG8=", MediaPolicy(), "x") == b"hello"
    assert load_media("data:,a%20b", MediaPolicy(), "x") == b"a b"
    refused("data:image/png;base64", MediaPolicy(), "malformed")
    refused("data:image/png;base64,aGVsbG8=", MediaPolicy(max_bytes=2), "more than the limit")


def test_local_files(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(b"img")
    (tmp_path / "b.png").write_bytes(b"secret")
    (tmp_path / "ok" / "link.png").symlink_to(tmp_path / "b.png")
    policy = MediaPolicy(allowed_local_path=str(tmp_path / "ok"))
    assert load_media((tmp_path / "ok" / "a.png").as_uri(), policy, "x") == b"img"
    refused((tmp_path / "ok" / "a.png").as_uri(), MediaPolicy(), "--allowed-local-media-path")
    refused((tmp_path / "b.png").as_uri(), policy, "outside")
    refused((tmp_path / "ok" / "link.png").as_uri(), policy, "outside")
    refused((tmp_path / "ok" / "none.png").as_uri(), policy, "cannot read")


def test_remote_urls(http_url):
    allow = MediaPolicy(allow_remote=True)
    assert load_media(http_url + "/img", allow, "x") == BODY
    refused(http_url + "/img", MediaPolicy(), "--allow-remote-media")
    refused(http_url + "/img", MediaPolicy(allow_remote=True, max_bytes=100), "larger than")
    refused(http_url + "/missing", allow, "HTTP 404")
    refused(http_url + "/moved", allow, "HTTP 302")
    refused("http://127.0.0.1:1/img", allow, "fetching the image failed")
