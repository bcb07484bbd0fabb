"""The demo model's corpus, built from the CPython standard library's own sources (no network).

* plain code: every stdlib `.py` file as one document, plus every documented function on its
  own (signature, docstring, body), each `BOS text EOS`;
* chat pairs in the V4 chat encoding: the user gives a function's signature and docstring,
  the assistant answers with the function, in thinking mode (after one short reasoning line)
  or in chat mode (no reasoning), chosen per function by a seeded draw;
* a deterministic 2% of the files (by a hash of their path) is held out for validation, and
  the held-out completion prompts for the tests come from those files.
"""
from __future__ import annotations

import ast
import hashlib
import math
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass

from dsv4.serve.chat_format.encoding import encode_messages
from dsv4.text.tokens import BOS, EOS

SKIP_DIRS = {"site-packages", "__pycache__"}
MAX_FILE_BYTES = 256 * 1024      # larger files are data tables (pydoc topics, unicode names)
MAX_FUNCTION_LINES = 60
HELDOUT_FRACTION = 0.02


@dataclass(frozen=True)
class Function:
    module: str       # dotted module name, e.g. "json.decoder"
    name: str
    signature: str    # the `def ...:` line(s), dedented to column 0
    docstring: str    # the docstring statement as written, indented as in the body
    body: str         # the statements after the docstring
    params: tuple[str, ...]
    returns: bool

    @property
    def text(self) -> str:
        return self.signature + self.docstring + self.body

    @property
    def prompt(self) -> str:
        return self.signature + self.docstring


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_sources(root: str) -> list[str]:
    """Relative paths of the library's .py files (sorted), skipping huge data files."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py") and os.path.getsize(path) <= MAX_FILE_BYTES:
                out.append(os.path.relpath(path, root))
    return sorted(out)


def read_source(root: str, rel: str) -> str | None:
    try:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, held out): the 2% of files whose path hashes lowest are held out."""
    ranked = sorted(files, key=lambda rel: hashlib.sha256(rel.encode()).hexdigest())
    held = set(ranked[:math.ceil(HELDOUT_FRACTION * len(files))])
    return [f for f in files if f not in held], [f for f in files if f in held]


def is_test_file(rel: str) -> bool:
    return any(part in ("test", "tests", "idle_test") for part in rel.split(os.sep))


