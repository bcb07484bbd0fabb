"""Schema-aware tool-call arguments: values converted to the declared types, strings kept,
unparsable values falling back to a string with a note in the log (schema_values.py,
arguments.py)."""
import logging

import pytest

from dsv4.serve.chat_format.schema_values import convert_text, declared_types
from serve.chat_cases import block, calls_of, invoke, param, parse_all, tool


@pytest.mark.parametrize("schema,types", [
    ({"type": "integer"}, {"integer"}), ({"type": ["string", "null"]}, {"string", "null"}),
    ({"type": "int"}, {"integer"}), ({"type": "varchar"}, {"string"}), ({"enum": ["a", 1]}, {"string", "integer"}),
    ({"anyOf": [{"type": "object"}, {"type": "null"}]}, {"object", "null"}), ({"const": True}, {"boolean"}),
    ({}, None), ({"$ref": "#/$defs/x"}, None), ({"anyOf": [{"type": "string"}, {}]}, None), (None, None),
])
def test_declared_types(schema, types):
    assert declared_types(schema) == (None if types is None else frozenset(types))


@pytest.mark.parametrize("text,is_string,schema,value", [
    ("3", True, {"type": "integer"}, 3),                     # string="true" but the schema says integer
    ("3.0", True, {"type": "integer"}, 3),
    ("2.5", True, {"type": "number"}, 2.5),
    ("true", True, {"type": "boolean"}, True),
    ("False", True, {"type": "boolean"}, False),
    ('["a", "b"]', True, {"type": "array"}, ["a", "b"]),
    ('{"k": 1}', True, {"type": "object"}, {"k": 1}),
    ("null", True, {"type": ["integer", "null"]}, None),
    ("42", True, {"type": "string"}, "42"),                   # strings stay strings
    ("42", True, None, "42"),
    ("42", False, None, 42),
    ('"quoted"', False, {"type": "string"}, "quoted"),
    ("12345e-3", False, {"type": "string"}, 12.345),          # JSON stays JSON (reference, peers)
    ("hello", False, {"type": "string"}, "hello"),
    ("42", None, None, 42),                                   # no string="..." flag: JSON if it parses
    ("hello", None, None, "hello"),
    ('"x"', None, {"type": "string"}, '"x"'),
])
def test_convert_text(text, is_string, schema, value):
    assert convert_text(text, is_string, schema, "f.p") == value


def test_an_unparsable_value_falls_back_to_a_string_with_a_note(caplog):
    with caplog.at_level(logging.INFO, logger="dsv4.serve.chat_format"):
        assert convert_text("[1, 2", False, {"type": "array"}, "f.items") == "[1, 2"
        assert convert_text("three", True, {"type": "integer"}, "f.n") == "three"
    notes = [r.getMessage() for r in caplog.records]
    assert any("f.items" in n and "not JSON" in n for n in notes)
    assert any("f.n" in n and "does not fit" in n for n in notes)


TRIP = tool("plan_trip", days={"type": "integer"}, flexible={"type": "boolean"}, cities={"type": "array"},
            budget={"type": ["number", "null"]}, notes={"type": "string"})


def test_values_follow_the_request_schema():
    text = block(invoke("plan_trip", param("days", "3"), param("flexible", "true"), param("cities", '["Rome"]'),
                        param("budget", "99.5"), param("notes", "42")))
    msg = parse_all(text, tools=[TRIP])
    assert calls_of(msg) == [("plan_trip", {"days": 3, "flexible": True, "cities": ["Rome"], "budget": 99.5,
                                            "notes": "42"})]


def test_without_tools_the_flags_decide():
    text = block(invoke("plan_trip", param("days", "3"), param("cities", '["Rome"]', "false")))
    assert calls_of(parse_all(text)) == [("plan_trip", {"days": "3", "cities": ["Rome"]})]


def test_unknown_properties_and_tools_follow_the_flags():
    text = block(invoke("plan_trip", param("extra", "7")), invoke("other", param("n", "7", "false")))
    assert calls_of(parse_all(text, tools=[TRIP])) == [("plan_trip", {"extra": "7"}), ("other", {"n": 7})]


def test_an_arguments_wrapper_is_unwrapped_only_when_spurious():
    wrapped = block(invoke("plan_trip", param("arguments", '{"days": "4", "notes": "x"}', "false")))
    assert calls_of(parse_all(wrapped, tools=[TRIP])) == [("plan_trip", {"days": 4, "notes": "x"})]
    # Keys the schema does not declare: kept as sent (no unwrapping).
    odd = block(invoke("plan_trip", param("arguments", '{"weird": 1}', "false")))
    assert calls_of(parse_all(odd, tools=[TRIP])) == [("plan_trip", {"arguments": {"weird": 1}})]
    # Without the tool's schema nothing says it is spurious.
    assert calls_of(parse_all(wrapped)) == [("plan_trip", {"arguments": {"days": "4", "notes": "x"}})]


def test_a_parameter_repeating_an_unwrapped_key_is_dropped():
    text = block(invoke("plan_trip", param("arguments", '{"days": 4}', "false"), param("days", "5")))
    assert calls_of(parse_all(text, tools=[TRIP])) == [("plan_trip", {"days": 4})]


def test_a_value_missing_both_closes_ends_at_the_wrapper_close():
    text = '<｜DSML｜tool_calls><｜DSML｜invoke name="plan_trip"><｜DSML｜parameter name="notes" string="true">hi' \
           "</｜DSML｜tool_calls>After."
    msg = parse_all(text, tools=[TRIP])
    assert (calls_of(msg), msg.content) == ([("plan_trip", {"notes": "hi"})], "After.")
