"""The test suite: one folder per package (trainer, rollout, env), e2e for whole runs, and support/ for the
helpers every folder uses."""
