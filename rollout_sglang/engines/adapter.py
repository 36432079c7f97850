"""A weight version as a LoRA adapter: the record engines load, and its files in PEFT's format.

In a LoRA run the base model stays on the engines and each live weight version is an adapter on it
(docs/rollout.md, "Versions as adapters"). An engine is told of a version by :class:`Adapter`: its name on
the engine (``v<version>``, what ``/generate``'s ``lora_path`` names), its version, PEFT's
``adapter_config.json`` as a dict, and its tensors under PEFT's saved names
(``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``, full, unsharded).
An engine in this process takes the tensors; an SGLang server in another process reads the adapter from
``path`` (a directory in PEFT's format that the server can read: a shared filesystem on a cluster).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: what PEFT puts before a Hugging Face module name in its saved keys
PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def adapter_name(version: int) -> str:
    """The name of weight version ``version``'s adapter on an engine."""
    return f"v{int(version)}"


@dataclass
class Adapter:
    """One weight version as a LoRA adapter (see the module doc).

    version: the weight version it is. config: PEFT's ``adapter_config.json`` (``r``, ``lora_alpha``,
    ``target_modules``, ...). tensors: PEFT-named full tensors on the CPU. path: a directory holding the same
    adapter in PEFT's format (None until :meth:`save` wrote one).
    """

    version: int
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(repr=False)
    path: str | None = None

    @property
    def name(self) -> str:
        """Its name on an engine (``v<version>``)."""
        return adapter_name(self.version)

    @property
    def rank(self) -> int:
        """The adapter's rank ``r``."""
        return int(self.config["r"])

    @property
    def scaling(self) -> float:
        """How its output is scaled: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), as PEFT does."""
        r = self.rank
        return float(self.config["lora_alpha"]) / (r ** 0.5 if self.config.get("use_rslora") else r)

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def modules(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{Hugging Face module name: (A [r, in], B [out, r])}``; ValueError naming a tensor without its pair or
        a name that is not PEFT's."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, a in self.tensors.items():
            if key.endswith(_B):
                if key.removesuffix(_B) + _A not in self.tensors:
                    raise ValueError(f"adapter {self.name}: {key} has no {key.removesuffix(_B) + _A}")
                continue
            if not (key.startswith(PEFT_PREFIX) and key.endswith(_A)):
                raise ValueError(f"adapter {self.name}: {key!r} is not a PEFT LoRA tensor name "
                                 f"({PEFT_PREFIX}<module>{_A} or {_B})")
            b = self.tensors.get(key.removesuffix(_A) + _B)
            if b is None:
                raise ValueError(f"adapter {self.name}: {key} has no {key.removesuffix(_A) + _B}")
            out[key[len(PEFT_PREFIX):].removesuffix(_A)] = (a, b)
        return out

    def save(self, directory: str | Path) -> "Adapter":
        """Write it in PEFT's format to ``directory`` (created; its files replaced atomically, so a server never
        reads half a file); this adapter with ``path`` set."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (WEIGHTS_FILE + ".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}, str(tmp))
        tmp.replace(out / WEIGHTS_FILE)
        tmp = out / (CONFIG_FILE + ".tmp")
        tmp.write_text(json.dumps(self.config, indent=2) + "\n")
        tmp.replace(out / CONFIG_FILE)
        self.path = str(out)
        return self

    @classmethod
    def load(cls, directory: str | Path, version: int) -> "Adapter":
        """The adapter in PEFT's format at ``directory`` as weight version ``version``; ValueError naming the
        directory and what is missing."""
        from safetensors.torch import load_file

        d = Path(directory)
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (d / f).is_file()]
        if missing:
            raise ValueError(f"{str(d)!r} is no LoRA adapter in PEFT's format: {', '.join(missing)} missing; give a "
                             "directory written by PEFT's save_pretrained or the run's adapter export")
        try:
            config = json.loads((d / CONFIG_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(d / CONFIG_FILE)!r} is not valid JSON: {e}") from e
        if not isinstance(config, dict) or not isinstance(config.get("r"), int) or "lora_alpha" not in config:
            raise ValueError(f"{str(d / CONFIG_FILE)!r} lacks an integer 'r' or 'lora_alpha'; it is no PEFT LoRA "
                             "adapter config")
        return cls(int(version), config, load_file(str(d / WEIGHTS_FILE)), str(d))
