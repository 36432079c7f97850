"""The task format of terminal agents: read task directories (Harbor / Terminal-Bench 2.0 and Terminal-Bench
1.0 layouts) and manifests of many instances (SWE-bench style) into :class:`TerminalInstance` records.

What is read, and what is refused, is listed in docs/environments.md ("Terminal tasks"); in short:

* **Harbor / Terminal-Bench 2.0**: ``task.toml``, ``instruction.md``, ``environment/Dockerfile`` (the
  build context is ``environment/``) or ``environment/rootfs.tar[.gz|.xz]`` (ours: an imported root
  filesystem) or ``[environment] docker_image``; ``tests/test.sh`` and the rest of ``tests/`` (copied to
  ``/tests`` after the episode); ``solution/solve.sh`` (the scripted expert's demonstration).
* **Terminal-Bench 1.0**: ``task.yaml`` (``instruction``), ``Dockerfile`` (context: the task directory),
  ``run-tests.sh`` and ``tests/`` (copied to ``/tests``), ``solution.sh``; a ``docker-compose.yaml`` of one
  service is ignored (the Dockerfile is the image), of several refused.
* **Manifests** (``.yaml`` / ``.json`` with a ``tasks`` list, or ``.jsonl`` with one instance per line): each
  entry is ``{path: <task directory>}`` or an inline instance ``{id, instruction, image: {dockerfile: DIR,
  file: NAME} | {rootfs: FILE} | {name: TAG} | {builtin: NAME}, setup: [..], verifier: {script | file,
  files: DIR, timeout_s, env}, solution, family, reuse_containers, workdir, scratch_workdir}``; relative paths
  are taken from the manifest's directory.

Every refusal is a :class:`TaskFormatError` naming the file, the field and the fix.
"""
from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from env_controller.sandbox.task_images import ImageSource

#: the verifier's default time limit, seconds (Harbor's default of ``[verifier] timeout_sec`` is 600)
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
#: files under a verifier's directory copied into the container, at most (bytes)
MAX_VERIFIER_BYTES = 16 << 20
_ROOTFS_NAMES = ("rootfs.tar", "rootfs.tar.gz", "rootfs.tgz", "rootfs.tar.xz")
_HARBOR_IGNORED = {"version", "schema_version", "metadata", "task", "source", "solution"}
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")


