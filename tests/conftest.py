"""Shared fixtures: random tiny V4 checkpoints written once per session, and logits of
dsv4 and of the transformers oracle for a checkpoint folder."""
from __future__ import annotations

import json
import os
from typing import NamedTuple

# Triton's interpreter on the CPU (tests/ops_triton; `DSV4_TRITON_DEVICE=cuda` on a GPU): the flag
# must be set before any module defines a @triton.jit kernel, and collection imports the test
# modules of every directory (some import dsv4.ops.triton) before tests/ops_triton's conftest
if os.environ.get("DSV4_TRITON_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch


# folders whose modules each run on one xdist worker: their module-scoped fixtures (engines,
# one-process reference runs, rank processes, server clusters) are then built once, not once on
# each worker that the module's tests happen to be sent to
ONE_WORKER_PER_MODULE = ("tests/engine/", "tests/disagg/", "tests/parallel/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (--dist load): as load, tests shared out one by one, but a module of
    ONE_WORKER_PER_MODULE is one unit of work."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAsUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.startswith(ONE_WORKER_PER_MODULE) else nodeid

    return ModulesAsUnits(config, log)


class Checkpoint(NamedTuple):
    path: str
    cfg: object      # dsv4.config.ModelConfig as written (before quantisation)
    state: dict      # canonical name -> fp32 tensor (experts stacked), MTP included


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(layers=None, names="deepseek", quant=None, seed=0,
    max_shard_bytes=2 GiB, **config_overrides)` -> Checkpoint, written once per argument set.
    The random state does not depend on `names`/`quant`/sharding, so the same arguments
    otherwise give the same weights in every format."""
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint

    written: dict[str, Checkpoint] = {}

    def make(layers=None, names="deepseek", quant=None, seed=0, max_shard_bytes=2 << 30, **overrides):
        key = json.dumps([layers, names, quant, seed, max_shard_bytes, overrides], sort_keys=True)
        if key not in written:
            cfg = preset_config("tiny", layers, **overrides)
            state = random_state(cfg, seed=seed, with_mtp=True)
            path = str(tmp_path_factory.mktemp("ckpt"))
            save_checkpoint(cfg, state, path, names=names, quant=quant, max_shard_bytes=max_shard_bytes)
            written[key] = Checkpoint(path, cfg, state)
        return written[key]

    return make


def random_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def our_logits():
    """our_logits(path, ids) -> fp32 [len, vocab]: dsv4's loader + one paged prefill."""
    from dsv4.engine.oneshot import full_logits
    from dsv4.model.weights import load_model

    return lambda path, ids: full_logits(load_model(path), ids)


@pytest.fixture(scope="session")
def reference_logits():
    """reference_logits(path, ids) -> fp32 [len, vocab] from transformers'
    DeepseekV4ForCausalLM (uncached full-sequence forward)."""
    from dsv4.model.reference import load_reference

    def run(path, ids):
        with torch.no_grad():
            return load_reference(path)(torch.tensor([ids]), use_cache=False).logits[0].float()

    return run


@pytest.fixture(scope="session")
def ids_for():
    """ids_for(cfg, length, seed=0) -> random token ids in the config's vocabulary."""
    return lambda cfg, length, seed=0: random_ids(cfg.vocab_size, length, seed)
