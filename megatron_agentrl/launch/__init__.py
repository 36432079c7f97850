"""Cluster launch: Ray placement (``ray_placement``), SLURM submission (``slurm``), the memory
plan of a layout (``plan``) and the pre-flight check of a run (``check``).

Importing this package, or ``slurm``, ``plan``, ``check`` or ``ray_placement``, imports neither Ray nor
torch: ``agentrl`` adds their subcommands without them.
"""
