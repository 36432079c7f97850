"""Private servers started for tasks and tests: ``private_server`` (the lifecycle of a server process
owned by this process: data directory, socket, readiness, shutdown) and ``mariadb`` (the db task's
MariaDB)."""
