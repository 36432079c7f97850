"""The supervised warm-up's examples: short format, careless mix, same generated tokens."""
from __future__ import annotations

import random
from types import SimpleNamespace

from env_controller.tasks import build_task
from megatron_agentrl.config import load_config
from megatron_agentrl.pipeline.sft import sft_example
from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.tokenizer import load_tokenizer

CONFIG = "tests/configs/tiny_test.yaml"


def _rollout_side(seed: int, weights: list[float] | None = None, sft_weights: list[float] | None = None
                  ) -> SimpleNamespace:
    names = ["lookup", "calc", "guess"]
    tok = load_tokenizer("examples/tokenizer/tiny_agent")
    return SimpleNamespace(rng=random.Random(seed), task_names=names, weights=weights or [1.0] * 3,
                           sft_weights=sft_weights or weights or [1.0] * 3,
                           train_indices={n: list(range(100)) for n in names},
                           tasks={n: build_task(n) for n in names}, template=ChatTemplate(tok))


def _generated(ids: list[int], mask: list[int]) -> list[int]:
    return [t for t, m in zip(ids, mask) if m]


def test_short_format_trains_the_same_generated_tokens_on_shorter_sequences():
    cfg = load_config(CONFIG, ["sft.careless_fraction=0"])
    short = [sft_example(cfg, _rollout_side(s), short=True) for s in range(12)]
    full = [sft_example(cfg, _rollout_side(s), short=False) for s in range(12)]
    for (s_ids, s_mask), (f_ids, f_mask) in zip(short, full):
        assert _generated(s_ids, s_mask) == _generated(f_ids, f_mask)   # the same calls and answers
        assert len(s_ids) < len(f_ids) - 100                             # no tool schemas, no system text
    assert sum(len(i) for i, _ in full) > 2.5 * sum(len(i) for i, _ in short)


def test_careless_fraction_mixes_careless_episodes():
    """With careless_fraction 0.5, about half of the full-format lookup/calc demonstrations answer
    without the tool; the short-format ones (the skill phase) are all the expert's."""
    cfg = load_config(CONFIG, ["sft.careless_fraction=0.5"])
    ro = _rollout_side(0)
    tok = ro.template.tokenizer
    first_calls = []
    for _ in range(300):
        ids, mask = sft_example(cfg, ro, short=False)
        text = tok.decode(_generated(ids, mask))
        if '"name": "guess"' not in text:
            first_calls.append('"name": "answer"' in text.split("</tool_call>")[0])
    share = sum(first_calls) / len(first_calls)
    assert 0.35 < share < 0.65, share
    for _ in range(60):
        ids, mask = sft_example(cfg, ro, short=True)
        text = tok.decode(_generated(ids, mask))
        assert '"name": "guess"' in text or '"name": "answer"' not in text.split("</tool_call>")[0]


def test_sft_weights_set_the_demonstration_mix_apart_from_rl_weights():
    """The warm-up draws tasks by ``sft_weight``: calc weighted 4 for RL only keeps the warm-up
    mix (and its draws) unchanged; calc's sft_weight 4 makes two thirds of the demonstrations calc."""
    cfg = load_config(CONFIG, ["sft.careless_fraction=0"])

    def calc_share(ro: SimpleNamespace) -> tuple[float, list[list[int]]]:
        examples = [sft_example(cfg, ro, short=True) for _ in range(300)]
        texts = [ro.template.tokenizer.decode(_generated(i, m)) for i, m in examples]
        return sum('"name": "add"' in t or '"name": "multiply"' in t for t in texts) / len(texts), \
            [i for i, _ in examples]

    even, even_ids = calc_share(_rollout_side(0))
    _, rl_only_ids = calc_share(_rollout_side(0, weights=[1.0, 4.0, 1.0], sft_weights=[1.0, 1.0, 1.0]))
    sft_calc, _ = calc_share(_rollout_side(0, sft_weights=[1.0, 4.0, 1.0]))
    assert rl_only_ids == even_ids
    assert 0.25 < even < 0.42, even
    assert 0.58 < sft_calc < 0.75, sft_calc
