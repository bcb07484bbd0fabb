"""`dsv4 plan` refuses what `dsv4 serve` would refuse at start-up, naming the flag: a
--max-model-len the cache cannot hold for one request, or above the model's positions, and a
budget too small for one page; without --max-model-len it counts requests of what the cache
holds (dsv4/engine/context_limit.py)."""
from __future__ import annotations

import pytest

from dsv4.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--num-pages", "2", "--max-model-len", "4096"],
     r"^--num-pages: .*holds 512 tokens .* too few for one request of max_model_len 4096"),
    (["--cache-memory-gb", "0.01", "--max-num-seqs", "2", "--max-model-len", "60000", "--no-enable-prefix-caching"],
     r"^--cache-memory-gb: .*too few for one request of max_model_len 60000"),
    (["--num-pages", "400", "--max-model-len", "70000"], r"^--max-model-len: .*max_position_embeddings 65536"),
    (["--cache-memory-gb", "0.00001"], r"^--cache-memory-gb: .*cache memory budget of .* too small"),
])
def test_plan_refuses_a_setting_no_request_could_use(flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["plan", "--model", "random:tiny", *flags])


def test_plan_counts_requests_of_what_the_cache_holds(capsys):
    assert main(["plan", "--model", "random:tiny", "--num-pages", "2"]) == 0
    assert "1 request(s) of 512 tokens" in capsys.readouterr().out
