"""``os_shell``: solve a small Linux task with bash in a sandbox (after AgentBench's OS interaction).

Each sample prepares files in a fresh sandbox (a per-session persistent bash, no network,
read-only root, private home and ``/tmp``; see :mod:`env_controller.sandbox`), then asks
either a question about them (how many files match, what a setting is, which file is the
largest...) or for a change (create a file, rename, chmod, delete...). Twelve generators
make the samples; sample ``index`` uses generator ``index % 12`` with parameters drawn from
``(seed, index)``, so every sample is fixed by the task's seed.
"""
from __future__ import annotations

import logging
import random
import re
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from env_controller.sandbox import Sandbox, SandboxBackend, SandboxError, make_backend
from env_controller.sandbox.options import ContainerOptions
from env_controller.sandbox.pool import SandboxPool
from env_controller.tasks.base import Expert, Message, ToolResult, function_schema
from env_controller.tasks.blocking import BlockingToolTask, BlockingToolTaskSession
from env_controller.tasks.options import BlockingTaskOptions

logger = logging.getLogger(__name__)


CHECK_TIMEOUT_S = 10.0
_WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "flint", "grove", "harbor", "iris", "jade", "kite",
          "lumen", "maple", "nova", "onyx", "pearl", "quartz", "raven", "sage", "tide", "umber", "vale",
          "willow", "xenon", "yarrow", "zephyr")
_SERVICES = ("api", "auth", "billing", "cache", "gateway", "mailer", "search", "worker")
_CITIES = ("Austin", "Berlin", "Cairo", "Delhi", "Lima", "Oslo", "Paris", "Quito", "Rome", "Seoul", "Tokyo")


@dataclass
class ShellSample:
    """One generated sample.

    kind: the generator's name. prompt: the task text. files: home-relative path -> content.
    setup: bash run before the episode (or None). answer: the expected answer of a question (or
    None). answer_type: ``int``, ``text`` or ``filename`` (how answers compare). check: a bash
    script that exits 0 when a change task is done (or None); it runs in a fresh shell with the
    agent's answer as ``$1``. solution: the expert's bash script.
    """

    kind: str
    prompt: str
    files: dict[str, str]
    solution: str
    answer: str | None = None
    answer_type: str = "text"
    check: str | None = None
    setup: str | None = None


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}_{rng.randint(10, 99)}"


def _count_ext(rng: random.Random) -> ShellSample:
    exts = ["log", "txt", "csv", "json", "py"]
    target = rng.choice(exts)
    files: dict[str, str] = {}
    while len(files) < rng.randint(8, 16) or not any(p.endswith("." + target) for p in files):
        d = rng.choice(["data", "data/a", "data/b", "data/a/deep", "data/c"])
        files[f"{d}/{_name(rng)}.{rng.choice(exts)}"] = "x\n"
    files[f"data/not_a_{target}.{target}.bak"] = "decoy\n"
    n = sum(p.endswith("." + target) for p in files)
    return ShellSample(
        "count_ext", f"How many files with the extension .{target} are there under ~/data, subdirectories "
        "included? Answer with the number only.", files,
        solution=f"find ~/data -type f -name '*.{target}' | wc -l", answer=str(n), answer_type="int")


def _config_value(rng: random.Random) -> ShellSample:
    services = rng.sample(_SERVICES, 4)
    keys = ["port", "timeout", "workers", "level", "region"]
    files: dict[str, str] = {}
    values: dict[tuple[str, str], str] = {}
    for svc in services:
        lines = [f"# {svc} configuration"]
        for key in rng.sample(keys, len(keys)):
            value = str(rng.randint(1000, 65000)) if key == "port" else (
                rng.choice(["debug", "info", "warn"]) if key == "level" else
                rng.choice(["eu-west", "us-east", "ap-south"]) if key == "region" else str(rng.randint(1, 120)))
            values[(svc, key)] = value
            lines.append(f"{key}={value}")
        files[f"etc/{svc}.conf"] = "\n".join(lines) + "\n"
    svc, key = rng.choice(services), rng.choice(keys)
    return ShellSample(
        "config_value", f"What is the value of the setting `{key}` in the configuration file of the {svc} "
        "service (the files are in ~/etc)? Answer with the value only.", files,
        solution=f"grep '^{key}=' ~/etc/{svc}.conf | cut -d= -f2", answer=values[(svc, key)])


