"""Fixtures shared by several test modules, and the rule that puts a test in the end-to-end tier."""
from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

E2E_DIR = Path(__file__).parent / "e2e"
# fixtures that start a real server (dockerd, MariaDB, SLURM, a Ray cluster): a test that uses one is end-to-end
REAL_SERVERS = frozenset({"docker_engine", "mariadb", "slurm", "ray_cluster"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``e2e`` every test under tests/e2e/ and every test that uses a real server (tests/README.md)."""
    for item in items:
        if item.path.is_relative_to(E2E_DIR) or REAL_SERVERS.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; all killed (with the groups they lead) and reaped at teardown."""
    from env_controller.servers.process import stop_processes

    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_processes(started, grace_s=0.0, first_signal=signal.SIGKILL)


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A private Docker engine (``dockerd`` on its own socket and data root) for the whole test run; skips
    with the reason only where dockerd cannot run (not installed, not root)."""
    from env_controller.sandbox.dockerd import DockerEngine, DockerUnavailableError

    try:
        engine = DockerEngine()
    except DockerUnavailableError as e:
        pytest.skip(f"{e} (CI installs docker.io)")
    with engine:
        yield engine


@pytest.fixture(scope="session")
def os_shell_image(docker_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The OS task's image (host bash and coreutils), built here and imported into ``docker_engine``."""
    from env_controller.sandbox.docker_image import ensure_image

    client = docker_engine.client()
    try:
        return ensure_image(client, tmp_path_factory.mktemp("image"))
    finally:
        client.close()
