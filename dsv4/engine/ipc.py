"""The wire between the API process and the engine-core process (docs/architecture.md, "Serving").

Two ZeroMQ PUSH/PULL pipes on ipc:// paths in a private temp dir, both bound by the API
process: requests flow in on `input`, results flow out on `output`. With several API processes
(`--api-server-count N`, serve/http/api_workers.py) each one binds a pair of its own
(`Addresses.of(i)`); the engine core pulls from all N inputs (fair-queued) and sends each
`StepOutputs` to every API process, with only the outputs of the requests it sent (the owner
is in the request id: `owned_id`) and the same `EngineStats`. Every frame is one
msgpack-encoded msgspec message of a tagged union below, so no JSON and no tensor ever
crosses: token ids, logprobs and finish reasons come back, sampling parameters go in.

Engine -> API: first exactly one `Ready` or `StartupFailed`, then `StepOutputs` (one per
engine step that produced something, or after a batch of inputs; each carries fresh
`EngineStats`). API -> engine: `AddRequest`, `AbortRequests`, `ResetPrefixCache`, `Shutdown`.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import msgspec
import zmq

from ..sampling_params import SamplingParams

# A logprob entry of one position: (token id, logprob) pairs, the chosen token first.
LogprobEntry = list[tuple[int, float]]


# ---- API -> engine -----------------------------------------------------------------------
class ImageItem(msgspec.Struct):
    """One image block of a prompt (docs/vision.md): positions [start, start + length) hold
    the image token; the engine encodes `data` (the image file's bytes)."""
    start: int
    length: int
    data: bytes
    hash: str
    n_llm_h: int
    n_llm_w: int


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: list[ImageItem] = []
    kv_transfer: str | None = None      # decode role: the prefill engine holding its state (dsv4/disagg/)


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineInput = AddRequest | AbortRequests | ResetPrefixCache | Shutdown


# ---- engine -> API -----------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    num_pages: int              # 256-token history pages (all free at start)
    max_num_seqs: int
    max_request_tokens: int     # prompt + output tokens that fit the cache even alone
    memory_report: str
    vision: dict | None = None  # the model's vision_* config fields (None: text only; docs/vision.md)
    context_limit: str = ""     # what sets max_model_len (engine/context_limit.py), for 4xx messages


class StartupFailed(msgspec.Struct, tag=True):
    message: str


class TokenOutput(msgspec.Struct, omit_defaults=True):    # (fields at their default are not sent)
    """What one request got in one step: tokens never sent before, in order."""
    request_id: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None = None          # one entry per token, when asked
    prompt_logprobs: list[LogprobEntry | None] | None = None  # with a request's first output
    finished: bool = False
    finish_reason: str | None = None                    # "stop" | "length"
    stop_reason: int | str | None = None
    final_text: str | None = None                       # the output cut at a stop string
    num_cached_tokens: int | None = None                # with a request's first output: prompt tokens resumed


class RequestFailed(msgspec.Struct):
    request_id: str
    status: int                 # 400: rejected on admission; 500: failed inside a step
    message: str


class EngineStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    pages_used: int = 0
    pages_free: int = 0
    swa_pages_used: int = 0
    slots_used: int = 0
    steps: int = 0              # engine steps run so far
    generated_tokens: int = 0   # tokens sampled so far (forwarded or not)
    prefix_queries: int = 0     # prompt tokens looked up in the prefix cache so far
    prefix_hits: int = 0        # of them, tokens resumed from it
    prefix_pages: int = 0       # history pages the prefix cache holds
    # host / disk tiers (cache/tiers/stats.py), so far: resumed tokens each tier supplied, bytes
    # moved each way, copy latencies (cumulative counts per bucket of `tier_buckets`, then the
    # sum of seconds), and occupancy now
    tier_hit_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    tier_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    tier_latency: dict[str, list[float]] = msgspec.field(default_factory=dict)
    tier_buckets: list[float] = msgspec.field(default_factory=list)
    tier_usage: dict[str, int] = msgspec.field(default_factory=dict)
    # speculative decoding so far (engine/speculative/stats.py): verifies with drafts, drafted
    # and accepted tokens, accepted tokens per draft position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # prefill/decode disaggregation (dsv4/disagg/): states pulled so far, their bytes and
    # seconds (reservation to install), failed pulls; transfers in progress
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_transfers_pending: int = 0


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]
    failures: list[RequestFailed]
    stats: EngineStats


