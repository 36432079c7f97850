"""Agent loop: token/mask/log-prob alignment and every way an episode ends, with a fake engine and env."""
from __future__ import annotations

import json
import time

import pytest

from env_controller.protocol import SampleStatus
from rollout_sglang.chat_template import ChatTemplate
from tests.rollout.support import ADD_TOOLS as TOOLS
from tests.rollout.support import FakeEngine, FakeEnv, _check_alignment, call, run


def test_episode_tokens_match_chat_format_and_alignment(template: ChatTemplate) -> None:
    engine, env = FakeEngine(template), FakeEnv()
    trajs = run(engine, env, template, [("calc", 0, 11), ("two", 1, 12)])
    for traj, kind in zip(trajs, ["calc", "two"]):
        assert traj.status == "completed" and traj.reward == 1.0 and traj.metrics == {"success": 1.0}
        _check_alignment(traj)
        assert traj.turn_versions == [7, 7]
        # turn t's log-probs are the engine's, in order
        for t, (s, e) in enumerate(traj.turn_spans):
            assert traj.behavior_logprobs[s:e] == [-(t + 1) - j / 1000 for j in range(e - s)]
            assert traj.token_ids[e - 1] == template.im_end_id
        # the token layout is exactly the Qwen2.5 chat render of the whole conversation
        sid = next(k for k in env.history if k.startswith(kind))
        assert template.decode(traj.token_ids) + "\n" == template.render_text(env.history[sid], TOOLS)
        assert set(traj.timings) >= {"generate_s", "env_s"}
    assert engine.batch_sizes == [2, 2]
    calc_msgs = env.received["calc-0-1"]
    assert calc_msgs[0]["content"] == "Let me add."
    assert calc_msgs[0]["tool_calls"][0]["id"] == "call_0"
    assert json.loads(calc_msgs[0]["tool_calls"][0]["function"]["arguments"]) == {"a": 40, "b": 2}
    assert calc_msgs[1] == {"role": "assistant", "content": "The answer is 42."}  # final answer: no tool_calls
    assert [c["id"] for c in env.received["two-1-2"][0]["tool_calls"]] == ["call_0", "call_1"]
    assert trajs[0].group_id == 11 and trajs[1].index == 1 and not env.cancelled


def test_validation_failures_end_episode_and_cancel(template: ChatTemplate, caplog: pytest.LogCaptureFixture) -> None:
    engine, env = FakeEngine(template), FakeEnv()
    trajs = run(engine, env, template, [("malformed", 0, 0), ("unknown", 0, 0), ("calc", 0, 0)])
    for t in trajs[:2]:
        assert t.status == SampleStatus.AGENT_VALIDATION_FAILED.value
        assert t.reward == 0.0 and t.metrics["validation_error"] == 1.0
        _check_alignment(t)
        assert t.num_turns == 1 and t.num_generated > 0  # the bad turn stays in the trajectory
    assert trajs[2].status == "completed"
    assert sorted(env.cancelled) == ["malformed-0-1", "unknown-0-2"]
    assert "not valid JSON" in trajs[0].error and "unknown tool 'delete_all'" in trajs[1].error
    assert trajs[2].error == ""
    assert engine.batch_sizes == [3, 1]


def test_max_turns_gives_task_limit(template: ChatTemplate) -> None:
    engine, env = FakeEngine(template), FakeEnv()
    (t,) = run(engine, env, template, [("forever", 0, 0)], max_turns=3)
    assert t.status == "task limit reached" and t.num_turns == 3
    assert env.cancelled == ["forever-0-1"]
    _check_alignment(t)
    assert t.token_ids[-1] == template.im_end_id  # the last env reply is not appended


def test_context_limit_cuts_the_turn(template: ChatTemplate) -> None:
    engine, env = FakeEngine(template), FakeEnv()
    prompt_len = len(template.encode_prompt(
        [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Solve the task EP=chatty."}],
        TOOLS,
    ))
    (t,) = run(engine, env, template, [("chatty", 0, 0)], max_total_tokens=prompt_len + 5)
    assert t.status == "agent context limit" and len(t.token_ids) == prompt_len + 5
    assert engine.max_new_tokens_seen == [5] and t.num_generated == 5
    assert env.cancelled == ["chatty-0-1"] and env.received["chatty-0-1"] == []
    _check_alignment(t)


def test_context_limit_on_env_reply(template: ChatTemplate) -> None:
    engine, env = FakeEngine(template), FakeEnv(tool_output="{result} " + "padding " * 200)
    (t,) = run(engine, env, template, [("verbose_env", 0, 0)], max_total_tokens=600)
    assert t.status == "agent context limit" and len(t.token_ids) <= 600
    assert env.cancelled == ["verbose_env-0-1"]
    _check_alignment(t)


def test_length_cut_turn_is_parsed_and_closed(template: ChatTemplate) -> None:
    engine, env = FakeEngine(template), FakeEnv()
    n_call = len(template.tokenizer.encode(call(3, 4), add_special_tokens=False))
    (t,) = run(engine, env, template, [("cut", 0, 0)], max_new_tokens=n_call + 3)
    assert t.status == "completed" and t.reward == 1.0
    _check_alignment(t)
    s, e = t.turn_spans[0]
    assert e - s == n_call + 3 and t.token_ids[e - 1] != template.im_end_id
    # the cut turn is closed by an <|im_end|> that the policy did not generate (mask 0)
    assert t.token_ids[e] == template.im_end_id and t.loss_mask[e] == 0
    msg = env.received["cut-0-1"][0]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 3, "b": 4}
    assert msg["content"].startswith("and then")


