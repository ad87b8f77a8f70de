"""Read tensors from a Hugging Face checkpoint directory (``*.safetensors``).

A checkpoint is either one ``model.safetensors``, several shards listed by
``model.safetensors.index.json``, or several ``*.safetensors`` files without an index.
Tensors are read one at a time, on demand, so an expert worker reads only its own experts.

:meth:`Checkpoint.read_into` reads a tensor straight into memory the caller owns (an expert
worker's pool row) with plain file reads: no mapping of the file, so its pages never count in
the reader's resident memory, and no intermediate copy when the dtypes match.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from typing import Iterable

import torch
from safetensors import safe_open


# safetensors' dtype names (little-endian, as the format stores every tensor).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """The checkpoint directory does not hold what the model config needs."""


class Checkpoint:
    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._files: dict[str, str] = self._index(model_dir)
        self._handles: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # path -> (data start, header)

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

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read tensor ``name`` into ``out`` (same number of elements; converted to its dtype and
        device). A contiguous CPU ``out`` of the stored dtype receives the file's bytes directly
        (``preadv``); otherwise one tensor-sized host buffer is read and copied in."""
        if name not in self._files:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        path = self._files[name]
        start, header = self._header(path)
        entry = header.get(name)
        if entry is None or entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: no readable entry for {name!r} ({entry})")
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if math.prod(shape) != out.numel():
            raise CheckpointError(f"{name}: {shape} in the checkpoint does not fit a tensor of shape {tuple(out.shape)}")
        direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        target = out if direct else torch.empty(shape, dtype=dtype)
        if target.numel() == 0:
            return
        buffer = target.reshape(-1).view(torch.uint8).numpy()
        if buffer.nbytes != end - begin:
            raise CheckpointError(f"{path}: {name} holds {end - begin} bytes, its shape and dtype {buffer.nbytes}")
        descriptor = os.open(path, os.O_RDONLY)
        try:
            done, view = 0, memoryview(buffer)
            while done < buffer.nbytes:
                count = os.preadv(descriptor, [view[done:]], start + begin + done)
                if count <= 0:
                    raise CheckpointError(f"{path} ends before {name} does (truncated file?)")
                done += count
        finally:
            os.close(descriptor)
        if not direct:
            out.copy_(target.view(out.shape))

    def _header(self, path: str) -> tuple[int, dict]:
        """Where the data of the safetensors file ``path`` starts, and its header."""
        if path not in self._headers:
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                self._headers[path] = (8 + length, json.loads(handle.read(length)))
        return self._headers[path]