EngineOutput = Ready | StartupFailed | StepOutputs

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineOutput)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_input(frame: bytes) -> EngineInput:
    return _input_decoder.decode(frame)


def decode_output(frame: bytes) -> Ready | StartupFailed | StepOutputs:
    return _output_decoder.decode(frame)


# ---- request ids: which API process sent a request ------------------------------------------
def owned_id(index: int, count: int, request_id: str) -> str:
    """The engine request id of API process `index` of `count`: "<index>:<id>" when there are
    several (ids are then unique across processes and name their owner), `request_id` alone
    when there is one."""
    return f"{index}:{request_id}" if count > 1 else request_id


def request_owner(request_id: str) -> int:
    """The API process that sent `request_id` (0 for an id without an owner prefix)."""
    head, sep, _ = request_id.partition(":")
    return int(head) if sep and head.isdigit() else 0


# ---- sockets -----------------------------------------------------------------------------
class Addresses(msgspec.Struct):
    input: str
    output: str
    folder: str
    count: int = 1      # API processes; process i > 0 has the paths of `of(i)`

    @classmethod
    def new(cls, count: int = 1) -> "Addresses":
        folder = tempfile.mkdtemp(prefix="dsv4-ipc-")
        return cls(f"ipc://{folder}/input", f"ipc://{folder}/output", folder, count)

    def of(self, index: int) -> "Addresses":
        """API process `index`'s pair (the same folder)."""
        if index == 0:
            return Addresses(self.input, self.output, self.folder)
        return Addresses(f"{self.input}-{index}", f"{self.output}-{index}", self.folder)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)   # never drop or block on a burst of messages
    sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(address)
    return sock


def api_sockets(ctx: zmq.Context, addr: Addresses) -> tuple[zmq.Socket, zmq.Socket]:
    """(input PUSH, output PULL), bound: the API process owns the paths."""
    return _socket(ctx, zmq.PUSH, addr.input, True), _socket(ctx, zmq.PULL, addr.output, True)


def engine_sockets(ctx: zmq.Context, addr: Addresses) -> tuple[zmq.Socket, "Outbox"]:
    """(input PULL connected to every API process's input, the outbox to all of them)."""
    inbox = _socket(ctx, zmq.PULL, addr.input, False)
    for i in range(1, addr.count):
        inbox.connect(addr.of(i).input)
    return inbox, Outbox([_socket(ctx, zmq.PUSH, addr.of(i).output, False) for i in range(addr.count)])


class Outbox:
    """The engine core's output pipes, one per API process (`Addresses.of(i)`)."""

    def __init__(self, sockets: list[zmq.Socket]):
        self.sockets = sockets

    def send(self, frame: bytes) -> None:
        """`frame` to every API process (Ready, StartupFailed)."""
        for sock in self.sockets:
            sock.send(frame)

    def send_step(self, message: StepOutputs) -> None:
        """Each API process gets the outputs and failures of its own requests (`request_owner`)
        and the stats; with one API process, `message` as it is."""
        if len(self.sockets) == 1:
            self.sockets[0].send(encode(message))
            return
        parts = [StepOutputs([], [], message.stats) for _ in self.sockets]
        last = len(parts) - 1          # (an owner out of range can only be a garbled id: process 0 gets it)
        for out in message.outputs:
            owner = request_owner(out.request_id)
            parts[owner if owner <= last else 0].outputs.append(out)
        for failure in message.failures:
            owner = request_owner(failure.request_id)
            parts[owner if owner <= last else 0].failures.append(failure)
        for sock, part in zip(self.sockets, parts):
            sock.send(encode(part))

    def close(self, linger: int | None = None) -> None:
        for sock in self.sockets:
            sock.close(linger=linger)


def parent_alive(parent_pid: int) -> bool:
    """False once the process that started us is gone (we were re-parented)."""
    return os.getppid() == parent_pid