def _count_level(rng: random.Random) -> ShellSample:
    levels = ["INFO", "WARN", "ERROR", "DEBUG"]
    target = rng.choice(levels)
    lines = []
    for i in range(rng.randint(20, 60)):
        level = rng.choice(levels)
        lines.append(f"2024-05-{1 + i % 28:02d}T10:{i % 60:02d}:00 {level} {rng.choice(_WORDS)} event {i}")
    lines.append(f"2024-05-30T11:00:00 INFO message mentions {target} but is not one")
    n = sum(line.split()[1] == target for line in lines)
    return ShellSample(
        "count_level", f"~/logs/app.log has one event per line: a timestamp, a level, then a message. How many "
        f"lines have the level {target}? Answer with the number only.", {"logs/app.log": "\n".join(lines) + "\n"},
        solution=f"awk '$2 == \"{target}\"' ~/logs/app.log | wc -l", answer=str(n), answer_type="int")


def _sum_numbers(rng: random.Random) -> ShellSample:
    numbers = [rng.randint(-500, 2000) for _ in range(rng.randint(10, 40))]
    return ShellSample(
        "sum_numbers", "~/numbers.txt holds one integer per line. What is their sum? Answer with the number only.",
        {"numbers.txt": "\n".join(map(str, numbers)) + "\n"},
        solution="awk '{s += $1} END {print s}' ~/numbers.txt", answer=str(sum(numbers)), answer_type="int")


def _largest_file(rng: random.Random) -> ShellSample:
    sizes = rng.sample(range(100, 20000), rng.randint(5, 10))
    files = {f"files/{_name(rng)}.{rng.choice(['bin', 'dat', 'img'])}": "z" * size for size in sizes}
    largest = max(files, key=lambda p: len(files[p])).split("/")[-1]
    return ShellSample(
        "largest_file", "Which file in ~/files is the largest? Answer with its file name only.", files,
        solution="ls -S ~/files | head -n 1", answer=largest, answer_type="filename")


def _distinct_cities(rng: random.Random) -> ShellSample:
    cities = rng.sample(_CITIES, rng.randint(3, 8))
    rows = [f"{_name(rng)},{rng.choice(cities)},{rng.randint(18, 80)}" for _ in range(rng.randint(10, 30))]
    n = len({r.split(",")[1] for r in rows})
    return ShellSample(
        "distinct_cities", "~/people.csv has a header line, then one person per line: name,city,age. How many "
        "distinct cities appear in it? Answer with the number only.",
        {"people.csv": "name,city,age\n" + "\n".join(rows) + "\n"},
        solution="tail -n +2 ~/people.csv | cut -d, -f2 | sort -u | wc -l", answer=str(n), answer_type="int")


def _count_word(rng: random.Random) -> ShellSample:
    word = rng.choice(_WORDS)
    text_words = [rng.choice(_WORDS[:8] + (word,)) for _ in range(rng.randint(40, 120))]
    text_words += [word + "s", "pre" + word]  # not whole-word occurrences
    rng.shuffle(text_words)
    lines = [" ".join(text_words[i:i + 9]) for i in range(0, len(text_words), 9)]
    n = text_words.count(word)
    return ShellSample(
        "count_word", f"How many times does the word \"{word}\" occur in ~/text/story.txt, counting whole words "
        "only (case-sensitive)? Answer with the number only.", {"text/story.txt": "\n".join(lines) + "\n"},
        solution=f"grep -ow '{word}' ~/text/story.txt | wc -l", answer=str(n), answer_type="int")


def _create_file(rng: random.Random) -> ShellSample:
    name = _name(rng)
    text = f"{rng.choice(_WORDS)} {rng.randint(100, 999)} {rng.choice(_WORDS)}"
    path = f"~/out/{name}.txt"
    return ShellSample(
        "create_file", f"Create the file {path} (create ~/out if needed) containing exactly one line: {text}",
        {"README": "Put results in ~/out.\n"},
        solution=f"mkdir -p ~/out && echo '{text}' > {path}",
        check=f"[ \"$(cat {path})\" = '{text}' ] && [ \"$(wc -l < {path})\" -eq 1 ]")


def _make_executable(rng: random.Random) -> ShellSample:
    names = [_name(rng) for _ in range(3)]
    target = rng.choice(names)
    body = f"#!/bin/sh\necho {target}\n"
    files = {f"bin/{n}.sh": f"#!/bin/sh\necho {n}\n" for n in names}
    others = [n for n in names if n != target]
    return ShellSample(
        "make_executable", f"Make the script ~/bin/{target}.sh executable, without changing its content or the "
        "other scripts.", files,
        solution=f"chmod u+x ~/bin/{target}.sh",
        check=(f"[ -x ~/bin/{target}.sh ] && [ \"$(cat ~/bin/{target}.sh)\" = {shlex.quote(body.rstrip())} ] && "
               + " && ".join(f"[ ! -x ~/bin/{o}.sh ]" for o in others)))


