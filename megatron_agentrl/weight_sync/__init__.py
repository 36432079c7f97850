"""Trainer side of the weight sync: what reads the actor. Its weights under HF names, fed to the engines.

:mod:`.gather` (the actor's tensors under Hugging Face names), :mod:`.sender` (:class:`WeightSender`,
the collective sync of every trainer rank, feeding the bucket protocol), :mod:`.options` (its settings,
:class:`SenderOptions`), :mod:`.publisher` (:class:`WeightPublisher`, the push after each step into the
version pool's slots). The wire itself
(bucket layout, the group, transports, the broadcaster and the receiver, in-process delivery, stats
and the error) is :mod:`rollout_sglang.weight_update`.
"""
from megatron_agentrl.weight_sync.gather import stage_hf_tensors
from megatron_agentrl.weight_sync.options import SenderOptions
from megatron_agentrl.weight_sync.publisher import WeightPublisher
from megatron_agentrl.weight_sync.sender import WeightSender

__all__ = ["SenderOptions", "WeightPublisher", "WeightSender", "stage_hf_tensors"]
