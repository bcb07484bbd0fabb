"""Images over HTTP (docs/vision.md, "API"): `dsv4 serve` as a subprocess on a random
tiny-vision model (the demo tokenizer), driven by the `openai` client with data: URLs; image
tokens counted in usage; local files only inside --allowed-local-media-path; remote URLs
refused without --allow-remote-media; every bad image a 400 naming its content part while the
server keeps serving; images to the text-only demo model refused."""
from __future__ import annotations

import base64
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))          # tests/, for serve.server_fixtures
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # vision_images
pytest_plugins = ["serve.server_fixtures"]

from vision_images import encoded, noise, png, png_header_claiming  # noqa: E402

SPEC = "random:tiny-vision::vocab_size=8192,image_token_id=8191"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(png(40, 30, seed=5))
    return d


@pytest.fixture(scope="module")
def server(demo_dir, media_dir, tmp_path_factory):
    from serve.server_fixtures import ServerProcess
    args = ["--model", SPEC, "--tokenizer", demo_dir, "--port", "0", "--num-pages", "16",
            "--max-model-len", "1024", "--log-level", "warning", "--allowed-local-media-path", str(media_dir)]
    proc = ServerProcess(args, tmp_path_factory.mktemp("vision-server") / "serve.log")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def ask(client, *urls, text="What is in the picture?", max_tokens=4):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=max_tokens,
                                          temperature=0, messages=[{"role": "user", "content": parts}])


def test_data_urls_and_image_tokens_in_usage(client):
    text_only = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}])
    one = ask(client, data_url(png(40, 30)))
    two = ask(client, data_url(png(40, 30)), data_url(encoded(noise(20, 70), "JPEG"), "image/jpeg"))
    assert one.choices[0].finish_reason == "length" and len(one.choices[0].message.content) > 0
    # the 40x30 image: a 4x5 grid, 28 or fewer block tokens (+ the "\n" joining parts, 1 token)
    assert 22 <= one.usage.prompt_tokens - text_only.usage.prompt_tokens <= 30
    assert two.usage.prompt_tokens > one.usage.prompt_tokens + 20
    again = ask(client, data_url(png(40, 30)))
    assert again.choices[0].message.content == one.choices[0].message.content


def test_local_files_inside_the_allowed_folder_only(client, media_dir, tmp_path):
    inside = ask(client, (media_dir / "cat.png").as_uri())
    assert inside.choices[0].message.content == ask(client, data_url(png(40, 30, seed=5))).choices[0].message.content
    (tmp_path / "secret.png").write_bytes(png(8, 8))
    for url in ((tmp_path / "secret.png").as_uri(), str(media_dir / ".." / "secret.png")):
        with pytest.raises(openai.BadRequestError, match="outside --allowed-local-media-path"):
            ask(client, url)


@pytest.mark.parametrize("url, words", [
    ("http://127.0.0.1:9/cat.png", "--allow-remote-media"),
    ("ftp://example/cat.png", "unsupported image URL scheme"),
    ("data:image/png;base64,@@@", "does not decode"),
    (data_url(b"not an image"), "cannot be decoded"),
    (data_url(png(40, 30)[:70]), "cannot be decoded"),
    (data_url(b""), "empty"),
    (data_url(png_header_claiming(10000, 10000)), "megapixels"),
])
def test_bad_images_are_400s_naming_the_part(client, url, words):
    with pytest.raises(openai.BadRequestError, match=words) as e:
        ask(client, url)
    assert "messages.0.content.0" in str(e.value)
    assert ask(client, data_url(png(16, 16))).choices[0].finish_reason == "length"   # still serving


def test_too_many_images_for_max_model_len(client):
    urls = [data_url(png(64, 64, seed=s)) for s in range(30)]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        ask(client, *urls)


def test_placeholder_text_without_an_image_part_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="placeholder"):
        ask(client, text="look: <｜deepseek_image｜>")


def test_images_to_a_text_only_model_are_refused(real_server):
    from serve.server_fixtures import API_KEY
    with openai.OpenAI(base_url=real_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        with pytest.raises(openai.BadRequestError, match="text-only"):
            ask(c, data_url(png(16, 16)))
