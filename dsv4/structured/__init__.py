"""Grammar-constrained decoding (docs/architecture.md, "Structured outputs"): a request's
`StructuredOutputs` -> an xgrammar grammar (`grammars.py`, tokenizer-free: the API process
validates with it), compiled against the tokenizer and cached (`compiler.py`), one matcher
per request (`matcher.py`) and a step's token bitmask (`masks.py`) that the sampler applies."""