def _rename_ext(rng: random.Random) -> ShellSample:
    stems = list({_name(rng) for _ in range(rng.randint(3, 6))})
    files = {f"docs/{s}.txt": f"notes on {s}\n" for s in stems}
    keep = {f"docs/{_name(rng)}.{ext}": "keep\n" for ext in ("pdf", "txt.orig")}
    files.update(keep)
    checks = [f"[ ! -e ~/docs/{s}.txt ] && [ \"$(cat ~/docs/{s}.md)\" = 'notes on {s}' ]" for s in stems]
    checks += [f"[ -f ~/{p} ]" for p in keep]
    return ShellSample(
        "rename_ext", "Rename every file in ~/docs whose name ends in .txt so that it ends in .md instead "
        "(keep the rest of the name); leave the other files alone.", files,
        solution="cd ~/docs && for f in *.txt; do mv -- \"$f\" \"${f%.txt}.md\"; done",
        check=" && ".join(checks) + f" && [ \"$(ls ~/docs | wc -l)\" -eq {len(files)} ]")


def _line_count_to_file(rng: random.Random) -> ShellSample:
    rows = [f"{rng.randint(1, 99)},{rng.choice(_WORDS)}" for _ in range(rng.randint(5, 50))]
    n = len(rows) + 1
    return ShellSample(
        "line_count_to_file", "Write the number of lines of ~/data.csv (its header line included) into the file "
        "~/answer.txt, as a number alone.", {"data.csv": "id,word\n" + "\n".join(rows) + "\n"},
        solution="wc -l < ~/data.csv > ~/answer.txt",
        check=f"[ \"$(tr -d '[:space:]' < ~/answer.txt)\" = '{n}' ]")


def _delete_bak(rng: random.Random) -> ShellSample:
    files: dict[str, str] = {}
    for _ in range(rng.randint(6, 14)):
        d = rng.choice(["cache", "cache/x", "cache/y/z"])
        files[f"{d}/{_name(rng)}.{rng.choice(['bak', 'dat', 'bak', 'txt'])}"] = "data\n"
    files["cache/backup.bak.keep"] = "keep\n"
    files.setdefault("cache/x/old.bak", "data\n")
    keep = [p for p in files if not p.endswith(".bak")]
    gone = [p for p in files if p.endswith(".bak")]
    return ShellSample(
        "delete_bak", "Delete every file whose name ends in .bak under ~/cache, in subdirectories too; "
        "do not delete anything else.", files,
        solution="find ~/cache -type f -name '*.bak' -delete",
        check=" && ".join([f"[ ! -e ~/{p} ]" for p in gone] + [f"[ -f ~/{p} ]" for p in keep]))


GENERATORS: tuple[Callable[[random.Random], ShellSample], ...] = (
    _count_ext, _config_value, _count_level, _sum_numbers, _largest_file, _distinct_cities, _count_word,
    _create_file, _make_executable, _rename_ext, _line_count_to_file, _delete_bak,
)


def normalize_answer(text: str) -> str:
    """An answer as compared: surrounding whitespace, quotes and backticks and a final period
    removed, inner whitespace runs collapsed to one space."""
    text = text.strip()
    for _ in range(2):
        text = text.strip().strip("\"'`").strip()
        if text.endswith(".") and not text.endswith(".."):
            text = text[:-1]
    return re.sub(r"\s+", " ", text)


def answer_matches(answer: str, expected: str, answer_type: str) -> bool:
    """Whether ``answer`` is right: integers compare by value (``"007"`` = ``"7"``), file names by
    their last path component, text exactly (after :func:`normalize_answer`)."""
    got = normalize_answer(answer)
    if answer_type == "int":
        try:
            return int(got.replace(",", "")) == int(expected)
        except ValueError:
            return False
    if answer_type == "filename":
        return got.rstrip("/").split("/")[-1] == expected
    return got == expected


