"""A request's output constraint (docs/architecture.md, "Structured outputs"): `response_format`
(json_object, json_schema), vLLM's `structured_outputs` and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` -> one `StructuredOutputs`, compiled here
once (tokenizer-free, structured/grammars.py) so that a bad schema, regex or grammar is a 400
naming it before the engine sees the request. At most one constraint per request."""
from __future__ import annotations

import json
from typing import Any

from ...sampling_params import StructuredOutputs
from ...structured.grammars import GrammarError, build_checked, spec_chars
from .errors import bad_request

# The longest constraint (schema, regex, grammar or choices, in characters) a request may give:
# compiling grows faster than its size (20,000 choices: ~3 s; 100,000: about a minute), and
# every step of the batch waits for the masks of a constraint being compiled.
MAX_CONSTRAINT_CHARS = 64 * 1024
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def request_constraint(req, response_format: dict | None, thinking: bool) -> StructuredOutputs | None:
    """The constraint of a chat or completions request (response_format: chat only), or None."""
    found: list[tuple[str, StructuredOutputs]] = []
    if response_format is not None and response_format["type"] != "text":
        found.append(("response_format", _from_response_format(response_format)))
    for field, kind in GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, _spec(field, kind, value)))
    so = getattr(req, "structured_outputs", None)
    if so:
        given = [k for k in VLLM_KEYS if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise bad_request(f"structured_outputs: give exactly one of {', '.join(VLLM_KEYS)}; got "
                              f"{given or 'none'}", "structured_outputs")
        found.append(("structured_outputs", _spec(f"structured_outputs.{given[0]}", given[0], so[given[0]])))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"{found[1][0]}: only one output constraint per request (also given: {found[0][0]})",
                          found[1][0])
    field, spec = found[0]
    size = spec_chars(spec)
    if size > MAX_CONSTRAINT_CHARS:
        raise bad_request(f"{field}: the constraint is {size} characters long; this server compiles at most "
                          f"{MAX_CONSTRAINT_CHARS}", field)
    spec.after_think = thinking
    check(spec, field)
    return spec


def check(spec: StructuredOutputs, field: str) -> None:
    """Compile the grammar once; a bad one is a 400 naming the field and the problem."""
    try:
        spec.validate()
        build_checked(spec)
    except GrammarError as e:
        raise bad_request(f"{field}: {e}", field) from None
    except ValueError as e:
        raise bad_request(str(e), field) from None


def _from_response_format(fmt: dict) -> StructuredOutputs:
    if fmt["type"] == "json_object":
        return StructuredOutputs(json_object=True)
    # strict or not, the output follows the schema (keys it does not declare are never written)
    return StructuredOutputs(json=json.dumps(fmt["json_schema"].get("schema", {})))


def _spec(field: str, kind: str, value: Any) -> StructuredOutputs:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"{field}: not valid JSON ({e})", field) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{field}: must be a JSON schema object", field)
        return StructuredOutputs(json=json.dumps(value))
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad_request(f"{field}: must be a non-empty list of strings", field)
        return StructuredOutputs(choice=list(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field}: must be a non-empty string", field)
    return StructuredOutputs(**{kind: value})
