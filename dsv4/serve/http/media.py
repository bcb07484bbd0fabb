"""Image URLs of chat content parts -> bytes (docs/vision.md, "API").

  * `data:` URLs (base64 or percent-encoded), always;
  * `file://` URLs and plain paths only inside `--allowed-local-media-path` (resolved, so no
    `..` or symlink leaves it);
  * `http(s)://` only with `--allow-remote-media`, at most `--media-max-mb` and
    `--media-timeout` seconds (no redirects to other schemes).
Every refusal is an APIError 400 naming the content part.
"""
from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
from dataclasses import dataclass

from .errors import bad_request

MB = 1 << 20


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_path: str | None = None
    allow_remote: bool = False
    max_bytes: int = 20 * MB
    timeout: float = 10.0


def load_media(url: str, policy: MediaPolicy, where: str) -> bytes:
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: the image URL must be a non-empty string", where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(url, where)
    elif scheme in ("http", "https"):
        data = _remote(url, policy, where)
    elif scheme == "file" or scheme == "":
        data = _local(urllib.parse.unquote(urllib.parse.urlparse(url).path) if scheme else url, policy, where)
    else:
        raise bad_request(f"{where}: unsupported image URL scheme {scheme!r} (data:, file:// or http(s)://)", where)
    if len(data) > policy.max_bytes:
        raise bad_request(f"{where}: the image is {len(data) / MB:.1f} MB, more than the limit of "
                          f"{policy.max_bytes / MB:g} MB", where)
    return data


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise bad_request(f"{where}: malformed data URL (no ',')", where)
    if head.split(";")[-1].lower() == "base64":
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}: the data URL's base64 payload does not decode", where) from None
    return urllib.parse.unquote_to_bytes(payload)


def _local(path: str, policy: MediaPolicy, where: str) -> bytes:
    if policy.allowed_local_path is None:
        raise bad_request(f"{where}: local image files are not allowed (start the server with "
                          f"--allowed-local-media-path)", where)
    root = os.path.realpath(policy.allowed_local_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise bad_request(f"{where}: {path!r} is outside --allowed-local-media-path", where)
    try:
        with open(real, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as e:
        raise bad_request(f"{where}: cannot read {path!r}: {e.strerror}", where) from None
    return data


def _remote(url: str, policy: MediaPolicy, where: str) -> bytes:
    if not policy.allow_remote:
        raise bad_request(f"{where}: remote image URLs are not allowed (start the server with "
                          f"--allow-remote-media)", where)
    import httpx
    try:
        with httpx.Client(timeout=policy.timeout, follow_redirects=False) as client, \
                client.stream("GET", url) as r:
            if r.status_code != 200:
                raise bad_request(f"{where}: fetching the image gave HTTP {r.status_code}", where)
            chunks, size = [], 0
            for chunk in r.iter_bytes():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise bad_request(f"{where}: the image is larger than {policy.max_bytes / MB:g} MB", where)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as e:
        raise bad_request(f"{where}: fetching the image failed: {type(e).__name__}", where) from None
