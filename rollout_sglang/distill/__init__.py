"""On-policy distillation: every sampled token scored by a teacher (``options``, ``scorer``)."""
