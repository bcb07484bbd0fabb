"""The API's detokenise + SSE work alone, in-process: PYTHONPATH=TREE python api_micro.py LABEL
(TREE: the checkout measured)."""
import sys, time, random
from dsv4.assets import demo_model_dir
from dsv4.text.tokenizer import Tokenizer
from dsv4.sampling_params import SamplingParams
from dsv4.engine.ipc import TokenOutput
from dsv4.serve.http.textstream import TextStream
from dsv4.serve.http import streaming
tok = Tokenizer.from_dir(demo_model_dir())
rng = random.Random(0)
ids = [[rng.randrange(100, 8192) for _ in range(128)] for _ in range(256)]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
head = {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion", "created": 1764590000, "model": "demo"}
best = 1e9
for rep in range(5):
    streams = [TextStream(tok, [5, 6, 7], params) for _ in range(256)]
    fmt = getattr(streaming, "ChunkFormat", None)
    chunks = [fmt(head, {"usage": None}, ("index", "text", "logprobs", "finish_reason", "stop_reason")) for _ in range(256)] if fmt else None
    t = time.thread_time()
    for step in range(128):
        for i in range(256):
            out = TokenOutput(str(i), [ids[i][step]])
            text = streams[i].push(out)
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
            if chunks:
                chunks[i].event(choice)
            else:
                streaming.sse({**head, "choices": [choice], "usage": None})
    best = min(best, (time.thread_time() - t) / (128 * 256) * 1e6)
print(sys.argv[1] if len(sys.argv) > 1 else "", f"detokenise + SSE event: {best:.2f} us per token")
