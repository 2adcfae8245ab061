"""The LoRA adapters a worker serves: ``--lora-modules`` (fixed at start) and ``--lora-modules-file`` (re-read while
the worker runs, so adapters can be loaded and unloaded without a restart), checked, given stable vLLM ids, written
to the table kvshuttle's vLLM plugin reads (workers/vllm_call_options.py) and registered as ``Worker.adapters``.

vLLM loads an adapter's weights on its first request (the plugin passes a ``LoRARequest``), so loading one here is
adding it to the table and the registration; unloading removes it from both (new turns for it are refused; vLLM
evicts its weights from its LRU when it needs the slot).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kvshuttle.v1 import common_pb2

# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class AdapterError(ValueError):
    """An adapter entry or directory that cannot be served."""


def parse_lora_modules(text: str) -> dict[str, str]:
    """``NAME=DIR`` entries, comma-separated (vLLM's --lora-modules, one string), by name."""
    found: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, eq, path = entry.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise AdapterError(f"--lora-modules entry {entry!r} is not NAME=DIR")
        _add(found, name.strip(), path.strip(), "--lora-modules")
    return found


def read_modules_file(path: str) -> dict[str, str]:
    """The adapters of a ``--lora-modules-file``: a JSON object of name -> directory."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"--lora-modules-file {path}: {exc}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise AdapterError(f"--lora-modules-file {path}: must be a JSON object of adapter name -> directory")
    found: dict[str, str] = {}
    for name, adapter_dir in raw.items():
        _add(found, name, adapter_dir, f"--lora-modules-file {path}")
    return found


def _add(found: dict[str, str], name: str, path: str, where: str) -> None:
    if not _NAME.match(name):
        raise AdapterError(f"{where}: adapter name {name!r} must be 1-128 letters, digits and ._:/- (a letter or "
                           "digit first)")
    if name in found:
        raise AdapterError(f"{where}: adapter {name!r} named twice")
    found[name] = path


def adapter_rank(path: str) -> int:
    """The rank ``r`` of the PEFT adapter in ``path`` (AdapterError: not a readable LoRA adapter)."""
    config = Path(path) / "adapter_config.json"
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter directory {path}: cannot read adapter_config.json ({exc})") from None
    rank = raw.get("r") if isinstance(raw, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter directory {path}: adapter_config.json has no rank 'r'")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter directory {path}: peft_type {raw.get('peft_type')!r} is not LORA")
    if not any((Path(path) / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise AdapterError(f"adapter directory {path}: no adapter_model.safetensors")
    return rank


def vllm_rank(ranks: list[int]) -> int:
    """vLLM's --max-lora-rank for adapters of ``ranks``: the smallest it takes that covers them all (at least
    vLLM's default 16, so an adapter loaded later of a common rank fits)."""
    need = max([16, *ranks])
    for rank in VLLM_RANKS:
        if rank >= need:
            return rank
    raise AdapterError(f"adapter rank {need} is above vLLM's largest --max-lora-rank ({VLLM_RANKS[-1]})")


class AdapterSet:
    """The adapters served now, with ids that stay the adapter's for the worker's life (vLLM keys its loaded
    weights by id), written to ``table_path`` for the plugin."""

    def __init__(self, table_path: Path, max_rank: int):
        self.table_path = table_path
        self.max_rank = max_rank
        self._ids: dict[str, int] = {}
        self.current: dict[str, str] = {}

    def apply(self, wanted: Mapping[str, str]) -> bool:
        """Serve exactly ``wanted`` (name -> directory); True when that changed what is served. Checks every
        directory first (AdapterError: nothing changes)."""
        resolved = {name: str(Path(path).resolve()) for name, path in wanted.items()}
        for name, path in resolved.items():
            if path != self.current.get(name):
                rank = adapter_rank(path)
                if rank > self.max_rank:
                    raise AdapterError(f"adapter {name!r} has rank {rank}, above this worker's --max-lora-rank "
                                       f"{self.max_rank}")
        if resolved == self.current and self.table_path.exists():
            return False
        for name in resolved:
            self._ids.setdefault(name, len(self._ids) + 1)
        self.current = resolved
        self._write()
        return True

    def records(self) -> list[common_pb2.LoraAdapter]:
        return [common_pb2.LoraAdapter(name=n, id=self._ids[n], path=p) for n, p in sorted(self.current.items())]

    def _write(self) -> None:
        table = {"adapters": [{"name": a.name, "id": a.id, "path": a.path} for a in self.records()]}
        self.table_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".lora-", dir=self.table_path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, self.table_path)  # the plugin never reads half a table
