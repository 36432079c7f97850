"""On-policy distillation's teacher scoring on the rollout side: every sampled token gets its task's teacher's
log-prob, a teacher engine that fails or stalls is routed around, and an episode no engine could score is an
infrastructure failure that the rollout manager re-runs or leaves out, never trained without a score."""
from __future__ import annotations

import asyncio

import pytest

from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.distill.options import DistillOptions, TeacherSpec
from rollout_sglang.distill.scorer import TeacherScorer
from rollout_sglang.rollout.manager import PromptSampler, RolloutError, RolloutManager
from rollout_sglang.trajectory import TEACHER_ERROR, Trajectory
from tests.rollout.test_rollout_infra import SIZE, FlakyEnv, OkEngine
from tests.rollout.test_rollout_infra import _options as rollout_options


def _traj(task: str, tokens: list[int], mask: list[int]) -> Trajectory:
    return Trajectory(token_ids=tokens, loss_mask=mask, behavior_logprobs=[-0.5 * m for m in mask],
                      versions=[0 if m else -1 for m in mask], turn_spans=[], task=task, index=0, group_id=0,
                      status="completed")


class Teacher:
    """Scores position i of a sequence as -(token id) / 100 - i / 1000; ``fail`` calls raise first, ``stall`` calls
    hang first; records the starts it was given."""

    def __init__(self, fail: int = 0, stall: int = 0, answer=None) -> None:
        self.fail, self.stall, self.answer, self.calls, self.starts = fail, stall, answer, 0, []

    async def score(self, sequences, starts=None):
        self.calls += 1
        self.starts.append(list(starts))
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("teacher server gone")
        if self.stall > 0:
            self.stall -= 1
            await asyncio.sleep(60)
        if self.answer is not None:
            return self.answer
        return [[0.0 if i < s else -t / 100 - i / 1000 for i, t in enumerate(seq)] for seq, s in zip(sequences, starts)]


def _options(**kw) -> DistillOptions:
    return DistillOptions(teachers=[TeacherSpec(checkpoint="/t")], **kw)


def test_each_sampled_token_gets_its_tasks_teachers_logprob_and_context_tokens_none():
    a, b = Teacher(), Teacher()
    scorer = TeacherScorer([[a], [b]], {"calc": 0, "guess": 1}, _options())
    calc = _traj("calc", [5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1])  # prompt, a turn, an env reply, a turn
    guess = _traj("guess", [3, 4, 5], [0, 1, 1])
    failed = _traj("calc", [1, 2], [0, 1])
    failed.status = "task error"
    asyncio.run(scorer([calc, guess, failed]))
    assert calc.teacher_logprobs == pytest.approx([0.0, 0.0, -0.072, -0.083, 0.0, -0.105])
    assert guess.teacher_logprobs == pytest.approx([0.0, -0.041, -0.052])
    assert failed.teacher_logprobs is None and a.calls == b.calls == 1  # an infra failure is not scored
    assert a.starts == [[2]] and b.starts == [[1]]  # scoring starts at the first sampled token
    assert calc.timings["teacher_score_s"] >= 0 and scorer.stats["episodes"] == 2


def test_a_failing_or_stalled_engine_is_routed_around():
    down, stalled, up = Teacher(fail=5), Teacher(stall=5), Teacher()
    scorer = TeacherScorer([[down, stalled, up]], {"calc": 0}, _options(score_timeout_s=0.2, max_attempts=3))
    t = _traj("calc", [1, 2, 3], [0, 1, 1])
    asyncio.run(scorer([t]))
    assert t.teacher_logprobs is not None and t.status == "completed"
    assert scorer.stats["failures"] == 2 and (down.calls, stalled.calls, up.calls) == (1, 1, 1)


@pytest.mark.parametrize("answer, why", [
    ([[0.0, -1.0]], "scored 2 positions of sequence 0, which has 3"),
    ([[0.0, 0.5, -1.0]], "log-prob of 0.5"),
    ([[0.0, float("nan"), -1.0]], "log-prob of nan"),
    ([], "of length 0 for 1 sequences"),
])
def test_an_episode_no_engine_could_score_is_an_infra_failure_naming_why(answer, why):
    scorer = TeacherScorer([[Teacher(answer=answer)]], {"calc": 0}, _options(max_attempts=2))
    t = _traj("calc", [1, 2, 3], [0, 1, 1])
    asyncio.run(scorer([t]))
    assert t.status == TEACHER_ERROR and t.infra_failed and t.teacher_logprobs is None
    assert "2 attempts" in t.error and why in t.error, t.error


