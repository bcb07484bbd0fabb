"""The offline API: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from ..config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from ..sampling_params import SamplingParams


def default_model_dir() -> str:
    """The bundled demo checkpoint (served when no model is given)."""
    from ..assets import demo_model_dir
    return demo_model_dir()


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(engine_kwargs) - fields
        if unknown:
            raise TypeError(f"LLM(): unknown engine settings {sorted(unknown)}; known: {sorted(fields)}")
        self.model_dir = model or default_model_dir()
        self.engine = LLMEngine(self.model_dir, EngineConfig(**engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        token_lists = self._token_lists(prompts, prompt_token_ids)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"sampling_params: {len(params)} given for {len(token_lists)} prompts")
        for p in params:      # n is consumed here, before the engine sees (and checks) a request
            p.validate(self.engine.cfg.vocab_size)
        ids = []
        try:
            for tokens, p in zip(token_lists, params):
                for k in range(p.n):
                    child = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + k)
                    rid = str(next(self._ids))
                    self.engine.add_request(rid, list(tokens), child)
                    ids.append(rid)
        except BaseException:
            for rid in ids:   # a bad prompt fails the call: leave none of its requests queued
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def _token_lists(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("prompts: give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(t) for t in prompt_token_ids]
        if isinstance(prompts, str):
            prompts = [prompts]
        if self.tokenizer is None:
            raise ValueError("prompts: this checkpoint has no tokenizer.json; pass prompt_token_ids")
        return [self.tokenizer.encode(p) for p in prompts]

    def _run(self, ids: list[str], show: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", disable=not show)
        try:
            while len(done) < len(ids):
                outs = self.engine.step()
                if not outs and not self.engine.has_unfinished():
                    raise RuntimeError("engine stopped with unfinished requests")
                for out in outs:
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]
