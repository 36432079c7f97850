"""``db``: answer questions about, or change, a small MariaDB database with SQL (after AgentBench's DBBench).

Each session gets its own database ``agentrl_<random>`` loaded with the sample's tables, and
its own MariaDB account that holds privileges on that database only, so a session can neither
see nor touch another session's tables; both are dropped when the session closes. The server
is an existing MariaDB/MySQL (``host``/``port`` or ``unix_socket`` with an admin account that
may create databases and users), or a private one the task starts itself
(``start_server=True``, see :mod:`env_controller.servers.mariadb`).

Twelve generators make the samples (sample ``index`` uses generator ``index % 12`` with
parameters drawn from ``(seed, index)``): eight questions over an ``employees`` table or
``products`` and ``orders`` tables (counts, maxima, an arg-max, a rounded average, a list of
names, a sum, distinct values, a join), and four changes (update one row, insert a row, delete
rows, raise prices by a percentage).
"""
from __future__ import annotations

import datetime
import decimal
import hashlib
import logging
import random
import re
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from env_controller.tasks.base import Expert, Message, ToolResult, function_schema
from env_controller.tasks.blocking import BlockingToolTask, BlockingToolTaskSession
from env_controller.tasks.options import BlockingTaskOptions

logger = logging.getLogger(__name__)


_FIRST = ("Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena", "Milo", "Nora",
          "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vik", "Wes", "Yara", "Zoe")
_LAST = ("Abbott", "Baker", "Chen", "Diaz", "Evans", "Fox", "Garcia", "Hill", "Ito", "Jones", "Khan", "Lopez",
         "Meyer", "Novak", "Ortiz", "Park", "Reyes", "Silva", "Tanaka", "Weber")
_DEPTS = ("Sales", "Support", "Research", "Finance", "Legal", "Design")
_CATEGORIES = ("books", "garden", "kitchen", "music", "sports", "toys")
_ITEMS = ("lamp", "kettle", "racket", "novel", "drum", "shovel", "puzzle", "blender", "atlas", "kite", "glove",
          "flute", "rake", "teapot", "robot", "ball")

EMPLOYEES_DDL = ("CREATE TABLE employees (id INT PRIMARY KEY, name VARCHAR(40) NOT NULL, department VARCHAR(20) "
                 "NOT NULL, salary INT NOT NULL, hire_year INT NOT NULL)")
PRODUCTS_DDL = ("CREATE TABLE products (id INT PRIMARY KEY, name VARCHAR(40) NOT NULL, category VARCHAR(20) "
                "NOT NULL, price DECIMAL(8,2) NOT NULL, stock INT NOT NULL)")
ORDERS_DDL = ("CREATE TABLE orders (id INT PRIMARY KEY, customer VARCHAR(40) NOT NULL, product_id INT NOT NULL, "
              "quantity INT NOT NULL, order_date DATE NOT NULL)")
SCHEMAS = {
    "employees": "employees(id INT PRIMARY KEY, name VARCHAR, department VARCHAR, salary INT, hire_year INT)",
    "products": "products(id INT PRIMARY KEY, name VARCHAR, category VARCHAR, price DECIMAL(8,2), stock INT)",
    "orders": ("orders(id INT PRIMARY KEY, customer VARCHAR, product_id INT (products.id), quantity INT, "
               "order_date DATE)"),
}


@dataclass
class Table:
    """One table of a sample: its DDL and rows (tuples in column order)."""

    name: str
    ddl: str
    rows: list[tuple[Any, ...]]


@dataclass
class DBSample:
    """One generated sample.

    kind: the generator's name. question: the task text. tables: what the database holds at start.
    solution: the reference SQL (a query whose result is the answer, or the change to make).
    target: for a change, the table graded by its hash (None for a question).
    """

    kind: str
    question: str
    tables: list[Table]
    solution: str
    target: str | None = None

    @property
    def is_query(self) -> bool:
        """The sample asks a question (graded by answer match), not for a change."""
        return self.target is None


# ---------------------------------------------------------------------------------------------
# sample generators


def _people(rng: random.Random, n: int) -> list[str]:
    names = [f"{a} {b}" for a in _FIRST for b in _LAST]
    return rng.sample(names, n)


