"""LLMEngine: requests in, tokens out, one `step()` at a time (scheduler -> cache ->
runner -> sampler). Bad requests raise ValueError at `add_request` and cost nothing else."""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable

import torch

from ..cache.layout import CacheLayout
from ..cache.manager import CacheManager
from ..cache.report import loaded_weight_bytes, model_dtype_plan, plan_report
from ..cache.sizing import memory_report, plan_cache, prefix_caching, reserves_workspace
from ..cache.tiers import TierOptions
from ..config import ConfigError, EngineConfig
from .context_limit import context_limit
from .deferred_free import DeferredFree
from .workspace import workspace_components
from .grammar_steps import COMPILE_WAIT_S, GrammarSteps
from .outputs import RequestOutput
from .inflight import HostCopy, PromptLogprobRows, StepInFlight
from ..model.vision.engine_checks import check_images
from ..model.vision.spans import ImageSpan
from .request import Request, Status
from .runner import ModelRunner, StepLogits
from .sampler import Sampler, compute_prompt_logprobs, count_pending, make_generator
from .sampling_inputs import SamplingInputs
from .slot_state import SlotState
from ..sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from ..text.stop import StopChecker, StopResult
from ..text.stop_watch import StopStringWatch

log = logging.getLogger("dsv4.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LLMEngine(GrammarSteps):
    def __init__(self, model_dir: str, config: EngineConfig = EngineConfig(), model=None, tokenizer=None):
        from ..model.weights import load_model
        from ..ops.backend import set_backend
        set_backend(config.ops_backend)
        self.config, self.workers = config, None
        if model is not None:
            config.check_no_model_overrides()
        parallel = "data_parallel_size" if config.data_parallel_size > 1 else "tensor_parallel_size"
        if config.world_size > 1:                 # ranks 1..n-1 start; this process is rank 0
            if model is not None:
                raise ConfigError(parallel, "every rank loads its own shard: give the engine the "
                                            "model's folder or random: spec, not a built model")
            from .workers import Workers, load_rank_model
            if config.data_parallel_size > 1:
                from .data_parallel import check_expert_split
                check_expert_split(model_dir, config)
            self.workers = Workers.start(model_dir, config)
            model = load_rank_model(model_dir, config, self.workers.comm)
        self.model = model if model is not None else load_model(model_dir, config.device, DTYPES[config.dtype],
                                                                keep_fp8=config.keep_fp8, keep_mxfp4=config.keep_mxfp4,
                                                                keep_fp8_dense=config.keep_fp8_dense,
                                                                overrides=config.model_overrides())
        spec = config.speculative_config
        if spec is not None:             # (a draft checkpoint may give the model its MTP blocks)
            from .speculative import check_speculative
            check_speculative(spec, self.model, model_dir)
        self.cfg = self.model.cfg
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config.tokenizer or model_dir)
        self.layout = CacheLayout(self.cfg, spec_slots=config.spec_slots, with_mtp=spec is not None,
                                  kv_fp8=config.kv_cache_dtype == "fp8")
        self.workspace = workspace_components(self.cfg, config, DTYPES[config.dtype])
        self.plan = plan_cache(self.layout, config, DTYPES[config.dtype], sum(self.workspace.values()))
        limit = context_limit(self.cfg, self.plan, config)
        self.max_model_len, self.context_limit = limit.tokens, limit.source
        if config.data_parallel_size > 1:     # one scheduler, a step per DP rank (engine/data_parallel.py)
            from .data_parallel import dp_engine_parts
            self.cache, self.scheduler, self.runner = dp_engine_parts(self.model, self.layout, self.plan, config,
                                                                      self.workers)
        else:
            self.cache = CacheManager(self.layout, self.plan, prefix_caching=prefix_caching(config))
            self.scheduler = Scheduler(self.cache, config.max_num_batched_tokens, config.max_num_seqs,
                                       config.max_prompt_logprobs_tokens)
            self.runner = ModelRunner(self.model, self.layout, self.plan, self.cache, config.device,
                                      0 if config.enforce_eager else config.cuda_graph_max_bs,
                                      keep_hidden=spec is not None and spec.method != "dspark",
                                      keep_taps=spec is not None and spec.method == "dspark")
        self.cache.bind(self.runner.storage, TierOptions.from_config(config))
        if self.workers is None and self.cfg.vision is None:      # the persistent batch (engine/slot_state.py)
            self.runner.batch = SlotState(self.runner.storage.ring_slots)
        if self.workers is not None:
            self.workers.send_cache(self.layout, self.plan, self.runner.storage)
            if self.cfg.vision is not None:
                self.workers.shutdown()
                raise ConfigError(parallel, "vision checkpoints run on one process (the tower is not sharded yet)")
            self.runner.workers = self.workers
        self.sampler = Sampler()
        self.generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self.eos_token_id = self.tokenizer.eos_id if self.tokenizer is not None else self.cfg.eos_token_id
        self.sampling_inputs = SamplingInputs(self.cfg.vocab_size, self.eos_token_id, self.generator, self.runner.h2d)
        self.spec = None            # the speculative decoder (engine/speculative/), when configured
        if spec is not None:
            from .speculative.decoder import SpeculativeDecoder
            self.spec = SpeculativeDecoder(spec, self.model, self.runner, self.cache, self.eos_token_id,
                                           self.generator)
            self.spec.grammar_mask = self._verify_grammar_mask
        self.requests: dict[str, Request] = {}
        self._stops: dict[str, StopChecker] = {}
        self._watches: dict[str, StopStringWatch] = {}   # requests with stop strings (check_stop_strings)
        self._arrivals = itertools.count()
        # speculative steps run synchronously: drafts need the step's tokens on the host
        self.async_scheduling = self.spec is None and (config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and torch.device(config.device).type == "cuda"))
        self._inflight: StepInFlight | None = None       # the launched step not yet read back
        # False in the engine-core process: the API process detokenises and checks stop strings
        # (text/stop_watch.py); the engine then never decodes text
        self.check_stop_strings = True
        # what a step returns per sampled token, made from the request as `_append` leaves it:
        # `output_of` (a RequestOutput, a snapshot) here; the engine core makes its wire output
        # straight from the request instead (engine/core.py: only the new tokens, no copy of
        # all generated ones per step, one object per token); None: no output
        self.make_output: Callable[[Request, list[int]], object | None] = self.output_of
        # the prompts of requests that ended, freed a slice after each launch (engine/deferred_free.py):
        # set by the engine core, whose outputs do not keep them; None: they die where they die (the
        # offline API's outputs keep them past the step)
        self.deferred_free: DeferredFree | None = None
        self._carried: list[RequestOutput] = []           # outputs of a step read after a failure
        self.grammars = None        # structured registry.Grammars or remote.WorkerGrammars, made on the first
        #                             constrained request
        self._compiling: dict[str, Request] = {}     # requests whose grammar compiles in the background
        # requests the engine ended on its own with an error: (id, why), reported by the engine core
        # as failures (`take_failed`): the grammar worker's death (a str: 500), or a constraint its
        # background compile refused (a grammars.GrammarError, a ValueError: 400)
        self.failed: list[tuple[str, str | ValueError]] = []
        log.info(self.memory_report())
        if torch.device(config.device).type == "cuda":
            self.warmup()

    def warmup(self) -> dict:
        """Compile the kernels and capture every CUDA-graph shape before the first request
        (ModelRunner.warmup); returns and logs what ran and how long it took."""
        start = time.perf_counter()
        k = self.config.speculative_config.num_speculative_tokens if self.spec is not None else 0
        self.sampling_inputs.warmup(self.sampler, self.config.device)     # (before the late-compile watch)
        done = self.runner.warmup(self.max_model_len, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                  (1, k + 1) if k else (1,))
        done["seconds"] = time.perf_counter() - start
        log.info("warm-up: %d eager steps, %d CUDA-graph shapes in %.1f s", done["eager_steps"],
                 done["graph_shapes"], done["seconds"])
        return done

    # ---- set-up ---------------------------------------------------------------------
    def memory_report(self) -> str:
        """The cache line, then the memory plan (`dsv4 plan`'s report, with the loaded weights)."""
        dtype = DTYPES[self.config.dtype]
        plan = plan_report(loaded_weight_bytes(self.model), self.layout, self.plan, dtype, self.max_model_len,
                           model_dtype_plan(self.layout, self.plan, dtype, self.config.max_num_batched_tokens),
                           self.workspace, reserves_workspace(self.config))
        return memory_report(self.layout, self.plan, dtype, self.max_model_len, self.config.tensor_parallel_size,
                             self.config.data_parallel_size) + "\n" + plan

    def close(self) -> None:
        """Stop the other ranks of a parallel run (nothing to do for one process), the grammar
        worker, and the late-compile watcher (another engine's warm-up in this process is not late)."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.grammars is not None:
            self.grammars.close()
        self.runner.late_compiles.uninstall()

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    images: tuple[ImageSpan, ...] = ()) -> Request:
        """images: the prompt's image blocks (docs/vision.md), checked against the model."""
        self._validate(request_id, prompt_token_ids, params)
        check_images(self.cfg, images, len(prompt_token_ids))
        compiling = False       # a bad grammar raises here (or fails from its compile) and costs nothing else
        if params.structured is not None:
            compiling = self._grammars().add(request_id, params.structured, background=True) is None
        req = Request(request_id, list(prompt_token_ids), params, arrival=next(self._arrivals),
                      generator=make_generator(params.seed, self.config.device),
                      images=tuple(sorted(images, key=lambda s: s.start)))
        self.requests[request_id] = req
        if compiling:           # not scheduled until its grammar is made (_settle_compiles)
            req.grammar_pending = True
            self._compiling[request_id] = req
        self._stops[request_id] = StopChecker(params, self.eos_token_id, len(prompt_token_ids), self.max_model_len)
        if params.stop and self.check_stop_strings and self.tokenizer is not None:
            self._watches[request_id] = StopStringWatch(self.tokenizer, prompt_token_ids, params)
        self.scheduler.add(req)
        return req

    def _validate(self, request_id, ids, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        plain = set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < self.cfg.vocab_size   # (in C)
        bad = [] if plain else [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                                or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]!r} is not a token id of the vocabulary "
                             f"[0, {self.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit max_model_len {self.max_model_len} "
                             f"(the prompt plus at least one generated token; set by {self.context_limit})")
        params.validate(self.cfg.vocab_size)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds max_model_len {self.max_model_len} (set by {self.context_limit})")
        chunk = self.config.max_num_batched_tokens
        if not self.cache.fits_ever(total, chunk):
            # name the prompt when it cannot fit even with a single generated token
            field = "max_tokens" if self.cache.fits_ever(len(ids) + 1, chunk) else "prompt"
            raise ValueError(f"{field}: a request of {total} tokens (prompt {len(ids)} + max_tokens "
                             f"{params.max_tokens}) cannot fit the KV cache ({self.plan.num_pages} pages "
                             f"of 256 tokens) even alone")

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, Status.ABORTED)
            req.finish_reason = "abort"
        if req is not None and self.deferred_free is not None:
            self.deferred_free.hold(req.prompt_token_ids)
        self._stops.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.drop(request_id)      # (a compile in flight: its result is dropped)
            self._compiling.pop(request_id, None)
        self._watches.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the pages freed (pages in use stay with their requests)."""
        return self.cache.reset_prefix()

    def prefix_stats(self) -> tuple[int, int, int]:
        """(tokens looked up, tokens hit, pages in the prefix cache) since start."""
        return self.scheduler.prefix_queries, self.scheduler.prefix_hits, self.cache.usage()["prefix_pages"]

    def has_unfinished(self) -> bool:
        """Requests to run or outputs to hand back (a request of a step in flight is still
        running or waiting in the scheduler, so the step itself needs no check)."""
        return self.scheduler.has_work() or bool(self._carried)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; return the outputs of the step that finished. With
        async scheduling that is the previous step, read while this one runs."""
        outputs, self._carried = self._carried, []
        if self._compiling:
            outputs += self._settle_compiles()
        if self._inflight is not None and self._must_wait():
            return outputs + self._drain()
        chunks = self.scheduler.schedule()
        if not chunks:
            drained = self._drain()
            if not drained and not outputs:
                if self.deferred_free is not None:
                    self.deferred_free.release_all()     # nothing runs: nobody waits for it
                if self._compiling:             # only compiles to wait for (bounded: new requests may come)
                    self.grammars.wait_compiled(COMPILE_WAIT_S)
                else:
                    self.cache.wait_for_tiers()     # e.g. a restore in flight: wait for it, don't spin
            return outputs + drained
        try:
            launched = self._launch(chunks)     # (the step in flight samples inside if its forward reads its tokens)
            self._sample_inflight()
        except BaseException:
            if self.workers is not None:      # a collective failed: a dead rank ends the run here
                self.workers.check_ranks()
            self._carried = outputs + self._drain()     # returned by the next step
            raise
        previous, self._inflight = self._inflight, launched
        if self.deferred_free is not None:
            self.deferred_free.release()            # (the device runs the launched step meanwhile)
        if previous is not None:
            outputs += self._complete(previous, following=launched)
        if not self.async_scheduling:
            outputs += self._drain()
        return outputs

    def _must_wait(self) -> bool:
        """The next schedule needs the tokens in flight: a request reaches max_tokens or
        max_model_len with them (it must not be scheduled again). Penalties and min_tokens
        need no wait: pending tokens are counted on the device (sampler.count_pending). With
        workers, a grammar-constrained request waits too: its mask needs the token in flight, and
        sampling after the next forward is launched would order rank 0's token broadcast after
        that forward's collectives."""
        for i in self._inflight.sampled:
            req = self._inflight.chunks[i].request
            if req.is_finished:
                continue
            p, n_out = req.params, len(req.output_token_ids) + req.num_pending
            if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
                return True
            if self.workers is not None and self.grammars and self.grammars.get(req.request_id) is not None:
                return True
        return False

    def _sample_inflight(self) -> None:
        """Sample the step in flight if its sampling waits for grammar masks and has not run yet."""
        if self._inflight is not None:
            self._inflight.sampled_tokens()

    def _drain(self) -> list[RequestOutput]:
        self._sample_inflight()
        previous, self._inflight = self._inflight, None
        return self._complete(previous) if previous is not None else []

    @torch.inference_mode()
    def _launch(self, chunks: list[ScheduledChunk]) -> StepInFlight:
        inflight = self._inflight
        if inflight is None or inflight.sample_later is None:
            prev = inflight.tokens if inflight is not None else None
        else:                                       # sampled when first read (StepInFlight.sampled_tokens)
            prev = inflight.sampled_tokens
        fills = self.spec.draft_fills(chunks) if self.spec is not None else []    # drafts still on the device
        step = self.runner.execute(chunks, prev, fills) if fills else self.runner.execute(chunks, prev)
        later = None
        if self.spec is None:
            sampled = [i for i, c in enumerate(chunks) if c.completes]
            if self._grammar_waits(chunks, sampled):   # (never with workers: see _must_wait)
                tokens = values = None              # masks started by _complete (its `following`)
                later = lambda: launched.set_sampled(*self._sample(chunks, sampled, step, prev,  # noqa: E731
                                                                   launched.masks))
            else:
                tokens, values = self._sample(chunks, sampled, step, prev)
                if self.workers is not None and tokens is not None:
                    self.workers.share_sampled(tokens)
        else:                           # verify drafts, rewind rejected ones, draft the next
            sampled, tokens, values = self.spec.step(chunks, step)
        lps = [self._prompt_logprobs(c.request, c, step, i) for i, c in enumerate(chunks)
               if c.request.params.prompt_logprobs is not None      # (wants_prompt_logprobs, inlined)
               and c.request.num_computed < len(c.request.prompt_token_ids)]
        for row, i in enumerate(sampled):
            chunks[i].request.num_pending += 1
            chunks[i].request.pending_row = row
        self.scheduler.advance_step(chunks)
        if step.slots is not None:                  # the persistent batch follows (engine/slot_state.py)
            self.runner.batch.launched(step.slots, chunks, sampled, self.spec is not None)
        launched = StepInFlight(chunks, sampled, tokens, values, lps, sample_later=later)
        return launched

    def _complete(self, step: StepInFlight, following: StepInFlight | None = None) -> list[RequestOutput]:
        """Read `step` back and append its tokens. `following`: the step launched after it; if its
        sampling waits for grammar masks, their fill starts as soon as the matchers have taken
        this step's tokens and runs while the rest of this bookkeeping does."""
        for rows in step.prompt_logprobs:
            self._record_prompt_logprobs(rows)
        if step.values is None:
            return []
        tokens, lps, top_ids, top_lps = step.values.get()
        outputs = []
        if self.grammars:
            self._advance_grammars(step, tokens, following)
            if self.grammars.error is not None:
                outputs = self._fail_grammar_requests()
        chunks, append = step.chunks, self._append
        commit = self.cache.commit if self.cache.prefix is not None else None    # (a no-op without one)
        for row, i in enumerate(step.sampled):
            req = chunks[i].request
            if req.is_finished:             # finished after this step was launched: surplus row
                continue
            req.num_pending -= 1
            out = append(req, tokens[row], lps[row], top_ids[row], top_lps[row])
            if out is not None:
                outputs.append(out)
            if commit is not None and not req.is_finished:
                commit(req)                 # a boundary whose last token was still pending at launch
        if self.runner.batch is not None:
            self.runner.batch.completed(chunks, step.sampled, tokens, self.spec is not None)
        return outputs

    def _sample(self, chunks: list[ScheduledChunk], idx: list[int], step: StepLogits, prev: torch.Tensor | None,
                masks=None):
        """-> (sampled tokens [N] on the device, their HostCopy), or (None, None). `prev`: the
        sampled tokens of the step in flight before this one (pending tokens' penalties).
        `masks`: the rows' grammar masks, already started (else started here: they fill while
        the sampling batch is built)."""
        if not idx:
            return None, None
        if masks is None:
            masks = self._start_masks(chunks, idx)
        reqs = [chunks[i].request for i in idx]
        rows = [step.first_row[i] + step.num_rows[i] - 1 for i in idx]
        batch, rows_t, pending_t = self.sampling_inputs.batch(reqs, rows, masks)
        if pending_t is not None:
            prev = prev() if callable(prev) else prev
            count_pending(batch.penalties, pending_t[:, 0], prev[pending_t[:, 1]])
        logits = step.logits[:len(rows)] if rows_t is None else step.logits[rows_t]
        out = self.sampler(logits, batch)
        return out.token_ids, HostCopy([out.token_ids, out.logprobs, out.top_ids, out.top_logprobs])

    def _prompt_logprobs(self, req: Request, c: ScheduledChunk, step: StepLogits, i: int):
        start, n_prompt = req.num_computed, len(req.prompt_token_ids)
        n = min(c.num_tokens, n_prompt - 1 - start)   # rows predicting a prompt token
        nxt = req.prompt_token_ids[start + 1:start + 1 + max(n, 0)]
        if n <= 0:
            return PromptLogprobRows(req, start, [], None)
        logits = step.logits[step.first_row[i]:step.first_row[i] + n]
        pl = compute_prompt_logprobs(logits, torch.tensor(nxt, device=logits.device), req.params.prompt_logprobs or 0)
        return PromptLogprobRows(req, start, nxt, HostCopy([pl.token_logprobs, pl.top_ids, pl.top_logprobs]))

    def _record_prompt_logprobs(self, rows: PromptLogprobRows) -> None:
        req = rows.request
        if rows.start == 0:
            req.prompt_logprobs = [None]   # (again, after a preemption by recompute)
        if rows.values is None:
            return
        for t, lp, ids, lps in zip(rows.next_ids, *rows.values.get()):
            req.prompt_logprobs.append({t: lp, **dict(zip(ids, lps))})

    def _append(self, req: Request, token: int, logprob: float, top_ids, top_lps) -> RequestOutput:
        req.output_token_ids.append(token)      # (its grammar takes the token in _advance_grammars)
        if req.params.logprobs is not None:
            req.logprobs.append({token: logprob, **dict(zip(top_ids, top_lps))})
        result = self._stops[req.request_id].check(req.output_token_ids)    # EOS, stop ids, lengths
        watch = self._watches.get(req.request_id)
        if watch is not None and (result is None or result.finish_reason == "length"):
            hit = watch.push([token])     # stop strings: the API process's rule (text/stop_watch.py)
            if hit is not None:
                result = StopResult("stop", hit[1], hit[2])
        if result is not None:
            req.finish_reason, req.stop_reason = result.finish_reason, result.stop_reason
            if result.output_text is not None:
                req.output_text = result.output_text
            elif self.check_stop_strings:
                self._text(req)         # decoded once, at the end
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            if self.deferred_free is not None:
                self.deferred_free.hold(req.prompt_token_ids)
            self._stops.pop(req.request_id, None)
            if self.grammars is not None:
                self.grammars.drop(req.request_id)
            self._watches.pop(req.request_id, None)
        return self.make_output(req, [token])

    def _text(self, req: Request) -> tuple[str | None, int | None]:
        if self.tokenizer is None:
            return None, None
        old = req.output_text or ""
        req.output_text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
        return req.output_text, max(len(req.output_text) - len(old), 0)

    def output_of(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), new_token_ids=new_tokens, finished=req.is_finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason, text=req.output_text,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.wants_prompt_logprobs else None,
            num_cached_tokens=req.num_cached_tokens or 0)


def _load_tokenizer(model_dir: str | None):
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return None
    from ..text.tokenizer import Tokenizer
    return Tokenizer.from_dir(model_dir)
