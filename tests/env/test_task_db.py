"""The ``db`` task on a real MariaDB server started by the test: samples, demonstrations, grading,
SQL errors and limits, and sessions in parallel that cannot see or drop each other's tables."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from env_controller.clients.local import LocalEnvClient
from env_controller.protocol import SampleStatus
from env_controller.servers.mariadb import MariaDBServer, MariaDBUnavailableError, find_mariadb
from env_controller.tasks import TASKS, build_task
from env_controller.tasks.db import GENERATORS, DBOptions, DBSession, DBTask, answer_matches
from tests.env.support import call, replay

pymysql = pytest.importorskip("pymysql", reason="PyMySQL is not installed (pip install PyMySQL)")


def _mariadb_missing() -> str | None:
    try:
        find_mariadb()
    except MariaDBUnavailableError as exc:
        return str(exc)
    return None


needs_mariadb = pytest.mark.skipif(_mariadb_missing() is not None,
                                   reason=f"{_mariadb_missing()} (CI installs it)")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[:1] != [b"Z"]


@pytest.fixture(scope="module")
def mariadb() -> Iterator[MariaDBServer]:
    """One private server for the module; it must be gone, files and process, afterwards."""
    srv = MariaDBServer()
    srv.start()
    assert srv.proc is not None
    pid, directory = srv.proc.pid, srv.dir
    try:
        yield srv
    finally:
        srv.stop()
        assert not _alive(pid), "mariadbd outlived the test"
        assert directory is not None and not directory.exists()


def _admin(server: MariaDBServer) -> Any:
    return pymysql.connect(**server.connect_args(), autocommit=True)


def _leftovers(server: MariaDBServer) -> tuple[list[str], list[str]]:
    with _admin(server) as conn, conn.cursor() as cur:
        cur.execute("SHOW DATABASES LIKE 'agentrl\\_%'")
        dbs = [r[0] for r in cur.fetchall()]
        cur.execute("SELECT user FROM mysql.user WHERE user LIKE 'agentrl\\_%'")
        return dbs, [r[0] for r in cur.fetchall()]


@pytest.fixture
def task(mariadb: MariaDBServer) -> Iterator[DBTask]:
    t = build_task("db", unix_socket=mariadb.socket_path, admin_user=mariadb.user, admin_password=mariadb.password,
                   query_timeout_s=2)
    assert isinstance(t, DBTask)
    try:
        yield t
    finally:
        t.close()
        assert _leftovers(mariadb) == ([], []), "a session's database or account was not dropped"


# ----------------------------------------------------------------------------------------------
# no server needed


def test_samples_are_deterministic_varied_and_documented() -> None:
    assert TASKS["db"] is DBTask
    a, b = DBTask(), DBTask()
    assert len(a.indices()) == 300 and a.max_turns == 8
    samples = [a.sample(i) for i in a.indices()]
    assert samples == [b.sample(i) for i in b.indices()]
    assert samples != [DBTask(DBOptions(seed=1)).sample(i) for i in range(300)]
    kinds = Counter(s.kind for s in samples)
    assert len(kinds) == len(GENERATORS) == 12 and set(kinds.values()) == {25}
    assert sum(s.is_query for s in samples) == 200
    assert len({(s.question, json.dumps([t.rows for t in s.tables], default=str)) for s in samples}) == 300
    doc = DBTask.__doc__ or ""
    assert "Reward" in doc and "SHA-256" in doc
    with pytest.raises(ValueError, match="query_timeout_s=0"):
        build_task("db", query_timeout_s=0)


def test_answer_matching() -> None:
    assert answer_matches("42", ["42"]) and answer_matches(" 42. ", ["42"]) and not answer_matches("43", ["42"])
    assert answer_matches("146.2", ["146.20"]) and answer_matches("146.23", ["146.23"])
    assert not answer_matches("146.24", ["146.23"])
    assert answer_matches("wes ito", ["Wes Ito"]) and not answer_matches("Wes", ["Wes Ito"])
    assert answer_matches("Gus Ito, Cleo Evans", ["Cleo Evans", "Gus Ito"])
    assert answer_matches("['Cleo Evans', 'Gus Ito']", ["Cleo Evans", "Gus Ito"])
    assert answer_matches("Cleo Evans\nGus Ito", ["Cleo Evans", "Gus Ito"])
    assert not answer_matches("Cleo Evans", ["Cleo Evans", "Gus Ito"])
    assert not answer_matches("Cleo Evans, Cleo Evans", ["Cleo Evans", "Gus Ito"])
    assert answer_matches("none", []) and answer_matches("NULL", ["NULL"])


def test_missing_server_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import env_controller.servers.mariadb as m

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(m, "_SEARCH", ())
    with pytest.raises(MariaDBUnavailableError, match=r"apt-get install mariadb-server"):
        MariaDBServer()


def test_unreachable_server_is_a_task_error() -> None:
    async def go() -> None:
        t = DBTask(DBOptions(unix_socket="/nonexistent/mysqld.sock"))
        with pytest.raises(ConnectionError,
                           match="cannot connect to MariaDB at /nonexistent/mysqld.sock.*start_server=True"):
            await t.start(0)
        c = LocalEnvClient({"db": t})
        _, reply = await c.start_sample("db", 0)
        assert reply.finish and reply.status is SampleStatus.TASK_ERROR
        t.close()

    asyncio.run(go())


# ----------------------------------------------------------------------------------------------
# on the server


@needs_mariadb
def test_demonstrations_replay_to_full_reward(task: DBTask) -> None:
    async def go() -> None:
        c = LocalEnvClient({"db": task})
        for index in range(12):  # every generator once
            demo, tools = task.demonstration(index)
            assistant = [m for m in demo if m["role"] == "assistant"]
            assert len(assistant) == 2 and tools == task.tools()
            conversation, reply = await replay(c, "db", index, assistant)
            assert conversation == demo
            assert reply.finish and reply.status is SampleStatus.COMPLETED and reply.reward == 1.0
            assert reply.metrics == {"success": 1.0, "turns": 2.0, "statements": 1.0, "sql_errors": 0.0}
        assert c.list_sessions() == []

    asyncio.run(go())


@needs_mariadb
def test_wrong_answers_and_wrong_changes_score_zero(task: DBTask) -> None:
    async def go() -> None:
        c = LocalEnvClient({"db": task})
        for index in range(12):
            sample = task.sample(index)
            if sample.is_query:
                _, reply = await replay(c, "db", index, [call("commit_final_answer", {"answer": "12345.67"})])
                assert reply.messages[-1]["content"] == "wrong"
            else:
                _, reply = await replay(c, "db", index, [call("commit_final_answer", {"answer": "done"})])
                assert reply.messages[-1]["content"] == "the database is not as requested"
                # the right change plus one more row changed is wrong too
                extra = f"DELETE FROM {sample.target} WHERE id = 1"
                _, reply = await replay(c, "db", index, [call("execute_sql", {"sql": sample.solution}),
                                                         call("execute_sql", {"sql": extra}),
                                                         call("commit_final_answer", {"answer": "done"})])
            assert reply.finish and reply.status is SampleStatus.COMPLETED
            assert reply.reward == 0.0 and reply.metrics["success"] == 0.0

    asyncio.run(go())


@needs_mariadb
def test_sql_errors_and_limits_are_tool_messages(mariadb: MariaDBServer) -> None:
    task = DBTask(DBOptions(unix_socket=mariadb.socket_path, admin_password=mariadb.password, query_timeout_s=2,
                             max_turns=20))

    async def go() -> None:
        c = LocalEnvClient({"db": task}, timeout_s=30)
        sid, _ = await c.start_sample("db", 0)  # an employees table

        async def sql(text: str) -> str:
            reply = await c.interact(sid, [call("execute_sql", {"sql": text})])
            assert reply.status is SampleStatus.RUNNING and not reply.finish
            return reply.messages[0]["content"]

        assert (await sql("SELEC name FROM employees")).startswith("error: (1064) You have an error in your SQL syntax")
        assert (await sql("SELECT * FROM nowhere")).startswith("error: (1146) Table")
        assert (await sql("   ")) == "error: the SQL statement is empty"
        assert (await sql("SELECT 1; DROP TABLE employees")).startswith("error: (1064)")
        started = time.monotonic()  # cut by the server's max_statement_time
        text = await sql("SELECT COUNT(*) FROM information_schema.columns a, information_schema.columns b, "
                         "information_schema.columns c")
        assert text.startswith("error: (1969)") and "took too long and was cancelled" in text, text
        assert time.monotonic() - started < 8
        # with the server's limit lifted, the client's read timeout still cancels it
        assert (await sql("SET SESSION max_statement_time = 0")) == "Query OK, 0 rows affected"
        started = time.monotonic()
        text = await sql("SELECT SLEEP(60)")
        assert text.startswith("error: the statement ran past the 2 s limit") and "new connection" in text, text
        assert time.monotonic() - started < 12
        text = await sql("SELECT a.id FROM employees a, employees b, employees c")
        lines = text.split("\n")
        assert lines[0] == "id" and len(lines) == 1 + 50 + 1 and "more rows not shown" in lines[-1]
        assert (await sql("UPDATE employees SET salary = salary WHERE id < 0")) == "Query OK, 0 rows affected"
        assert (await sql("SELECT COUNT(*) AS n FROM employees")).startswith("n\n")  # still connected, table intact
        await c.cancel(sid)

    try:
        asyncio.run(go())
    finally:
        task.close()
    assert _leftovers(mariadb) == ([], [])


@needs_mariadb
def test_a_session_makes_no_database_beyond_its_own_and_leaves_nothing(mariadb: MariaDBServer) -> None:
    """A grant's database name is a pattern (``_`` matches any character): the session's names its own database
    exactly, so a database the unescaped pattern would match is refused, and what the session made in its own
    database (a MEMORY table) goes with it."""
    task = DBTask(DBOptions(unix_socket=mariadb.socket_path, admin_password=mariadb.password, max_turns=20))
    with _admin(mariadb) as conn, conn.cursor() as cur:
        cur.execute("SHOW DATABASES")
        before = {r[0] for r in cur.fetchall()}

    async def go() -> None:
        c = LocalEnvClient({"db": task}, timeout_s=30)
        sid, _ = await c.start_sample("db", 0)

        async def sql(text: str) -> str:
            reply = await c.interact(sid, [call("execute_sql", {"sql": text})])
            return reply.messages[0]["content"]

        own = (await sql("SELECT DATABASE() AS db")).split("\n")[1]
        assert own.startswith("agentrl_"), own
        twin = own.replace("_", "X", 1)  # matched by `agentrl_...` as a pattern, not by the name itself
        refused = await sql(f"CREATE DATABASE `{twin}`")
        assert refused.startswith("error: (1044) Access denied"), refused
        assert await sql("CREATE TABLE kept (x INT) ENGINE=MEMORY") == "Query OK, 0 rows affected"
        await c.cancel(sid)

    try:
        asyncio.run(go())
    finally:
        task.close()
    with _admin(mariadb) as conn, conn.cursor() as cur:
        cur.execute("SHOW DATABASES")
        assert {r[0] for r in cur.fetchall()} == before
    assert _leftovers(mariadb) == ([], [])


@needs_mariadb
def test_parallel_sessions_are_isolated(mariadb: MariaDBServer) -> None:
    task = DBTask(DBOptions(unix_socket=mariadb.socket_path, admin_password=mariadb.password, max_turns=20))

    async def go() -> None:
        opened = await asyncio.gather(*(task.start(i) for i in range(12, 20)))
        sessions = [s for s, _ in opened]
        try:
            await use(sessions)
        finally:
            await asyncio.gather(*(s.close() for s in sessions))
        assert _leftovers(mariadb) == ([], [])

    async def use(sessions: list[Any]) -> None:
        assert all(isinstance(s, DBSession) for s in sessions)
        assert len({s.database for s in sessions}) == 8

        async def sql(session: Any, text: str) -> str:
            reply = await session.interact(call("execute_sql", {"sql": text}))
            return reply.messages[0]["content"]

        async def attack(i: int) -> None:
            me, other = sessions[i], sessions[(i + 1) % len(sessions)]
            shown = await sql(me, "SHOW DATABASES")
            assert shown.split("\n")[1:] == sorted(["information_schema", me.database]), shown
            table = other.sample.tables[0].name
            for text in (f"SELECT * FROM `{other.database}`.`{table}`", f"DROP TABLE `{other.database}`.`{table}`",
                         f"DROP DATABASE `{other.database}`", f"CREATE DATABASE `{me.database}_2`",
                         "SELECT user, host FROM mysql.user", f"GRANT ALL ON *.* TO '{me.user}'@'%'",
                         f"KILL {other.conn.thread_id()}"):
                out = await sql(me, text)
                assert out.startswith("error: (") and ("denied" in out or "not owner" in out.lower()), (text, out)

        await asyncio.gather(*(attack(i) for i in range(len(sessions))))
        # every database is intact: each expert still scores 1, all at once
        async def solve(index: int, session: Any) -> float:
            demo, _ = await asyncio.get_running_loop().run_in_executor(None, task.demonstration, index)
            reply = None
            for message in [m for m in demo if m["role"] == "assistant"]:
                reply = await session.interact(message)
            assert reply is not None
            return reply.reward

        rewards = await asyncio.gather(*(solve(12 + k, s) for k, s in enumerate(sessions)))
        assert rewards == [1.0] * 8

    try:
        asyncio.run(go())
    finally:
        task.close()


@pytest.mark.e2e
@needs_mariadb
def test_start_server_option_runs_its_own_server() -> None:
    t = DBTask(DBOptions(start_server=True))
    try:
        demo, _ = t.demonstration(3)
        assert demo[-1]["content"] == "correct"
        server = t._server
        assert server is not None and server.running and server.proc is not None
        pid, directory = server.proc.pid, server.dir
    finally:
        t.close()
    assert not _alive(pid) and t._server is None and directory is not None and not directory.exists()
