"""Read tensors from a Hugging Face checkpoint directory (``*.safetensors``).

A checkpoint is either one ``model.safetensors``, several shards listed by
``model.safetensors.index.json``, or several ``*.safetensors`` files without an index.
Tensors are read one at a time, on demand, so an expert worker reads only its own experts.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterable

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint directory does not hold what the model config needs."""


class Checkpoint:
    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._files: dict[str, str] = self._index(model_dir)
        self._handles: dict[str, object] = {}

    @staticmethod
    def _index(model_dir: str) -> dict[str, str]:
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map") or {}
            missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(model_dir, f))})
            if missing:
                raise CheckpointError(f"{index_path} lists shards that do not exist: {missing[:3]}")
            return {name: os.path.join(model_dir, f) for name, f in weight_map.items()}
        paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not paths:
            raise CheckpointError(
                f"no *.safetensors files in {model_dir}; raymoe loads safetensors checkpoints only"
            )
        files: dict[str, str] = {}
        for path in paths:
            with safe_open(path, framework="pt") as handle:
                files.update({name: path for name in handle.keys()})
        return files

    def names(self) -> Iterable[str]:
        return self._files.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        tensor = self._handle(name).get_tensor(name)
        return tensor.to(dtype) if dtype is not None and tensor.dtype != dtype else tensor

    def _handle(self, name: str):
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]
