#!/usr/bin/env python3
"""Submit an agentrl training run to SLURM: the same as ``agentrl slurm submit``.

    python tools/submit_slurm.py --config run.yaml --nodes 2 --gpus-per-node 8 --partition gpu
    python tools/submit_slurm.py --config run.yaml --dry-run      # print the sbatch script
    python tools/submit_slurm.py --config run.yaml --no-ray --wait train.steps=10

Flags override the config's ``slurm`` section, ``key=value`` arguments the run config
(``megatron_agentrl/launch/slurm.py`` holds the logic).
"""
import sys

from megatron_agentrl.launch.slurm import main_submit

if __name__ == "__main__":
    sys.exit(main_submit())
