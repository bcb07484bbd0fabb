"""`--role` / `--kv-transfer` parsing: every mistake names the flag and the key."""
import pytest

from dsv4.disagg.settings import parse_kv_transfer


def test_defaults_and_values():
    s = parse_kv_transfer("decode", '{"timeout": 2.5, "port": 9100}')
    assert (s.role, s.timeout, s.port, s.transport) == ("decode", 2.5, 9100, "tcp")


@pytest.mark.parametrize("role, text, words", [
    ("both", None, "--role"), ("prefill", "{", "not JSON"), ("prefill", "[]", "JSON object"),
    ("prefill", '{"prot": 1}', "unknown key"), ("prefill", '{"port": 70000}', "port"),
    ("decode", '{"timeout": 0}', "timeout"), ("decode", '{"transport": "ucx"}', "transport")])
def test_bad_flags_are_named(role, text, words):
    with pytest.raises(ValueError, match=words):
        parse_kv_transfer(role, text)
