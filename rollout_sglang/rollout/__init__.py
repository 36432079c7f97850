"""Scheduling the rollout: groups of episodes on engines and environments and the bounded queue to the trainer
(``manager``, the orchestrator), over admission (``admission``), infrastructure retries (``retries``) and dynamic
sampling (``dynamic_sampling``); the records it keeps (``groups``, ``stats``); an env client with simulated
latency (``sim_env``)."""