def test_env_errors_and_timeouts_are_task_errors(template: ChatTemplate) -> None:
    engine, env = FakeEngine(template), FakeEnv()
    t0 = time.perf_counter()
    trajs = run(engine, env, template, [("raises", 0, 0), ("hangs", 0, 0), ("calc", 0, 0), ("nostart", 0, 0)],
                timeout=0.3)
    assert time.perf_counter() - t0 < 5
    assert [t.status for t in trajs] == ["task error", "task error", "completed", "task error"]
    assert sorted(env.cancelled) == ["hangs-0-2", "raises-0-1"]
    assert trajs[3].token_ids == [] and trajs[3].versions == []
    assert trajs[1].timings["env_s"] >= 0.3
    for t in trajs:
        _check_alignment(t)


def test_a_hostile_env_reply_costs_only_its_episode(template: ChatTemplate) -> None:
    """A worker's reply the template cannot render (whatever the exception) ends that episode with a task
    error and cancels its session; the other episodes of the batch complete."""
    class HostileEnv(FakeEnv):
        async def start_sample(self, task, index):
            sid, reply = await super().start_sample(task, index)
            if index == 1:
                reply.messages.append(None)  # the template's .get on it raises AttributeError
            return sid, reply

        async def interact(self, session_id, messages):
            reply = await super().interact(session_id, messages)
            if session_id.endswith("-0-1"):
                reply.messages = [["not", "a", "message"]]
            return reply

    engine, env = FakeEngine(template), HostileEnv()
    trajs = run(engine, env, template, [("calc", 0, 0), ("calc", 1, 0), ("calc", 2, 0)])
    assert [t.status for t in trajs] == ["task error", "task error", "completed"]
    assert "cannot render the env reply" in trajs[0].error and "cannot render the first messages" in trajs[1].error
    assert sorted(env.cancelled) == ["calc-0-1", "calc-1-2"]
    for t in trajs:
        _check_alignment(t)


def test_engine_failure_cancels_sessions_and_raises(template: ChatTemplate) -> None:
    class Broken(FakeEngine):
        async def generate(self, prompts, params, seeds=None):
            raise RuntimeError("engine died")

    env = FakeEnv()
    with pytest.raises(RuntimeError, match="engine died"):
        run(Broken(template), env, template, [("calc", 0, 0), ("calc", 1, 0)])
    assert sorted(env.cancelled) == ["calc-0-1", "calc-1-2"]


def test_with_local_engine_end_to_end(template: ChatTemplate) -> None:
    """A random tiny Qwen2 behind the loop: valid trajectories whose log-probs re-score exactly."""
    import torch
    from transformers import Qwen2Config

    from rollout_sglang.engines.local import LocalEngine

    cfg = Qwen2Config(vocab_size=len(template.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    engine = LocalEngine.from_config(cfg, init_seed=0, version=2)
    env = FakeEnv()
    trajs = run(engine, env, template, [("calc", i, 0) for i in range(3)], max_turns=2, max_new_tokens=12)
    allowed = {"completed", "agent validation failed", "task limit reached", "agent context limit"}
    for t in trajs:
        assert t.status in allowed
        assert len(t.loss_mask) == len(t.behavior_logprobs) == len(t.token_ids)
        assert t.sampled_versions and set(t.sampled_versions) == {2}
        with torch.no_grad():
            logits = engine.model(torch.tensor([t.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        for s, e in t.turn_spans:
            ref = logp[s - 1 : e - 1].gather(-1, torch.tensor(t.token_ids[s:e])[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(t.behavior_logprobs[s:e]), ref, atol=1e-5, rtol=0)
            assert all(m == 1 for m in t.loss_mask[s:e])
