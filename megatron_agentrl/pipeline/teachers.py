"""The teachers of on-policy distillation (the ``distill`` section), built on the rollout rank: their engines, their
tokenizers checked against the student's, the scorer the rollout manager runs on every cohort."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from megatron_agentrl.config import Config, ConfigError
from rollout_sglang.distill.options import TeacherSpec
from rollout_sglang.distill.scorer import TeacherScorer
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.sglang_client import SGLangEngine
from rollout_sglang.engines.sglang_options import SGLangClientOptions
from rollout_sglang.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def check_teacher_tokenizer(i: int, spec: TeacherSpec, student: Any, student_path: str) -> None:
    """ConfigError naming both tokenizers unless teacher ``i`` tokenizes as the student does (the same vocabulary:
    every token id means the same text, so a teacher's log-prob of a student's token is of that token)."""
    path = spec.tokenizer_path
    if not Path(path).exists():
        raise ConfigError(f"distill.teachers[{i}]: the teacher's tokenizer '{path}' does not exist")
    teacher = load_tokenizer(path)
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        diff = sorted(set(tv.items()) ^ set(sv.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(f"distill.teachers[{i}]: the teacher's tokenizer '{path}' ({len(tv)} tokens) is not the "
                          f"student's model.tokenizer '{student_path}' ({len(sv)} tokens; they differ at e.g. {diff}); "
                          "a teacher must share the student's tokenizer")


def build_teacher_scorer(cfg: Config, dtype: torch.dtype, student_tokenizer: Any) -> TeacherScorer | None:
    """The scorer of ``cfg.distill`` (None when no teacher is set): a local engine per checkpoint teacher (on the
    GPU when there is one), an SGLang client per server of the others, each teacher's tokenizer checked first."""
    d = cfg.distill
    if not d.enabled:
        return None
    r = cfg.rollout
    task_teacher = d.teacher_of([s.name for s in cfg.tasks])
    teachers = []
    for i, spec in enumerate(d.teachers):
        check_teacher_tokenizer(i, spec, student_tokenizer, str(cfg.model.tokenizer))
        if spec.checkpoint is not None:
            if not Path(spec.checkpoint).is_dir():
                raise ConfigError(f"distill.teachers[{i}].checkpoint='{spec.checkpoint}' is not a directory; give the "
                                  "teacher's Hugging Face checkpoint (e.g. a run's hf_export)")
            device = "cuda" if torch.cuda.is_available() else "cpu"
            teachers.append([LocalEngine.from_pretrained(spec.checkpoint, dtype=dtype, device=device,
                                                         seed=cfg.train.seed)])
        else:
            options = SGLangClientOptions(request_timeout_s=d.score_timeout_s,
                                          api_key=os.environ.get(r.engine_api_key_env) or None)
            teachers.append([SGLangEngine(u, options) for u in spec.engine_urls])
        logger.info("distill: teacher %d (%s) scores %s", i, spec.name,
                    ", ".join(t for t, k in task_teacher.items() if k == i))
    return TeacherScorer(teachers, task_teacher, d)
