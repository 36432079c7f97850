"""The test suite, one folder per package (trainer, rollout, env) and e2e for whole runs; helpers shared by all in support/."""