def module_name(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def functions(source: str, module: str) -> list[Function]:
    """Documented functions and methods of a module, each dedented to column 0."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = _function(node, lines, module)
            if fn is not None:
                out.append(fn)
    return out


def _function(node, lines: list[str], module: str) -> Function | None:
    if ast.get_docstring(node) is None or len(node.body) < 2:
        return None
    doc, first = node.body[0], node.body[1]
    if doc.lineno == node.lineno or node.end_lineno - node.lineno >= MAX_FUNCTION_LINES:
        return None
    if first.lineno <= doc.end_lineno:  # statements sharing the docstring's line
        return None
    text = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
    if not text.endswith("\n"):
        text += "\n"
    flat = text.splitlines(keepends=True)
    rel = lambda ln: ln - node.lineno                       # noqa: E731  (line -> index in `flat`)
    signature = "".join(flat[:rel(doc.lineno)])
    docstring = "".join(flat[rel(doc.lineno):rel(doc.end_lineno) + 1])
    body = "".join(flat[rel(doc.end_lineno) + 1:])
    if not signature.lstrip().startswith(("def ", "async def ")) or not body.strip():
        return None
    try:
        ast.parse(text)
    except SyntaxError:
        return None
    params = tuple(a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                   if a.arg not in ("self", "cls"))
    returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node))
    return Function(module, node.name, signature, docstring, body, params, returns)


# ---- documents ------------------------------------------------------------------------------

def code_document(source: str) -> str:
    return BOS + source + EOS


def code_token_stream(tokenizer, held_out: bool, max_files: int | None = None) -> list[int]:
    """The training (or held-out) stdlib files, each BOS source EOS, in one token stream."""
    root = stdlib_root()
    files = split_files(list_sources(root))[1 if held_out else 0]
    ids = []
    for rel in files[:max_files]:
        src = read_source(root, rel)
        if src:
            ids += tokenizer.encode(code_document(src))
    return ids


def function_document(fn: Function) -> str:
    return BOS + fn.text + EOS


def _first_sentence(docstring: str) -> str:
    text = " ".join(ast.literal_eval(docstring.strip()).split()) if docstring.strip() else ""
    sentence = text.split(". ")[0].rstrip(".")
    return sentence[:160]


def reasoning_line(fn: Function) -> str:
    params = ", ".join(f"`{p}`" for p in fn.params) or "no arguments"
    n = len([ln for ln in fn.body.splitlines() if ln.strip()])
    tail = "; it returns a value" if fn.returns else ""
    return (f"`{fn.name}` takes {params}; the docstring says: {_first_sentence(fn.docstring)}. "
            f"I'll write the body in {n} line{'s' if n != 1 else ''}{tail}.")


def chat_document(fn: Function, thinking: bool) -> str:
    user = (f"Write the Python function `{fn.name}` of module `{fn.module}`, with this signature "
            f"and docstring:\n\n```python\n{fn.prompt}```")
    answer = {"role": "assistant", "content": f"```python\n{fn.text}```"}
    if thinking:
        answer["reasoning_content"] = reasoning_line(fn)
    return encode_messages([{"role": "user", "content": user}, answer], thinking=thinking)


def chat_mode(fn: Function, seed: int) -> bool:
    """Thinking (True) or chat (False) for this function, by a seeded draw."""
    return random.Random(f"{seed}:{fn.module}:{fn.name}:{fn.signature}").random() < 0.5


@dataclass
class Corpus:
    train: dict[str, list[str]]      # kind ("code", "function", "chat") -> documents
    val: dict[str, list[str]]
    heldout_functions: list[Function]
    files: tuple[int, int]           # (train files, held-out files)


def build_corpus(root: str | None = None, seed: int = 0) -> Corpus:
    root = root or stdlib_root()
    train_files, val_files = split_files(list_sources(root))
    parts = {}
    held_fns: list[Function] = []
    for split, files in (("train", train_files), ("val", val_files)):
        docs: dict[str, list[str]] = {"code": [], "function": [], "chat": []}
        for rel in files:
            source = read_source(root, rel)
            if source is None or not source.strip():
                continue
            docs["code"].append(code_document(source))
            for fn in functions(source, module_name(rel)):
                docs["function"].append(function_document(fn))
                docs["chat"].append(chat_document(fn, chat_mode(fn, seed)))
                if split == "val" and not is_test_file(rel):
                    held_fns.append(fn)
        parts[split] = docs
    return Corpus(parts["train"], parts["val"], held_fns, (len(train_files), len(val_files)))


def heldout_prompts(fns: list[Function], count: int = 20, max_body_chars: int = 160) -> list[dict]:
    """`count` short held-out functions (one-line signature, body of 1-6 lines) as completion
    prompts: BOS + signature + docstring, ending at the docstring's closing quotes; the model
    is to write the rest of the function. (A prompt ending in a lone newline token would be off
    the training distribution: the byte-level BPE writes a newline followed by indentation as
    one token, "\n   " + " return".)"""
    def fits(fn: Function) -> bool:
        body_lines = [ln for ln in fn.body.splitlines() if ln.strip()]
        return (fn.signature.count("\n") == 1 and 1 <= len(body_lines) <= 6
                and len(fn.body) <= max_body_chars and len(fn.docstring) <= 400)
    ranked = sorted((fn for fn in fns if fits(fn)),
                    key=lambda fn: hashlib.sha256(f"{fn.module}.{fn.name}".encode()).hexdigest())
    seen, picked = set(), []
    for fn in ranked:
        if fn.text not in seen and len(picked) < count:
            seen.add(fn.text)
            picked.append({"module": fn.module, "name": fn.name, "prompt": BOS + fn.prompt.rstrip("\n"),
                           "reference_completion": "\n" + fn.body})
    return picked
