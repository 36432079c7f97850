"""Private servers started for tasks and tests: ``process`` (starting, waiting for and stopping a process, which
the bench scripts and the end-to-end tests use too), ``private_server`` (the lifecycle of a server process owned
by this process: data directory, socket, readiness, shutdown) and ``mariadb`` (the db task's MariaDB)."""
