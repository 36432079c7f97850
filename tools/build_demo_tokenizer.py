#!/usr/bin/env python
"""Rebuild the demo's tokenizer (examples/tokenizer/tiny_agent) from the built-in tasks' text.

A byte-level BPE (Qwen2.5-style pre-tokenization and chat tokens) trained on the scripted
demonstrations of every built-in task, rendered in the Qwen2.5 chat format. Deterministic; runs
offline in seconds:  python tools/build_demo_tokenizer.py [--vocab-size 1024] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from env_controller.tasks import build_task  # noqa: E402
from rollout_sglang.chat_template import ChatTemplate  # noqa: E402
from rollout_sglang.tokenizer import train_bpe_tokenizer  # noqa: E402

#: the small learnable tasks of the CPU demo (os_shell and db need bwrap / MariaDB and a bigger model)
DEMO_TASKS = ("calc", "guess", "lookup")


def demo_corpus(samples_per_task: int = 512) -> list[str]:
    """Rendered demonstrations of the demo's tasks, in the Qwen2.5 chat format."""
    with tempfile.TemporaryDirectory() as tmp:
        # the template only needs a tokenizer with the chat tokens to render text
        template = ChatTemplate(train_bpe_tokenizer(["a"], vocab_size=300, out_dir=tmp))
    texts = []
    for name in DEMO_TASKS:
        task = build_task(name)
        for index in list(task.indices())[:samples_per_task]:
            messages, tools = task.demonstration(index)
            texts.append(template.render_text(messages, tools))
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "examples/tokenizer/tiny_agent"))
    args = ap.parse_args()
    tok = train_bpe_tokenizer(demo_corpus(), vocab_size=args.vocab_size, out_dir=args.out)
    print(f"wrote {args.out}: {len(tok)} tokens")


if __name__ == "__main__":
    main()