class OsShellSession(BlockingToolTaskSession):
    """One ``os_shell`` episode in its own sandbox."""

    def __init__(self, sample: ShellSample, sandbox: Sandbox, max_turns: int, max_output_chars: int,
                 executor: Any, pool: SandboxPool | None = None) -> None:
        """``sample``: the task; ``sandbox``: prepared with the sample's files, from ``pool`` (which takes it
        back at the end; without one, it is closed)."""
        super().__init__(OsShellTask.TOOLS, max_turns, executor)
        self.sample = sample
        self.sandbox = sandbox
        self.pool = pool
        self.max_output_chars = max_output_chars
        self.commands = 0
        self.limit_hits = 0

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run ``bash_action`` in the sandbox; grade on ``answer_action`` / ``finish_action``."""
        if name == "bash_action":
            return ToolResult(self._bash(arguments["script"]))
        answer = arguments.get("answer", "") if name == "answer_action" else ""
        return self._grade(name, answer)

    def _bash(self, script: str) -> str:
        self.commands += 1
        if not script.strip():
            return "error: the script is empty; pass bash commands in 'script'"
        try:
            result = self.sandbox.run(script)
        except ValueError as exc:
            return f"error: {exc}"
        if result.limit is not None:
            self.limit_hits += 1
        return result.reply(self.max_output_chars)

    def _grade(self, name: str, answer: str) -> ToolResult:
        sample = self.sample
        if sample.answer is not None:
            if name == "finish_action":
                return ToolResult("finished without an answer; this task asked a question (use answer_action)",
                                  finish=True, success=False)
            ok = answer_matches(answer, sample.answer, sample.answer_type)
            return ToolResult("correct" if ok else "wrong", finish=True, success=ok)
        assert sample.check is not None
        ok = self.run_check(answer)
        return ToolResult("the change is correct" if ok else "the change is not what was asked", finish=True,
                          success=ok)

    def run_check(self, answer: str = "") -> bool:
        """Run the sample's check script in a fresh shell of the sandbox (clean environment, the
        agent's background processes killed first); True when it exits 0."""
        assert self.sample.check is not None
        self.sandbox.reset()
        script = (f"env -i HOME={shlex.quote(self.sandbox.workdir)} PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 "
                  f"bash --noprofile --norc -c {shlex.quote(self.sample.check)} check {shlex.quote(answer)}")
        result = self.sandbox.run(script, timeout_s=CHECK_TIMEOUT_S)
        if result.limit is not None:
            logger.warning("os_shell %s check hit a limit: %s", self.sample.kind, result.error)
        return result.ok

    def extra_metrics(self) -> dict[str, float]:
        """``commands`` (bash_action calls) and ``limit_hits`` (commands stopped by a sandbox limit)."""
        return {"commands": float(self.commands), "limit_hits": float(self.limit_hits)}

    def release(self) -> None:
        """Give the sandbox back to the pool (wiped for another session when the task reuses sandboxes,
        else removed), or close it."""
        if self.pool is not None:
            self.pool.release(self.sandbox, reusable=True)
        else:
            self.sandbox.close()


@dataclass
class OsShellOptions(BlockingTaskOptions, ContainerOptions):
    """The os_shell task's params: its samples, its sandboxes' backend, limits and pool
    (:class:`~env_controller.sandbox.options.ContainerOptions`)."""

    KEY = "os_shell"

    num_samples: int = 300
    max_turns: int = 8
    memory_mb: int = 1024
    #: where sandboxes run: ``"bwrap"`` (bubblewrap) or ``"docker"`` (one container per session)
    backend: Literal["bwrap", "docker"] = "bwrap"
    #: the Docker image (it must hold bash and coreutils)
    image: str = "ubuntu:22.04"
    #: a command's background processes run on after it returns (off: they are killed)
    background_jobs: bool = False

    def check(self) -> None:
        """See :class:`ContainerOptions`."""
        super().check()
        self.require_string("image")
        self.require_bool("background_jobs")


