"""Which GPU an actor owns: the one Ray assigned it, never a hard-coded ``cuda:0``."""

from __future__ import annotations

import os

import ray
import torch


def actor_cuda_device() -> torch.device:
    """This actor's GPU as a torch device, made current.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPUs unless told not to
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``); either way the device is found from
    ``ray.get_gpu_ids()`` and its position among the visible devices.
    """
    gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()]
    if not gpu_ids:
        raise RuntimeError("this actor was started without a GPU (num_gpus=0) but asked for device cuda; "
                           "start it with num_gpus=1 or use device: cpu")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = visible.index(gpu_ids[0]) if gpu_ids[0] in visible else (0 if visible else int(float(gpu_ids[0])))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
