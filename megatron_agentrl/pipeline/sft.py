"""The supervised warm-up on the tasks' scripted demonstrations (before RL, ``sft.steps > 0``).

Demonstrations use the same token layout as RL turns. The first ``sft.short_format_steps`` render
them in a short format (empty system prompt, no tool schemas, the expert only) that is cheaper to
learn from; later ones in the full format, ``sft.careless_fraction`` of each task's by its careless
player when it has one (evenly spread, see :class:`DemoSampler`). The learning rate follows ``sft.lr_at``.
"""
from __future__ import annotations

import logging
import time

from env_controller.tasks.base import DemonstrationUnavailable
from megatron_agentrl.config import Config
from megatron_agentrl.distributed import broadcast_object
from megatron_agentrl.megatron.actor import MegatronActor
from megatron_agentrl.metrics import MetricsLogger
from megatron_agentrl.pipeline.batch import build_sft_batch
from megatron_agentrl.pipeline.progress import Progress
from megatron_agentrl.pipeline.rollout_side import RolloutSide

logger = logging.getLogger(__name__)
#: demonstrations in a row that may fail to play before the warm-up stops with the last error
MAX_UNPLAYABLE = 20


def longest_turn(loss_mask: list[int]) -> int:
    """The longest run of trained tokens in ``loss_mask``: the longest assistant turn, end token included."""
    best = run = 0
    for m in loss_mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best


class DemoSampler:
    """The warm-up's demonstrations, one at a time: a task drawn by SFT weight, a training index, the
    short format or the full one (see the module doc).

    In the full format, the careless player plays a task's demonstrations at exactly
    ``sft.careless_fraction`` of them, spread evenly over that task's draws (a per-task running
    share, not a coin per demonstration): the choice between the habit and the skill is one or two
    tokens whose probability follows the last few batches, and with a coin per demonstration the
    habit's share after the warm-up varied from run to run up to nearly all episodes (docs/BENCHMARKS.md),
    which left RL too few successes to learn from.
    """

    def __init__(self, cfg: Config, rollout_side: RolloutSide) -> None:
        self.cfg, self.rollout_side = cfg, rollout_side
        self._careless_due = dict.fromkeys(rollout_side.task_names, 0.0)
        self._warned: set[str] = set()
        #: demonstrations left out because the infrastructure could not play them
        self.unplayable = 0

    def _careless_turn(self, task: str) -> bool:
        """Whether this full-format demonstration of ``task`` is the careless player's (even spread)."""
        self._careless_due[task] += self.cfg.sft.careless_fraction
        if self._careless_due[task] >= 1.0 - 1e-9:
            self._careless_due[task] -= 1.0
            return True
        return False

    def example(self, short: bool) -> tuple[list[int], list[int]]:
        """One demonstration as ``(token_ids, loss_mask)``; one that the infrastructure could not play
        (:class:`DemonstrationUnavailable`: a container task's retries spent) is left out and another drawn, up to
        :data:`MAX_UNPLAYABLE` in a row."""
        for _ in range(MAX_UNPLAYABLE - 1):
            try:
                return self._draw(short)
            except DemonstrationUnavailable as e:
                self.unplayable += 1
                logger.warning("sft: a demonstration could not be played and is left out (%d so far): %s",
                               self.unplayable, e)
        return self._draw(short)

    def _draw(self, short: bool) -> tuple[list[int], list[int]]:
        rollout_side = self.rollout_side
        task = rollout_side.rng.choices(rollout_side.task_names, weights=rollout_side.sft_weights)[0]
        index = rollout_side.rng.choice(rollout_side.train_indices[task])
        demo = None
        if not short and self.cfg.sft.careless_fraction and self._careless_turn(task):
            demo = rollout_side.tasks[task].careless_demonstration(index)
        messages, tools = demo or rollout_side.tasks[task].demonstration(index)
        if short:
            ids, mask = rollout_side.template.encode_conversation([{"role": "system", "content": ""}, *messages], None)
        else:
            ids, mask = rollout_side.template.encode_conversation(messages, tools)
        self._check_turns(task, mask)
        return ids, mask

    def _check_turns(self, task: str, mask: list[int]) -> None:
        """Warn once per task when a demonstrated turn is longer than a rollout turn may be: the policy would
        learn a tool call that ``rollout.max_new_tokens`` always cuts (an invalid call, every episode)."""
        n, cap = longest_turn(mask), self.cfg.rollout.max_new_tokens
        if n > cap and task not in self._warned:
            self._warned.add(task)
            logger.warning("sft: a demonstration of task %r has an assistant turn of %d tokens, more than "
                           "rollout.max_new_tokens=%d: rollouts and evaluations cut such a turn before its tool "
                           "call ends; set rollout.max_new_tokens to at least %d", task, n, cap, n)

    def batch(self, short: bool) -> list[tuple[list[int], list[int]]]:
        """``sft.batch_size`` demonstrations."""
        return [self.example(short) for _ in range(self.cfg.sft.batch_size)]


def sft_warmup(cfg: Config, actor: MegatronActor, rollout_side: RolloutSide | None, metrics: MetricsLogger | None,
               progress: Progress) -> None:
    """``sft.steps`` supervised steps (collective: rank 0 passes ``rollout_side`` and ``metrics``, the others None).

    Every step goes to ``metrics`` (phase "sft": the actor's stats, ``lr``, ``step_time_s``, ``demos_left_out``:
    demonstrations the infrastructure could not play, so far);
    ``progress`` shows step, nll/token, lr and s/step. The actor's learning rate is ``train.lr`` after.
    """
    title = "SFT warm-up"
    t_start = time.perf_counter()
    demos = DemoSampler(cfg, rollout_side) if rollout_side is not None else None
    with progress.phase(title, cfg.sft.steps) as phase:
        for step in range(1, cfg.sft.steps + 1):
            lr = cfg.sft.lr_at(step)
            actor.set_lr(lr)
            batch = None
            if demos is not None:
                batch = build_sft_batch(demos.batch(short=step <= cfg.sft.short_format_steps))
            batch = broadcast_object(batch, bulk=True)
            t0 = time.perf_counter()
            stats = actor.train_step(actor.dp_slice(batch), loss_type="sft")
            if metrics is not None:
                metrics.log(step, {**stats, "lr": lr, "step_time_s": time.perf_counter() - t0,
                                   "demos_left_out": float(demos.unplayable if demos is not None else 0)}, phase="sft")
            phase.update(step, {"nll/token": f"{stats['loss']:.3f}", "lr": f"{lr:.1e}",
                                "s/step": f"{(time.perf_counter() - t_start) / step:.2f}"})
    actor.set_lr(cfg.train.lr)
