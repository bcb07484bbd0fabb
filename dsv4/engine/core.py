"""The engine-core process: owns the model and the scheduler, runs the step loop.

`run_engine_core` is the process entry (multiprocessing spawn). It loads the engine, sends
`Ready` (or `StartupFailed` with the reason, then exits 1), and loops: take every waiting
input without blocking when there is work (blocking, with a timeout, when idle), run one
`step()`, send what it produced as one `StepOutputs`. It exits on `Shutdown` or as soon as
the API process (its parent) is gone. With several API processes (`--api-server-count`) it
takes inputs from all and sends each one its own requests' outputs (ipc.Outbox). Stop strings are the API process's (it has the text):
here requests end on EOS, stop token ids and lengths, and are aborted by the API on a stop
string (text/stop_watch.py).

`EngineCore` is the loop's logic without sockets, so it can be tested in-process. Failure
rules: a request rejected by `add_request` fails alone with 400; an exception inside
`step()` is narrowed down by running each request of the failed batch (and the next one to
admit) alone for one step (their state is unchanged by a step that raised before the
bookkeeping, and a request simply advances by a solo step that succeeds); the ones that
still fail are aborted and reported with 500, the others go on.
"""
from __future__ import annotations

import gc
import logging
import signal
import sys
import time
from collections.abc import Callable

import msgspec

from ..config_parse import vision_dict
from ..model.vision.spans import ImageSpan
from .deferred_free import DeferredFree
from .ipc import (AbortRequests, AddRequest, Addresses, EngineStats, Ready, RequestFailed, ResetPrefixCache,
                  Shutdown, StartupFailed, StepOutputs, TokenOutput, decode_input, encode, engine_sockets,
                  parent_alive)

log = logging.getLogger("dsv4.engine_core")
IDLE_POLL_MS = 200   # how often an idle engine checks that its parent is still there


