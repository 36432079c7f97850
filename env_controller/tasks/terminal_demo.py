"""The terminal demo's task families: small instances in the terminal format, each family with its own tiny
image made on this machine from host binaries (as the OS task's image is), judged by a verifier in the
container.

Families (``demo_instances(family, seed, n)``; instance ``i`` is fixed by ``(family, seed, i)``):

* ``files``: create the empty file ``notes/<word>.txt`` (the setup command makes ``notes/``);
  expert ``touch notes/<word>.txt``; image ``term-files`` (bash and coreutils).
* ``copy``: copy ``data/<name>.txt`` (one of 24 files baked into the image) to ``backup/``;
  expert ``mkdir -p backup && cp data/<name>.txt backup/``; image ``term-copy``.
* ``count``: write the line count of ``logs/<name>.log`` (baked into the image) into ``answer.txt``;
  expert ``wc -l < logs/<name>.log > answer.txt``; image ``term-count``.

The working directory ``/app`` is a scratch tmpfs of each container (``scratch_workdir``): the images keep
their files in ``/srv/task`` and the setup copies them in, so a session changes nothing of the image and its
container can serve another session after the verified wipe (``reuse_containers`` of the task).

Each expert's script copies its instruction's path, after the same prefix (``notes/``, ``data/``, ``logs/``), so a
small policy can learn it; the careless player calls ``finish_action`` at once (reward 0), the habit that RL has to
unlearn. Instances draw from 24 words: the held-out evaluation (indices not trained on) repeats words of training,
so it measures the habit unlearned and the copying sharpened, not new words.
"""
from __future__ import annotations

import random
from pathlib import Path

from env_controller.sandbox.docker_image import build_rootfs
from env_controller.sandbox.task_images import BUILTIN_ROOTFS, ImageSource
from env_controller.tasks.terminal_format import TerminalInstance, Verifier

FAMILIES = ("files", "copy", "count")
#: the tools of the demo's images (a subset of the OS task's)
TOOLS = ("bash", "ls", "cat", "echo", "printf", "mkdir", "rm", "cp", "mv", "touch", "wc", "head", "tail", "grep",
         "sort", "cut", "tr", "find", "sleep", "test", "true", "false", "env", "cmp", "id", "timeout")
_WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "flint", "grove", "harbor", "iris", "jade", "kite", "lumen",
          "maple", "nova", "onyx", "pearl", "quartz", "raven", "sage", "tide", "umber", "vale", "willow", "zephyr")
_VERIFIER_TIMEOUT_S = 20.0
#: where the images keep the files the setup copies into the scratch working directory
SEED_DIR = "/srv/task"


def _data_files() -> dict[str, str]:
    """The ``copy`` image's ``data/``: one file per word."""
    return {f"data/{w}.txt": f"{w} record {i}\n" * (1 + i % 3) for i, w in enumerate(_WORDS)}


def _log_files() -> dict[str, str]:
    """The ``count`` image's ``logs/``: one log per word, 3 to 17 lines."""
    return {f"logs/{w}.log": "".join(f"{w} event {k}\n" for k in range(3 + (i * 7) % 15))
            for i, w in enumerate(_WORDS)}


def _builder(files: dict[str, str]):  # noqa: ANN202 - a closure registered below
    def build(root: Path) -> None:
        build_rootfs(root, TOOLS)
        (root / "app").mkdir(parents=True, exist_ok=True)  # the mount point of the scratch workdir
        seed = root / SEED_DIR.lstrip("/")
        seed.mkdir(parents=True, exist_ok=True)
        for rel, text in files.items():
            path = seed / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return build


BUILTIN_ROOTFS.update({"term-files": _builder({"README": "notes go in notes/\n"}),
                       "term-copy": _builder(_data_files()),
                       "term-count": _builder(_log_files())})


def _files(rng: random.Random) -> dict[str, object]:
    path = f"notes/{rng.choice(_WORDS)}.txt"
    # the word follows "notes/" in the instruction and in the command: the tiny policy copies it after the same
    # prefix, as in the other families (with "echo <word> > ..." no prefix shows what to copy, and the warm-up
    # does not teach it)
    return {"instruction": f"Create the empty file {path}.", "setup": (f"cp {SEED_DIR}/README . && mkdir -p notes",),
            "solution": f"touch {path}", "verifier": f"[ -f /app/{path} ] && [ ! -s /app/{path} ]",
            "image": "term-files"}


def _copy(rng: random.Random) -> dict[str, object]:
    name = rng.choice(_WORDS)
    return {"instruction": f"Copy the file data/{name}.txt into the directory backup.",
            "setup": (f"cp -r {SEED_DIR}/data .",),
            "solution": f"mkdir -p backup && cp data/{name}.txt backup/",
            "verifier": f"cmp -s /app/data/{name}.txt /app/backup/{name}.txt", "image": "term-copy"}


def _count(rng: random.Random) -> dict[str, object]:
    name = rng.choice(_WORDS)
    lines = _log_files()[f"logs/{name}.log"].count("\n")
    return {"instruction": f"Write the number of lines of logs/{name}.log into answer.txt.",
            "setup": (f"cp -r {SEED_DIR}/logs .",),
            "solution": f"wc -l < logs/{name}.log > answer.txt",
            "verifier": f'[ "$(tr -d "[:space:]" < /app/answer.txt)" = {lines} ]', "image": "term-count"}


_GENERATORS = {"files": _files, "copy": _copy, "count": _count}


def demo_instances(family: str, seed: int, n: int) -> list[TerminalInstance]:
    """``n`` instances of ``family`` (ValueError naming the families for an unknown one)."""
    if family not in _GENERATORS:
        raise ValueError(f"unknown demo family {family!r}; families: {', '.join(FAMILIES)}")
    out = []
    for i in range(n):
        spec = _GENERATORS[family](random.Random(f"terminal/{family}/{seed}/{i}"))
        out.append(TerminalInstance(
            id=f"{family}-{seed}-{i}", instruction=str(spec["instruction"]),
            image=ImageSource.builtin(str(spec["image"])),
            verifier=Verifier("bash /tests/test.sh", {"test.sh": str(spec["verifier"]).encode()},
                              _VERIFIER_TIMEOUT_S),
            setup=tuple(spec["setup"]),  # type: ignore[arg-type]
            solution=str(spec["solution"]), family=family, workdir="/app", scratch_workdir=True))
    return out
