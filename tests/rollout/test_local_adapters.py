"""The local engine serves weight versions as LoRA adapters on one base: per row, unmerged, equal to PEFT."""
from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from rollout_sglang.engines.adapter import Adapter
from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams
from tests.support.peft_adapters import as_adapter, random_peft
from tests.support.tiny_models import tiny_qwen2_config

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(tiny_qwen2_config()).eval()
    one = random_peft(base, 1, ["q_proj", "k_proj", "v_proj", "o_proj"])
    two = random_peft(base, 2, ["gate_proj", "up_proj", "down_proj", "q_proj"], rank=2, alpha=3.0)
    return base, one, two


def _greedy(engine, prompts, adapters, n=6):
    params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=7)
    return asyncio.run(engine.generate(prompts, params, adapters=adapters))


def test_rows_follow_their_adapter_as_peft_computes_it(setup):
    """Rows of one batch on different adapters (and the base) sample what the base, or PEFT's model, samples alone:
    same tokens, log-probs within 1e-5, each row stamped with its adapter's version."""
    base, one, two = setup
    engine = LocalEngine(copy.deepcopy(base), seed=0)
    engine.load_adapter(as_adapter(one, 3))
    engine.load_adapter(as_adapter(two, 4))
    prompts = [[5, 9, 11, 3], [7, 7, 1], [2, 4, 6, 8, 10], [12, 1]]
    mixed = _greedy(engine, prompts, ["v3", None, "v4", "v3"])
    for i, (name, model) in enumerate([("v3", one), (None, base), ("v4", two), ("v3", one)]):
        alone = LocalEngine(copy.deepcopy(model).merge_and_unload() if name else copy.deepcopy(model), seed=0)
        # compare the log-probs of the tokens the mixed call sampled with the merged model's, by teacher forcing
        got = mixed[i]
        assert got.version == (3 if name == "v3" else 4 if name == "v4" else 0)
        full = torch.tensor([prompts[i] + got.token_ids])
        with torch.no_grad():
            logits = alone.model(full).logits[0, len(prompts[i]) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(got.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got.logprobs), want, atol=1e-5), (i, got.logprobs, want)


def test_adapter_output_equals_peft_unmerged(setup):
    """The engine's adapted forward equals PEFT's own (unmerged) forward within 1e-5."""
    base, one, _ = setup
    engine = LocalEngine(copy.deepcopy(base), seed=0)
    engine.load_adapter(as_adapter(one, 1))
    ids = torch.tensor([[5, 9, 11, 3, 7, 2]])
    with torch.no_grad(), engine._adapters.assign(["v1"]):
        ours = engine.model(ids).logits
    with torch.no_grad():
        theirs = one(ids).logits
        plain = base(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert not torch.allclose(ours, plain, atol=1e-3)


def test_unknown_and_misfit_adapters_are_refused(setup):
    base, one, _ = setup
    engine = LocalEngine(copy.deepcopy(base), seed=0)
    with pytest.raises(KeyError, match="'v9' is not loaded"):
        _greedy(engine, [[1, 2]], ["v9"])
    a = as_adapter(one, 1)
    engine.load_adapter(a)
    with pytest.raises(ValueError, match="loaded already"):
        engine.load_adapter(a)
    bad = Adapter(2, a.config, {k: (v[:, :-1] if k.endswith("lora_A.weight") else v) for k, v in a.tensors.items()})
    with pytest.raises(ValueError, match=r"A must be \[r, 32\]"):
        engine.load_adapter(bad)
    wrong = Adapter(3, a.config, {k.replace("q_proj", "qq_proj"): v for k, v in a.tensors.items()})
    with pytest.raises(ValueError, match="no linear layer"):
        engine.load_adapter(wrong)
    with pytest.raises(ValueError, match="2 names for 1 prompts"):
        _greedy(engine, [[1, 2]], ["v1", None])
    engine.unload_adapter("v1")
    assert engine.adapters == []
    with pytest.raises(KeyError, match="no adapter 'v1'"):
        engine.unload_adapter("v1")


def test_batching_merges_calls_of_different_adapters(setup, tmp_path):
    """Concurrent calls on different adapters share a batch (the engine takes them into one loop); each keeps its
    own adapter's tokens.
    An adapter written in PEFT's format and read back serves the same."""
    base, one, two = setup
    engine = LocalEngine(copy.deepcopy(base), seed=0)
    engine.load_adapter(Adapter.load(as_adapter(one, 1).save(tmp_path / "v1").path, 1))
    engine.load_adapter(as_adapter(two, 2))
    wrapped = BatchingEngine(engine)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)

    async def both():
        return await asyncio.gather(wrapped.generate([[3, 4, 5]], params, adapters=["v1"]),
                                    wrapped.generate([[3, 4, 5]], params, adapters=["v2"]),
                                    wrapped.generate([[3, 4, 5]], params))

    a, b, c = asyncio.run(both())
    alone = {n: asyncio.run(engine.generate([[3, 4, 5]], params, adapters=[n]))[0] for n in ("v1", "v2", None)}
    assert (a[0].token_ids, b[0].token_ids, c[0].token_ids) == tuple(alone[n].token_ids for n in ("v1", "v2", None))
    assert (a[0].version, b[0].version, c[0].version) == (1, 2, 0)
    assert wrapped.calls <= 3 and wrapped.merged_calls == 3
