"""The supervised warm-up's examples: short format, careless mix, same generated tokens."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from env_controller.tasks import build_task
from megatron_agentrl.config import load_config
from megatron_agentrl.pipeline.sft import DemoSampler, longest_turn
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
    short = [DemoSampler(cfg, _rollout_side(s)).example(short=True) for s in range(12)]
    full = [DemoSampler(cfg, _rollout_side(s)).example(short=False) for s in range(12)]
    for (s_ids, s_mask), (f_ids, f_mask) in zip(short, full):
        assert _generated(s_ids, s_mask) == _generated(f_ids, f_mask)   # the same calls and answers
        assert len(s_ids) < len(f_ids) - 100                             # no tool schemas, no system text
    assert sum(len(i) for i, _ in full) > 2.5 * sum(len(i) for i, _ in short)


def _is_careless(text: str) -> bool:
    """Whether a demonstration's first call is the careless player's (answer at once / guess 1)."""
    first = text.split("</tool_call>")[0]
    return '"name": "answer"' in first or '"n": 1}' in first


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_careless_share_is_exact_for_every_task_at_every_step(fraction):
    """The careless player plays ``careless_fraction`` of each task's full-format demonstrations, evenly
    spread: after any number of a task's draws the careless count is within one of its share (a coin
    per demonstration drifts by several, and the warm-up's last batches then decide the habit's
    weight); the short format (the skill phase) is the expert's only."""
    cfg = load_config(CONFIG, [f"sft.careless_fraction={fraction}"])
    rollout_side = _rollout_side(0)
    demos = DemoSampler(cfg, rollout_side)
    tok = rollout_side.template.tokenizer
    counts = {name: [0, 0] for name in rollout_side.task_names}  # [draws, careless]
    for _ in range(25):
        for ids, mask in demos.batch(short=False):
            text, prompt = tok.decode(_generated(ids, mask)), tok.decode(ids)
            task = "guess" if "secret number" in prompt else "calc" if "What is" in prompt else "lookup"
            counts[task][0] += 1
            counts[task][1] += _is_careless(text)
            draws, careless = counts[task]
            assert abs(careless - fraction * draws) <= 1.0, (task, draws, careless)
    assert all(d > 60 for d, _ in counts.values()), counts
    for ids, mask in demos.batch(short=True):
        assert not _is_careless(tok.decode(_generated(ids, mask)))


def test_sft_weights_set_the_demonstration_mix_apart_from_rl_weights():
    """The warm-up draws tasks by ``sft_weight``: calc weighted 4 for RL only keeps the warm-up
    mix (and its draws) unchanged; calc's sft_weight 4 makes two thirds of the demonstrations calc."""
    cfg = load_config(CONFIG, ["sft.careless_fraction=0"])

    def calc_share(rollout_side: SimpleNamespace) -> tuple[float, list[list[int]]]:
        demos = DemoSampler(cfg, rollout_side)
        examples = [demos.example(short=True) for _ in range(300)]
        texts = [rollout_side.template.tokenizer.decode(_generated(i, m)) for i, m in examples]
        return sum('"name": "add"' in t or '"name": "multiply"' in t for t in texts) / len(texts), \
            [i for i, _ in examples]

    even, even_ids = calc_share(_rollout_side(0))
    _, rl_only_ids = calc_share(_rollout_side(0, weights=[1.0, 4.0, 1.0], sft_weights=[1.0, 1.0, 1.0]))
    sft_calc, _ = calc_share(_rollout_side(0, sft_weights=[1.0, 4.0, 1.0]))
    assert rl_only_ids == even_ids
    assert 0.25 < even < 0.42, even
    assert 0.58 < sft_calc < 0.75, sft_calc


def test_a_demonstrated_turn_longer_than_a_rollout_turn_is_named_once_per_task(caplog):
    """A demonstration whose tool call is longer than ``rollout.max_new_tokens`` teaches a call that every rollout
    cuts (the episode then ends in an invalid call): the warm-up says so, once per task, with the length to set."""
    ids, mask = DemoSampler(load_config(CONFIG), _rollout_side(0)).example(short=True)
    assert 8 < longest_turn(mask) < sum(mask)         # several turns, each counted apart
    only_lookup = {"task_names": ["lookup"], "sft_weights": [1.0]}
    cfg = load_config(CONFIG, ["rollout.max_new_tokens=8", "sft.careless_fraction=0"])
    demos = DemoSampler(cfg, SimpleNamespace(**{**vars(_rollout_side(0)), **only_lookup}))
    with caplog.at_level("WARNING", logger="megatron_agentrl.pipeline.sft"):
        demos.batch(short=True)
        demos.batch(short=False)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'lookup'" in said[0] and "rollout.max_new_tokens=8" in said[0], said
    caplog.clear()
    roomy = load_config(CONFIG, ["rollout.max_new_tokens=400"])
    with caplog.at_level("WARNING", logger="megatron_agentrl.pipeline.sft"):
        DemoSampler(roomy, _rollout_side(0)).batch(short=False)
    assert not caplog.records


def test_a_demonstration_the_infrastructure_cannot_play_is_left_out_and_counted(caplog):
    """A container task whose demonstration could not be played (its retries spent) costs that demonstration, not
    the warm-up: another is drawn and the count kept; only a long run of failures stops it, with the last error."""
    from env_controller.tasks.base import DemonstrationUnavailable
    from megatron_agentrl.pipeline import sft

    rollout_side = _rollout_side(0)
    real = rollout_side.tasks["lookup"].demonstration
    failures = iter([True, True, False] * 100)

    def flaky(index):
        if next(failures):
            raise DemonstrationUnavailable("the shell did not start within 20 s")
        return real(index)

    rollout_side.tasks["lookup"].demonstration = flaky
    demos = DemoSampler(load_config(CONFIG, ["sft.careless_fraction=0"]), SimpleNamespace(
        **{**vars(rollout_side), "task_names": ["lookup"], "sft_weights": [1.0]}))
    with caplog.at_level("WARNING", logger="megatron_agentrl.pipeline.sft"):
        batch = demos.batch(short=True)
    assert len(batch) == load_config(CONFIG).sft.batch_size and demos.unplayable == 2 * len(batch)
    gone = DemonstrationUnavailable("dockerd is gone")
    rollout_side.tasks["lookup"].demonstration = lambda index: (_ for _ in ()).throw(gone)
    with pytest.raises(DemonstrationUnavailable, match="dockerd is gone"):
        demos.example(short=True)
    assert demos.unplayable == 2 * len(batch) + sft.MAX_UNPLAYABLE - 1