def _employees(rng: random.Random) -> Table:
    n = rng.randint(12, 30)
    depts = rng.sample(_DEPTS, rng.randint(3, 5))
    salaries = rng.sample(range(30, 200), n)  # distinct, so maxima are unique
    rows = [(i + 1, name, rng.choice(depts), salaries[i] * 500, rng.randint(2012, 2024))
            for i, name in enumerate(_people(rng, n))]
    return Table("employees", EMPLOYEES_DDL, rows)


def _products(rng: random.Random) -> Table:
    n = rng.randint(10, 24)
    cats = rng.sample(_CATEGORIES, rng.randint(3, 5))
    names = rng.sample([f"{c} {i}" for c in ("red", "blue", "green", "steel", "oak", "mini") for i in _ITEMS], n)
    rows = [(i + 1, name, rng.choice(cats), decimal.Decimal(rng.randint(199, 19999)) / 100,
             rng.choice([0, 0, rng.randint(1, 90), rng.randint(1, 90), rng.randint(1, 90)]))
            for i, name in enumerate(names)]
    return Table("products", PRODUCTS_DDL, rows)


def _orders(rng: random.Random, products: Table) -> Table:
    customers = _people(rng, 6)
    rows = [(i + 1, rng.choice(customers), rng.choice(products.rows)[0], rng.randint(1, 9),
             datetime.date(2024, rng.randint(1, 12), rng.randint(1, 28))) for i in range(rng.randint(15, 40))]
    return Table("orders", ORDERS_DDL, rows)