class OsShellTask(BlockingToolTask):
    """``os_shell``: answer a question or make a change with bash in a sandbox.

    Tools: ``bash_action(script: string)`` runs the script in the session's persistent bash and
    returns its output (stdout and stderr, at most ``max_output_chars`` shown), ``[exit code N]``
    after a failing command, ``(no output)`` for a silent success, and ``error: ...`` when a
    sandbox limit stopped it (time, output, processes, memory; the shell is restarted, files
    kept), or an ``error: ...`` line after the output when a write hit a full ``/tmp`` or home;
    ``answer_action(answer: string)`` and ``finish_action()`` end the episode.
    Samples: 12 generators (``index % 12``): 7 questions (count files by extension, read a
    config value, count log lines of a level, sum numbers, name the largest file, count
    distinct CSV values, count a word) and 5 changes (create a file, chmod a script, rename
    extensions, write a line count to a file, delete ``*.bak`` files).
    Expert: the generator's one-line bash solution, then ``answer_action(<its output>)`` for a
    question or ``finish_action()`` for a change (2 turns).
    Reward: 1 or 0. A question is right when the answer matches: integers by value, file names
    by their last path component, other text exactly, after trimming whitespace, quotes and a
    final period; ``finish_action`` on a question scores 0. A change is right when the sample's
    check script, run after the episode in a fresh shell of the same sandbox (clean
    environment, background processes killed), exits 0; the answer, if any, is ignored.
    0 on the turn limit (default 8 tool calls) or a message without tool calls.
    Metrics: ``success``, ``turns``, ``commands``, ``limit_hits``.

    Sandboxes: :class:`OsShellOptions` (the backend, limits and pool); a :class:`SandboxBackend` of the caller's
    may be given instead of the options' ``backend``.
    """

    name = "os_shell"
    Options = OsShellOptions
    options: OsShellOptions
    TOOLS = [
        function_schema(
            "bash_action",
            "Run a bash script in your Linux shell and get its output (stdout and stderr) and exit code. "
            "The shell keeps its working directory and variables between calls; there is no network.",
            {"script": "string"},
        ),
        function_schema("answer_action", "Give the final answer to the question; ends the task.", {"answer": "string"}),
        function_schema("finish_action", "Say that the requested change is done; ends the task.", {}),
    ]

    def __init__(self, options: OsShellOptions | None = None, *, backend: SandboxBackend | None = None) -> None:
        """See :class:`ToolTask`; ``backend``: sandboxes from this backend (else one of ``options.backend``, made
        on first use)."""
        super().__init__(options)
        options = self.options
        self.max_output_chars = options.max_output_chars
        self.limits = options.limits(background_jobs=options.background_jobs)
        self.max_containers = options.max_containers
        self._backend: SandboxBackend | None = backend
        self._own_backend = backend is None  # closed with the task
        self._pool: SandboxPool | None = None
        self._backend_lock = threading.RLock()

    @property
    def backend(self) -> SandboxBackend:
        """The sandbox backend (started on first use; SandboxUnavailableError when it cannot run)."""
        with self._backend_lock:
            if self._backend is None:
                options: dict[str, Any] = {}
                if self.options.backend == "docker":
                    # a worker restarted after a crash serves while its predecessor's containers go
                    options = {"image": self.options.image, "docker_host": self.options.docker_host,
                               "user": self.options.user, "reap": "background"}
                self._backend = make_backend(self.options.backend, self.limits, **options)
            return self._backend

    def sandbox_pool(self) -> SandboxPool:
        """The pool sessions take their sandboxes from: started, with the backend (which removes the leaked
        sandboxes of dead workers), on the first call (blocking)."""
        with self._backend_lock:
            if self._pool is None:
                self._pool = SandboxPool(self.backend, self.options, limits=self.limits,
                                         labels={"agentrl.task": self.name},
                                         limit_hint="max_containers (the worker's --max-containers)")
            return self._pool

    def sample(self, index: int) -> ShellSample:
        """The generated sample ``index`` (see the class docstring)."""
        self.check_index(index)
        return GENERATORS[index % len(GENERATORS)](self.rng(index))

    def new_session(self, index: int) -> tuple[OsShellSession, list[Message]]:
        """A sandbox holding the sample's files, and the prompt (blocking)."""
        sample = self.sample(index)
        pool = self.sandbox_pool()
        box = pool.acquire(labels={"agentrl.index": str(index)})
        try:
            box.copy_in(sample.files)
            if sample.setup:
                result = box.run(sample.setup)
                if not result.ok:
                    raise SandboxError(f"os_shell index {index}: setup failed: {result.error or result.output}")
        except BaseException:
            pool.release(box, reusable=False)
            raise
        prompt = (
            "You are in a Linux bash shell as the user `user` (home /home/user, no network). Run commands with "
            "bash_action; the shell keeps its working directory and variables between calls. When the task asks "
            "a question, reply with answer_action and the answer only; when it asks for a change, make it and "
            f"then call finish_action. You have {self.max_turns} tool calls.\n\nTask: {sample.prompt}"
        )
        session = OsShellSession(sample, box, self.max_turns, self.max_output_chars, self.executor, pool)
        return session, [{"role": "user", "content": prompt}]

    def expert(self, index: int) -> Expert:
        """The sample's bash solution, then ``answer_action(<output>)`` or ``finish_action()``."""
        sample = self.sample(index)
        output = yield "bash_action", {"script": sample.solution}
        if sample.answer is not None:
            yield "answer_action", {"answer": output.strip()}
        else:
            yield "finish_action", {}

    def close(self) -> None:
        """Remove every sandbox of this task (its pool's, warm ones included) and stop its threads."""
        super().close()
        with self._backend_lock:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.close()
            if self._backend is not None and self._own_backend:
                self._backend.close()
                self._backend = None
