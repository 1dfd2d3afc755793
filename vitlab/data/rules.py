"""What a way of reading the data can take, stated once for the config's checks and the tasks alike:
shards read in order (:func:`streamed_in_shards`) and the device-resident loader (:func:`device_loader_problems`).
Each takes the ``data`` section (any object with its keys)."""
from __future__ import annotations

from typing import Any

__all__ = ["SHARDS", "streamed_in_shards", "device_loader_problems"]


SHARDS = "shards (data.dataset=wds, data.streaming=true)"


def streamed_in_shards(d: Any) -> bool:
    """Whether the data is read as shards, in order: WebDataset, or a streamed Hugging Face split."""
    return d.dataset == "wds" or (d.dataset == "hf" and d.streaming)


def device_loader_problems(augment: str = "none", train_crop: str = "pad", color_jitter: float = 0.0,
                           aug_repeats: int = 1, dataset: str = "imagefolder", streaming: bool = False,
                           in_memory: bool | str = "auto") -> list[tuple[str, Any, str]]:
    """What keeps a run from the device-resident loader (``data.loader=gpu``: the whole data set on the device,
    crop, flip and RandAugment a batch at a time), as ``(key, value, what it must be)``: an augmentation, a crop or
    an order only the DataLoader's per-image transforms have, images streamed from disk; [] when it can."""
    rules = [
        (aug_repeats == 1, "data.aug_repeats", aug_repeats,
         "1 with data.loader=gpu (repeated augmentation orders the DataLoader's samples: data.loader=torch)"),
        (color_jitter == 0, "data.color_jitter", color_jitter,
         "0 with data.loader=gpu (color jitter is a DataLoader transform: data.loader=torch)"),
        (augment in ("none", "randaugment"), "data.augment", augment,
         "'none' or 'randaugment' with data.loader=gpu (use data.loader=torch for the others)"),
        (train_crop in ("pad", "rrc"), "data.train_crop", train_crop,
         "'pad' or 'rrc' with data.loader=gpu (DeiT III's simple random crop needs data.loader=torch)"),
        (dataset != "wds", "data.loader", "gpu",
         "torch or auto with data.dataset=wds (shards are streamed by DataLoader workers)"),
        (not streaming, "data.streaming", streaming,
         "false with data.in_memory=true or data.loader=gpu (a streamed data set is read by DataLoader workers)"),
        (in_memory is not False, "data.in_memory", in_memory,
         "true or auto with data.loader=gpu (the device loader holds the whole data set; stream with "
         "data.loader=torch)"),
    ]
    return [(key, value, allowed) for ok, key, value, allowed in rules if not ok]
