"""``agentrl convert hf-to-megatron | megatron-to-hf``: the weight converters on the command line.

The same options as ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``
(which call :func:`main_hf_to_megatron` / :func:`main_megatron_to_hf`). Importing this module
does not import torch; the converters are imported when a command runs. A bad input is a
ConversionError (a ConfigError): exit status 2 and one line on stderr, as for a bad training config;
an interrupt (Ctrl-C, SIGTERM) removes the partial output and exits 130.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from megatron_agentrl.sigterm import sigterm_raises


def add_hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hf-to-megatron``."""
    parser.add_argument("--hf-dir", required=True, help="Hugging Face checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out-dir", required=True, help="output megatron distributed checkpoint directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to lay the checkpoint out for")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (checked against the layers)")
    parser.add_argument("--dtype", default="auto", help="auto (keep the HF dtypes) | float32 | bfloat16 | float16")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocab to a multiple of this times --tp (megatron's default: 128)")
    parser.add_argument("--overwrite", action="store_true", help="allow a non-empty --out-dir")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``megatron-to-hf``."""
    parser.add_argument("--megatron-dir", required=True,
                        help="megatron distributed checkpoint directory, or a run's checkpoint step_<k>/")
    parser.add_argument("--out-dir", required=True, help="output Hugging Face directory")
    parser.add_argument("--hf-config", default=None,
                        help="HF config.json or directory (default: the copy in <megatron-dir>/hf)")
    parser.add_argument("--dtype", default="auto", help="auto (as stored) | float32 | bfloat16 | float16")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    parser.add_argument("--peft-adapter", action="store_true",
                        help="a LoRA run's checkpoint: write its adapters in PEFT's format (for the base it names) "
                             "instead of the merged model")
    parser.add_argument("--overwrite", action="store_true", help="allow a non-empty --out-dir")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    """Run :func:`~megatron_agentrl.convert.hf_to_megatron.convert_hf_to_megatron` on parsed options."""
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron

    _setup_logging()
    return _interruptible(args.out_dir, lambda: convert_hf_to_megatron(
        args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, dtype=args.dtype,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, progress=not args.no_progress,
        overwrite=args.overwrite))


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    """Run :func:`~megatron_agentrl.convert.megatron_to_hf.convert_megatron_to_hf` on parsed options."""
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    _setup_logging()
    return _interruptible(args.out_dir, lambda: convert_megatron_to_hf(
        args.megatron_dir, args.out_dir, hf_config=args.hf_config, dtype=args.dtype,
        max_shard_size=args.max_shard_size, progress=not args.no_progress, overwrite=args.overwrite,
        peft_adapter=args.peft_adapter))


def _interruptible(out_dir: str, convert: Callable[[], Any]) -> int:
    """Run ``convert`` with SIGTERM raising KeyboardInterrupt, so that the converter removes its partial
    output as on Ctrl-C; 0, or 130 after an interrupt (one log line, no traceback)."""
    try:
        with sigterm_raises(lambda signum: KeyboardInterrupt(f"signal {signum}")):
            convert()
    except KeyboardInterrupt:
        logging.getLogger("agentrl").warning("interrupted; '%s' was left as it was", out_dir)
        return 130
    return 0


# the subcommands of ``agentrl convert``: name, help, the function that adds its options, the one that runs it
COMMANDS = (
    ("hf-to-megatron", "HF safetensors -> megatron distributed checkpoint (any TP x PP)",
     add_hf_to_megatron_arguments, run_hf_to_megatron),
    ("megatron-to-hf", "megatron distributed checkpoint -> HF safetensors",
     add_megatron_to_hf_arguments, run_megatron_to_hf),
)


def _setup_logging() -> None:
    import warnings

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("megatron", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine and Apex) (is|are) not installed.*")


def _main(add_arguments: Callable[[argparse.ArgumentParser], None], run: Callable[[argparse.Namespace], int],
          prog: str, argv: list[str] | None) -> int:
    from megatron_agentrl.config import ConfigError

    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def main_hf_to_megatron(argv: list[str] | None = None) -> int:
    """Entry point of ``tools/convert_hf_to_megatron.py``; exit status 2 on a user error."""
    return _main(add_hf_to_megatron_arguments, run_hf_to_megatron, "convert_hf_to_megatron", argv)


def main_megatron_to_hf(argv: list[str] | None = None) -> int:
    """Entry point of ``tools/convert_megatron_to_hf.py``; exit status 2 on a user error."""
    return _main(add_megatron_to_hf_arguments, run_megatron_to_hf, "convert_megatron_to_hf", argv)