def test_the_manager_never_queues_an_unscored_episode(template: ChatTemplate):
    """A teacher whose every other call fails: each group's first scoring fails, the group is re-run (infra retried)
    and queued only once scored; a teacher that never answers drops the groups, and the run fails saying why."""
    class Flaky(Teacher):
        n = 0

        async def score(self, sequences, starts=None):
            self.n += 1
            if self.n % 2:  # every other call fails: a group is scored on its second try
                raise ConnectionError("teacher server gone")
            return await Teacher.score(self, sequences, starts)

    scorer = TeacherScorer([[Flaky()]], {"t": 0}, _options(max_attempts=1))
    sampler = PromptSampler(["t"], [1.0], {"t": [0]}, SIZE, seed=0)
    engine = OkEngine(template)
    mgr = RolloutManager(engine, FlakyEnv(), template, sampler, _options_mgr(template, 3), score=scorer)
    mgr.start()
    batches = []
    try:
        for version in range(3):
            batches.append(mgr.get_batch(timeout_s=30))
            engine.version = version + 1  # the step's weights, then the next groups
            mgr.set_version(version + 1)
    finally:
        mgr.stop(timeout_s=10)
    for batch in batches:
        for g in batch:
            assert all(t.teacher_logprobs is not None and not t.infra_failed for t in g.trajectories)
    assert mgr.stats.infra_retried >= 3 and scorer.stats["unscored"] >= 3 * SIZE

    never = TeacherScorer([[Teacher(fail=10 ** 6)]], {"t": 0}, _options(max_attempts=1))
    mgr = RolloutManager(OkEngine(template), FlakyEnv(), template, sampler,
                         rollout_options(template, total_groups=3, max_dropped_in_row=2), score=never)
    mgr.start()
    try:
        with pytest.raises(RolloutError, match="teacher error"):
            mgr.get_batch(timeout_s=30)
    finally:
        mgr.stop(timeout_s=10)


def _options_mgr(template: ChatTemplate, total: int):
    """The rollout options of test_rollout_infra: one group per batch, ``total`` groups in all."""
    return rollout_options(template, total_groups=total)


def test_a_teacher_per_task_and_every_task_covered():
    two = DistillOptions(teachers=[TeacherSpec(checkpoint="/a", tasks=["calc"]), TeacherSpec(checkpoint="/b")])
    assert two.teacher_of(["calc", "guess", "lookup"]) == {"calc": 0, "guess": 1, "lookup": 1}
    with pytest.raises(ValueError, match="task 'guess' has no teacher"):
        DistillOptions(teachers=[TeacherSpec(checkpoint="/a", tasks=["calc"])]).teacher_of(["calc", "guess"])
    with pytest.raises(ValueError, match="both name task 'calc'"):
        DistillOptions(teachers=[TeacherSpec(checkpoint="/a", tasks=["calc"]),
                                 TeacherSpec(checkpoint="/b", tasks=["calc"])]).teacher_of(["calc"])


def test_teacher_logprobs_equal_a_direct_forward_of_the_teacher_on_a_multi_turn_tool_episode(template, taught_engine):
    """A calc episode played through the agent loop (a tool call, the env's reply, the answer) scored by a local
    teacher: every sampled token's log-prob equals the teacher model's own forward over the whole episode within
    1e-5 (fp32); the prompt and the env's reply are context, never scored."""
    import torch
    from transformers import Qwen2Config

    from rollout_sglang.engines.local import LocalEngine
    from tests.rollout.support import FakeEnv, run

    (traj,) = run(taught_engine, FakeEnv(), template, [("calc", 0, 0)])
    first, last = traj.loss_mask.index(1), len(traj.loss_mask) - traj.loss_mask[::-1].index(1)
    assert traj.num_turns >= 2 and 0 in traj.loss_mask[first:last], "a multi-turn episode with an env reply inside"
    cfg = Qwen2Config(vocab_size=taught_engine.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.2)
    teacher = LocalEngine.from_config(cfg, init_seed=7)
    asyncio.run(TeacherScorer([[teacher]], {"calc": 0}, _options())([traj]))
    with torch.no_grad():
        logits = teacher.model(torch.tensor([traj.token_ids])).logits.float()
    direct = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(traj.token_ids[1:])[:, None])[:, 0]
    for i, (lp, m) in enumerate(zip(traj.teacher_logprobs, traj.loss_mask)):
        if m:
            assert abs(lp - float(direct[i - 1])) < 1e-5, (i, lp, float(direct[i - 1]))
        else:
            assert lp == 0.0