class TaskFormatError(ValueError):
    """A task directory or manifest this format cannot run; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Verifier:
    """A script run in the container after the episode (in a fresh shell, as the session's user, from the
    working directory): ``command`` (e.g. ``bash /tests/test.sh``), ``files`` (relative path -> bytes, put in
    ``/tests``), ``timeout_s`` and ``env`` (variables set for it)."""

    command: str
    files: dict[str, bytes] = field(default_factory=dict)
    timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TerminalInstance:
    """One terminal task instance.

    id: its name (unique in a task set). instruction: the text the agent gets. image: where its image comes
    from. setup: shell commands run (as the user, in the working directory) before the episode; one failing
    fails the start. verifier: see :class:`Verifier`. solution: the scripted expert's bash script (the
    demonstration), or None. family: a group name for reports. reuse_containers: a container of this
    instance may serve another session after a verified wipe (None: the task's setting). workdir: where the
    shell starts (None: the image's WORKDIR, else /app). scratch_workdir: the working directory is an empty
    tmpfs of each container (the image's files there hidden), filled by ``setup``; the wipe empties it, so a
    session's work there does not bar the container's reuse. cpus / memory_mb / storage_mb: per-container limits
    (None: the task's; storage_mb caps the container's own files, the task's ``disk_mb``). careless: a
    low-effort player's script (the warm-up's bad habit), or None.
    """

    id: str
    instruction: str
    image: ImageSource
    verifier: Verifier
    setup: tuple[str, ...] = ()
    solution: str | None = None
    family: str = ""
    reuse_containers: bool | None = None
    workdir: str | None = None
    scratch_workdir: bool = False
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    careless: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _err(where: Path | str, what: str) -> TaskFormatError:
    return TaskFormatError(f"{where}: {what}")


def _read_tests(directory: Path, where: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes), at most :data:`MAX_VERIFIER_BYTES` in all."""
    files: dict[str, bytes] = {}
    total = 0
    for path in sorted(directory.rglob("*")):
        if path.is_symlink():
            raise _err(where, f"{path} is a symbolic link; the verifier's files must be plain files")
        if path.is_file():
            data = path.read_bytes()
            total += len(data)
            if total > MAX_VERIFIER_BYTES:
                raise _err(where, f"the verifier's files under {directory} exceed {MAX_VERIFIER_BYTES >> 20} MiB; "
                           "put large data in the image instead")
            files[str(path.relative_to(directory))] = data
    return files


def _seconds(value: Any, where: Path | str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise _err(where, f"{key}={value!r} must be a positive number of seconds")
    return float(value)


def _str_env(value: Any, where: Path | str, key: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                              for k in value):
        raise _err(where, f"{key} must be a table of variable names to values")
    return {k: str(v) for k, v in value.items()}


def _rootfs_in(directory: Path) -> Path | None:
    for name in _ROOTFS_NAMES:
        if (directory / name).is_file():
            return directory / name
    return None


def _check_id(value: Any, where: Path | str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise _err(where, f"id={value!r} must be 1-200 characters of letters, digits, '.', '_', '/' or '-'")
    return value


def load_task_dir(path: str | Path) -> TerminalInstance:
    """One task directory in the Harbor (``task.toml``) or Terminal-Bench 1.0 (``task.yaml``) layout."""
    root = Path(path).resolve()
    if not root.is_dir():
        raise _err(root, "not a directory; a task is a directory with task.toml (Harbor / Terminal-Bench 2.0) or "
                   "task.yaml (Terminal-Bench 1.0)")
    if (root / "task.toml").is_file():
        return _load_harbor(root)
    if (root / "task.yaml").is_file():
        return _load_tb1(root)
    raise _err(root, "has neither task.toml (Harbor / Terminal-Bench 2.0) nor task.yaml (Terminal-Bench 1.0)")


def _agentrl_section(raw: Any, where: Path) -> dict[str, Any]:
    """Our own settings (``[agentrl]`` in task.toml, ``agentrl:`` in task.yaml): setup, reuse_containers,
    workdir, scratch_workdir, family: the :class:`TerminalInstance` fields they set (defaults when absent)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _err(where, "the agentrl section must be a table")
    unknown = sorted(set(raw) - {"setup", "reuse_containers", "workdir", "scratch_workdir", "family"})
    if unknown:
        raise _err(where, f"agentrl.{unknown[0]} is not a setting; known: setup, reuse_containers, workdir, "
                   "scratch_workdir, family")
    setup = _commands(raw.get("setup", []), where, "agentrl.setup")
    reuse = _optional_flag(raw.get("reuse_containers"), where, "agentrl.reuse_containers")
    workdir = raw.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise _err(where, "agentrl.workdir must be an absolute path")
    family = raw.get("family", "")
    if not isinstance(family, str):
        raise _err(where, "agentrl.family must be a string")
    return {"setup": setup, "reuse_containers": reuse, "workdir": workdir,
            "scratch_workdir": _flag(raw.get("scratch_workdir", False), where, "agentrl.scratch_workdir"),
            "family": family}


def _read_conf(where: Path, parse: Callable[[str], Any], errors: tuple[type[Exception], ...], kind: str) -> Any:
    """The file ``where`` parsed by ``parse``; a :class:`TaskFormatError` naming it when ``errors`` say it is not
    valid ``kind``."""
    try:
        return parse(where.read_text())
    except errors as e:
        raise _err(where, f"not valid {kind}: {e}") from None


def _text_if_file(path: Path) -> str | None:
    """The text of the file ``path``, or None when there is none."""
    return path.read_text() if path.is_file() else None


def _flag(value: Any, where: Path | str, key: str) -> bool:
    if not isinstance(value, bool):
        raise _err(where, f"{key}={value!r} must be true or false")
    return value


def _optional_flag(value: Any, where: Path | str, key: str) -> bool | None:
    """``value``: true, false or None (unset)."""
    return None if value is None else _flag(value, where, key)


def _commands(value: Any, where: Path | str, key: str) -> tuple[str, ...]:
    """``value``, a shell command or a list of them, as a tuple of commands."""
    commands = [value] if isinstance(value, str) else value
    if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
        raise _err(where, f"{key} must be a list of shell commands")
    return tuple(commands)


def _load_harbor(root: Path) -> TerminalInstance:
    where = root / "task.toml"
    conf = _read_conf(where, tomllib.loads, (tomllib.TOMLDecodeError, UnicodeDecodeError), "TOML")
    if "steps" in conf:
        raise _err(where, "[[steps]] (a multi-step task) is not supported; split it into single-step tasks")
    unknown = sorted(set(conf) - _HARBOR_IGNORED - {"verifier", "agent", "environment", "agentrl"})
    if unknown:
        raise _err(where, f"[{unknown[0]}] is not supported (read: verifier, agent, environment, agentrl; "
                   "metadata and task are kept as metadata)")
    instruction_path = root / "instruction.md"
    if not instruction_path.is_file():
        raise _err(root, "instruction.md is missing (the agent's instruction)")
    env = conf.get("environment") or {}
    if env.get("allow_internet"):
        raise _err(where, "[environment] allow_internet = true: containers here have no network; the task "
                   "cannot run (make it work offline)")
    if env.get("gpus"):
        raise _err(where, "[environment] gpus: containers here get no GPU")
    for key in ("docker_compose", "services"):
        if key in env:
            raise _err(where, f"[environment] {key}: multi-container tasks are not supported")
    if (root / "environment" / "docker-compose.yaml").is_file() or (root / "environment" / "docker-compose.yml"
                                                                     ).is_file():
        raise _err(root, "environment/docker-compose.yaml: multi-container tasks are not supported; give "
                   "environment/Dockerfile")
    image = _image_of(root / "environment", env.get("docker_image"), where)
    verifier_conf = conf.get("verifier") or {}
    if verifier_conf.get("user") not in (None, ""):
        raise _err(where, f"[verifier] user = {verifier_conf['user']!r}: the verifier runs as a user of its own, "
                   "neither root nor the agent's (the terminal task's verifier_user); leave user out")
    tests = root / "tests"
    if not (tests / "test.sh").is_file():
        raise _err(root, "tests/test.sh is missing (the verifier)")
    ours = _agentrl_section(conf.get("agentrl"), where)
    return TerminalInstance(
        id=_check_id(str((conf.get("task") or {}).get("name") or root.name).replace("/", "."), where),
        instruction=instruction_path.read_text(),
        image=image,
        verifier=Verifier("bash /tests/test.sh", _read_tests(tests, where),
                          _seconds(verifier_conf.get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S), where,
                                   "[verifier] timeout_sec"),
                          _str_env(verifier_conf.get("env"), where, "[verifier] env")),
        solution=_text_if_file(root / "solution" / "solve.sh"), **ours,
        cpus=_opt_number(env.get("cpus"), where, "[environment] cpus"),
        memory_mb=_opt_int(env.get("memory_mb"), where, "[environment] memory_mb"),
        storage_mb=_opt_int(env.get("storage_mb"), where, "[environment] storage_mb"),
        metadata={"format": "harbor", **(conf.get("metadata") or {})},
    )


def _image_of(env_dir: Path, docker_image: Any, where: Path) -> ImageSource:
    if docker_image:
        if not isinstance(docker_image, str):
            raise _err(where, "[environment] docker_image must be an image name")
        return ImageSource.from_tag(docker_image)
    if (env_dir / "Dockerfile").is_file():
        return ImageSource.from_dockerfile(env_dir)
    rootfs = _rootfs_in(env_dir)
    if rootfs is not None:
        return ImageSource.from_rootfs(rootfs)
    raise _err(env_dir, "holds no Dockerfile and no rootfs.tar[.gz]; give the task an image (or [environment] "
               "docker_image naming one the engine has)")


def _opt_number(value: Any, where: Path | str, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.01 <= value < math.inf):
        raise _err(where, f"{key}={value!r} must be a number of CPUs of at least 0.01")
    return float(value)


def _opt_int(value: Any, where: Path | str, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 16:
        raise _err(where, f"{key}={value!r} must be an integer of at least 16 (MB)")
    return value


def _load_tb1(root: Path) -> TerminalInstance:
    import yaml

    where = root / "task.yaml"
    conf = _read_conf(where, yaml.safe_load, (yaml.YAMLError,), "YAML")
    if not isinstance(conf, dict):
        raise _err(where, "must be a mapping with at least 'instruction'")
    instruction = conf.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        descriptions = conf.get("descriptions")
        if isinstance(descriptions, list) and descriptions and isinstance(descriptions[0], dict):
            instruction = descriptions[0].get("description")  # Terminal-Bench 1.0's list of descriptions
    if not isinstance(instruction, str) or not instruction.strip():
        raise _err(where, "instruction is missing (the agent's instruction)")
    for name in ("docker-compose.yaml", "docker-compose.yml"):
        compose = root / name
        if compose.is_file():
            try:
                services = (yaml.safe_load(compose.read_text()) or {}).get("services") or {}
            except (yaml.YAMLError, AttributeError):
                services = {}
            if len(services) > 1:
                raise _err(compose, f"{len(services)} services: multi-container tasks are not supported")
    if not (root / "Dockerfile").is_file():
        raise _err(root, "Dockerfile is missing (Terminal-Bench 1.0 builds the task's image from it)")
    if not (root / "run-tests.sh").is_file():
        raise _err(root, "run-tests.sh is missing (the verifier: its exit code decides the reward)")
    files = _read_tests(root / "tests", where) if (root / "tests").is_dir() else {}
    files["run-tests.sh"] = (root / "run-tests.sh").read_bytes()
    ours = _agentrl_section(conf.get("agentrl"), where)
    ours["family"] = ours["family"] or str(conf.get("category") or "")
    return TerminalInstance(
        id=_check_id(root.name, where), instruction=instruction,
        image=ImageSource.from_dockerfile(root),
        verifier=Verifier("bash /tests/run-tests.sh", files,
                          _seconds(conf.get("max_test_timeout_sec", 180.0), where, "max_test_timeout_sec")),
        solution=_text_if_file(root / "solution.sh"), **ours,
        metadata={"format": "terminal-bench-1", **{k: conf[k] for k in ("difficulty", "category", "tags")
                                                   if k in conf}},
    )


def _inline(entry: dict[str, Any], base: Path, where: str) -> TerminalInstance:
    known = {"id", "instruction", "image", "setup", "verifier", "solution", "family", "reuse_containers", "workdir",
             "scratch_workdir", "cpus", "memory_mb", "storage_mb", "careless", "metadata"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise _err(where, f"{unknown[0]!r} is not a field of an instance; known: {', '.join(sorted(known))} "
                   "(or {path: <task directory>})")
    instruction = entry.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise _err(where, "instruction is missing")
    image = entry.get("image")
    workdir = entry.get("workdir")
    if not isinstance(image, dict) or len(set(image) & {"dockerfile", "rootfs", "name", "builtin"}) != 1:
        raise _err(where, "image must be one of {dockerfile: DIR[, file: NAME]}, {rootfs: FILE}, {name: TAG}, "
                   "{builtin: NAME}")
    if "dockerfile" in image:
        source = ImageSource.from_dockerfile(base / image["dockerfile"], image.get("file", "Dockerfile"))
    elif "rootfs" in image:
        source = ImageSource.from_rootfs(base / image["rootfs"], workdir=workdir or "/app",
                                         env=_str_env(image.get("env"), where, "image.env"))
    elif "name" in image:
        source = ImageSource.from_tag(str(image["name"]))
    else:
        source = ImageSource.builtin(str(image["builtin"]), workdir=workdir or "/app")
    v = entry.get("verifier")
    if not isinstance(v, dict) or not (("script" in v) ^ ("file" in v)):
        raise _err(where, "verifier must have 'script' (bash text) or 'file' (a script path), with optional files "
                   "(a directory copied to /tests), timeout_s and env")
    files = _read_tests(base / v["files"], where) if v.get("files") else {}
    if "script" in v:
        files["test.sh"] = str(v["script"]).encode()
    else:
        files["test.sh"] = (base / v["file"]).read_bytes()
    verifier = Verifier("bash /tests/test.sh", files,
                        _seconds(v.get("timeout_s", DEFAULT_VERIFIER_TIMEOUT_S), where, "verifier.timeout_s"),
                        _str_env(v.get("env"), where, "verifier.env"))
    setup = _commands(entry.get("setup") or [], where, "setup")
    reuse = _optional_flag(entry.get("reuse_containers"), where, "reuse_containers")
    return TerminalInstance(
        id=_check_id(entry.get("id"), where), instruction=instruction, image=source, verifier=verifier,
        setup=setup, solution=entry.get("solution"), family=str(entry.get("family") or ""),
        reuse_containers=reuse, workdir=workdir,
        scratch_workdir=_flag(entry.get("scratch_workdir", False), where, "scratch_workdir"),
        cpus=_opt_number(entry.get("cpus"), where, "cpus"),
        memory_mb=_opt_int(entry.get("memory_mb"), where, "memory_mb"),
        storage_mb=_opt_int(entry.get("storage_mb"), where, "storage_mb"), careless=entry.get("careless"),
        metadata=dict(entry.get("metadata") or {}),
    )


def load_manifest(path: str | Path) -> list[TerminalInstance]:
    """The instances a manifest lists (see the module docstring)."""
    import yaml

    path = Path(path).resolve()
    base = path.parent
    text = path.read_text()
    if path.suffix == ".jsonl":
        entries: Any = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise _err(f"{path}:{n}", f"not valid JSON: {e}") from None
    else:
        try:
            doc = yaml.safe_load(text)  # JSON is YAML
        except yaml.YAMLError as e:
            raise _err(path, f"not valid YAML: {e}") from None
        entries = doc.get("tasks") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise _err(path, "must hold a list 'tasks' of instances (or be a .jsonl file of them)")
    out = []
    for i, entry in enumerate(entries):
        where = f"{path}: tasks[{i}]"
        if not isinstance(entry, dict):
            raise _err(where, "must be a mapping")
        if set(entry) == {"path"}:
            out.append(load_task_dir(base / str(entry["path"])))
        else:
            out.append(_inline(entry, base, where))
    return out


def load_tasks(source: str | Path | list[str]) -> list[TerminalInstance]:
    """Instances from a task directory, a directory of task directories, a manifest, or a list of those; ids
    must be unique."""
    sources = source if isinstance(source, list) else [source]
    out: list[TerminalInstance] = []
    for item in sources:
        p = Path(item)
        if p.is_file():
            out.extend(load_manifest(p))
        elif p.is_dir() and ((p / "task.toml").is_file() or (p / "task.yaml").is_file()):
            out.append(load_task_dir(p))
        elif p.is_dir():
            subdirs = sorted(d for d in p.iterdir() if d.is_dir() and ((d / "task.toml").is_file()
                                                                     or (d / "task.yaml").is_file()))
            if not subdirs:
                raise _err(p, "holds no task directory (a directory with task.toml or task.yaml)")
            out.extend(load_task_dir(d) for d in subdirs)
        else:
            raise _err(p, "no such file or directory")
    seen: set[str] = set()
    for inst in out:
        if inst.id in seen:
            raise TaskFormatError(f"two instances are named {inst.id!r}; ids must be unique in a task set")
        seen.add(inst.id)
    return out
