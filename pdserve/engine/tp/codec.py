"""What travels from rank 0 to the other ranks of a tensor-parallel engine: at start the engine
config and the model (`Start`), then each step's inputs (`Step`), as msgspec (typed, no
pickle; tensors and arrays as dtype, shape and bytes) in a uint8 tensor for gloo."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from pdserve.model.loader import ModelFiles


class Step(msgspec.Struct):
    """One step's inputs, as rank 0 prepared them (`ModelRunner._prepare`). `hidden`: for
    the ranks of a later pipeline stage, the residual stream its layers run over (T, hidden)
    instead of the embedded tokens."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    hidden: torch.Tensor | None = None

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping, self.num_decodes, self.decode_groups,
                                 self.prefills)  # fmt: skip


class Start(msgspec.Struct):
    """What the other ranks build their part from: the engine config and the model (for a
    pipeline stage's ranks: the stage's layers, `stage`)."""

    config: EngineConfig
    model: ModelConfig
    weights: dict[str, np.ndarray]
    fingerprint: str
    path: str | None
    max_model_len: int
    stage: int = 0

    def files(self) -> ModelFiles:
        return ModelFiles(self.path and Path(self.path), self.model, self.weights, self.fingerprint)


def _enc_hook(obj):
    if isinstance(obj, torch.Tensor):
        obj = obj.contiguous()
        return (str(obj.dtype).removeprefix("torch."), list(obj.shape),
                obj.reshape(-1).view(torch.uint8).numpy().tobytes())  # fmt: skip
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the other ranks")


def _dec_hook(kind: type, obj):
    if kind is torch.Tensor:
        dtype, shape, data = obj
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)
    raise NotImplementedError(f"cannot receive a {kind.__name__} from rank 0")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(_ENCODER.encode(obj)), dtype=torch.uint8)


def decode(data: torch.Tensor, kind: type):
    return msgspec.msgpack.decode(data.numpy().tobytes(), type=kind, dec_hook=_dec_hook)
