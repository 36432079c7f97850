"""Scheduling the rollout: groups of episodes on engines and environments, the bounded queue to the
trainer, retries and dynamic sampling (``manager``); an env client with simulated latency (``sim_env``)."""
