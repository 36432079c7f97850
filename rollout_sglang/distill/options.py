"""The ``distill:`` section: teachers that score the student's sampled tokens, and how their signal is weighed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from env_controller.options import Options


@dataclass
class TeacherSpec(Options):
    """One teacher: a Hugging Face checkpoint scored in process, or SGLang servers that serve it; the tasks whose
    trajectories it scores."""

    KEY: ClassVar[str] = "distill.teachers"

    #: a Hugging Face checkpoint directory, loaded into a local engine on the rollout rank (small teachers, CPU
    #: runs); exclusive with ``engine_urls``
    checkpoint: str | None = None
    #: SGLang servers already serving the teacher (``http(s)://host:port``); each trajectory is scored by one of
    #: them, another one after a failure
    engine_urls: list[str] = field(default_factory=list)
    #: the teacher's tokenizer, compared with the student's at the start (default: ``checkpoint``; needed with
    #: ``engine_urls``)
    tokenizer: str | None = None
    #: the tasks this teacher scores (empty: every task that no other teacher names)
    tasks: list[str] = field(default_factory=list)

    def check(self) -> None:
        """One source of the teacher, and a tokenizer to compare."""
        super().check()
        self.require((self.checkpoint is None) != (not self.engine_urls), "checkpoint",
                     "and engine_urls: give exactly one (a Hugging Face directory, or the SGLang servers of the "
                     "teacher)")
        for u in self.engine_urls:
            self.require(isinstance(u, str) and u.startswith(("http://", "https://")), "engine_urls",
                         f"has {u!r}; each must be an http(s)://host:port URL")
        self.require(self.checkpoint is not None or bool(self.tokenizer), "tokenizer",
                     "is needed with engine_urls: the teacher's tokenizer directory, checked equal to the student's")

    @property
    def tokenizer_path(self) -> str:
        """The directory of the teacher's tokenizer."""
        return str(self.tokenizer or self.checkpoint)

    @property
    def name(self) -> str:
        """How messages name the teacher."""
        return str(self.checkpoint) if self.checkpoint else ",".join(self.engine_urls)


@dataclass
class DistillOptions(Options):
    """On-policy distillation (docs/training.md, "On-policy distillation"): each token the student sampled gets
    its task's teacher's log-prob in the same context, and ``coef * (log p_teacher - log p_behavior)`` joins its
    advantage. Off while ``teachers`` is empty."""

    KEY: ClassVar[str] = "distill"

    #: the teachers; each task is scored by exactly one
    teachers: list[TeacherSpec] = field(default_factory=list)
    #: weight of the per-token signal ``log p_teacher - log p_behavior`` in each token's advantage
    coef: float = 1.0
    #: weight of the task reward's advantage (group advantage, normalized per task as in RL); 0: the teacher's
    #: signal alone (pure distillation)
    reward_coef: float = 0.0
    #: the per-token signal is cut to ``[-signal_clip, signal_clip]`` before it is weighed (0: not cut): a few
    #: tokens the teacher finds far less likely than the student does (log-ratios of -10) would otherwise make most
    #: of a step's gradient
    signal_clip: float = 0.0
    #: limit on scoring one batch of trajectories with one teacher engine, seconds
    score_timeout_s: float = 300.0
    #: tries to score a batch of trajectories, over the teacher's engines in turn; after the last, its episodes
    #: are infrastructure failures (re-run or left out, never trained)
    max_attempts: int = 3

    def check(self) -> None:
        """Non-negative weights, not both 0; positive limits."""
        super().check()
        self.require_non_negative("coef", "reward_coef", "signal_clip")
        self.require(not self.teachers or self.coef > 0 or self.reward_coef > 0, "coef",
                     "and reward_coef are both 0: nothing would be trained; set coef > 0")
        self.require_seconds("score_timeout_s")
        self.require_positive_int("max_attempts")

    @property
    def enabled(self) -> bool:
        """Whether a teacher scores the trajectories."""
        return bool(self.teachers)

    def teacher_of(self, tasks: list[str]) -> dict[str, int]:
        """Each of ``tasks`` -> the index of its teacher; ValueError naming a task with none or with two, or a
        teacher's task that is not a task of the run."""
        named: dict[str, int] = {}
        for i, t in enumerate(self.teachers):
            for task in t.tasks:
                if task not in tasks:
                    raise ValueError(f"distill.teachers[{i}].tasks names {task!r}, which is not a task of the run "
                                     f"({', '.join(tasks)})")
                if task in named:
                    raise ValueError(f"distill.teachers[{named[task]}] and [{i}] both name task {task!r}; give each "
                                     "task one teacher")
                named[task] = i
        fallback = [i for i, t in enumerate(self.teachers) if not t.tasks]
        if len(fallback) > 1:
            raise ValueError(f"distill.teachers{fallback} all leave tasks empty (every task no other teacher names); "
                             "at most one may")
        out = {}
        for task in tasks:
            if task in named:
                out[task] = named[task]
            elif fallback:
                out[task] = fallback[0]
            else:
                raise ValueError(f"task {task!r} has no teacher: name it in the tasks of one of distill.teachers, or "
                                 "leave one teacher's tasks empty (it then scores every other task)")
        return out