def _sql_str(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _about_one_value(kind: str, table: Callable[[random.Random], Table], column: int, question: str,
                     sql: str) -> Callable[[random.Random], DBSample]:
    """A generator of questions about one value of ``column`` in a fresh ``table``, drawn at random;
    ``question`` and ``sql`` are format strings of that value (quoted as an SQL string in ``sql`` when it
    is one)."""
    def generate(rng: random.Random) -> DBSample:
        t = table(rng)
        value = rng.choice(sorted({r[column] for r in t.rows}))
        literal = _sql_str(value) if isinstance(value, str) else value
        return DBSample(kind, question.format(value), [t], sql.format(literal))

    generate.__name__ = f"_q_{kind}"
    return generate


_q_count_dept = _about_one_value("count_dept", _employees, 2, "How many employees work in the {} department?",
                                 "SELECT COUNT(*) FROM employees WHERE department = {}")
_q_max_salary = _about_one_value("max_salary", _employees, 2, "What is the highest salary in the {} department?",
                                 "SELECT MAX(salary) FROM employees WHERE department = {}")
_q_top_earner = _about_one_value(
    "top_earner", _employees, 4, "Who has the highest salary among the employees hired in {}? Answer with the name.",
    "SELECT name FROM employees WHERE hire_year = {} ORDER BY salary DESC LIMIT 1")
_q_avg_price = _about_one_value(
    "avg_price", _products, 2, "What is the average price of the products in the category {}, rounded to 2 decimals?",
    "SELECT ROUND(AVG(price), 2) FROM products WHERE category = {}")
_q_names_hired = _about_one_value("names_hired", _employees, 4, "List the names of all employees hired in {}.",
                                  "SELECT name FROM employees WHERE hire_year = {} ORDER BY name")
_q_stock_sum = _about_one_value("stock_sum", _products, 2, "How many items of the category {} are in stock in total?",
                                "SELECT COALESCE(SUM(stock), 0) FROM products WHERE category = {}")


def _q_distinct_customers(rng: random.Random) -> DBSample:
    prod = _products(rng)
    orders = _orders(rng, prod)
    month = rng.choice(sorted({r[4].month for r in orders.rows}))
    return DBSample("distinct_customers",
                    f"How many different customers placed at least one order in month {month} of 2024?",
                    [prod, orders],
                    f"SELECT COUNT(DISTINCT customer) FROM orders WHERE MONTH(order_date) = {month} "
                    "AND YEAR(order_date) = 2024")


def _q_join_quantity(rng: random.Random) -> DBSample:
    prod = _products(rng)
    orders = _orders(rng, prod)
    ordered = sorted({r[2] for r in orders.rows})
    pid = rng.choice(ordered)
    name = next(r[1] for r in prod.rows if r[0] == pid)
    return DBSample("join_quantity", f"What is the total quantity ordered of the product named '{name}'?",
                    [prod, orders],
                    "SELECT SUM(o.quantity) FROM orders o JOIN products p ON o.product_id = p.id "
                    f"WHERE p.name = {_sql_str(name)}")


def _m_update_salary(rng: random.Random) -> DBSample:
    emp = _employees(rng)
    row = rng.choice(emp.rows)
    new = row[3] + rng.randint(1, 40) * 250
    return DBSample("update_salary", f"Set the salary of {row[1]} to {new}.", [emp],
                    f"UPDATE employees SET salary = {new} WHERE name = {_sql_str(row[1])}", target="employees")


def _m_insert_employee(rng: random.Random) -> DBSample:
    emp = _employees(rng)
    taken = {r[1] for r in emp.rows}
    name = next(n for n in _people(rng, 60) if n not in taken)
    new_id = max(r[0] for r in emp.rows) + 1
    dept = rng.choice(sorted({r[2] for r in emp.rows}))
    salary = rng.randint(60, 190) * 500
    year = rng.randint(2020, 2025)
    return DBSample(
        "insert_employee",
        f"Add the employee {name} with id {new_id}, department {dept}, salary {salary}, hired in {year}.",
        [emp], f"INSERT INTO employees (id, name, department, salary, hire_year) VALUES "
               f"({new_id}, {_sql_str(name)}, {_sql_str(dept)}, {salary}, {year})", target="employees")


def _m_delete_out_of_stock(rng: random.Random) -> DBSample:
    prod = _products(rng)
    cats = sorted({r[2] for r in prod.rows if r[4] == 0})
    if not cats:  # make sure there is something to delete
        i = rng.randrange(len(prod.rows))
        prod.rows[i] = (*prod.rows[i][:4], 0)
        cats = [prod.rows[i][2]]
    cat = rng.choice(cats)
    return DBSample("delete_out_of_stock",
                    f"Delete the products of the category {cat} that are out of stock (stock 0).",
                    [prod], f"DELETE FROM products WHERE category = {_sql_str(cat)} AND stock = 0", target="products")


def _m_raise_prices(rng: random.Random) -> DBSample:
    prod = _products(rng)
    cat = rng.choice(sorted({r[2] for r in prod.rows}))
    pct = rng.choice([5, 10, 15, 20, 25])
    return DBSample("raise_prices", f"Raise the price of every product in the category {cat} by {pct}% "
                    "(prices keep 2 decimals).", [prod],
                    f"UPDATE products SET price = ROUND(price * {100 + pct} / 100, 2) WHERE category = {_sql_str(cat)}",
                    target="products")


GENERATORS: tuple[Callable[[random.Random], DBSample], ...] = (
    _q_count_dept, _q_max_salary, _q_top_earner, _q_avg_price, _q_names_hired, _q_stock_sum, _q_distinct_customers,
    _q_join_quantity, _m_update_salary, _m_insert_employee, _m_delete_out_of_stock, _m_raise_prices,
)


# ---------------------------------------------------------------------------------------------
# values, answers, hashes


def format_value(value: Any) -> str:
    """One cell as text: NULL, integers and decimals as written by MariaDB, dates in ISO form."""
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_result(columns: Sequence[str], rows: Sequence[Sequence[Any]], more: int) -> str:
    """A result set as the tool shows it: ``col | col`` then one line per row, and a note of hidden rows."""
    lines = [" | ".join(columns)] + [" | ".join(format_value(v) for v in row) for row in rows]
    if not rows:
        lines.append("(no rows)")
    if more:
        lines.append(f"[... {more} more rows not shown]")
    return "\n".join(lines)


def _split_answer(answer: str) -> list[str]:
    text = answer.strip().strip("[](){}").strip()
    parts = re.split(r"\s*(?:,|;|\n)\s*", text)
    return [p.strip().strip("\"'`").strip() for p in parts if p.strip().strip("\"'`").strip()]


def _cell_matches(got: str, expected: str) -> bool:
    got = got.strip().strip("\"'`").strip()
    if got.endswith("."):
        got = got[:-1]
    try:
        e = decimal.Decimal(expected)
        g = decimal.Decimal(got.replace(",", ""))
        return abs(e - g) <= decimal.Decimal("0.005") + abs(e) * decimal.Decimal("1e-9")
    except decimal.InvalidOperation:
        return got.casefold() == expected.strip().casefold()


def answer_matches(answer: str, expected: list[str]) -> bool:
    """Whether ``answer`` gives the expected cells: one expected value is compared with the whole
    answer; several are compared, in any order, with the answer split on commas, semicolons or
    new lines (brackets and quotes ignored). Numbers compare by value within 0.005, text
    case-insensitively; an empty result expects ``none`` (or an empty answer)."""
    if not expected:
        return answer.strip().strip(".").casefold() in ("", "none", "null", "no rows", "0 rows")
    if len(expected) == 1:
        return _cell_matches(answer, expected[0])
    parts = _split_answer(answer)
    if len(parts) != len(expected):
        return False
    left = list(expected)
    for part in parts:
        match = next((i for i, e in enumerate(left) if _cell_matches(part, e)), None)
        if match is None:
            return False
        left.pop(match)
    return True


def table_digest(cursor: Any, database: str, table: str) -> str:
    """SHA-256 of a table's column names and rows, independent of row order (blocking)."""
    cursor.execute(f"SELECT * FROM `{database}`.`{table}`")
    columns = [d[0] for d in cursor.description]
    rows = Counter(tuple(format_value(v) for v in row) for row in cursor.fetchall())
    h = hashlib.sha256(repr(columns).encode())
    for row in sorted(rows.items()):
        h.update(repr(row).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# sessions


class DBSession(BlockingToolTaskSession):
    """One ``db`` episode on its own database and account."""

    def __init__(self, task: "DBTask", sample: DBSample, database: str, user: str, password: str,
                 expected: list[str] | None, expected_digest: str | None) -> None:
        """Connect as the session's account; the database is already loaded."""
        super().__init__(task.TOOLS, task.max_turns, task.executor)
        self.task = task
        self.sample = sample
        self.database = database
        self.user = user
        self.password = password
        self.expected = expected
        self.expected_digest = expected_digest
        self.statements = 0
        self.sql_errors = 0
        self.conn: Any = None
        self._connect()

    def _connect(self) -> None:
        import pymysql

        self.conn = pymysql.connect(**self.task.connect_args(self.user, self.password), database=self.database,
                                    autocommit=True, connect_timeout=10, read_timeout=self.task.query_timeout_s + 3,
                                    write_timeout=30,
                                    init_command=f"SET SESSION max_statement_time = {self.task.query_timeout_s:g}")

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """``execute_sql`` runs one statement; ``commit_final_answer`` grades and ends the episode."""
        if name == "execute_sql":
            return ToolResult(self._execute(arguments["sql"]))
        return self._grade(arguments["answer"])

    def _execute(self, sql: str) -> str:
        import pymysql

        self.statements += 1
        if not sql.strip():
            return "error: the SQL statement is empty"
        if self.conn is None:
            self._connect()
        max_rows = self.task.max_rows
        cur = self.conn.cursor(pymysql.cursors.SSCursor)  # unbuffered: a huge result is never held
        try:
            cur.execute(sql)
            if cur.description is None:
                return f"Query OK, {cur.rowcount} row{'s' if cur.rowcount != 1 else ''} affected"
            columns = [d[0] for d in cur.description]
            rows = cur.fetchmany(max_rows)
            more = 0
            while more < self.task.max_scan_rows and cur.fetchone() is not None:
                more += 1
            text = format_result(columns, rows, more)
            if more >= self.task.max_scan_rows:
                self._reset_connection()  # do not stream the rest of a huge result
                text += " (at least; the connection was reset)"
            if len(text) > self.task.max_output_chars:
                text = text[: self.task.max_output_chars] + "\n[... output cut]"
            return text
        except pymysql.err.OperationalError as exc:
            code = exc.args[0] if exc.args else 0
            if code in (2013, 2006, 2014, 0) or "timed out" in str(exc):
                self._reset_connection()
                self.sql_errors += 1
                return (f"error: the statement ran past the {self.task.query_timeout_s:g} s limit or lost its "
                        "connection and was cancelled; a new connection was opened (session variables and temporary "
                        "tables are gone)")
            self.sql_errors += 1
            return self._sql_error(exc)
        except pymysql.MySQLError as exc:
            self.sql_errors += 1
            return self._sql_error(exc)
        finally:
            try:
                cur.close()
            except Exception:  # noqa: BLE001 - the connection may have been reset
                pass

    @staticmethod
    def _sql_error(exc: Exception) -> str:
        if len(exc.args) >= 2:
            text = f"({exc.args[0]}) {exc.args[1]}"
            if exc.args[0] == 1969 or "max_statement_time" in str(exc.args[1]):
                return f"error: {text}: the statement took too long and was cancelled"
            return f"error: {text}"
        return f"error: {exc}"

    def _reset_connection(self) -> None:
        """Kill the session's server thread (a runaway statement with it) and drop the connection."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            thread_id = conn.thread_id()
            with self.task.admin() as admin, admin.cursor() as cur:
                cur.execute(f"KILL {int(thread_id)}")
        except Exception as exc:  # noqa: BLE001 - the thread may be gone already
            logger.debug("db session %s: KILL failed: %s", self.database, exc)
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass

    def _grade(self, answer: str) -> ToolResult:
        if self.sample.is_query:
            assert self.expected is not None
            ok = answer_matches(answer, self.expected)
            return ToolResult("correct" if ok else "wrong", finish=True, success=ok)
        try:
            with self.task.admin() as admin, admin.cursor() as cur:
                ok = table_digest(cur, self.database, self.sample.target or "") == self.expected_digest
        except Exception as exc:  # noqa: BLE001 - e.g. the agent dropped the table
            logger.debug("db session %s: hashing %s failed: %s", self.database, self.sample.target, exc)
            ok = False
        return ToolResult("the database is as requested" if ok else "the database is not as requested",
                          finish=True, success=ok)

    def extra_metrics(self) -> dict[str, float]:
        """``statements`` (execute_sql calls) and ``sql_errors`` (those answered with an error)."""
        return {"statements": float(self.statements), "sql_errors": float(self.sql_errors)}

    def release(self) -> None:
        """Close the connection, drop the database and the account."""
        self._reset_connection()
        self.task.drop(self.database, self.user)


@dataclass
class DBOptions(BlockingTaskOptions):
    """The db task's params (the server: :class:`DBTask`)."""

    KEY = "db"

    num_samples: int = 300
    max_turns: int = 8
    #: the server's host and port (when no ``unix_socket``)
    host: str = "127.0.0.1"
    port: int = 3306
    #: the server's socket file (wins over host and port)
    unix_socket: str | None = None
    #: an account allowed to create databases and users, with GRANT OPTION
    admin_user: str = "root"
    admin_password: str = ""
    #: start a private server on first use (stopped when the task closes) instead of using one
    start_server: bool = False
    #: a statement running past this is cancelled, seconds
    query_timeout_s: float = 5.0
    #: rows of a result shown to the agent (then how many more)
    max_rows: int = 50
    #: characters of a reply shown to the agent
    max_output_chars: int = 4000

    def check(self) -> None:
        """See :class:`BlockingTaskOptions`."""
        super().check()
        self.require_string("host")
        self.require_int("port", low=1, high=65535)
        self.require_string("unix_socket", optional=True)
        self.require_string("admin_user")
        self.require_string("admin_password", empty=True)
        self.require_bool("start_server")
        self.require_seconds("query_timeout_s")
        self.require_positive_int("max_rows")
        self.require_int("max_output_chars", low=100)


class DBTask(BlockingToolTask):
    """``db``: answer a question about a small MariaDB database, or change it, with SQL.

    Tools: ``execute_sql(sql: string)`` runs one statement on the session's database and returns
    ``col | col`` and one line per row (at most ``max_rows`` rows, then how many more), or
    ``Query OK, N rows affected``; SQL errors come back as ``error: (code) message``, a statement
    past ``query_timeout_s`` is cancelled with an ``error: ...``. Changes are committed at once.
    ``commit_final_answer(answer: string)`` ends the episode.
    Samples: 12 generators (``index % 12``), 8 questions and 4 changes (see the module docstring);
    the prompt gives the tables' schemas.
    Expert: the reference SQL, then ``commit_final_answer`` with the result's values joined by
    ", " (a question) or ``done`` (a change); 2 turns.
    Reward: 1 or 0. A question is right when the answer matches the reference query's result,
    computed on the freshly loaded database: numbers by value within 0.005, text
    case-insensitively, several values in any order, split on commas, semicolons or new lines.
    A change is right when the SHA-256 of the target table's rows (order-free) equals that of a
    scratch copy of the initial data with the reference SQL applied; the answer text is then
    ignored. 0 on the turn limit (default 8 tool calls) or a message without tool calls.
    Metrics: ``success``, ``turns``, ``statements``, ``sql_errors``.

    Server: ``unix_socket`` or ``host``/``port`` and ``admin_user``/``admin_password`` (an account
    allowed to create databases and users, with GRANT OPTION), or ``start_server=True`` for a
    private server started on first use and stopped by :meth:`close`. Each session's account is
    ``'agentrl_<random>'@'localhost'`` and ``@'%'`` with a random password, privileges on its
    database only, and ``MAX_USER_CONNECTIONS 2``.
    """

    name = "db"
    Options = DBOptions
    options: DBOptions
    TOOLS = [
        function_schema(
            "execute_sql",
            "Execute one SQL statement (MariaDB dialect) on your database and get its result: the rows of a query, "
            "or the number of rows a change affected. Changes are committed at once.",
            {"sql": "string"},
        ),
        function_schema(
            "commit_final_answer",
            "Give the final answer to a question (the value(s) only; several values separated by commas), or "
            "say 'done' once a requested change is made; ends the task.",
            {"answer": "string"},
        ),
    ]

    def __init__(self, options: DBOptions | None = None) -> None:
        """See :class:`ToolTask`; no connection is made yet."""
        super().__init__(options)
        options = self.options
        # the server's address and admin account: a private server's once it started (``start_server``)
        self.host, self.port, self.unix_socket = options.host, options.port, options.unix_socket
        self.admin_user, self.admin_password = options.admin_user, options.admin_password
        self.start_server = options.start_server
        self.query_timeout_s = options.query_timeout_s
        self.max_rows = options.max_rows
        self.max_scan_rows = 100_000
        self.max_output_chars = options.max_output_chars
        self._server: Any = None
        self._server_lock = threading.Lock()

    # -- server and accounts --------------------------------------------------------------------

    def _ensure_server(self) -> None:
        if not self.start_server:
            return
        with self._server_lock:
            if self._server is None:
                from env_controller.servers.mariadb import MariaDBServer

                server = MariaDBServer().start()
                self._server = server
                self.unix_socket, self.port = server.socket_path, int(server.port or 0)
                self.admin_user, self.admin_password = server.user, server.password

    def connect_args(self, user: str, password: str) -> dict[str, Any]:
        """``pymysql.connect`` arguments for ``user`` on the task's server."""
        self._ensure_server()
        where: dict[str, Any] = (
            {"unix_socket": self.unix_socket} if self.unix_socket else {"host": self.host, "port": self.port})
        return {**where, "user": user, "password": password, "charset": "utf8mb4"}

    def admin(self) -> Any:
        """A new autocommit connection as the admin account (a context manager; blocking)."""
        import pymysql

        self._ensure_server()  # first: it sets the admin account of a private server
        try:
            return pymysql.connect(**self.connect_args(self.admin_user, self.admin_password), autocommit=True,
                                   connect_timeout=10, read_timeout=60, write_timeout=60)
        except pymysql.MySQLError as exc:
            where = self.unix_socket or f"{self.host}:{self.port}"
            raise ConnectionError(
                f"db: cannot connect to MariaDB at {where} as {self.admin_user!r}: {exc}; start a server "
                "(apt-get install mariadb-server) and pass host/port or unix_socket and the admin account, "
                "or set start_server=True") from exc

    @staticmethod
    def _load(cur: Any, database: str, tables: list[Table]) -> None:
        cur.execute(f"USE `{database}`")
        for table in tables:
            cur.execute(table.ddl)
            if table.rows:
                marks = ", ".join(["%s"] * len(table.rows[0]))
                cur.executemany(f"INSERT INTO `{table.name}` VALUES ({marks})", table.rows)

    def drop(self, database: str, user: str) -> None:
        """Drop a session's database and account (blocking; missing ones are fine)."""
        try:
            with self.admin() as admin, admin.cursor() as cur:
                cur.execute(f"DROP DATABASE IF EXISTS `{database}`")
                cur.execute(f"DROP USER IF EXISTS '{user}'@'localhost', '{user}'@'%'")
        except Exception:  # noqa: BLE001 - best effort: log and go on
            logger.exception("db: dropping %s / %s failed", database, user)

    # -- task API -------------------------------------------------------------------------------

    def sample(self, index: int) -> DBSample:
        """The generated sample ``index`` (see the module docstring)."""
        self.check_index(index)
        return GENERATORS[index % len(GENERATORS)](self.rng(index))

    def new_session(self, index: int) -> tuple[DBSession, list[Message]]:
        """Create and load the session's database and account, compute the expected result (blocking)."""
        sample = self.sample(index)
        token = secrets.token_hex(8)
        database = user = f"agentrl_{token}"
        password = secrets.token_urlsafe(18)
        expected: list[str] | None = None
        digest: str | None = None
        with self.admin() as admin, admin.cursor() as cur:
            try:
                cur.execute(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4")
                cur.execute(f"CREATE USER '{user}'@'localhost' IDENTIFIED BY %s, '{user}'@'%%' IDENTIFIED BY %s "
                            "WITH MAX_USER_CONNECTIONS 2", (password, password))
                # a grant's database name is a pattern where _ matches any character: escaped, it names this
                # database alone (else CREATE would reach databases that drop() never removes)
                exact = database.replace("_", "\\_")
                for host in ("localhost", "%"):
                    cur.execute("GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, DROP, ALTER, INDEX, CREATE VIEW, "
                                "SHOW VIEW, CREATE TEMPORARY TABLES, LOCK TABLES "
                                f"ON `{exact}`.* TO '{user}'@'{host}'")
                self._load(cur, database, sample.tables)
                if sample.is_query:
                    cur.execute(sample.solution)
                    expected = [format_value(v) for row in cur.fetchall() for v in row]
                else:
                    scratch = f"{database}_ref"
                    cur.execute(f"CREATE DATABASE `{scratch}`")
                    try:
                        self._load(cur, scratch, sample.tables)
                        cur.execute(sample.solution)
                        digest = table_digest(cur, scratch, sample.target or "")
                    finally:
                        cur.execute(f"DROP DATABASE IF EXISTS `{scratch}`")
            except BaseException:
                self.drop(database, user)
                raise
        try:
            session = DBSession(self, sample, database, user, password, expected, digest)
        except BaseException:
            self.drop(database, user)
            raise
        schemas = "\n".join(f"- {SCHEMAS[t.name]}" for t in sample.tables)
        prompt = (
            "You can run SQL on a MariaDB database with execute_sql (one statement per call). Its tables:\n"
            f"{schemas}\n"
            "When you know the answer, call commit_final_answer with the value(s) only; when asked to change the "
            f"data, make the change and then call commit_final_answer('done'). You have {self.max_turns} tool calls."
            f"\n\nTask: {sample.question}"
        )
        return session, [{"role": "user", "content": prompt}]

    def expert(self, index: int) -> Expert:
        """The reference SQL, then the values it returned (a question) or ``done`` (a change)."""
        sample = self.sample(index)
        output = yield "execute_sql", {"sql": sample.solution}
        if sample.is_query:
            cells = [cell for line in output.split("\n")[1:] if line != "(no rows)" for cell in line.split(" | ")]
            yield "commit_final_answer", {"answer": ", ".join(cells)}
        else:
            yield "commit_final_answer", {"answer": "done"}

    def close(self) -> None:
        """Stop the threads, and the private server when the task started one."""
        super().close()
        with self._server_lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()
