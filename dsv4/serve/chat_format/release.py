"""What differs between V4 releases in the chat format: the reasoning-effort prefixes.

* "preview" (April 2026 V4-Flash / V4-Pro): efforts None, "high", "max"; only "max" adds a
  prefix (the "Absolute maximum" paragraph). Reference: the checkpoints' encoding_dsv4.py,
  `REASONING_EFFORT_MAX`, as copied in vLLM `deepseek_v4_encoding.py` and SGLang.
* "0731" (V4-Flash-0731, V4-Pro-0813): efforts "low" (the default for None, no prefix),
  "high" (the former "max" paragraph), "max" (the "Beyond maximum" paragraph). Reference:
  the 0731 encoder's `REASONING_EFFORT_PROMPTS` / `DEFAULT_REASONING_EFFORT = "low"`.

Either way the prefix goes right after BOS, and only in thinking mode.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

RELEASES = ("preview", "0731")

EFFORT_ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
EFFORT_BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)

# The prefix text of each accepted effort, per release.
_PREFIXES = {
    "preview": {None: "", "high": "", "max": EFFORT_ABSOLUTE_MAXIMUM},
    "0731": {None: "", "low": "", "high": EFFORT_ABSOLUTE_MAXIMUM, "max": EFFORT_BEYOND_MAXIMUM},
}
REASONING_EFFORTS = {release: tuple(prefixes) for release, prefixes in _PREFIXES.items()}


# Any requested effort -> the release's own, as vLLM maps them (server policy): "none"
# turns thinking off; None keeps the release's default (preview: no prefix; 0731: "low",
# where vLLM defaults to "high"); any other value, unknown ones included, maps as below.
_EFFORT_MAP = {
    "preview": ({"max": "max", "xhigh": "max"}, "high"),
    "0731": ({"max": "max", "low": "low", "minimal": "low", "medium": "low"}, "high"),
}


def normalize_effort(release: str, reasoning_effort: str | None) -> tuple[str | None, bool]:
    """(the release's effort, whether thinking stays allowed) for a requested effort."""
    if reasoning_effort is None:
        return None, True
    if reasoning_effort == "none":
        return None, False
    named, otherwise = _EFFORT_MAP.get(release, ({}, reasoning_effort))
    return named.get(reasoning_effort, otherwise), True


def effort_prefix(release: str, reasoning_effort: str | None, thinking: bool) -> str:
    """The text that follows BOS; raises ValueError for an effort the release does not know."""
    if release not in _PREFIXES:
        raise ValueError(f"unknown chat release {release!r}; expected one of {list(RELEASES)}")
    prefixes = _PREFIXES[release]
    if reasoning_effort not in prefixes:
        raise ValueError(f"reasoning_effort {reasoning_effort!r} is not accepted by the {release} "
                         f"release; expected one of {list(prefixes)}")
    return prefixes[reasoning_effort] if thinking else ""


def detect_release(checkpoint_dir: str | Path) -> str:
    """The chat release of a checkpoint folder, judged (in order) by the encoder it ships
    (`encoding/encoding_dsv4.py`), by `dspark_*` keys in config.json (only the 0731/0813
    releases carry the DSpark draft), and by its folder name; "preview" when nothing says."""
    path = Path(checkpoint_dir)
    from_encoder = _release_from_encoder(path / "encoding" / "encoding_dsv4.py")
    if from_encoder:
        return from_encoder
    if _has_dspark_config(path / "config.json"):
        return "0731"
    name = path.resolve().name.lower()
    return "0731" if ("0731" in name or "0813" in name) else "preview"


def _release_from_encoder(file: Path) -> str | None:
    """Look for the module-level names that tell the two encoders apart (never runs it)."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    names: dict[str, ast.expr | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update({t.id: node.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node.value
    default = names.get("DEFAULT_REASONING_EFFORT")
    if "REASONING_EFFORT_PROMPTS" in names and isinstance(default, ast.Constant) \
            and default.value == "low":
        return "0731"
    return "preview" if "REASONING_EFFORT_MAX" in names else None


def _has_dspark_config(file: Path) -> bool:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and any(str(k).startswith("dspark_") for k in config)