class EngineCore:
    def __init__(self, engine):
        self.engine = engine
        engine.make_output = self._output   # the engine's step returns our wire outputs (made per token)
        engine.deferred_free = DeferredFree()   # (our outputs keep no prompt: the engine frees them, between steps)
        self._sent: dict[str, int] = {}   # request id -> tokens already forwarded
        self._aborted: set[str] = set()   # aborted since the last step: their outputs made before are dropped
        self._failures: list[RequestFailed] = []
        self._steps = 0
        self._generated = 0

    # ---- inputs ------------------------------------------------------------------------
    def handle(self, message: AddRequest | AbortRequests | ResetPrefixCache) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, ResetPrefixCache):
            log.info("prefix cache reset: %d pages freed", self.engine.reset_prefix_cache())
        else:
            for rid in message.request_ids:
                self.engine.abort(rid)
                self._sent.pop(rid, None)
                self._aborted.add(rid)

    def _add(self, message: AddRequest) -> None:
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                    images=tuple(ImageSpan(i.start, i.length, i.hash, i.data, i.n_llm_h, i.n_llm_w)
                                                 for i in message.images))
        except ValueError as e:
            self._failures.append(RequestFailed(message.request_id, 400, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - whatever it was, it fails this request only
            log.exception("add_request %s failed", message.request_id)
            self._failures.append(RequestFailed(message.request_id, 500, f"{type(e).__name__}: {e}"))
            return
        self._sent[message.request_id] = 0

    # ---- the step ----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[TokenOutput]:
        """The step's outputs (`_output`'s, made as the engine appended each token), less those
        of requests aborted since they were made (outputs a failed step carried over)."""
        self._steps += 1
        try:
            outs = self.engine.step()
        except Exception:  # noqa: BLE001
            log.exception("engine step failed; running its requests one by one")
            outs = self._isolate()
        for rid, why in self.engine.take_failed():      # ended by the engine itself (grammar worker gone,
            self._sent.pop(rid, None)                   # or a constraint its compile refused: a ValueError)
            self._aborted.add(rid)
            self._failures.append(RequestFailed(rid, 400 if isinstance(why, ValueError) else 500, str(why)))
        if self._aborted:
            outs = [o for o in outs if o.request_id not in self._aborted]
            self._aborted.clear()
        return outs

    def idle(self) -> list:
        """No work: free what ended requests left (engine/deferred_free.py); no outputs."""
        self.engine.deferred_free.release_all()
        return []

    def _isolate(self) -> list:
        """Run each request the failed step may have touched (the running ones and the next
        to admit) alone for one step; abort those that fail on their own."""
        sched = self.engine.scheduler
        suspects = list(sched.running) + list(sched.waiting)[:1]       # the step's requests and the next to admit
        outs, culprits = [], []
        for req in suspects:
            try:
                outs += self._solo_step(req)
            except Exception as e:  # noqa: BLE001
                log.exception("request %s fails on its own", req.request_id)
                culprits.append((req.request_id, f"{type(e).__name__}: {e}"))
        for rid, message in culprits:
            self.engine.abort(rid)
            self._sent.pop(rid, None)
            self._aborted.add(rid)
            self._failures.append(RequestFailed(rid, 500, f"engine step failed: {message}"))
        return outs

    def _solo_step(self, req) -> list:
        """One engine step with `req` as the only request the scheduler can see."""
        with self.engine.scheduler.only(req):
            return self.engine.step()

    def _output(self, req, new_tokens: list[int]) -> TokenOutput | None:
        """The engine's output of `req` once it appended a token (`LLMEngine.make_output`):
        every token not forwarded before (a step that raised may have appended tokens whose
        output was lost); None for a request this core does not serve (or no longer: aborted)."""
        sent = self._sent.get(req.request_id)
        if sent is None:
            return None
        tokens = req.output_token_ids
        new = TokenOutput(req.request_id, tokens[sent:])
        self._generated += len(tokens) - sent
        if req.params.logprobs is not None:
            new.logprobs = [list(entry.items()) for entry in req.logprobs[sent:]]
        if sent == 0:
            new.num_cached_tokens = req.num_cached_tokens or 0
            if req.params.prompt_logprobs is not None:
                new.prompt_logprobs = [None if e is None else list(e.items()) for e in req.prompt_logprobs]
        if req.is_finished:
            new.finished, new.finish_reason, new.stop_reason = True, req.finish_reason, req.stop_reason
            if isinstance(req.stop_reason, str):
                new.final_text = req.output_text
            del self._sent[req.request_id]
        else:
            self._sent[req.request_id] = len(tokens)
        return new

    # ---- reporting ---------------------------------------------------------------------
    def reject(self, request_id: str, reason: str) -> None:
        """Fail a request that never reached the engine (400)."""
        self._failures.append(RequestFailed(request_id, 400, reason))

    def take_failures(self) -> list[RequestFailed]:
        failures, self._failures = self._failures, []
        return failures

    def stats(self) -> EngineStats:
        (running, waiting), cache = self.engine.scheduler.counts(), self.engine.cache
        usage, (queries, hits, cached) = cache.usage(), self.engine.prefix_stats()
        free = cache.available_pages()          # pages only the prefix cache holds count as free
        stats = EngineStats(num_running=running, num_waiting=waiting,
                            pages_used=usage["pages_total"] - free, pages_free=free,
                            swa_pages_used=usage["swa_pages_used"], slots_used=usage["slots_used"],
                            steps=self._steps, generated_tokens=self._generated, prefix_queries=queries,
                            prefix_hits=hits, prefix_pages=cached)
        if cache.tiers is not None:
            for name, value in cache.tiers.report().items():
                setattr(stats, name, value)
        spec = getattr(self.engine, "spec", None)
        if spec is not None:
            s = spec.stats
            stats.spec_drafts, stats.spec_draft_tokens = s.num_drafts, s.num_draft_tokens
            stats.spec_accepted_tokens, stats.spec_accepted_per_pos = s.num_accepted_tokens, list(s.accepted_per_pos)
        return stats


def ready_message(engine) -> Ready:
    plan = engine.plan
    return Ready(max_model_len=engine.max_model_len, vocab_size=engine.cfg.vocab_size,
                 eos_token_id=engine.eos_token_id, num_pages=plan.num_pages, max_num_seqs=plan.max_num_seqs,
                 max_request_tokens=min(engine.max_model_len, plan.num_pages * 256),
                 context_limit=engine.context_limit,
                 memory_report=engine.memory_report(),
                 vision=vision_dict(engine.cfg.vision) if engine.cfg.vision is not None else None)


# ---- the process ---------------------------------------------------------------------------
def run_engine_core(model_dir: str, config, addresses: Addresses, parent_pid: int) -> None:
    """Process entry: load, report, loop. Exit code 1 when the engine could not start."""
    import zmq
    # Ctrl-C and SIGTERM (also when sent to the whole process group) are the API process's to
    # handle: it drains its requests, then sends Shutdown (and kills us only if we hang).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    started = time.perf_counter()
    ctx = zmq.Context()
    inbox, outbox = engine_sockets(ctx, addresses)
    try:
        engine = _load_engine(model_dir, config)
    except BaseException as e:  # noqa: BLE001 - report anything, including MemoryError
        outbox.send(encode(StartupFailed(_startup_message(model_dir, e))))
        outbox.close(linger=2000)
        sys.exit(1)
    engine.check_stop_strings = False      # the API process does (serve/client.py, text/stop_watch.py)
    gc.freeze()     # the start-up's objects (model, tokenizer, plans) are never scanned by a full collection again
    log.info("engine core ready in %.1f s (load, cache, warm-up)", time.perf_counter() - started)
    outbox.send(encode(ready_message(engine)))
    try:
        serve_loop(EngineCore(engine), inbox, outbox, parent_pid)
    finally:
        engine.close()                 # the other ranks of a parallel run (with a timeout)
        ctx.destroy(linger=0)
        if not parent_alive(parent_pid):
            addresses.remove()     # the API process died without cleaning up: its IPC folder


def _load_engine(model_dir: str, config):
    from .engine import LLMEngine
    return LLMEngine(model_dir, config)


def _startup_message(model_dir: str, error: BaseException) -> str:
    from ..config import ConfigError
    if isinstance(error, ConfigError):           # a setting the model or the cache cannot serve
        return f"--{error.field.replace('_', '-')}: {error}"
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "out of memory" in str(error).lower():
        text += " (lower --cache-memory-gb / --num-pages / --max-model-len, or use a larger device)"
    return f"cannot load model {model_dir!r}: {text}"


def serve_loop(core: EngineCore, inbox, outbox, parent_pid: int) -> None:
    while parent_alive(parent_pid):
        messages = _drain(inbox, wait_ms=0 if core.has_work else IDLE_POLL_MS, reject=core.reject)
        if any(isinstance(m, Shutdown) for m in messages):
            return
        for m in messages:
            core.handle(m)
        outputs = core.step() if core.has_work else core.idle()
        failures = core.take_failures()
        if messages or outputs or failures:
            outbox.send_step(StepOutputs(outputs, failures, core.stats()))   # (each API process its own part)


def _drain(inbox, wait_ms: int, reject: Callable[[str, str], None] | None = None) -> list:
    """Every waiting input. A frame that does not decode is dropped (logged); when it names
    a request, `reject(request_id, reason)` fails that request."""
    messages = []
    while inbox.poll(wait_ms):
        frame = inbox.recv()
        wait_ms = 0
        try:
            messages.append(decode_input(frame))
        except (msgspec.DecodeError, ValueError) as e:
            log.error("dropped an input frame that does not decode: %s", e)
            rid = _request_id_of(frame)
            if rid is not None and reject is not None:
                reject(rid, f"the engine could not decode the request: {e}")
    return messages


def _request_id_of(frame: bytes) -> str | None:
    try:
        raw = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, ValueError):
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None
